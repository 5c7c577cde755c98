"""The allocator hooks for CPU and any device, and :func:`make_hook`, which picks one for a device.

The interface, :class:`OomHook`, is in ``_hook.py``; it has three back-ends:

* :class:`AccountedHook` (CPU, tested): the active :class:`DeviceMemory`, a session of the counting
  C++ CPU allocator (``runtime/_cpu_allocator.cpp``), counts device bytes exactly and, when an
  allocation would pass its ``cap``, calls its ``on_oom`` hooks from inside that allocation (GIL
  taken), re-checks and only then refuses it with ``torch.OutOfMemoryError``. This hook is one of
  them: it asks the SwapManager for the shortfall.
* :class:`RetryOnOom` (``_retry.py``, any device): a dispatch mode that catches
  ``torch.OutOfMemoryError`` raised by an op, asks for the shortfall (parsed
  from the message when it says, else a doubling guess) and runs the op again.
  An op that failed to allocate has written nothing, so the retry is exact.
* ``_cuda_allocator.CudaOomHook`` (CUDA builds only; run on an H200 under a memory fraction): PyTorch's caching
  allocator stays; its out-of-memory observer rescues before the error propagates and
  :class:`RetryOnOom` runs the op again.

The ``rescue`` callback (``needed_bytes -> freed_anything``) is the SwapManager's.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from adaptive_mem.runtime._accounting import DeviceMemory, current_accounting

from ._hook import OomHook, Rescue
from ._retry import RetryOnOom, shortfall_of

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

    def lift_cap(self) -> bool:
        if self.memory is None or self.memory.cap is None:
            return False
        self._lifted = self.memory, self.memory.cap
        self.memory.cap = None
        return True

    def restore_cap(self) -> None:
        lifted, self._lifted = getattr(self, "_lifted", None), None
        if lifted is not None:
            memory, cap = lifted
            memory.cap = cap

    def remove(self) -> None:
        if self.memory is not None and self._hook in self.memory.on_oom:
            self.memory.on_oom.remove(self._hook)
        self.memory = None


class _RetryHook(OomHook):
    """Accelerators without an allocator hook: :class:`RetryOnOom` around each step."""

    name = "retry"

    def __init__(self, rescue: Rescue, device: torch.device) -> None:
        super().__init__(rescue)
        self.device = device
        self.mode = RetryOnOom(rescue)
        self._entered = False

    def enter(self) -> None:
        if not self._entered:
            self.mode.exhausted = self.exhausted
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


def make_hook(rescue: Rescue, device: torch.device, *, pluggable: bool = False,
              exhausted: Callable[[int, int | None], BaseException | None] | None = None) -> OomHook:
    """The hook for ``device``: accounted on CPU (the C++ allocator, or its dispatch-mode fallback); on
    CUDA, when ``pluggable`` (the allocator-level hook) is asked for and possible, the caching
    allocator's out-of-memory observer plus retry at the op; else retry at the op alone (the path for
    every other accelerator too). ``exhausted``: its :attr:`OomHook.exhausted`."""
    hook = _pick_hook(rescue, device, pluggable)
    hook.exhausted = exhausted
    return hook


def _pick_hook(rescue: Rescue, device: torch.device, pluggable: bool) -> OomHook:
    if device.type == "cpu":
        return AccountedHook(rescue)
    if device.type == "cuda" and pluggable:
        try:
            from ._cuda_allocator import CudaOomHook  # loaded only where asked for, on CUDA

            return CudaOomHook(rescue, device)
        except (RuntimeError, OSError, ImportError) as exc:
            log.warning("CUDA allocator hook (pluggable allocator unavailable: %s); catching OutOfMemoryError "
                        "at the op instead",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return _RetryHook(rescue, device)
