"""Tensor-parallel cases of tests/test_parallel_exec.py: llama-tiny under DTensor ``parallelize_module`` (column-wise
q/k/v and w1/w3, row-wise wo and w2), and a sequence-parallel variant (``SequenceParallel`` on the norms, the
embedding and the head sharded on the sequence)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from adaptive_mem import optimize

__all__ = ["parallelize", "tensor_parallel"]


class _LinearStyle:
    """The project's bias-free ``Linear`` (no ``nn.Linear`` subclass) sharded as ``nn.Linear`` is."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if isinstance(self, RowwiseParallel):
            self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Colwise(_LinearStyle, ColwiseParallel):
    pass


class Rowwise(_LinearStyle, RowwiseParallel):
    pass


def parallelize(model: nn.Module, *, sequence: bool) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tp = mesh.size()
    for layer in model.layers:
        attention = layer.attention
        attention.num_heads //= tp  # the local heads, as Megatron's and torchtitan's attention do
        attention.kv_heads //= tp
        plan: dict[str, Any] = {
            "attention.wq": Colwise(), "attention.wk": Colwise(), "attention.wv": Colwise(),
            "attention.wo": Rowwise(output_layouts=Shard(1) if sequence else None),
            "feed_forward.w1": Colwise(), "feed_forward.w3": Colwise(),
            "feed_forward.w2": Rowwise(output_layouts=Shard(1) if sequence else None),
        }
        if sequence:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, mesh, plan)
    if sequence:
        parallelize_module(model, mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": Colwise(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    return model


def _record_offloads(handle: Any) -> list[tuple[str, int, int, int, int]]:
    """Each tensor the swap engine offloads: its type, the swap record it got (numbered; several tensors of one
    storage share one), its (local) storage's bytes, and the bytes of its local shard's elements and of its
    global shape."""
    engine = handle._executor.engine
    swapped: list[tuple[str, int, int, int, int]] = []
    if engine is None:
        return swapped
    engine.store = None  # every save a Python record, which the spy sees (a layer's C++ pack calls the store itself)
    offload = engine.offload
    records: list[Any] = []  # held for the case: a record's number must not be reused

    def record(t: torch.Tensor, **kwargs: Any) -> Any:
        local = t.to_local() if hasattr(t, "to_local") else t
        packed = offload(t, **kwargs)
        if packed.record not in records:
            records.append(packed.record)
        swapped.append((type(t).__name__, records.index(packed.record), local.untyped_storage().nbytes(),
                        local.numel() * local.element_size(), t.numel() * t.element_size()))
        return packed

    engine.offload = record
    return swapped


def tensor_parallel(results: dict, rank: int, groups: list[str], *, guard: Callable[..., None],
                    plan: Callable[..., Any], bundle: Callable[..., Any], step: Callable[..., tuple],
                    compare: Callable[..., dict]) -> None:
    from _parallel_cases import PLANS

    ids, labels = bundle().batch(seed=0)  # one batch for the tensor-parallel group
    for layout in [g for g in ("tp", "sp") if g in groups]:
        wrap = partial(parallelize, sequence=layout == "sp")
        ref = step(wrap(bundle().model), ids, labels)
        for plan_name, decisions in PLANS.items():
            for order in ("before", "after"):
                def case() -> dict:
                    model = bundle().model
                    if order == "before":
                        handle = optimize(model, plan=plan(decisions))
                        model = wrap(model)
                    else:
                        model = wrap(model)
                        handle = optimize(model, plan=plan(decisions))
                    swapped = _record_offloads(handle)
                    with handle:
                        got = step(model, ids, labels)
                        stats = handle.swap_stats
                        return {**compare(got, ref), "offloaded": stats.offloaded_bytes if stats else 0,
                                "swapped": swapped, "summary": str(handle.summary())}
                guard(results, f"{layout}-{plan_name}-{order}", case)
