"""Which layers each pipeline stage holds, and MindFormers' per-stage layer counts.

MindFormers cuts ``num_layers`` into ``pp_interleave_num x pipeline_stage`` chunks
(``[interleave][stage]``): every chunk gets ``num_layers // (pp * interleave)``
layers plus its ``offset``; chunks are laid out row by row (interleave 0, stage
0..pp-1, then interleave 1, ...). A count ``N`` for a chunk means its *first*
``N`` layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._errors import ConfigError, fmt

__all__ = ["StageLayout"]

_ALL = 2**31 - 1  # MindFormers' MAX_INT32: ``True`` inside a per-stage count list


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StageLayout:
    num_layers: int
    """Layers of the model."""
    pipeline_stage: int
    """Pipeline stages (``parallel_config.pipeline_stage``)."""
    interleave: int
    """Virtual stages per stage (``model.model_config.pp_interleave_num``)."""
    counts: tuple[tuple[int, ...], ...]
    """Layers of each chunk, ``[interleave][stage]``."""

    @classmethod
    def build(cls, *, num_layers: int, pipeline_stage: int = 1, interleave: int = 1, offset: Any = 0,
              where: dict[str, str] | None = None) -> "StageLayout":
        """``where`` names the config keys of ``pipeline_stage``, ``interleave`` and ``offset`` for errors."""
        where = {"pipeline_stage": "pipeline_stage", "interleave": "pp_interleave_num", "offset": "offset",
                 **(where or {})}
        pp, vv = pipeline_stage, interleave
        cls._check_chunks(num_layers, pp, vv, offset, where)
        grid = cls._offset_grid(offset, pp, vv, where)
        base = num_layers // (pp * vv)
        counts = tuple(tuple(base + o for o in row) for row in grid)
        total = sum(sum(row) for row in counts)
        if total != num_layers:
            remainder = num_layers - base * pp * vv
            raise ConfigError(
                f"{where['offset']}={fmt(offset)}: offsets sum to {total - base * pp * vv}; expected them to sum to "
                f"{remainder} = num_layers ({num_layers}) % (pipeline_stage ({pp}) * pp_interleave_num ({vv}))")
        for v, row in enumerate(counts):
            for s, count in enumerate(row):
                if count < 0:
                    raise ConfigError(f"{where['offset']}={fmt(offset)}: chunk [{v}][{s}] gets {count} layers; "
                                      "expected offsets leaving every chunk >= 0 layers")
        return cls(num_layers, pp, vv, counts)

    @staticmethod
    def _check_chunks(num_layers: int, pp: int, vv: int, offset: Any, where: dict[str, str]) -> None:
        """Refuse, before building any grid, more chunks than an offset can fill (10**9 stages is an error, not a loop).

        Every chunk of an integer offset gets the same count, and a per-stage offset list repeats over the
        interleaved chunks: their layers sum to ``num_layers`` only if there are at most that many chunks
        (or interleave rows). A 2-D offset list is as long as the file says.
        """
        if _is_int(offset) and pp * vv > num_layers:
            raise ConfigError(f"{where['pipeline_stage']}={fmt(pp)} x {where['interleave']}={fmt(vv)}: more chunks "
                              f"than the {num_layers} layers; expected at most {num_layers} chunks, or a "
                              f"[interleave][stage] {where['offset']} list giving each chunk its layers")
        if isinstance(offset, (list, tuple)) and all(_is_int(o) for o in offset) and vv > num_layers:
            raise ConfigError(f"{where['interleave']}={fmt(vv)}: more interleaved chunks per stage than the "
                              f"{num_layers} layers; expected at most {num_layers}")

    @staticmethod
    def _offset_grid(offset: Any, pp: int, vv: int, where: dict[str, str]) -> list[list[int]]:
        path = where["offset"]
        form = (f"an integer, a list of {pp} integers (one per pipeline stage) or a {vv}x{pp} list "
                "[interleave][stage]")
        if _is_int(offset):
            return [[offset] * pp for _ in range(vv)]
        if not isinstance(offset, (list, tuple)):
            raise ConfigError(f"{path}={fmt(offset)}: expected {form}")
        if all(_is_int(o) for o in offset):
            if len(offset) != pp:
                raise ConfigError(f"{path}={fmt(offset)}: {len(offset)} entries but {where['pipeline_stage']}={pp}; "
                                  f"expected {form}")
            return [list(offset) for _ in range(vv)]
        if all(isinstance(row, (list, tuple)) for row in offset):
            if len(offset) != vv or any(len(row) != pp or not all(_is_int(o) for o in row) for row in offset):
                raise ConfigError(f"{path}={fmt(offset)}: expected {form} ({where['interleave']}={vv}, "
                                  f"{where['pipeline_stage']}={pp})")
            return [list(row) for row in offset]
        raise ConfigError(f"{path}={fmt(offset)}: expected {form}")

    # ------------------------------------------------------------------ geometry
    def starts(self) -> list[list[int]]:
        """First layer index of every chunk, ``[interleave][stage]``."""
        out, at = [], 0
        for row in self.counts:
            out.append([])
            for count in row:
                out[-1].append(at)
                at += count
        return out

    def chunk_of(self, layer: int) -> tuple[int, int, int]:
        """``(interleave, stage, position in the chunk)`` of a layer."""
        starts = self.starts()
        for v, row in enumerate(self.counts):
            for s, count in enumerate(row):
                if starts[v][s] <= layer < starts[v][s] + count:
                    return v, s, layer - starts[v][s]
        raise AssertionError(f"layer {layer} outside 0..{self.num_layers - 1}")

    def first_layers(self, grid: list[list[int]]) -> list[int]:
        """Layers selected by per-chunk counts: the first ``grid[v][s]`` layers of every chunk."""
        starts = self.starts()
        return sorted(starts[v][s] + k for v, row in enumerate(grid) for s, n in enumerate(row) for k in range(n))

    def stage_layers(self) -> list[list[int]]:
        """Layers of each pipeline stage over all its interleaved chunks, in order."""
        starts = self.starts()
        return [sorted(starts[v][s] + k for v in range(self.interleave) for k in range(self.counts[v][s]))
                for s in range(self.pipeline_stage)]

    # ------------------------------------------------------------------ MindFormers count forms
    def format_counts(self, value: Any, path: str) -> list[list[int]]:
        """A ``recompute``-style value as per-chunk counts ``[interleave][stage]`` (MindFormers' normal form).

        Accepts True/False, a list of per-stage counts (ints or True/False; spread over the
        interleaved chunks of the stage round-robin), or a 2-D list ``[interleave][stage]``
        (rows may be True/False). Counts above a chunk's size are clipped to it.
        """
        pp, vv = self.pipeline_stage, self.interleave
        form = (f"True/False, a list of {pp} per-stage layer counts, or a {vv}x{pp} list [interleave][stage] "
                "of counts (True/False allowed for a count)")
        if isinstance(value, bool):
            return [list(row) if value else [0] * pp for row in self.counts]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={fmt(value)}: expected {form}")
        if all(isinstance(item, (int, bool)) for item in value):
            if len(value) != pp:
                raise ConfigError(f"{path}={fmt(value)}: {len(value)} stage counts but pipeline_stage={pp}; "
                                  f"expected {form}")
            wanted = []
            for j, item in enumerate(value):
                if _is_int(item) and item < 0:
                    raise ConfigError(f"{path}[{j}]={fmt(item)}: expected a layer count >= 0 or True/False")
                wanted.append((_ALL if item else 0) if isinstance(item, bool) else item)
            return self._spread(wanted)
        if len(value) != vv:
            raise ConfigError(f"{path}={fmt(value)}: {len(value)} rows but pp_interleave_num={vv}; expected {form}")
        grid = []
        for v, row in enumerate(value):
            if isinstance(row, bool):
                grid.append(list(self.counts[v]) if row else [0] * pp)
                continue
            if not isinstance(row, (list, tuple)) or len(row) != pp:
                raise ConfigError(f"{path}[{v}]={fmt(row)}: expected True/False or a list of {pp} per-stage counts; "
                                  f"whole value expected {form}")
            out = []
            for s, item in enumerate(row):
                if isinstance(item, bool):
                    out.append(self.counts[v][s] if item else 0)
                elif _is_int(item) and item >= 0:
                    out.append(min(item, self.counts[v][s]))
                else:
                    raise ConfigError(f"{path}[{v}][{s}]={fmt(item)}: expected a layer count >= 0 or True/False")
            grid.append(out)
        return grid

    def _spread(self, wanted: list[int]) -> list[list[int]]:
        """Per-stage counts over the stage's interleaved chunks, one layer per chunk in turn."""
        grid = [[0] * self.pipeline_stage for _ in range(self.interleave)]
        for s, num in enumerate(wanted):
            num = min(num, sum(self.counts[v][s] for v in range(self.interleave)))
            while num:
                for v in range(self.interleave):
                    if num and grid[v][s] < self.counts[v][s]:
                        grid[v][s] += 1
                        num -= 1
        return grid
