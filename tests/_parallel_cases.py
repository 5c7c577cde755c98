"""The cases of tests/test_parallel_exec.py, run inside 2 spawned gloo ranks: each runs one step of llama-tiny under
a parallel layout with a plan, and the same layout without one, and records what differs.

A case's result: ``error`` (the exception, or None), ``loss`` (losses equal), ``mismatched`` (parameters whose
gradient, local shard, differs), and case-specific figures (``offloaded``, ``expected_offloaded``, ``saved``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from adaptive_mem import build_model, optimize
from search import Plan

from _spawn import gloo_rank, guard

__all__ = ["PLANS", "worker"]

TIMEOUT = 240  # seconds: every collective; the spawn gets twice this


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


def _swap(prefetch: int) -> dict:
    return {"action": "swap", "backward_prefetch": prefetch}


PLANS = {
    "full": {"layers": "recompute"},
    "select": {"layers.0.feed_forward.w1.activation.silu": "recompute", "layers.0.feed_forward.mul": "recompute",
               "layers.1.attention.flash_attention": "recompute"},
    "swap": {"layers.0": _swap(1), "layers.1.feed_forward": _swap(0)},
}


def _bundle(layers: int = 2, batch: int = 2):
    return build_model("llama-tiny", seed=0, model_args={"num_layers": layers}, batch_size=batch, seq_len=16)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _local(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    logits = _local(model(ids))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return loss.detach(), _grads(model)


def _compare(got: tuple, ref: tuple) -> dict[str, Any]:
    loss, grads = got
    ref_loss, ref_grads = ref
    mismatched = sorted(n for n in ref_grads if n not in grads or not torch.equal(grads[n], ref_grads[n]))
    return {"loss": torch.equal(loss, ref_loss), "mismatched": mismatched, "count": len(grads)}


# ------------------------------------------------------------------------------------------ DDP and FSDP2
def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _data_parallel(results: dict, rank: int, layout: str, wrap: Callable[[nn.Module], nn.Module]) -> None:
    ids, labels = _bundle().batch(seed=rank)  # each rank its own batch: the gradient reduction matters
    ref = _step(wrap(_bundle().model), ids, labels)
    for plan_name, decisions in PLANS.items():
        for order in ("before", "after"):
            def case() -> dict:
                model = _bundle().model
                if order == "before":
                    handle = optimize(model, plan=_plan(decisions))
                    model = wrap(model)
                else:
                    model = wrap(model)
                    handle = optimize(model, plan=_plan(decisions))
                with handle:
                    got = _step(model, ids, labels)
                    stats = handle.swap_stats
                    return {**_compare(got, ref), "offloaded": stats.offloaded_bytes if stats else 0,
                            "summary": str(handle.summary())}
            guard(results, f"{layout}-{plan_name}-{order}", case)


# ------------------------------------------------------------------------------------------ entry
def worker(rank: int, world: int, port: int, out: str, groups: list[str]) -> None:
    with gloo_rank(rank, world, port, out, timeout=TIMEOUT) as results:
        if "ddp" in groups:
            _data_parallel(results, rank, "ddp", _ddp)
        if "fsdp" in groups:
            _data_parallel(results, rank, "fsdp", _fsdp)
        if "tp" in groups or "sp" in groups:
            from _parallel_tp import tensor_parallel

            tensor_parallel(results, rank, groups, guard=guard, plan=_plan, bundle=_bundle, step=_step,
                            compare=_compare)
        if "pp" in groups:
            from _parallel_pp import pipeline_parallel

            pipeline_parallel(results, rank, guard=guard, plan=_plan, bundle=_bundle, compare=_compare)
