"""What a parallel wrapper around the model holds on the device beyond the model itself.

The profile sees the step's parameters, gradients, optimizer state and activations; a wrapper adds memory
of its own: DDP's gradient buckets for the whole step, FSDP2's unsharded layer in flight.
:func:`wrapper_memory` gives those bytes, so that the budget check and the profile count them; a wrapper
it cannot size is named in one warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["WrapperMemory", "wrapper_memory"]

log = logging.getLogger("adaptive_mem.adaptive._loop")  # Note: [the loop's logger]


@dataclass(frozen=True)
class WrapperMemory:
    """Device bytes a parallel wrapper adds to the step."""

    resident: int = 0
    """Held for the whole step (DDP's gradient buckets)."""
    in_flight: int = 0
    """Held while one layer runs (FSDP2's unsharded parameters, gradients and their collective buffers)."""
    what: str = ""
    """One phrase naming them with their sizes ("" when none)."""


def _fmt(n: int) -> str:
    from search._solver import fmt_bytes

    return f"{fmt_bytes(n)} ({n} bytes)"


def _ddp_buckets(ddp: nn.Module) -> int:
    # Note: [DDP gradient buckets] torch's Reducer keeps one flat bucket per bucket_cap_mb of trainable
    # gradients (per dtype) from construction on, and copies each .grad into it for the all-reduce: the
    # buckets add the trainable gradients' bytes again, unless gradient_as_bucket_view makes .grad a view
    # of them (then the gradients the profile counts are the buckets). Guarded by
    # tests/test_adaptive_refusals.py::test_wrapped_budget_between_the_minima_is_refused_at_the_start.
    if getattr(ddp, "gradient_as_bucket_view", False):
        return 0
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    seen: dict[int, int] = {}
    for name, p in ddp.module.named_parameters():
        if p.requires_grad and name not in ignored:
            seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def _fsdp2_largest_layer(model: nn.Module, fsdp_module: type) -> int:
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


def wrapper_memory(model: nn.Module) -> WrapperMemory:
    """What the parallel wrappers in ``model`` hold on the device; warns once for a wrapper it cannot size."""
    if not torch.distributed.is_available():
        _warn([type(m).__name__ for m in model.modules() if isinstance(m, nn.DataParallel)])
        return WrapperMemory()
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    buckets = sum(_ddp_buckets(m) for m in model.modules() if isinstance(m, DistributedDataParallel))
    # Note: [FSDP2 layer in flight] an estimate, not a count: forward holds the all-gather output and the
    # unsharded parameters copied out of it; backward the unsharded parameters, their gradients and the
    # reduce-scatter input. Four times the largest layer's unsharded parameters covered the measured step
    # (llama-tiny, 2 gloo ranks); three did not. Guarded by the same test as [DDP gradient buckets].
    in_flight = 4 * _fsdp2_largest_layer(model, FSDPModule)
    _warn([type(m).__name__ for m in model.modules() if isinstance(m, (nn.DataParallel, FullyShardedDataParallel))])
    parts = []
    if buckets:
        parts.append(f"DDP gradient buckets {_fmt(buckets)}")
    if in_flight:
        parts.append(f"FSDP2 unsharded largest layer in flight {_fmt(in_flight)}")
    return WrapperMemory(resident=buckets, in_flight=in_flight, what=", ".join(parts))


def _warn(unmodelled: list[str]) -> None:
    if unmodelled:
        log.warning("adaptive memory: what %s adds to device memory is not modelled: the budget check covers the "
                    "wrapped model only, and a budget near its minimum may run out of memory at the first step",
                    sorted(set(unmodelled))[0])
