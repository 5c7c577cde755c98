"""CUDA only: the allocator hook that keeps PyTorch's caching allocator.

Note: [cuda hook]. Run on an H200 (torch 2.11, benchmarks/README "GPU (lent H200)"): under a per-process memory
fraction the adaptive loop's steps survive by its rescues (multi-GPU and real device-capacity OOMs not run). It replaces the
former ``CUDAPluggableAllocator`` shim, which sent every allocation to ``cudaMalloc`` (no caching) and
so cost far more than any plan saves. Nothing is compiled: two public pieces of PyTorch do the work.

1. The caching allocator's out-of-memory observer
   (``torch._C._cuda_attach_out_of_memory_observer``): when the allocator has already released its
   cached blocks and is about to raise, it calls the observer (GIL taken, the allocator's lock
   released) with the device, the size asked and the device's free bytes. The observer asks the
   SwapManager for the shortfall, so the swapped storages return to the cache before the error
   even propagates.
2. :class:`RetryOnOom` around the step: the failed op is run again; when the observer has already
   rescued for this failure the retry does not rescue twice.

Observers cannot be detached, so one module-level observer forwards to the hook that is entered.
"""

from __future__ import annotations

import threading
import torch

from ._hook import OomHook, Rescue
from ._retry import RetryOnOom

__all__ = ["CudaOomHook", "observed_shortfall"]

_observer_lock = threading.Lock()
_observer_attached = False
_current: list["CudaOomHook"] = []


def _observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    hook = _current[-1] if _current else None
    if hook is not None:
        hook._observed(alloc, device_free)


def observed_shortfall(alloc: int, device_free: int) -> int:
    """Bytes a rescue frees for a failed allocation of ``alloc`` bytes with ``device_free`` bytes free on the
    device: the difference where the device is full, the whole allocation where something else set the limit (a
    per-process memory fraction leaves the device's free bytes far above the allocation)."""
    if 0 <= device_free < alloc:
        return alloc - device_free
    return max(1, alloc)


class CudaOomHook(OomHook):
    """CUDA: rescue in the caching allocator's out-of-memory observer, then run the op again."""

    name = "cuda-observer"

    def __init__(self, rescue: Rescue, device: torch.device) -> None:
        super().__init__(rescue)
        global _observer_attached
        if not (torch.cuda.is_available() and hasattr(torch._C, "_cuda_attach_out_of_memory_observer")):
            raise RuntimeError("the CUDA out-of-memory observer needs a CUDA build of torch and a GPU")
        with _observer_lock:
            if not _observer_attached:
                torch._C._cuda_attach_out_of_memory_observer(_observer)
                _observer_attached = True
        self.device = device
        self._rescued = 0  # bytes the observer freed for the failure now propagating
        self.mode = RetryOnOom(self._retry_rescue)
        self._entered = False

    # ------------------------------------------------------------------ the two halves
    def _observed(self, alloc: int, device_free: int) -> None:
        needed = observed_shortfall(alloc, device_free)
        if self.rescue(needed):
            self._rescued = needed

    def _retry_rescue(self, needed: int) -> bool:
        if self._rescued:  # the observer already made room for this failure
            self._rescued = 0
            self.retries += 1
            return True
        freed = self.rescue(needed)
        self.retries += bool(freed)
        return freed

    # ------------------------------------------------------------------ OomHook
    def enter(self) -> None:
        if not self._entered:
            self.mode.exhausted = self.exhausted
            self.mode.__enter__()
            _current.append(self)
            self._entered = True

    def exit(self) -> None:
        if self._entered:
            _current.remove(self)
            self.mode.__exit__(None, None, None)
            self._entered = False

    def live(self) -> int | None:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def remove(self) -> None:
        self.exit()
