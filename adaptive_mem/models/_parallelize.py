"""The reference Llama under a parallel layout, in one place (torchtitan's ``parallelize`` style): DDP,
FSDP2 ``fully_shard`` per layer and on the root, DTensor tensor parallel (``parallelize_module``), or one
``torch.distributed.pipelining`` stage per rank. Used by ``examples/train.py`` and ``adaptive-mem run --parallel``.

:func:`parallelize` returns a :class:`ParallelModel`: the module to plan for (``module``: the wrapped model, or this
rank's stage), the batch this rank trains on, and one training step's forward and backward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ._loss import causal_lm_loss

__all__ = ["KINDS", "Parallel", "ParallelModel", "parallelize", "stage_decisions"]

KINDS = ("ddp", "fsdp", "tp", "pp")


@dataclass(frozen=True)
class Parallel:
    """A small layout: ``kind`` over ``world`` ranks (all of them one DP, TP or PP group); ``micro_batches`` per
    step for ``pp`` (GPipe below ``world`` micro-batches, 1F1B from there)."""

    kind: str
    world: int
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--parallel={self.kind!r}: expected one of {', '.join(KINDS)}")
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 2:
            raise ValueError(f"--parallel={self.kind} with --nproc={self.world}: expected --nproc >= 2 (one rank "
                             f"{'per pipeline stage' if self.kind == 'pp' else 'per shard or replica'})")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"--micro-batches={self.micro_batches!r}: expected a positive integer")

    def check(self, model: nn.Module, *, batch_size: int) -> None:
        """Refuse a model or batch this layout cannot cut, with the numbers."""
        from ._llama import LlamaModel

        if self.kind in ("tp", "pp") and not isinstance(model, LlamaModel):
            raise ValueError(f"--parallel={self.kind} with a {type(model).__name__}: expected a reference Llama "
                             "(llama-tiny, llama-small, ...): tensor and pipeline cuts are written for its layers")
        if self.kind == "tp":
            heads = model.layers[0].attention.kv_heads
            if heads % self.world:
                raise ValueError(f"--parallel=tp with --nproc={self.world}: expected a divisor of the model's "
                                 f"{heads} key/value heads")
        if self.kind == "pp":
            if len(model.layers) % self.world:
                raise ValueError(f"--parallel=pp with --nproc={self.world}: expected a divisor of the model's "
                                 f"{len(model.layers)} layers (one stage of equal layers per rank)")
            if batch_size % self.micro_batches:
                raise ValueError(f"--micro-batches={self.micro_batches}: expected a divisor of the batch size "
                                 f"{batch_size}")


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.to_local() if hasattr(logits, "to_local") else logits
    return causal_lm_loss(logits, labels)


class Stage(nn.Module):
    """Layers ``lo..hi-1`` of a reference Llama: the embedding on the first stage, the head on the last."""

    def __init__(self, model: nn.Module, lo: int, hi: int) -> None:
        super().__init__()
        # the bound method would keep the whole model (every other stage's layers) alive on this rank
        self.rope = partial(type(model)._rope_tables, SimpleNamespace(config=model.config))
        self.tok_embeddings = model.tok_embeddings if lo == 0 else None
        self.layers = nn.ModuleList(model.layers[lo:hi])
        last = hi == len(model.layers)
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        with torch.no_grad():
            cos, sin = self.rope(h.shape[1], device=h.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def stage_decisions(decisions: dict[str, Any], *, lo: int, hi: int, stage: nn.Module) -> dict[str, Any]:
    """A whole-model plan's decisions for the stage holding layers ``lo..hi-1`` (named ``layers.0..`` there)."""
    kept: dict[str, Any] = {}
    for key, value in decisions.items():
        m = re.match(r"^layers\.(\d+)(\..*)?$", key)
        if m is not None:
            if lo <= int(m.group(1)) < hi:
                kept[f"layers.{int(m.group(1)) - lo}{m.group(2) or ''}"] = value
        elif key == "layers" or getattr(stage, key.split(".")[0], None) is not None:
            kept[key] = value
    return kept


@dataclass
class ParallelModel:
    layout: Parallel
    rank: int
    module: nn.Module
    """What to plan for and optimize: the wrapped model, or this rank's pipeline stage."""
    schedule: Any = None
    bounds: tuple[int, int] = (0, 0)
    """``pp``: the layers ``[lo, hi)`` of this rank's stage."""
    dp_group: Any = None
    """The ranks that agree on this rank's adaptive plan (``pp``: this rank alone; else the world, None)."""

    def batch(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a global batch: DDP and FSDP each a slice, TP and PP all of it."""
        if self.layout.kind in ("ddp", "fsdp"):
            n = ids.shape[0] // self.layout.world
            if n == 0:
                raise ValueError(f"--batch-size={ids.shape[0]}: expected at least one sample per rank "
                                 f"({self.layout.world} ranks)")
            return ids[self.rank * n:(self.rank + 1) * n], labels[self.rank * n:(self.rank + 1) * n]
        return ids, labels

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one step; the loss (``pp``: the last stage's mean over micro-batches, on every
        rank)."""
        if self.schedule is None:
            loss = _loss(self.module(ids), labels)
            loss.backward()
            return loss.detach()
        losses: list[torch.Tensor] = []
        last = self.rank == self.layout.world - 1
        if self.rank == 0:
            self.schedule.step(ids)
        else:
            self.schedule.step(target=labels if last else None, losses=losses if last else None)
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        torch.distributed.broadcast(loss, src=self.layout.world - 1)
        return loss


def parallelize(model: nn.Module, *, layout: Parallel, batch_size: int) -> ParallelModel:
    """Apply ``layout`` to ``model`` on the initialised default process group (this rank's device is the CPU or
    the current accelerator)."""
    import torch.distributed as dist

    layout.check(model, batch_size=batch_size)
    rank = dist.get_rank()
    device = next(model.parameters()).device
    if layout.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return ParallelModel(layout, rank, DistributedDataParallel(model))
    if layout.kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (layout.world,))
        for layer in getattr(model, "layers", []):
            fully_shard(layer, mesh=mesh)
        return ParallelModel(layout, rank, fully_shard(model, mesh=mesh))
    if layout.kind == "tp":
        return ParallelModel(layout, rank, _tensor_parallel(model, device.type, layout.world))
    from torch.distributed import pipelining

    per = len(model.layers) // layout.world
    lo, hi = rank * per, (rank + 1) * per
    stage_module = Stage(model, lo, hi)
    stage = pipelining.PipelineStage(stage_module, rank, layout.world, device)
    cls = pipelining.Schedule1F1B if layout.micro_batches >= layout.world else pipelining.ScheduleGPipe
    schedule = cls(stage, n_microbatches=layout.micro_batches, loss_fn=_loss)
    groups = [dist.new_group([r]) for r in range(layout.world)]  # every rank creates every group
    return ParallelModel(layout, rank, stage_module, schedule=schedule, bounds=(lo, hi), dp_group=groups[rank])


def _tensor_parallel(model: nn.Module, device_type: str, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    def linear(style: Any) -> Any:  # the reference Llama's bias-free Linear is no nn.Linear: shard it as one
        def apply(module: nn.Module, device_mesh: Any) -> nn.Module:
            return distribute_module(module, device_mesh, style._partition_linear_fn,
                                     partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
                                     partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))
        style._apply = apply
        return style

    mesh = init_device_mesh(device_type, (world,))
    for layer in model.layers:
        layer.attention.num_heads //= world  # the local heads, as Megatron's and torchtitan's attention do
        layer.attention.kv_heads //= world
        parallelize_module(layer, mesh, {
            "attention.wq": linear(ColwiseParallel()), "attention.wk": linear(ColwiseParallel()),
            "attention.wv": linear(ColwiseParallel()), "attention.wo": _rowwise(linear),
            "feed_forward.w1": linear(ColwiseParallel()), "feed_forward.w3": linear(ColwiseParallel()),
            "feed_forward.w2": _rowwise(linear)})
    return model


def _rowwise(linear: Any) -> Any:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    style = RowwiseParallel()
    style.desired_input_layouts = (Shard(-1),)
    return linear(style)
