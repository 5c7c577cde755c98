"""What a parallel wrapper around the model surely adds to device memory.

The loop measures what a wrapper holds while it profiles the first step (``static.other``, Note: [other
device memory]): FSDP2's gathered block and its collective buffers, DDP's gradient buckets. Two things are
known without a measurement:

* before any step, a lower bound for the refusal of a budget that cannot hold even the model: FSDP2 gathers
  each block's whole parameters for its forward, so the largest block's unsharded bytes are on the device
  at some moment beside the rank's shards;
* Note: [DDP gradient buckets] DDP keeps one flat bucket per ``bucket_cap_mb`` of trainable gradients from
  its construction on, and builds them anew after its first backward (in the order gradients became
  ready): the profile of the first step may see neither (on CPU, buckets made before the active
  ``DeviceMemory`` and not tracked are not counted until rebuilt inside it). They are held for the whole
  step, as many bytes as the trainable gradients unless ``gradient_as_bucket_view`` makes the gradients
  views of them; the profile holds at least that much beside the step. Guarded by
  tests/test_parallel_adaptive_layouts.py (DDP, before and after the wrapper, between the minimum and the
  plain peak).

A wrapper the loop is not tested under is named in one warning.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch
from torch import nn

from search import fmt_bytes

__all__ = ["WrapperMemory", "is_laid_out", "warn_untested", "wrapper_memory"]

log = logging.getLogger("adaptive_mem.adaptive._loop")  # Note: [the loop's logger]


@dataclass(frozen=True)
class WrapperMemory:
    """Device bytes a parallel wrapper surely adds to the step (a lower bound)."""

    gathered: int = 0
    """FSDP2's largest block, unsharded: all-gathered for its forward beside the rank's shards."""
    buckets: int = 0
    """DDP's gradient buckets, held for the whole step (Note: [DDP gradient buckets])."""
    what: str = ""
    """One phrase naming them with their sizes ("" when none)."""



def _fsdp2_largest_block(model: nn.Module, fsdp_module: type) -> int:
    largest = 0
    for m in model.modules():
        if not isinstance(m, fsdp_module):
            continue
        nested = {id(p) for child in m.modules() if child is not m and isinstance(child, fsdp_module)
                  for p in child.parameters()}
        own = {id(p): p for p in m.parameters() if id(p) not in nested}
        # a sharded parameter (DTensor) reports its global, unsharded shape
        largest = max(largest, sum(p.numel() * p.element_size() for p in own.values()))
    return largest


def _ddp_buckets(ddp: nn.Module) -> int:
    if getattr(ddp, "gradient_as_bucket_view", False):
        return 0
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    seen = {id(p): p.numel() * p.element_size() for name, p in ddp.module.named_parameters()
            if p.requires_grad and name not in ignored}
    return sum(seen.values())


def _ddp_around(model: nn.Module, ddp_type: type) -> list[nn.Module]:
    """The DDP wrappers inside ``model`` and those wrapping it (applied after the loop)."""
    inside = [m for m in model.modules() if isinstance(m, ddp_type)]
    if inside:
        return inside
    return [o for o in gc.get_objects() if type(o) is ddp_type and o.module is model]


def wrapper_memory(model: nn.Module, *, around: bool = False) -> WrapperMemory:
    """What the parallel wrappers in ``model`` surely hold; ``around``: DDP wrapping ``model`` counts too."""
    if not torch.distributed.is_available():
        return WrapperMemory()
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    gathered = _fsdp2_largest_block(model, FSDPModule)
    ddps = _ddp_around(model, DistributedDataParallel) if around else \
        [m for m in model.modules() if isinstance(m, DistributedDataParallel)]
    buckets = sum(_ddp_buckets(m) for m in ddps)
    parts = [f"FSDP2 gathered largest block {fmt_bytes(gathered, exact=True)}"] if gathered else []
    parts += [f"DDP gradient buckets {fmt_bytes(buckets, exact=True)}"] if buckets else []
    return WrapperMemory(gathered=gathered, buckets=buckets, what=", ".join(parts))


def is_laid_out(model: nn.Module) -> bool:
    """Whether ``model`` carries a parallel layout already (DDP, FSDP2, DTensor parameters): the loop applied before
    ``fully_shard`` or ``parallelize_module`` sees whole parameters a layout will shard, so what never leaves the
    device is known only at the first step."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    wrapped = any(isinstance(m, (FSDPModule, DistributedDataParallel)) for m in model.modules())
    return wrapped or any(type(p).__name__ == "DTensor" for p in model.parameters())


def warn_untested(model: nn.Module) -> None:
    """One warning naming a wrapper in ``model`` the loop is not tested under (DataParallel, FSDP1)."""
    kinds: tuple[type, ...] = (nn.DataParallel,)
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        kinds += (FullyShardedDataParallel,)
    untested = [type(m).__name__ for m in model.modules() if isinstance(m, kinds)]
    if untested:
        log.warning("adaptive memory: %s is not a layout the loop is tested under (DDP, FSDP2, tensor parallel and "
                    "pipeline stages are): what it holds on this device is measured at the first step, but its "
                    "plans are unverified", sorted(set(untested))[0])
