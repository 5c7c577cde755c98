"""Host memory is finite: a host budget for the swap store, and the disk tier beyond it.

:class:`HostBudget` is the RAM the swap store may hold (buffers in use and kept for reuse), shared by
every host pool of one ``optimize`` / ``adaptive_optimize`` call; by default one per process, half of
the RAM free when it is first needed (``psutil``). :class:`TieredHostPool` serves swapped activations
from RAM while the budget allows and from :class:`MmapHostPool` beyond it.

Note: [spill files]. A disk-tier buffer is a file of its exact size in this process's spill directory
``<tmp>/adaptive-mem-spill-<pid>`` (``$ADAPTIVE_MEM_SPILL_DIR`` or ``host_dir`` instead of ``<tmp>``),
memory-mapped shared (``torch.from_file``) and unlinked at once: its pages are backed by the file,
written back by the kernel, and freed with the mapping, so nothing stays on disk after the step, an
exception or a crash. The directory itself is removed when the last pool closes and at exit; a
directory of a process that no longer runs (a crash) is removed when the next one starts. Reloads
from the disk tier are ordinary reload copies on the copy thread, so scheduled prefetches read the
disk ahead of backward, beside compute.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from pathlib import Path

import torch

from ._host_marks import host_allocations, mark_host
from ._host_pool import HostBuffer, HostPool, MemoryHostPool

__all__ = ["HostBudget", "as_host_budget", "TieredHostPool", "MmapHostPool", "default_host_budget", "spill_root",
           "spill_directory", "remove_stale_spill_directories", "SPILL_PREFIX"]

SPILL_PREFIX = "adaptive-mem-spill-"
HOST_SHARE = 0.5
"""Share of the free RAM the default host budget takes."""


def default_host_budget() -> int:
    """Half of the RAM free now (``psutil.virtual_memory().available``)."""
    import psutil

    return max(1, int(HOST_SHARE * psutil.virtual_memory().available))


class HostBudget:
    """Bytes of RAM the swap store may hold; thread-safe, shared by pools."""

    _default: "HostBudget | None" = None
    _default_lock = threading.Lock()

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"host memory budget {limit!r}: expected a positive number of bytes")
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    @classmethod
    def default(cls) -> "HostBudget":
        """The process's budget when none is given: :func:`default_host_budget` at first use."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = cls(default_host_budget())
            return cls._default

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


def as_host_budget(value: "HostBudget | int | str | None", *, flag: str = "host_memory_budget"
                   ) -> "HostBudget | None":
    """``host_memory_budget=`` as given (bytes, a size such as ``"8GiB"``, a :class:`HostBudget`) or None
    (the process default)."""
    if value is None or isinstance(value, HostBudget):
        return value
    if isinstance(value, str):
        from search import parse_bytes

        return HostBudget(parse_bytes(value, key=flag))
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{flag}={value!r}: expected a positive number of bytes or a size like 8GiB")
    return HostBudget(value)


# --------------------------------------------------------------------------- the spill directory
_dir_lock = threading.Lock()
_dir_users = 0
_dirs: set[Path] = set()


def spill_root(host_dir: str | None = None) -> Path:
    return Path(host_dir or os.environ.get("ADAPTIVE_MEM_SPILL_DIR") or tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_spill_directories(root: Path) -> list[Path]:
    """Remove spill directories of processes that no longer run (a crash); returns them."""
    removed = []
    for path in root.glob(f"{SPILL_PREFIX}*"):
        suffix = path.name[len(SPILL_PREFIX):]
        if not suffix.isdigit() or int(suffix) == os.getpid() or _alive(int(suffix)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def spill_directory(host_dir: str | None = None) -> Path:
    """This process's spill directory under ``host_dir`` (created, stale ones removed first)."""
    root = spill_root(host_dir)
    path = root / f"{SPILL_PREFIX}{os.getpid()}"
    with _dir_lock:
        if path not in _dirs:
            remove_stale_spill_directories(root)
            path.mkdir(parents=True, exist_ok=True)
            _dirs.add(path)
    return path


def _remove_directories() -> None:
    with _dir_lock:
        for path in _dirs:
            shutil.rmtree(path, ignore_errors=True)
        _dirs.clear()


atexit.register(_remove_directories)


class MmapHostPool(HostPool):
    """The disk tier: each buffer a memory-mapped, already unlinked file (Note: [spill files])."""

    def __init__(self, *, host_dir: str | None = None) -> None:
        global _dir_users
        super().__init__()
        self.directory = spill_directory(host_dir)
        with _dir_lock:
            _dir_users += 1
        self._closed = False

    def _create(self, nbytes: int) -> HostBuffer:
        path = self.directory / f"{uuid.uuid4().hex}.swap"
        try:
            with host_allocations():
                tensor = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return HostBuffer(nbytes, mark_host(tensor))

    def write(self, buf: HostBuffer, src: torch.Tensor, *, non_blocking: bool) -> None:
        buf.tensor.copy_(src)

    def read(self, buf: HostBuffer, dst: torch.Tensor, *, non_blocking: bool) -> None:
        dst.copy_(buf.tensor)

    def close(self) -> None:
        global _dir_users
        if self._closed:
            return
        self._closed = True
        self.clear()
        with _dir_lock:
            _dir_users -= 1
            last = _dir_users == 0
        if last:
            _remove_directories()


class TieredHostPool(HostPool):
    """RAM buffers within ``budget``, memory-mapped files beyond it. Free RAM buffers of other sizes are
    dropped first when that makes room; disk buffers are reused like RAM ones."""

    def __init__(self, *, pin: bool, budget: HostBudget, host_dir: str | None = None) -> None:
        super().__init__()
        self.memory = MemoryHostPool(pin=pin)
        self.budget = budget
        self.host_dir = host_dir
        self.disk: MmapHostPool | None = None
        self._on_disk: set[HostBuffer] = set()  # identity (HostBuffer compares by identity)
        # a pool dropped without close() gives its RAM back to the shared budget when collected
        self._finalizer = weakref.finalize(self, _give_back, budget, self.memory)
        self.spilled_bytes = 0
        """Bytes acquired from the disk tier (cumulative)."""

    def acquire(self, nbytes: int) -> HostBuffer:
        with self._lock:
            memory = self.memory
            free = memory._free.get(nbytes)
            if free:
                buf = free.pop()
            elif nbytes == 0 or self.budget.take(nbytes) or (self._drop_free(nbytes) and self.budget.take(nbytes)):
                buf = memory._create(nbytes)
                memory.allocated_bytes += nbytes
            else:
                if self.disk is None:
                    self.disk = MmapHostPool(host_dir=self.host_dir)
                buf = self.disk.acquire(nbytes)
                self._on_disk.add(buf)
                self.spilled_bytes += nbytes
                self.in_use_bytes += nbytes
                return buf
            memory.in_use_bytes += nbytes
            self.in_use_bytes += nbytes
            return buf

    def on_disk(self, buf: HostBuffer) -> bool:
        """True for a buffer of the disk tier."""
        return buf in self._on_disk

    def _drop_free(self, nbytes: int) -> bool:
        """Release free RAM buffers (other sizes) until ``nbytes`` fit; True if they now do."""
        memory = self.memory
        for size in sorted(memory._free, reverse=True):
            while memory._free[size] and self.budget.used + nbytes > self.budget.limit:
                memory._free[size].pop()
                memory.allocated_bytes -= size
                self.budget.give(size)
        return self.budget.used + nbytes <= self.budget.limit

    def release(self, buf: HostBuffer) -> None:
        with self._lock:
            self.in_use_bytes -= buf.nbytes
            if buf in self._on_disk:
                self._on_disk.discard(buf)
                self.disk.release(buf)
                return
            self.memory.in_use_bytes -= buf.nbytes
            self.memory._free[buf.nbytes].append(buf)

    def clear(self) -> None:
        with self._lock:
            before = self.memory.allocated_bytes
            self.memory.clear()
            self.budget.give(before - self.memory.allocated_bytes)
            if self.disk is not None:
                self.disk.clear()

    @property
    def allocated_bytes(self) -> int:  # type: ignore[override]
        return self.memory.allocated_bytes + (self.disk.allocated_bytes if self.disk is not None else 0)

    @allocated_bytes.setter
    def allocated_bytes(self, value: int) -> None:
        pass  # computed from the tiers

    def write(self, buf: HostBuffer, src: torch.Tensor, *, non_blocking: bool) -> None:
        buf.tensor.copy_(src, non_blocking=non_blocking and buf not in self._on_disk)

    def read(self, buf: HostBuffer, dst: torch.Tensor, *, non_blocking: bool) -> None:
        dst.copy_(buf.tensor, non_blocking=non_blocking and buf not in self._on_disk)

    def close(self) -> None:
        self.clear()
        if self.disk is not None:
            self.disk.close()
            self.disk = None


def _give_back(budget: HostBudget, memory: MemoryHostPool) -> None:
    budget.give(memory.allocated_bytes)
    memory.allocated_bytes = 0
