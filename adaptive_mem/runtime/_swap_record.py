"""One swapped storage and the handle autograd holds for each save of it: the :class:`SwapEngine`'s parts (Note:
[swap by storage], [dead record], [in-place after save] and [budget-aware prefetch] in ``_swap_engine.py``)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from profiler import machinery_scope

from ._copier import Copy
from ._host_pool import HostBuffer

__all__ = ["Packed", "Record", "SwapStats"]


@dataclass
class SwapStats:
    offloaded_bytes: int = 0
    """Bytes copied device -> host (cumulative)."""
    reloaded_bytes: int = 0
    """Bytes copied host -> device (cumulative)."""
    late_reloads: int = 0
    """Unpacks that had to wait for their reload (``wait_seconds`` in all)."""
    wait_seconds: float = 0.0
    on_demand_reloads: int = 0
    """Reloads issued at unpack time for want of a prefetch (prefetch 0 or a trigger that never fired); not those a
    copier that runs them inline makes at the unpack by design (Note: [reload at the unpack] in ``_copier.py``)."""
    spilled_bytes: int = 0
    """Of ``offloaded_bytes``, those that went to the disk tier (beyond the host memory budget)."""


class Record:
    """One swapped storage. Note: [a lock per record]: a record's lock is held around its reload's allocation, which
    can run the out-of-memory hook; a rescue then swaps other storages, whose records' locks the copy thread takes:
    one lock per engine would deadlock there (tests/test_swap_engine.py)."""

    __slots__ = ("engine", "label", "layer", "nbytes", "device", "src", "src_ref", "version", "host", "d2h", "h2d",
                 "dst", "handles", "copying", "error", "reloaded", "served", "dead", "lock", "at_unpack",
                 "__weakref__")

    def __init__(self, engine: Any, src: torch.Tensor, nbytes: int, label: str, layer: int) -> None:
        self.engine, self.label, self.layer, self.nbytes, self.device = engine, label, layer, nbytes, src.device
        self.src: torch.Tensor | None = src  # the saved tensor, held until the offload copy landed
        self.src_ref = weakref.ref(src)  # to see in-place changes made after the copy, while it lives
        self.version = src._version
        self.host: HostBuffer | None = None
        self.d2h: Copy | None = None  # the offload copy
        self.h2d: Copy | None = None  # the reload copy
        self.dst: torch.Tensor | None = None  # uint8 device tensor after reload
        self.handles, self.copying, self.error = 0, False, None
        self.reloaded = False  # the reload copy landed (``host`` still holds the bytes until served)
        self.served = False  # an unpack has rebuilt a tensor on ``dst``
        self.dead = False  # the last handle died: copies cancelled or done, host buffer released
        self.lock = threading.RLock()  # Note: [a lock per record]
        self.at_unpack = False  # reloaded at its unpack by design, not for want of a trigger (Note: [reload at the
        # unpack] in ``_copier.py``)

    def offload(self) -> None:
        engine = self.engine
        self.host = engine.pool.acquire(self.nbytes)
        if engine.tiered and engine.pool.on_disk(self.host):
            engine.stats.spilled_bytes += self.nbytes
        self.d2h = engine.copier.submit(self._write, self._written, self.nbytes)
        engine.stats.offloaded_bytes += self.nbytes

    def _write(self, non_blocking: bool) -> None:
        """The offload copy, where the copier runs it."""
        with self.lock:  # Note: [cancelled offload]
            src, host = self.src, self.host
            if src is None:
                return
            self.copying = True
        try:  # the copy reads a uint8 view of the whole storage, made where the copy runs
            flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(src.untyped_storage())
            self.engine.pool.write(host, flat, non_blocking=non_blocking)
        finally:
            with self.lock:
                self.copying = False

    def _written(self) -> None:
        with self.lock:
            if self.src is not None and self.src._version != self.version:
                self.error = self._modified()
            self.src = None

    def _modified(self) -> str:
        """Autograd's own error for a saved tensor changed in place (Note: [in-place after save])."""
        return ("one of the variables needed for gradient computation has been modified by an inplace operation "
                f"(swapped activation of {self.label})")

    def reload(self) -> None:
        with self.lock:
            if self.h2d is not None or self.host is None:
                return
            engine = self.engine
            self.dst = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self.h2d = engine.copier.submit(self._read, self._read_done, self.nbytes)
            engine.stats.reloaded_bytes += self.nbytes
            engine._reloads.append(weakref.ref(self))
        if not engine.triggering:  # a reload asked for outside a backward trigger starts now (Note: [batched issue])
            engine.copier.flush()

    def _read(self, non_blocking: bool) -> None:
        """The reload copy, where the copier runs it (a record that died before it ran needs no bytes)."""
        dst, host = self.dst, self.host
        if dst is not None and host is not None:
            self.engine.pool.read(host, dst, non_blocking=non_blocking)

    def _read_done(self) -> None:
        with self.lock:
            self.reloaded = True
            if self.handles == 0 or self.served:
                self._release_host()

    def _release_host(self) -> None:
        host, self.host = self.host, None
        if host is not None:
            self.engine.pool.release(host)

    def evict(self) -> bool:
        """Note: [budget-aware prefetch]: drop the reloaded, never served device copy (the host copy stays)."""
        if self.h2d is None or self.served or self.handles == 0 or self.host is None:
            return False
        self.engine.copier.sync(self.h2d)  # the device bytes are free once no copy writes them
        with self.lock:
            if self.served or self.host is None:
                return False
            self.dst = None
            self.h2d = None
            self.reloaded = False
        return True

    def storage(self) -> torch.UntypedStorage:
        engine = self.engine
        if self.h2d is None:
            engine.stats.on_demand_reloads += not self.at_unpack
            self.reload()
        waited = engine.copier.wait(self.h2d)
        if waited > 0:
            engine.stats.late_reloads += 1
            engine.stats.wait_seconds += waited
        for copy in (self.d2h, self.h2d):
            if copy.error is not None:
                raise RuntimeError(f"swap of {self.label} failed: {copy.error}") from copy.error
        later = self.src_ref()
        if self.error is None and later is not None and later._version != self.version:
            self.error = self._modified()
        if self.error is not None:
            raise RuntimeError(self.error)
        with self.lock:
            self.served = True
            if self.reloaded:
                self._release_host()
        return self.dst.untyped_storage()

    def add_handle(self) -> None:
        """One more save of the storage (or a view of it) refers to this record (Note: [dead record])."""
        if self.dead:
            raise RuntimeError(f"swap of {self.label}: a saved tensor attached to a record whose handles all died "
                               "(its host copy is released); expected a new record for the storage")
        self.handles += 1

    def drop_handle(self) -> None:
        """The last handle died (backward ran, or the graph was dropped).

        Note: [cancelled offload]. A tensor whose offload copy has not run yet is
        never needed again: the copy is cancelled and the device storage released
        now; a copy in flight is waited for. So nothing of a dead record stays
        alive in the copy queue (device bytes return to the pre-step value).
        """
        self.handles -= 1
        if self.handles:
            return
        self.dead = True  # Note: [dead record]
        self.dst = None
        if self.h2d is not None:
            with self.lock:
                if self.reloaded:
                    self._release_host()
            return  # else the reload releases the host buffer when it lands
        with self.lock:
            running = self.copying
            self.src = None
        engine = self.engine
        if self.d2h is not None and not self.d2h.finished and (running or engine.copier.asynchronous_issue):
            engine.copier.sync(self.d2h)
        with self.lock:
            self._release_host()


class Packed:
    """What autograd holds instead of a swapped saved tensor."""

    __slots__ = ("record", "dtype", "size", "stride", "offset", "dtensor", "__weakref__")

    def __init__(self, record: Record, t: torch.Tensor, dtensor: Any = None) -> None:
        self.dtensor = None if dtensor is None else (dtensor._spec, dtensor.requires_grad)
        self.record = record
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        record.add_handle()

    @machinery_scope()  # Note: [machinery ops]: its ops are no units of the model
    def unpack(self) -> torch.Tensor:
        storage = self.record.storage()
        out = torch.empty(0, dtype=self.dtype, device=self.record.device)
        out = out.set_(storage, self.offset, self.size, self.stride)
        if self.dtensor is None:
            return out
        from torch.distributed.tensor import DTensor

        spec, requires_grad = self.dtensor
        return DTensor(out, spec, requires_grad=requires_grad)

    def __del__(self) -> None:
        record = self.record
        if record is not None:
            self.record = None
            record.drop_handle()
