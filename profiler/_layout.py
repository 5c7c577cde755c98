"""A parallel layout as data: how one training step is split over ranks.

``Layout`` names the degrees of tensor (TP), pipeline (PP, with V virtual chunks per rank) and data
parallelism (DP), sequence parallelism (SP, Megatron's: the activations TP leaves replicated are
split along the sequence over the TP group), the ZeRO stage over DP (3 = FSDP), the micro-batches
of one step and the pipeline schedule. It is recorded in a profile (``model.layout``) and a plan
(``meta.layout``); the default layout (all 1, ZeRO 0) is one device and is not written.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["SCHEDULES", "Layout", "LayoutError"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


class LayoutError(ValueError):
    """A layout value of the wrong form."""


_FLAGS = {
    "tensor_parallel": "--tensor-parallel", "pipeline_stages": "--pipeline-stages",
    "virtual_pipeline_stages": "--virtual-pipeline-stages", "data_parallel": "--data-parallel",
    "sequence_parallel": "--sequence-parallel", "zero": "--zero", "micro_batches": "--micro-batches",
    "schedule": "--schedule",
}


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    virtual_pipeline_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B); 1 otherwise."""
    data_parallel: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    """0: replicated; 1: optimizer state, 2: + gradients, 3: + parameters sharded over DP (3 = FSDP)."""
    micro_batches: int = 1
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_stages", "virtual_pipeline_stages", "data_parallel",
                     "micro_batches"):
            _positive(name, getattr(self, name))
        if not isinstance(self.sequence_parallel, bool):
            raise LayoutError(f"{self._key('sequence_parallel')}={self.sequence_parallel!r}: expected true or false")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"{self._key('zero')}={self.zero!r}: expected one of 0, 1, 2, 3")
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"{self._key('schedule')}={self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise LayoutError("--sequence-parallel with --tensor-parallel=1: expected --tensor-parallel >= 2 "
                              "(sequence parallel splits over the tensor-parallel group)")
        if self.zero and self.data_parallel == 1:
            raise LayoutError(f"--zero={self.zero} with --data-parallel=1: expected --data-parallel >= 2 "
                              "(ZeRO shards over the data-parallel ranks)")
        v, p, m = self.virtual_pipeline_stages, self.pipeline_stages, self.micro_batches
        if self.schedule == "interleaved-1f1b":
            if v < 2 or p < 2:
                raise LayoutError(f"--schedule=interleaved-1f1b with --pipeline-stages={p} "
                                  f"--virtual-pipeline-stages={v}: expected both >= 2")
            if m % p:
                raise LayoutError(f"--micro-batches={m}: expected a multiple of --pipeline-stages={p} "
                                  "(Megatron's interleaved schedule runs micro-batches in groups of P)")
        elif v != 1:
            raise LayoutError(f"--virtual-pipeline-stages={v} with --schedule={self.schedule}: expected "
                              "--schedule interleaved-1f1b (or --virtual-pipeline-stages 1)")

    @staticmethod
    def _key(name: str) -> str:
        return _FLAGS[name]

    @property
    def chunks(self) -> int:
        """Model chunks in the pipeline: P * V."""
        return self.pipeline_stages * self.virtual_pipeline_stages

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "layout") -> "Layout":
        if not isinstance(data, dict):
            raise LayoutError(f"{where}={data!r}: expected an object with keys {', '.join(_FLAGS)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LayoutError(f"{where}.{unknown[0]}: unknown key; expected one of {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_flags(cls, *, base: "Layout | None" = None, **values: Any) -> "Layout":
        """From command-line strings (None: ``base``'s value or the default); one-line errors naming the flag."""
        out: dict[str, Any] = base.to_dict() if base is not None else {}
        for name, value in values.items():
            if name not in _FLAGS:
                raise LayoutError(f"layout.{name}: unknown key; expected one of {', '.join(_FLAGS)}")
            if value is None:
                continue
            if name == "sequence_parallel" or name == "schedule":
                out[name] = value
                continue
            try:
                out[name] = int(value)
            except (TypeError, ValueError):
                expected = "one of 0, 1, 2, 3" if name == "zero" else "a positive integer"
                raise LayoutError(f"{_FLAGS[name]}={value!r}: expected {expected}") from None
        return cls(**out)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{_FLAGS[name]}={value!r}: expected a positive integer")
