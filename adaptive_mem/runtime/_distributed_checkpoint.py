"""Megatron's ``--distribute-saved-activations``: a checkpoint whose saved input is sharded across ranks.

``distributed_checkpoint(fn, *args)`` behaves like
``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``, except that
after the forward the first tensor argument keeps only this rank's 1-D chunk of
its data (``world_size`` equal chunks, the last zero-padded); in backward, just
before the recompute, the chunks are all-gathered over the default
``torch.distributed`` group and the tensor gets its full data back.

Note: [TP group] as Megatron, the input is sharded over the *tensor-parallel* group, whose ranks hold the same
layer input: with ``layer=`` (the executor passes the checkpointed layer) the group is the device-mesh dimension
its DTensor parameters are sharded on (``parallelize_module``). A layer without such parameters, or under
sequence parallel (its input is already split on the sequence, as Megatron refuses the pair), keeps its input
whole, with one warning: sharding over data-parallel ranks would mix their different inputs
(tests/test_parallel_comm.py). Without ``layer=`` the group is the default (world) group.

Note: [sharded checkpoint input] Like Megatron, the input tensor object itself is
re-pointed (``.data``) at the chunk, so the storage the checkpoint holds shrinks to
1/world_size; the caller must not read that tensor between forward and backward
(it is a layer input consumed only by the checkpointed region). Every rank must
run the same checkpoints in the same order: backward all-gathers collectively.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from adaptive_mem.config._collective_names import layout_styles
from adaptive_mem.config._errors import ConfigError

__all__ = ["distributed_checkpoint", "tp_group"]

log = logging.getLogger(__name__)


_warned: set[str] = set()


def _group_size() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("distribute_saved_activations=True: no torch.distributed process group is initialized; "
                          "expected torch.distributed.init_process_group(...) on every rank first (gloo on CPU)")
    return dist.get_world_size()


def _sequence_parallel(layer: nn.Module) -> bool:
    return any(name.startswith("SequenceParallel.") for m in layer.modules() for name, _ in layout_styles(m))


def tp_group(layer: nn.Module) -> tuple[Any, str | None]:
    """The tensor-parallel process group of ``layer`` (Note: [TP group]), or ``None`` and why not."""
    for param in layer.parameters():
        mesh, placements = getattr(param, "device_mesh", None), getattr(param, "placements", None)
        if mesh is None or placements is None:
            continue
        dims = [d for d, p in enumerate(placements) if p.is_shard()]
        if dims:
            if _sequence_parallel(layer):
                return None, "the layer runs sequence parallel: its input is already split over the TP ranks"
            return mesh.get_group(dims[0]), None
    return None, "the layer has no tensor-parallel (DTensor-sharded) parameters, so no TP group holds its input"


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("distribute_saved_activations=True: layer input kept whole: %s", reason)


class _Shard:
    """Holds the shape of the sharded tensor and restores its data before the recompute."""

    def __init__(self, tensor: torch.Tensor, world: int, group: Any = None) -> None:
        self.tensor = tensor
        self.world = world
        self.group = group
        self.shape = tensor.shape
        self.numel = tensor.numel()
        self.sharded = False

    def shard(self) -> None:
        flat = self.tensor.detach().reshape(-1)
        size = -(-self.numel // self.world)
        rank = dist.get_rank(self.group)
        chunk = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        part = flat[rank * size:(rank + 1) * size]
        chunk[:part.numel()].copy_(part)
        self.tensor.data = chunk
        self.sharded = True

    def gather(self) -> None:
        if not self.sharded:
            return
        chunk = self.tensor.data
        pieces = [torch.empty_like(chunk) for _ in range(self.world)]
        dist.all_gather(pieces, chunk, group=self.group)
        self.tensor.data = torch.cat(pieces)[:self.numel].view(self.shape)
        self.sharded = False


def distributed_checkpoint(fn: Callable[..., Any], *args: Any, layer: nn.Module | None = None, **kwargs: Any) -> Any:
    """Non-reentrant checkpoint of ``fn(*args, **kwargs)`` with its first tensor argument sharded across ranks:
    those of ``layer``'s tensor-parallel group (Note: [TP group]), else the default group."""
    world = _group_size()
    group = None
    if layer is not None:
        group, reason = tp_group(layer)
        if group is None:
            _warn_once(reason)
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        world = dist.get_world_size(group)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        raise ConfigError("distribute_saved_activations=True: the checkpointed function got no tensor argument; "
                          "expected the layer input as a tensor")
    if first._base is not None:
        raise ConfigError("distribute_saved_activations=True: the layer input is a view of another tensor; "
                          "expected a tensor owning its storage (call .contiguous().clone() before the layer)")
    holder = _Shard(first, world, group)

    @contextlib.contextmanager
    def before_recompute():
        holder.gather()
        yield

    out = checkpoint(fn, *args, use_reentrant=False,
                     context_fn=lambda: (contextlib.nullcontext(), before_recompute()), **kwargs)
    holder.shard()
    return out
