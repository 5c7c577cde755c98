"""The swap engine: saved activations leave device memory after forward and come back before backward.

A swapped tensor is handled at the level of its *storage*: the whole storage
is copied to one host buffer once, however many views of it autograd saves
(Note: [swap by storage]). Views keep no device memory alive because the
engine drops its device reference as soon as the copy has landed, and each
unpack rebuilds the view (dtype, size, stride, offset) on the reloaded
storage. Reloads are issued by backward triggers (``backward_prefetch``
layers ahead) or on demand at unpack; unpack blocks only if the reload is
late. Host buffers return to the pool as soon as their bytes are back on the
device, so nothing leaks across steps. On the CPU, a storage up to the copier's
inline size gets a record in C++ instead (Note: [native swap records] in
``_swap_store.cpp``), with the same rules and no Python per storage.

Note: [dead record]. A record serves the saves of its storage until its last handle dies, then drops
its copy and host buffer for good; a later save of the storage in the same forward gets a new record
(a router's ``topk`` saves its indices and dies with its unused values, then ``gather`` saves the
same indices). A dead record takes no handle (tests/test_swap_engine.py, ``..._saved_again_...``).

Note: [budget-aware prefetch]. With a ``headroom`` callback (the executor sets
one that reads the active ``DeviceMemory`` cap; the adaptive loop its own) a scheduled prefetch is issued only when it fits in the free device
bytes minus ``prefetch_reserve``; otherwise it is retried at the next layer's
backward and, at the latest, reloaded on demand at unpack. A reloaded storage
keeps its host copy until it is first served, so :meth:`SwapEngine.evict` can
drop the reloaded device bytes of a prefetch that is not yet used, at no copy
cost, when an allocation of the step needs the room.

Note: [in-place after save]. A saved tensor modified in place before its
offload copy ran would be swapped with the wrong bytes; the engine compares
the tensor's version counter after the copy and fails the unpack with
autograd's own error instead of returning a wrong gradient.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

from profiler import machinery_scope
from profiler.tracing import local_shard, no_cycle

from ._copier import ThreadCopier, make_copier
from ._host_pool import FileHostPool, HostPool
from ._native_swap import NativeStats, close_store, native_store
from ._spill import HostBudget, TieredHostPool
from ._swap_record import Packed, Record, SwapStats

__all__ = ["SwapEngine", "SwapStats", "Packed", "local_shard", "no_cycle", "parameter_storages"]


def parameter_storages(module: Any) -> set[int]:
    """Keys (``_cdata``) of the storages behind ``module``'s current parameters.

    Note: [parameter storages are never swapped]. FSDP2 gathers a layer's parameters into buffers that an op
    of the layer call writes, so the tracker sees them produced by the layer; autograd then saves views of them
    (``linear`` saves its weight). FSDP frees those buffers after the layer's forward (``resize_(0)``): an
    offload copying one would read freed memory. A storage behind any current parameter of the layer (of the
    model, outside the layers) is kept where it is (tests/test_parallel_exec.py, FSDP2 swap cases)."""
    return {p.untyped_storage()._cdata for p in module.parameters()}


log = logging.getLogger(__name__)

_ANY_SIZE = 1 << 62


class SwapEngine:
    """Offloads storages, keeps prefetch schedules, serves unpacks. One per optimized model. With ``native=False``
    every save gets a Python record (the SwapManager's rescues wait on their records' copies)."""

    def __init__(self, *, device: torch.device | str, num_layers: int, host_store: str = "memory",
                 host_dir: str | None = None, host_budget: HostBudget | None = None, native: bool = True) -> None:
        self.device = torch.device(device)
        self.num_layers = num_layers
        if host_store == "file":
            if self.device.type != "cpu":
                raise ValueError(f"host_store='file' on device {self.device}: expected a cpu device "
                                 "(accelerators swap to pinned host memory)")
            self.pool: HostPool = FileHostPool(directory=host_dir)
        elif host_store == "memory":  # RAM within the host budget, memory-mapped files beyond (_spill.py)
            self.pool = TieredHostPool(pin=self.device.type != "cpu", budget=host_budget or HostBudget.default(),
                                       host_dir=host_dir)
        else:
            raise ValueError(f"host_store={host_store!r}: expected 'memory' or 'file'")
        self.tiered = isinstance(self.pool, TieredHostPool)
        self.copier = make_copier(self.device)
        self.store = native_store(self.device, self.pool.budget) if native and self.tiered else None
        """Note: [native swap records] in ``_swap_store.cpp``: the C++ records of the saves it takes (CPU only)."""
        self._layer: int | None = None  # the layer of the offloads submitted since the last flush
        self.triggering = False  # in a backward trigger (until the next flush): its reloads start together
        self.stats = SwapStats() if self.store is None else NativeStats(self.store)
        self._close_store = None if self.store is None else weakref.finalize(self, close_store, self.store,
                                                                              self.pool.budget)
        self._by_storage: dict[int, tuple[Any, Record]] = {}
        self._pending: dict[int, list[weakref.ref]] = {}
        self._reloads: list[weakref.ref] = []
        self.headroom: Callable[[], int | None] = lambda: None
        """Free device bytes now, or None when unknown (then every scheduled prefetch is issued)."""
        self.prefetch_reserve = 0
        """Bytes a prefetch must leave free for backward's own allocations (with a ``headroom``)."""

    # ------------------------------------------------------------------ forward
    def begin_forward(self) -> None:
        if self.store is not None:
            self.store.new_forward()
        self._by_storage.clear()
        self._reloads.clear()
        self.flush()
        self.copier.reap()

    def end_forward(self) -> None:
        if self.store is not None:
            self.store.new_forward()
        self._by_storage.clear()
        self.flush()

    def flush(self) -> None:  # Note: [batched issue] in ``_copier.py``: issue the copies submitted so far
        self._layer, self.triggering = None, False
        self.copier.flush()

    def offload(self, t: torch.Tensor, *, label: str, layer: int, prefetch: int) -> Any:
        """Start copying ``t``'s storage to the host; returns the handle autograd keeps (its ``unpack()`` gives
        the tensor back): a native store's where it takes the save (Note: [native swap records]), else a
        :class:`Packed` on a Python record."""
        store = self.store
        if store is not None and type(t) is torch.Tensor:
            handle = store.offload(t, label, *self.native_terms(layer, prefetch))
            if handle is not None:
                return handle
        return self._offload(t, label=label, layer=layer, prefetch=prefetch)

    def native_terms(self, layer: int, prefetch: int) -> tuple[int, int]:
        """(trigger layer or -1, largest storage) of a native store's offload of a save in ``layer``."""
        trigger = min(layer + prefetch, self.num_layers) if prefetch > 0 else -1
        return trigger, _ANY_SIZE if self.store.overlap else self.copier.inline_bytes  # Note: [overlapped native copies]

    @machinery_scope()  # Note: [machinery ops]: the host buffer, the copy where it runs inline
    def _offload(self, t: torch.Tensor, *, label: str, layer: int, prefetch: int) -> Packed:
        """The Python record's offload.

        Note: [DTensor swap] a DTensor's local shard is what is copied (its own storage is an empty wrapper); the
        unpack wraps the reloaded shard in the same layout (tests/test_parallel_exec.py: offloaded bytes are the
        local shards' bytes)."""
        dtensor = None
        if type(t) is not torch.Tensor and local_shard(t) is not t:
            dtensor, t = t, local_shard(t)
        st = t.untyped_storage()
        key = st._cdata
        known = self._by_storage.get(key)
        if known is not None and known[0]() is not None and not known[1].dead:  # Note: [dead record]
            return Packed(known[1], t, dtensor)  # Note: [swap by storage]: saved twice or another view
        if layer != self._layer:  # Note: [batched issue]: one batch of offloads per layer
            self.copier.flush()
            self._layer = layer
        record = Record(self, t, st.nbytes(), label, layer)
        record.offload()
        self._by_storage[key] = (weakref.ref(st), record)
        if prefetch > 0:
            if self.copier.overlaps(record.nbytes):
                trigger = min(layer + prefetch, self.num_layers)
                self._pending.setdefault(trigger, []).append(weakref.ref(record))
            else:  # Note: [reload at the unpack] in ``_copier.py``
                record.at_unpack = True
        return Packed(record, t, dtensor)

    # ------------------------------------------------------------------ backward
    def wants_trigger(self, layer: int) -> bool:
        """Note: [triggers where due]. Asked at the end of ``layer``'s forward: whether the layer's output needs a
        backward trigger's gradient hook. Every reload that trigger could issue is scheduled by then (a trigger is
        its record's layer plus its prefetch distance, so later offloads only add higher ones). Without a
        ``headroom`` every reload is issued at its own trigger, so only a layer a reload is scheduled at gets one.
        With one, a reload that did not fit waits for the next layer's trigger (Note: [budget-aware prefetch]), so
        every layer from the highest trigger down gets one, but none below every trigger: a record's deferred
        reload never needs a trigger below its own layer (its unpack comes first). tests/test_footprint_swap.py
        counts the triggers."""
        if self.headroom() is None:
            return layer in self._pending or (self.store is not None and self.store.has_trigger(layer))
        return any(k >= layer for k in self._pending) or self._native_due(layer)

    def _native_due(self, layer: int) -> bool:  # Note: [overlapped native copies]
        return self.store is not None and self.store.last_trigger >= layer

    def on_backward(self, layer: int) -> None:
        """Backward begins ``layer`` (``num_layers`` = backward begins): issue the reloads scheduled here
        and any whose trigger was skipped; with a ``headroom``, only those that fit (Note: [budget-aware
        prefetch]), the rest wait for the next layer or their unpack."""
        self.copier.reap()
        if self._native_due(layer):
            room = self.headroom()
            self.store.prefetch(layer, -1 if room is None else max(0, room - self.prefetch_reserve))
        if any(k >= layer for k in self._pending):
            self._issue(layer)

    @machinery_scope()  # Note: [machinery ops]
    def _issue(self, layer: int) -> None:
        room = self.headroom()
        if room is not None:
            room -= self.prefetch_reserve
        deferred: list[weakref.ref] = []
        self.triggering = True  # Note: [batched issue]: the reloads below start together
        for trigger in sorted((k for k in self._pending if k >= layer), reverse=True):
            for ref in self._pending.pop(trigger):
                record = ref()
                if record is None or record.handles <= 0 or record.h2d is not None:
                    continue
                if room is not None and record.nbytes > room:
                    deferred.append(ref)
                    continue
                try:
                    record.reload()
                except torch.OutOfMemoryError:
                    deferred.append(ref)
                    continue
                if room is not None:
                    room -= record.nbytes
        if deferred and layer > 0:
            self._pending.setdefault(layer - 1, []).extend(deferred)
        self.flush()

    def evict(self, needed: int) -> int:
        """Free up to ``needed`` device bytes by dropping reloaded prefetches not yet used, the one needed
        last (lowest layer) first; returns the bytes freed."""
        alive = [r for r in (ref() for ref in self._reloads) if r is not None and r.h2d is not None]
        self._reloads = [weakref.ref(r) for r in alive]
        freed = self.store.evict(needed) if self.store is not None else 0
        for record in sorted(alive, key=lambda r: r.layer):
            if freed >= needed:
                break
            if record.evict():
                freed += record.nbytes
                self._pending.setdefault(record.layer, []).append(weakref.ref(record))
        return freed

    def drain(self) -> bool:
        """Wait for the copies in flight (on the copy thread bounded: a copy may be blocked behind the allocation
        that asked); whether they landed, releasing the device bytes of their offloads."""
        drained = self.store.drain() if self.store is not None else False
        marker = self.copier.submit(lambda non_blocking: None)  # copies run in issue order: behind all of them
        if isinstance(self.copier, ThreadCopier):
            return marker.landed.wait(timeout=2.0) or drained
        self.copier.stream.synchronize()
        self.copier.reap()
        return True

    def close(self) -> None:
        if self._close_store is not None:
            self._close_store()
        self.copier.close()
        self._pending.clear()
        self._by_storage.clear()
        self.pool.clear()
        if isinstance(self.pool, (FileHostPool, TieredHostPool)):
            self.pool.close()

    @property
    def host_bytes(self) -> int:
        """Host bytes the pool and the native store hold (in use or free)."""
        return self.pool.allocated_bytes + (self.store.allocated_bytes if self.store is not None else 0)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a SwapEngine cannot be copied or pickled (it owns a copy thread and host buffers); a model "
                        "under the adaptive loop (optimize(budget=...)) can be copied once its handle is removed")


