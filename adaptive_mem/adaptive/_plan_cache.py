"""Plans the adaptive loop converged to, on disk, keyed by what makes a plan valid.

The key (:func:`plan_key`) hashes the model structure, the step's input shapes
(the sequence length as its bucket's) and dtypes, the parameter dtype, the device type, the parallel sizes, the
library version and the memory budget: change any of them and the cache
misses. Entries are JSON (``Plan.to_dict`` plus the converged memory target),
read with the JSON parser only; an unreadable entry is a miss, logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from profiler.naming import structure_fingerprint
from search import Plan, PlanError

__all__ = ["PlanCache", "CachedPlan", "CacheEntry", "plan_key", "default_cache_dir", "layout_sizes"]

log = logging.getLogger(__name__)

_FORMAT = "adaptive-mem-plan-cache"


def default_cache_dir() -> Path:
    """``$ADAPTIVE_MEM_CACHE`` or ``$XDG_CACHE_HOME/adaptive-mem/plans`` (``~/.cache/...``)."""
    if os.environ.get("ADAPTIVE_MEM_CACHE"):
        return Path(os.environ["ADAPTIVE_MEM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaptive-mem" / "plans"


def plan_key(model: nn.Module, *, inputs: Sequence[torch.Tensor], budget: int,
             parallel: dict[str, Any] | None = None, structure: str | None = None,
             bucket: int | None = None) -> tuple[str, dict[str, Any]]:
    """``(key, described fields)`` for ``model`` stepping on ``inputs`` under ``budget`` bytes; with ``bucket``
    the plan is for every sequence length up to it: the inputs' length is recorded as the bucket's."""
    from adaptive_mem._version import __version__
    from adaptive_mem.runtime._buckets import seq_len_of
    from ._buckets import bucketed_shape

    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    seq_len = seq_len_of(tuple(inputs)) if bucket is not None else None
    fields = {
        "structure": structure or structure_fingerprint(model),
        "inputs": [[bucketed_shape(t.shape, seq_len, bucket), str(t.dtype).removeprefix("torch.")] for t in inputs],
        "dtype": str(param.dtype).removeprefix("torch.") if param is not None else "none",
        "device": param.device.type if param is not None else "cpu",
        "parallel": dict(sorted((parallel or {}).items())),
        "version": __version__,
        "budget": int(budget),
    }
    if bucket is not None:
        fields["seq_len_bucket"] = int(bucket)
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
    return key, fields


@dataclass
class CachedPlan:
    plan: Plan
    """The converged plan."""
    target: int
    """The memory target (bytes) the search converged to."""
    fields: dict[str, Any]
    """What the key was made of (for the log and for humans reading the file)."""


class PlanCache:
    """A directory of ``<key>.json`` entries."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> CachedPlan | None:
        path = self.path(key)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("plan cache entry %s unreadable (%s); planning again", path, exc)
            return None
        try:
            if not isinstance(data, dict) or data.get("format") != _FORMAT:
                raise PlanError(f"format={data.get('format') if isinstance(data, dict) else data!r}")
            target = data.get("target")
            if isinstance(target, bool) or not isinstance(target, int) or target <= 0:
                raise PlanError(f"target={target!r}")
            fields = data.get("fields")
            if not isinstance(fields, dict):
                raise PlanError(f"fields={fields!r}")
            return CachedPlan(Plan.from_dict(data.get("plan")), target, fields)
        except PlanError as exc:
            log.warning("plan cache entry %s is not a cached plan (%s); planning again", path, exc)
            return None

    def save(self, key: str, entry: CachedPlan) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"format": _FORMAT, "target": int(entry.target), "fields": entry.fields,
                                   "plan": entry.plan.to_dict()}, indent=1) + "\n")
        os.replace(tmp, path)
        return path


def layout_sizes(parallel: dict[str, int], ranks: Any, model: nn.Module) -> dict[str, Any]:
    """The parallel sizes the key holds: ``parallel``, the world size, the DP group of ``ranks`` (a
    ``_ranks.RankGroup``) and, for DTensor parameters (FSDP2, tensor parallel), the mesh they are sharded over."""
    sizes: dict[str, Any] = dict(parallel)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        sizes.setdefault("world", torch.distributed.get_world_size())
    sizes.update(ranks.layout())
    mesh = next((list(p.device_mesh.shape) for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if mesh is not None:
        sizes["mesh"] = mesh
    return sizes


class CacheEntry:
    """The adaptive loop's entry in ``cache`` (None: no cache) for the input shapes it steps on now; the
    deciding rank of ``ranks`` (a ``_ranks.RankGroup``) reads it for the group and alone writes it."""

    def __init__(self, cache: PlanCache | None, ranks: Any) -> None:
        self.cache = cache
        self.ranks = ranks
        self.key: str | None = None
        """The key of the current input shapes (None before the first step)."""
        self.fields: dict[str, Any] = {}
        """What :attr:`key` was made of."""

    def select(self, model: nn.Module, *, inputs: Sequence[torch.Tensor], budget: int, parallel: dict[str, Any],
               structure: str, bucket: int | None = None) -> None:
        """Make the entry that of ``model`` stepping on ``inputs`` (of up to ``bucket`` tokens) under ``budget``."""
        self.key, self.fields = plan_key(model, inputs=inputs, budget=budget, parallel=parallel, structure=structure,
                                         bucket=bucket)

    def load(self) -> CachedPlan | None:
        """The deciding rank's cached plan for the group (None: a miss on every rank)."""
        assert self.key is not None
        return self.ranks.agree_on_cache(self.cache, self.key)

    def path(self) -> Path | None:
        return self.cache.path(self.key) if self.cache is not None and self.key is not None else None

    def save(self, target: int, plan: Plan) -> Path | None:
        """Keep ``plan`` converged at ``target``; its file (None: no cache, or not the deciding rank)."""
        if self.cache is None or self.key is None or not self.ranks.decides:
            return None
        return self.cache.save(self.key, CachedPlan(plan, target, self.fields))
