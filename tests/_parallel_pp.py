"""Pipeline cases of tests/test_parallel_exec.py: llama-tiny cut into stage modules of ``torch.distributed.pipelining``,
each stage module with its own plan, GPipe / 1F1B on 2 stages and interleaved 1F1B on 4 (2 chunks per rank)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from adaptive_mem import optimize
from adaptive_mem.models._parallelize import Stage

__all__ = ["STAGE_PLANS", "pipeline_parallel"]

MICROBATCHES = 4


def _swap(prefetch: int) -> dict:
    return {"action": "swap", "backward_prefetch": prefetch}


STAGE_PLANS = [  # each stage module its own (local names: every stage's layers are layers.0 and layers.1)
    {"layers.0": "recompute", "layers.1.feed_forward.w1.activation.silu": "recompute"},
    {"layers.0": _swap(1), "layers.1": "recompute"},
    {"layers.0.attention.flash_attention": "recompute", "layers.1.feed_forward": _swap(0)},
    {"layers": _swap(1)},
]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _run(schedule_name: str, rank: int, world: int, bundle: Callable[..., Any], with_plans: bool) -> tuple:
    from torch.distributed import pipelining

    chunks = 2 if schedule_name == "ScheduleInterleaved1F1B" else 1
    stages_total = world * chunks
    b = bundle(layers=2 * stages_total, batch=MICROBATCHES)
    ids, labels = b.batch(seed=0)
    indices = [rank + world * c for c in range(chunks)]  # interleaved: rank r holds stages r, r + world
    modules = [Stage(b.model, 2 * i, 2 * i + 2) for i in indices]
    handles = [optimize(m, plan={"format": "adaptive-mem-plan", "version": 1, "decisions": STAGE_PLANS[i]})
               for m, i in zip(modules, indices)] if with_plans else []
    stages = [pipelining.PipelineStage(m, i, stages_total, torch.device("cpu")) for m, i in zip(modules, indices)]
    cls = getattr(pipelining, schedule_name)
    schedule = cls(stages if chunks > 1 else stages[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(ids)
    else:
        schedule.step(target=labels, losses=losses)
    grads = {f"stage{i}.{n}": p.grad.detach().clone() for m, i in zip(modules, indices)
             for n, p in m.named_parameters() if p.grad is not None}
    offloaded = sum(h.swap_stats.offloaded_bytes for h in handles if h.swap_stats is not None)
    summaries = [str(h.summary()) for h in handles]
    for h in handles:
        h.remove()
    loss = torch.stack(losses).sum().detach() if losses else torch.zeros(())
    swaps = any("swap" in str(STAGE_PLANS[i]) for i in indices)
    return (loss, grads), {"offloaded": offloaded, "swaps": swaps, "summaries": summaries}


def pipeline_parallel(results: dict, rank: int, *, guard: Callable[..., None], plan: Callable[..., Any],
                      bundle: Callable[..., Any], compare: Callable[..., dict]) -> None:
    world = dist.get_world_size()
    for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"):
        def case() -> dict:
            ref, _ = _run(name, rank, world, bundle, with_plans=False)
            got, figures = _run(name, rank, world, bundle, with_plans=True)
            return {**compare(got, ref), **figures}
        guard(results, f"pp-{name}", case)
