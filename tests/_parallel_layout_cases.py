"""The cases of tests/test_parallel_adaptive_layouts.py, run inside 2 spawned gloo ranks (every collective with a
timeout): the adaptive loop on DDP, FSDP2 (``fully_shard`` per layer and the root) and tensor parallel
(``adaptive_mem.models.parallelize``), applied before and after the wrapper, at a budget above the plain step's peak, one between the loop's minimum and that peak, and one below
the minimum; and the same runs with out-of-memory faults injected at random allocations. Each rank trains under its
own ``DeviceMemory`` capped at the budget and records every step's loss and local gradients, and the plain run of the
same layout."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from adaptive_mem import AdaptiveBudgetError, DeviceMemory, adaptive_optimize, build_model
from adaptive_mem.runtime._accounting import host_allocations

from _spawn import gloo_rank, guard

__all__ = ["LAYOUTS", "ORDERS", "STEPS", "TIMEOUT", "FAULTS", "worker"]

STEPS = 4
TIMEOUT = 240  # seconds: every collective; the spawn gets twice this
FAULTS = 30  # injected per layout and rank, at random allocations of the adaptive run's steps
LAYOUTS = ("ddp", "fsdp", "tp")
ORDERS = ("before", "after")


def _bundle():
    return build_model("llama-tiny", seed=0, batch_size=2, seq_len=32)


def _wrap(layout: str, model: nn.Module) -> nn.Module:
    """``model`` laid out as ``layout`` (``adaptive_mem.models.parallelize``: DDP, ``fully_shard`` per layer and the
    root, DTensor tensor parallel)."""
    from adaptive_mem.models import Parallel, parallelize

    return parallelize(model, layout=Parallel(layout, dist.get_world_size()), batch_size=2).module


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Faults:
    """Schedules ``count`` injected out-of-memory faults at random allocations of the steps of a run."""

    def __init__(self, count: int, seed: int, per_step: list[int]) -> None:
        self.rng = random.Random(seed)
        self.left = count
        self.per_step = per_step

    def arm(self, mem: DeviceMemory, step: int, steps: int) -> None:
        mem.clear_faults()
        mem.allocations = 0
        share = -(-self.left // max(1, steps - step))  # spread what is left over the remaining steps
        for _ in range(min(share, self.left)):
            at = self.rng.randrange(1, max(2, 9 * self.per_step[step] // 10))  # within the plain step's allocations
            mem.inject_fault(at=at, needed=self.rng.randrange(1, 1 << 18))
        self.left -= min(share, self.left)


def _train(layout: str, *, rank: int, order: str | None, budget: int | None, faults: _Faults | None = None,
           built: dict | None = None) -> dict[str, Any]:
    """STEPS steps of the wrapped llama-tiny (each rank its own batches) under ``DeviceMemory(cap=budget)``; with
    ``order`` the adaptive loop applied ``before`` (the optimizer named: it is made after the wrapper) or ``after``
    the wrapper. ``built`` gets the model."""
    b = _bundle()
    model, am = b.model, None
    if order == "before":
        am = adaptive_optimize(model, budget=budget, optimizer="sgd", cache=False)
    model = _wrap(layout, model)
    if built is not None:
        built["model"] = model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if order == "after":
        am = adaptive_optimize(model, budget=budget, optimizer=opt, cache=False)
    out: dict[str, Any] = {"losses": [], "grads": [], "peaks": [], "allocations": [], "faults": 0}
    try:
        with DeviceMemory(cap=budget, track_existing=False) as mem:
            mem.track(model, opt)
            for step in range(STEPS):
                mem.reset_peak()
                if faults is not None:
                    faults.arm(mem, step, STEPS)
                else:
                    mem.allocations = 0
                # data parallel: each rank its own batch (the reduction matters); tensor parallel: one batch
                ids, labels = b.batch(seed=2 * step + (rank if layout != "tp" else 0))
                logits = _local(model(ids))
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
                loss.backward()
                mem.clear_faults()
                with host_allocations():  # the copies kept for the comparison are no device memory of the step
                    out["losses"].append(loss.detach().clone())
                    out["grads"].append({n: _local(p.grad).detach().clone() for n, p in model.named_parameters()})
                del loss, logits
                out["peaks"].append(mem.peak)
                out["allocations"].append(mem.allocations)
                opt.step()
                opt.zero_grad(set_to_none=True)
            out["faults"] = mem.faults
    finally:
        if am is not None:
            out["history"] = [(r.kind, r.rescues, r.decision) for r in am.history]
            out["minimum"], out["rescues"] = am.minimum, am.manager.stats.rescues
            am.remove()
    return out


def _refused(layout: str, *, rank: int, order: str, budget: int) -> dict[str, Any]:
    """A budget under the minimum: refused before the first step runs (no loss, no gradient written)."""
    built: dict = {}
    try:
        out = _train(layout, rank=rank, order=order, budget=budget, built=built)
    except AdaptiveBudgetError as exc:
        written = [n for n, p in built["model"].named_parameters() if p.grad is not None] if built else []
        return {"refused": str(exc), "grads": written}
    return {"refused": None, "steps": len(out["losses"])}


def _profile(layout: str) -> dict[str, Any]:
    """The wrapped model's profile: its units (name, saved bytes) and what the rank holds."""
    import profiler

    b = _bundle()
    model = _wrap(layout, b.model)
    ids, _ = b.batch(seed=0)
    prof = profiler.profile_step(model, inputs=(ids,), loss_fn=lambda m, inputs: _local(m(*inputs)).sum(),
                                 optimizer="sgd", warmup=0, repeat=0, record=1, optimizer_time=0.0)
    return {"units": [(u.name, u.saved_bytes) for u in prof.units], "static": prof.static}


def _layout(results: dict, rank: int, layout: str) -> None:
    guard(results, f"{layout}-profile", lambda: _profile(layout))
    guard(results, f"{layout}-plain", lambda: _train(layout, rank=rank, order=None, budget=None))
    plain = results[f"{layout}-plain"]
    peak = torch.tensor([max(plain.get("peaks") or [0])])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # one budget for the group
    for order in ORDERS:
        above = int(1.3 * int(peak))
        guard(results, f"{layout}-{order}-above", lambda: _train(layout, rank=rank, order=order, budget=above))
        minimum = results[f"{layout}-{order}-above"].get("minimum") or int(peak)
        between = minimum + (int(peak) - minimum) // 2
        results[f"{layout}-{order}-budgets"] = {"peak": int(peak), "minimum": minimum, "between": between}
        guard(results, f"{layout}-{order}-between",
              lambda: _train(layout, rank=rank, order=order, budget=between))
        guard(results, f"{layout}-{order}-refused",
              lambda: _refused(layout, rank=rank, order=order, budget=int(0.9 * minimum)))
    between = results[f"{layout}-after-budgets"]["between"]
    faults = _Faults(FAULTS, seed=rank + 7 * len(layout), per_step=plain.get("allocations") or [500] * STEPS)
    guard(results, f"{layout}-injected",
          lambda: _train(layout, rank=rank, order="after", budget=between, faults=faults))


def worker(rank: int, world: int, port: int, out: str) -> None:
    with gloo_rank(rank, world, port, out, timeout=TIMEOUT) as results:
        for layout in LAYOUTS:
            _layout(results, rank, layout)
