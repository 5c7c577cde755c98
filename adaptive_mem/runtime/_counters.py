"""The two ways :class:`~adaptive_mem.DeviceMemory` counts bytes: the C++ allocator hook and the dispatch mode.

Both count per storage, exactly: a storage created while the accounting is entered counts until it
dies; one that existed before counts only once tracked (``DeviceMemory.track`` or the gc scan on
entry), and then its free is seen too. Host-store storages (:func:`host_allocations`,
:func:`mark_host`) never count. Both support the fault injection of :meth:`DeviceMemory.inject_fault`.

* :class:`CppCounter`: a session of the counting CPU allocator. Allocation, free, cap and rescue happen
  in C++ at the allocation itself; the rescue reaches the ``on_oom`` hooks through
  :func:`_on_allocation_failure` (called with the GIL by the allocator, no lock held). Storages of
  other allocators (numpy, shared memory) are tracked with weak references, as the dispatch mode does.
* :class:`DispatchCounter`: the fallback; sees the outputs of every op (``__torch_dispatch__``), counts
  new storages and uses weak references to see them die. It only sees ops of the entering thread.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from profiler.tracing import tensor_leaves

from ._host_marks import extension, in_host_block, is_host_storage

DeviceMemory = Any  # ``_accounting.DeviceMemory`` (which imports this module)
__all__ = ["CppCounter", "DispatchCounter"]

_sessions: dict[int, weakref.ref] = {}
_next_id = [0]
_callback_set = [False]


def _on_allocation_failure(session_id: int, nbytes: int, fault: int) -> None:
    """Called by the C++ allocator (GIL held): an allocation of ``nbytes`` is over the cap of session
    ``session_id`` (``fault`` = 0) or an injected fault asks the hooks for ``fault`` bytes."""
    ref = _sessions.get(session_id)
    mem = ref() if ref is not None else None
    if mem is not None:
        mem._run_hooks(nbytes, fault)


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor" or t.device.type == "meta"


def _storage_of(t: torch.Tensor, device: torch.device) -> torch.UntypedStorage | None:
    if t.device != device or _is_fake(t) or t.is_sparse:
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # storage-less wrapper subclasses
        return None
    return None if is_host_storage(st) else st


class _WeakTable:
    """Storages counted through weak references: ``register`` adds, the storage's death subtracts."""

    def __init__(self, add: Any) -> None:
        self._add = add
        self._sizes: dict[int, tuple[Any, int]] = {}
        self._lock = threading.RLock()

    def register(self, st: torch.UntypedStorage) -> int:
        key = st._cdata
        nbytes = st.nbytes()
        with self._lock:
            known = self._sizes.get(key)
            if known is not None and known[0]() is not None:
                delta = nbytes - known[1]  # resized in place
                if delta:
                    self._sizes[key] = (known[0], nbytes)
                    self._add(delta)
                return max(delta, 0)
            ref = weakref.ref(st, lambda _r, key=key: self._dead(key, _r))
            self._sizes[key] = (ref, nbytes)
            self._add(nbytes)
        return nbytes

    def _dead(self, key: int, ref: Any) -> None:
        with self._lock:
            known = self._sizes.get(key)
            if known is not None and known[0] is ref:
                del self._sizes[key]
                self._add(-known[1])


class CppCounter:
    """One session of the counting CPU allocator."""

    backend = "cpp"

    def __init__(self, mem: "DeviceMemory") -> None:
        ext = extension()
        assert ext is not None, "the C++ back-end needs the built extension"
        if not _callback_set[0]:
            ext.set_callback(_on_allocation_failure)
            _callback_set[0] = True
        _next_id[0] += 1
        self.id = _next_id[0]
        self.session = ext.Session(self.id)
        _sessions[self.id] = weakref.ref(mem, lambda _r, key=self.id: _sessions.pop(key, None))
        self._foreign = _WeakTable(self.session.add)

    def start(self) -> None:
        self.session.start()

    def stop(self) -> None:
        self.session.stop()

    def register(self, t: torch.Tensor, device: torch.device) -> int:
        st = _storage_of(t, device)
        if st is None:
            return 0
        added = self.session.adopt(st._cdata)
        return added if added >= 0 else self._foreign.register(st)

    @property
    def live(self) -> int:
        return self.session.live()

    @property
    def peak(self) -> int:
        return self.session.peak()

    @peak.setter
    def peak(self, value: int) -> None:
        self.session.set_peak(value)

    def set_cap(self, cap: int | None) -> None:
        self.session.set_cap(-1 if cap is None else cap)

    @property
    def allocations(self) -> int:
        return self.session.allocations()

    @allocations.setter
    def allocations(self, value: int) -> None:
        self.session.set_allocations(value)

    @property
    def faults(self) -> int:
        return self.session.faults()

    def inject_fault(self, at: int, needed: int) -> None:
        self.session.inject_fault(at, needed)

    def clear_faults(self) -> None:
        self.session.clear_faults()

    def on_op(self, mem: "DeviceMemory", func: Any, out: Any) -> None:
        pass  # the allocator saw everything already


class DispatchCounter:
    """The Python fallback: counts the storages of every op's outputs (``__torch_dispatch__``)."""

    backend = "dispatch"

    def __init__(self, mem: "DeviceMemory") -> None:
        self.live = 0
        self.peak = 0
        self.cap: int | None = None
        self.allocations = 0
        self.faults = 0
        self._scheduled: list[tuple[int, int]] = []  # injected faults (allocation number, bytes), latest first
        self._table = _WeakTable(self._add)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def set_cap(self, cap: int | None) -> None:
        self.cap = cap

    def inject_fault(self, at: int, needed: int) -> None:
        self._scheduled = sorted([*self._scheduled, (at, needed)], reverse=True)

    def clear_faults(self) -> None:
        self._scheduled = []

    def register(self, t: torch.Tensor, device: torch.device) -> int:
        st = _storage_of(t, device)
        if st is None:
            return 0
        added = self._table.register(st)
        if added:
            self.allocations += 1
        return added

    def _add(self, delta: int) -> None:
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live

    def on_op(self, mem: "DeviceMemory", func: Any, out: Any) -> None:
        if in_host_block():
            return
        peak_before, added, before = self.peak, 0, self.allocations
        for t in tensor_leaves(out):
            added += self.register(t, mem.device)
        if self._scheduled and self._scheduled[-1][0] <= self.allocations and self.allocations > before:
            self.faults += 1
            mem._run_hooks(0, self._scheduled.pop()[1])
        if added and self.cap is not None and self.live > self.cap:
            self._over_cap(mem, added, func, peak_before)

    def _over_cap(self, mem: "DeviceMemory", added: int, func: Any, peak_before: int) -> None:
        mem._run_hooks(0, 0)
        if self.live <= self.cap:
            # A real allocator frees first and allocates after: the moment over the cap never happened.
            self.peak = max(peak_before, self.live)
            return
        # The op's outputs die with this exception: the refused allocation never counts in the peak.
        self.peak = max(peak_before, self.live - added)
        raise torch.OutOfMemoryError(
            f"device memory cap exceeded: {func} needs {added} bytes with {self.live - added} live "
            f"of cap {self.cap}"
        )
