"""Wall-clock timing of device work: synchronize an accelerator around the timed call.

One helper for every measurement of the profiler and of ``adaptive_mem.calibrate``, so each of
them waits for queued kernels the same way (a no-op on CPU, whose ops run synchronously, and on
``meta``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["synchronize", "timed"]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on CPU or meta)."""
    if device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes on ``device``, its queued work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start
