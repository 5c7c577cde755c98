"""The allocator-hook interface: when an allocation fails, ask for ``needed`` bytes to be freed, then retry.

Every back-end implements :class:`OomHook`: on CPU the counting C++ allocator behind
:class:`~adaptive_mem.DeviceMemory` (``_oom.AccountedHook``: the rescue runs inside the failing
allocation, which then retries), on CUDA the caching allocator's out-of-memory observer plus a retry
of the op (``_cuda_allocator.CudaOomHook``), elsewhere the retry at the op alone (``_oom._RetryHook``).
The ``rescue`` callback (``needed_bytes -> freed_anything``) is the SwapManager's; ``exhausted``
builds the error raised when it could not make room.
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

    def enter(self) -> None:
        """The step's forward begins (a hook that retries at the op enters its mode here)."""

    def exit(self) -> None:
        """The step ended (after backward) or was abandoned."""

    def live(self) -> int | None:
        return None

    def peak(self) -> int | None:
        return None

    def reset_peak(self) -> None:
        pass

    def capacity(self) -> int | None:
        """Bytes the device may hold, when known."""
        return None

    def lift_cap(self) -> bool:
        """Let the step go past the budget from now on (a measurement that must finish on every rank, Note: [profile
        past the budget]); False where the limit is the device's own and cannot be lifted."""
        return False

    def restore_cap(self) -> None:
        """Undo :meth:`lift_cap`."""

    def headroom(self) -> int | None:
        cap, live = self.capacity(), self.live()
        return None if cap is None or live is None else cap - live

    def remove(self) -> None:
        pass
