"""Host buffers for swapped activations, reused across steps.

Buffers are bucketed by exact byte size: a training step repeats the same
activation sizes, so after the first step every acquire is served from the
free list and the pool stops growing (Note: [bounded host pool]).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from ._accounting import host_allocations, mark_host

__all__ = ["HostBuffer", "HostPool", "MemoryHostPool", "FileHostPool"]


@dataclass(eq=False)
class HostBuffer:
    nbytes: int
    """Usable size in bytes."""
    tensor: torch.Tensor | None = None
    """uint8 host tensor (memory pool); None for the file pool."""
    offset: int = 0
    """Byte offset in the backing file (file pool)."""


class HostPool:
    """Free lists of host buffers keyed by size; thread-safe."""

    def __init__(self) -> None:
        self._free: dict[int, list[HostBuffer]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        """Bytes of all buffers ever created and not released: the pool's host footprint."""
        self.in_use_bytes = 0
        """Bytes currently holding a swapped activation."""

    def acquire(self, nbytes: int) -> HostBuffer:
        with self._lock:
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
            if buf is None:
                buf = self._create(nbytes)
                self.allocated_bytes += nbytes
            self.in_use_bytes += nbytes
            return buf

    def release(self, buf: HostBuffer) -> None:
        with self._lock:
            self.in_use_bytes -= buf.nbytes
            self._free[buf.nbytes].append(buf)

    def clear(self) -> None:
        """Drop every free buffer (buffers in use are dropped when released)."""
        with self._lock:
            for bufs in self._free.values():
                self.allocated_bytes -= sum(b.nbytes for b in bufs)
            self._free.clear()

    def _create(self, nbytes: int) -> HostBuffer:
        raise NotImplementedError

    # Copies between a device uint8 tensor and a host buffer, run on the copy thread/stream.
    def write(self, buf: HostBuffer, src: torch.Tensor, *, non_blocking: bool) -> None:
        raise NotImplementedError

    def read(self, buf: HostBuffer, dst: torch.Tensor, *, non_blocking: bool) -> None:
        raise NotImplementedError


class MemoryHostPool(HostPool):
    """Host RAM buffers, pinned when the device is an accelerator (async DMA)."""

    def __init__(self, *, pin: bool) -> None:
        super().__init__()
        self.pin = pin

    def _create(self, nbytes: int) -> HostBuffer:
        with host_allocations():
            return HostBuffer(nbytes, mark_host(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)))

    def write(self, buf: HostBuffer, src: torch.Tensor, *, non_blocking: bool) -> None:
        buf.tensor.copy_(src, non_blocking=non_blocking)

    def read(self, buf: HostBuffer, dst: torch.Tensor, *, non_blocking: bool) -> None:
        dst.copy_(buf.tensor, non_blocking=non_blocking)


class FileHostPool(HostPool):
    """Buffers are regions of one temporary file: swapped bytes leave the process's RAM.

    Copies are ``pwrite``/``preadv`` on the copy thread (CPU device only); the
    OS may keep the pages in its reclaimable page cache.
    """

    def __init__(self, *, directory: str | None = None) -> None:
        super().__init__()
        handle, self.path = tempfile.mkstemp(prefix="adaptive-mem-swap-", dir=directory)
        self._fd: int | None = handle
        self._end = 0

    def _create(self, nbytes: int) -> HostBuffer:
        buf = HostBuffer(nbytes, None, self._end)
        self._end += nbytes
        return buf

    def write(self, buf: HostBuffer, src: torch.Tensor, *, non_blocking: bool) -> None:
        assert src.device.type == "cpu", "the file host store serves the CPU device only"
        view = memoryview(src.numpy())
        done = 0
        while done < buf.nbytes:
            done += os.pwrite(self._fd, view[done:], buf.offset + done)

    def read(self, buf: HostBuffer, dst: torch.Tensor, *, non_blocking: bool) -> None:
        view = memoryview(dst.numpy())
        done = 0
        while done < buf.nbytes:
            got = os.preadv(self._fd, [view[done:]], buf.offset + done)
            assert got > 0, "swap file shorter than written"
            done += got

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            os.unlink(self.path)

    def __del__(self) -> Any:
        try:
            self.close()
        except OSError:
            pass
