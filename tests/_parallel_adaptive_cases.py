"""The cases of tests/test_parallel_adaptive.py, run inside 2 spawned gloo ranks (every collective with a timeout):
the adaptive loop on a DDP-wrapped llama-tiny, each rank under its own ``DeviceMemory`` cap, against the same DDP
run without the loop; a DP group whose ranks step different models; per-stage groups and their cache keys."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from adaptive_mem import DeviceMemory, adaptive_optimize
from adaptive_mem.runtime._accounting import host_allocations

from _adaptive_common import bundle, optimizer
from _spawn import gloo_rank, guard

__all__ = ["STEPS", "TIMEOUT", "worker"]

STEPS = 8
TIMEOUT = 240  # seconds: every collective; the spawn gets twice this
SPEC = dict(batch_size=4, seq_len=128)


def _ddp(module: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module)


def _record_and_step(out: dict[str, Any], model: torch.nn.Module, am: Any, opt: torch.optim.Optimizer) -> None:
    """Keep the step's gradients (and the loop's plan), then the optimizer step."""
    with host_allocations():  # the copies kept for the comparison are no device memory of the step
        out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    if am is not None:
        out["plans"].append(am.plan.to_dict() if am.plan is not None else None)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _train(*, rank: int, cap: int | None, budget: int | None, cache_dir: str | None = None) -> dict[str, Any]:
    """STEPS steps of DDP llama-tiny (each rank its own batches) under ``cap``; the loop with ``budget``."""
    b = bundle(**SPEC)
    model = _ddp(b.model)
    opt = optimizer(model)
    am = adaptive_optimize(model, budget=budget, optimizer=opt, cache=cache_dir is not None,
                           cache_dir=cache_dir) if budget is not None else None
    out: dict[str, Any] = {"grads": [], "plans": [], "peaks": []}
    try:
        with DeviceMemory(cap=cap, track_existing=False) as mem:
            mem.track(model, opt)
            for step in range(STEPS):
                mem.reset_peak()
                ids, labels = b.batch(seed=2 * step + rank)  # each rank its own batch: the all-reduce matters
                logits = model(ids)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
                loss.backward()
                del loss, logits
                out["peaks"].append(mem.peak)
                _record_and_step(out, model, am, opt)
    finally:
        if am is not None:
            out["history"] = [vars(r).copy() for r in am.history]
            out["converged_at"] = am.converged_at
            out["cache_key"], out["cache_fields"] = am.cache_entry.key, am.cache_entry.fields
            out["cache_hits"], out["profiles"] = am.cache_hits, am.profiles_run
            am.remove()
    return out


def _mismatched_models(rank: int) -> dict[str, Any]:
    b = bundle(**SPEC, model_args={"num_layers": 1 + rank})  # rank 1 holds a different model: not one DP group
    with adaptive_optimize(b.model, budget="1GiB", optimizer=optimizer(b.model), cache=False):
        b.loss(b.batch(seed=0)).backward()
    return {}


def _stage_groups(rank: int) -> dict[str, Any]:
    groups = [dist.new_group([r], timeout=datetime.timedelta(seconds=TIMEOUT)) for r in range(dist.get_world_size())]
    b = bundle(**SPEC)
    with adaptive_optimize(b.model, budget="1GiB", optimizer=optimizer(b.model), cache=False,
                           dp_group=groups[rank]) as am:
        b.loss(b.batch(seed=0)).backward()
        key, fields = am.cache_entry.key, am.cache_entry.fields
    return {"cache_key": key, "cache_fields": fields}


def _pipeline(*, rank: int, budget: int | None) -> dict[str, Any]:
    """STEPS steps of llama-tiny cut into 2 pipeline stages (``parallelize``), the loop on each stage under ``budget``
    with the stage's own group."""
    from adaptive_mem.models import Parallel, parallelize

    b = bundle(**SPEC)
    pm = parallelize(b.model, layout=Parallel("pp", dist.get_world_size()), batch_size=b.batch_size)
    opt = optimizer(pm.module)
    am = adaptive_optimize(pm.module, budget=budget, optimizer=opt, cache=False,
                           dp_group=pm.dp_group) if budget is not None else None
    out: dict[str, Any] = {"grads": [], "plans": [], "losses": [], "peaks": []}
    try:
        with DeviceMemory(cap=budget, track_existing=False) as mem:
            mem.track(pm.module, opt)
            for step in range(STEPS):
                mem.reset_peak()
                out["losses"].append(pm.step(*b.batch(seed=step)))
                out["peaks"].append(mem.peak)
                _record_and_step(out, pm.module, am, opt)
    finally:
        if am is not None:
            out["history"] = [vars(r).copy() for r in am.history]
            out["cache_fields"] = am.cache_entry.fields
            am.remove()
    return out


def worker(rank: int, world: int, port: int, out: str, cache_dir: str) -> None:
    with gloo_rank(rank, world, port, out, timeout=TIMEOUT) as results:
        guard(results, "plain", lambda: _train(rank=rank, cap=None, budget=None))
        peak = max(results["plain"].get("peaks") or [0])
        peak = dist.broadcast_object_list(box := [peak], src=0) or box[0]
        budget = int(0.65 * peak)
        results["budget"] = budget
        guard(results, "same", lambda: _train(rank=rank, cap=budget, budget=budget))
        # a tighter device on rank 1 only: its rescues must re-plan rank 0 too
        tight = budget if rank == 0 else int(0.8 * budget)
        guard(results, "rescue", lambda: _train(rank=rank, cap=tight, budget=budget, cache_dir=cache_dir))
        guard(results, "cached", lambda: _train(rank=rank, cap=tight, budget=budget, cache_dir=cache_dir))
        guard(results, "mismatch", lambda: _mismatched_models(rank))
        guard(results, "stages", lambda: _stage_groups(rank))
        guard(results, "pp-plain", lambda: _pipeline(rank=rank, budget=None))
        stage_peak = torch.tensor(max(results["pp-plain"].get("peaks") or [0]))
        dist.all_reduce(stage_peak, op=dist.ReduceOp.MAX)  # one budget for both stages: their plans still differ
        guard(results, "pp", lambda: _pipeline(rank=rank, budget=int(0.6 * int(stage_peak))))
