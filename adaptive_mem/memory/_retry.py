"""Catch ``torch.OutOfMemoryError`` at the op, rescue, run the op again: the path for any device.

An op that failed to allocate has written nothing, so running it again is exact. The shortfall is
read from the error message (DeviceMemory's ``needs N bytes`` or the CUDA allocator's ``Tried to
allocate``), else guessed, doubling.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._hook import Rescue

__all__ = ["RetryOnOom", "shortfall_of"]

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
