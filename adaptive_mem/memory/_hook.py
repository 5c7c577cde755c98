"""The allocator-hook interface: when an allocation fails, ask for ``needed`` bytes to be freed, then retry.

Every back-end implements :class:`OomHook`: the accounting and retry-at-the-op hooks in ``_oom.py``
and the CUDA pluggable allocator in ``_cuda_allocator.py``. The ``rescue`` callback
(``needed_bytes -> freed_anything``) is the SwapManager's.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["OomHook", "Rescue"]

Rescue = Callable[[int], bool]


class OomHook:
    """Where allocation failures meet the SwapManager; also the live/peak bytes the adaptive loop watches."""

    name = "none"
    retries = 0
    """Allocations retried after a rescue."""

    def __init__(self, rescue: Rescue) -> None:
        self.rescue = rescue
        self.retries = 0
        self.exhausted: Callable[[int, int | None], BaseException | None] | None = None
        """``(needed, budget) -> error`` raised when a rescue could not make room (None: the device's own error)."""

    def begin_step(self) -> None:
        """Called at the start of every step (find the accounting / allocator of this step)."""

    def live(self) -> int | None:
        return None

    def peak(self) -> int | None:
        return None

    def reset_peak(self) -> None:
        pass

    def capacity(self) -> int | None:
        """Bytes the device may hold, when known."""
        return None

    def headroom(self) -> int | None:
        cap, live = self.capacity(), self.live()
        return None if cap is None or live is None else cap - live

    def remove(self) -> None:
        pass
