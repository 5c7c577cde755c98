"""Seconds of one optimizer step: measured on scratch parameters, or estimated from memory bandwidth.

The optimizer step is part of every training step the simulator predicts, but the profiler must
not step the user's optimizer (that would change the weights). On a real device it builds a
scratch copy of the optimizer over a sample of the parameters' shapes (at most
``SAMPLE_ELEMENTS`` elements, so a nearly full device is not pushed over), times a few steps and
scales by the parameter count. On fake tensors it estimates the step as memory-bound: every
element of parameter, gradient and state is read, and parameter and state are written back.
"""

from __future__ import annotations

import logging
import statistics

import torch
from torch import nn

from ._cost import memory_seconds
from ._profile import HardwareSpec
from ._static import OPTIMIZERS
from ._timing import timed

__all__ = ["SAMPLE_ELEMENTS", "estimate_optimizer_seconds", "measure_optimizer_seconds"]

log = logging.getLogger(__name__)

SAMPLE_ELEMENTS = 1 << 22
"""Largest scratch sample (elements) the measurement allocates, with its gradient and state."""

_CLASSES = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-4),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-4, momentum=0.9),
}


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters() if p.requires_grad}.values())


def estimate_optimizer_seconds(model: nn.Module, optimizer: str | torch.optim.Optimizer, hardware: HardwareSpec) -> float:
    """Memory-bound estimate: read p, g, state; write p, state (bytes at the achieved memory bandwidth, Note:
    [op pricing])."""
    params = _trainable(model)
    if not params or hardware.memory_bandwidth <= 0:
        return 0.0
    numel = sum(p.numel() for p in params)
    width = params[0].element_size()
    name = optimizer.lower() if isinstance(optimizer, str) else type(optimizer).__name__.lower()
    state = OPTIMIZERS.get(name, OPTIMIZERS["adam"])
    return memory_seconds(hardware, numel * (3 * width + 2 * state))


def _scratch_optimizer(optimizer: str | torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if isinstance(optimizer, str):
        kind = _CLASSES.get(optimizer.lower())
        if kind is None:
            raise ValueError(f"optimizer={optimizer!r}: expected one of {', '.join(_CLASSES)} or a torch optimizer")
        return kind(params)
    return type(optimizer)(params, **optimizer.defaults)


def _sample(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Scratch tensors with the shapes of the first parameters, up to ``SAMPLE_ELEMENTS`` elements."""
    out: list[torch.Tensor] = []
    total = 0
    for p in params:
        if total + p.numel() > SAMPLE_ELEMENTS and out:
            break
        shape = p.shape if p.numel() <= SAMPLE_ELEMENTS else (SAMPLE_ELEMENTS,)
        out.append(torch.zeros(shape, dtype=p.dtype, device=p.device, requires_grad=True))
        total += out[-1].numel()
    for t in out:
        t.grad = torch.full_like(t, 1e-3)
    return out


def measure_optimizer_seconds(model: nn.Module, optimizer: str | torch.optim.Optimizer, *, repeat: int = 3) -> float:
    """Median seconds of ``repeat`` scratch optimizer steps, scaled to the model's parameter count."""
    params = _trainable(model)
    if not params:
        return 0.0
    device = params[0].device
    sample = _sample(params)
    scratch = _scratch_optimizer(optimizer, sample)
    times = [timed(scratch.step, device) for _ in range(repeat + 1)][1:]  # the first creates the state lazily
    sampled = sum(t.numel() for t in sample)
    seconds = statistics.median(times) * sum(p.numel() for p in params) / sampled
    log.debug("optimizer step: %.4f s (%d of %d elements sampled)", seconds, sampled, sum(p.numel() for p in params))
    return seconds
