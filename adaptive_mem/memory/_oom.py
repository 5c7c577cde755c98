"""The allocator hooks for CPU and any device, and :func:`make_hook`, which picks one for a device.

The interface, :class:`OomHook`, is in ``_hook.py``; it has three back-ends:

* :class:`AccountedHook` (CPU, tested): the executor's :class:`DeviceMemory`
  counts device bytes exactly and calls its ``on_oom`` hooks before refusing
  an allocation over its ``cap``; the hook frees, the accounting re-checks.
* :class:`RetryOnOom` (any device): a dispatch mode that catches
  ``torch.OutOfMemoryError`` raised by an op, asks for the shortfall (parsed
  from the message when it says, else a doubling guess) and runs the op again.
  An op that failed to allocate has written nothing, so the retry is exact.
* ``_cuda_allocator.CudaAllocatorHook`` (CUDA builds only, NOT compiled or tested on the
  CPU machine this was written on): a ``CUDAPluggableAllocator`` whose C++
  ``malloc`` calls back into Python on ``cudaMalloc`` failure, as MindSpeed does
  with ``NPUPluggableAllocator``. It must be installed before CUDA allocates.

The ``rescue`` callback (``needed_bytes -> freed_anything``) is the SwapManager's.
"""

from __future__ import annotations

import logging
import re
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_mem.runtime._accounting import DeviceMemory, current_accounting

from ._hook import OomHook, Rescue

# OomHook and Rescue are re-exported: callers that pick a hook with make_hook get its type here too.
__all__ = ["OomHook", "AccountedHook", "RetryOnOom", "Rescue", "shortfall_of", "make_hook"]

log = logging.getLogger(__name__)


class AccountedHook(OomHook):
    """CPU: hook into the active :class:`DeviceMemory` (its ``cap`` is the budget)."""

    name = "accounted"

    def __init__(self, rescue: Rescue) -> None:
        super().__init__(rescue)
        self.memory: DeviceMemory | None = None

    def _hook(self, needed: int) -> bool:
        self.retries += 1
        freed = self.rescue(needed)
        mem = self.memory
        over = mem.shortfall() if mem is not None else 0  # the allocation being decided included
        if over > 0 and self.exhausted is not None:
            error = self.exhausted(over, mem.cap)
            if error is not None:
                raise error
        return freed

    def begin_step(self) -> None:
        mem = current_accounting()
        if mem is self.memory:
            return
        self.remove()
        self.memory = mem
        if mem is not None:
            mem.add_oom_hook(self._hook)

    def live(self) -> int | None:
        return self.memory.live if self.memory is not None else None

    def peak(self) -> int | None:
        return self.memory.peak if self.memory is not None else None

    def reset_peak(self) -> None:
        if self.memory is not None:
            self.memory.reset_peak()

    def capacity(self) -> int | None:
        return self.memory.cap if self.memory is not None else None

    def remove(self) -> None:
        if self.memory is not None and self._hook in self.memory.on_oom:
            self.memory.on_oom.remove(self._hook)
        self.memory = None


_NEEDS = re.compile(r"needs (\d+) bytes")
_TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) (B|KiB|MiB|GiB)")
_SCALE = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def shortfall_of(exc: BaseException) -> int | None:
    """Bytes the failed allocation asked for, from DeviceMemory's or the CUDA allocator's message."""
    text = str(exc)
    match = _NEEDS.search(text)
    if match:
        return int(match.group(1))
    match = _TRIED.search(text)
    if match:
        return int(float(match.group(1)) * _SCALE[match.group(2)])
    return None


class RetryOnOom(TorchDispatchMode):
    """Catch ``OutOfMemoryError`` at the op, rescue, run the op again (``max_retries`` times).

    Enter it *inside* whatever raises (the device allocator, or a ``DeviceMemory``
    entered earlier) so that the op's failure passes through this mode.
    """

    def __init__(self, rescue: Rescue, *, max_retries: int = 8, first_guess: int = 1 << 20) -> None:
        super().__init__()
        self.rescue = rescue
        self.max_retries = max_retries
        self.first_guess = first_guess
        self.retries = 0
        self.exhausted: Callable[[int, int | None], BaseException | None] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        guess = self.first_guess
        for attempt in range(self.max_retries + 1):
            try:
                return func(*args, **(kwargs or {}))
            except torch.OutOfMemoryError as exc:
                if attempt == self.max_retries:
                    raise
                needed = shortfall_of(exc) or guess
                guess *= 2
                if not self.rescue(needed):
                    error = self.exhausted(needed, None) if self.exhausted is not None else None
                    if error is not None:
                        raise error from exc
                    raise
                self.retries += 1
        raise AssertionError("unreachable")


class _RetryHook(OomHook):
    """Accelerators without the pluggable allocator: :class:`RetryOnOom` around each step."""

    name = "retry"

    def __init__(self, rescue: Rescue, device: torch.device) -> None:
        super().__init__(rescue)
        self.device = device
        self.mode = RetryOnOom(rescue)
        self._entered = False

    def enter(self) -> None:
        if not self._entered:
            self.mode.__enter__()
            self._entered = True

    def exit(self) -> None:
        if self._entered:
            self.mode.__exit__(None, None, None)
            self._entered = False

    @property
    def retries(self) -> int:  # type: ignore[override]
        return self.mode.retries

    @retries.setter
    def retries(self, value: int) -> None:
        pass

    def live(self) -> int | None:
        return torch.accelerator.memory_allocated(self.device)

    def peak(self) -> int | None:
        return torch.accelerator.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.device)

    def remove(self) -> None:
        self.exit()


def make_hook(rescue: Rescue, device: torch.device, *, pluggable: bool = False) -> OomHook:
    """The hook for ``device``: accounted on CPU; on CUDA the pluggable allocator when asked and still
    possible, else retry-at-the-op (the path for every other accelerator too)."""
    if device.type == "cpu":
        return AccountedHook(rescue)
    if device.type == "cuda" and pluggable:
        try:
            from ._cuda_allocator import CudaAllocatorHook  # loaded only where asked for, on CUDA

            return CudaAllocatorHook(rescue, device)
        except (RuntimeError, OSError, ImportError) as exc:
            log.warning("CUDA pluggable allocator unavailable (%s); catching OutOfMemoryError at the op instead",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return _RetryHook(rescue, device)
