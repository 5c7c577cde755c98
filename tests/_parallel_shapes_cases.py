"""The case of tests/test_adaptive_shapes.py run inside 2 spawned gloo ranks: the adaptive loop on a DDP-wrapped
llama-tiny whose ranks step different sequence lengths at the same step (dynamic padding), against the same DDP run
without the loop."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from adaptive_mem import DeviceMemory, adaptive_optimize, build_model
from adaptive_mem.runtime._accounting import host_allocations

from _adaptive_common import optimizer
from _spawn import gloo_rank, guard

__all__ = ["LENGTHS", "TIMEOUT", "worker"]

TIMEOUT = 240  # seconds: every collective; the spawn gets twice this
LENGTHS = ((32, 128, 64, 128, 96, 32, 128, 128), (64, 32, 128, 96, 64, 128, 32, 64))
"""Each rank's lengths, step by step: at steps 1 and 3 the longest is on the other rank."""


def _train(rank: int, budget: int | None) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    b = build_model("llama-tiny", batch_size=2, seq_len=128, seed=0)
    model = DistributedDataParallel(b.model)
    opt = optimizer(model)
    am = adaptive_optimize(model, budget=budget, optimizer=opt, cache=False) if budget is not None else None
    out: dict[str, Any] = {"grads": [], "plans": [], "peaks": []}
    try:
        with DeviceMemory(cap=budget, track_existing=False) as mem:
            mem.track(model, opt)
            for step, seq in enumerate(LENGTHS[rank]):
                mem.reset_peak()
                ids = torch.randint(0, b.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(step))
                logits = model(ids[:, :-1])
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
                del logits
                out["peaks"].append(mem.peak)
                with host_allocations():
                    out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
                if am is not None:
                    out["plans"].append(am.plan.to_dict() if am.plan is not None else None)
                opt.step()
                opt.zero_grad(set_to_none=True)
        if am is not None:
            out["history"] = [{"kind": r.kind, "rescues": r.rescues, "decision": r.decision} for r in am.history]
            out["profiles"] = am.profiles_run
    finally:
        if am is not None:
            am.remove()
    return out


def worker(rank: int, world: int, port: int, out: str, budget: int) -> None:
    with gloo_rank(rank, world, port, out, timeout=TIMEOUT) as results:
        guard(results, "plain", lambda: _train(rank, None))
        guard(results, "loop", lambda: _train(rank, budget))
        dist.barrier()
