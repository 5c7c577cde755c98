"""Asynchronous copies between device and host, one at a time in issue order.

Two back-ends with one interface: :class:`StreamCopier` runs copies on a
side stream of an accelerator (``torch.Stream`` / ``torch.Event`` through
``torch.accelerator``), :class:`ThreadCopier` runs them on a copy thread
(CPU, where the "device" is host memory accounted by ``DeviceMemory``).
A single FIFO serialises offloads and reloads, so a reload can never race
the offload copy of the same tensor (Note: [reload after offload]).
"""

from __future__ import annotations

import _thread
import queue
import threading
import time
from typing import Any, Callable

import torch

__all__ = ["Copy", "Copier", "LANDED", "ThreadCopier", "StreamCopier", "make_copier"]


class Landed:
    """Set once a copy's bytes have landed: ``threading.Event``'s ``set`` / ``is_set`` / ``wait`` on one raw lock,
    held until set (no Python-level condition per copy)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self) -> None:
        if self._lock.locked():
            self._lock.release()

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or ``timeout`` seconds passed; whether it is set."""
        if not self._lock.locked():
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._lock.release()
        return True


class Copy:
    """One submitted copy; ``on_done`` runs once the bytes have landed."""

    __slots__ = ("fn", "on_done", "landed", "finished", "error", "event")

    def __init__(self, fn: Callable[[bool], None] | None, on_done: Callable[[], None] | None,
                 landed: Landed | None = None) -> None:
        self.fn = fn
        self.on_done = on_done
        self.landed = Landed() if landed is None else landed
        self.finished = False
        self.error: BaseException | None = None
        self.event: Any = None


_SET = Landed()
_SET.set()
LANDED = Copy(None, None, _SET)
"""The handle of every copy that ran inline and succeeded (Note: [inline copies]): landed, nothing to wait for."""
LANDED.finished = True


class Copier:
    def submit(self, fn: Callable[[bool], None], on_done: Callable[[], None] | None = None,
               nbytes: int | None = None) -> Copy:
        """Queue ``fn(non_blocking)`` (it copies ``nbytes``, when known); returns a handle to wait on."""
        raise NotImplementedError

    def flush(self) -> None:
        """Start the copies submitted so far (Note: [batched issue]); waits and syncs flush by themselves."""

    def wait(self, copy: Copy) -> float:
        """Make the compute stream (or thread) wait for ``copy``; returns the seconds blocked."""
        raise NotImplementedError

    inline_bytes = 0
    """Copies of known size up to this run inline in ``submit`` (Note: [inline copies]); 0: none does. The swap
    engine's native records take the storages up to it (Note: [native swap records] in ``_swap_store.cpp``)."""

    asynchronous_issue = False
    """True when a submitted copy may still be running on the device after ``submit`` returned
    without the host knowing (streams); a queued-but-unstarted copy can then not be cancelled."""

    def sync(self, copy: Copy) -> None:
        """Block the host until ``copy`` has landed."""
        raise NotImplementedError

    def reap(self) -> None:
        """Run ``on_done`` of copies that have landed."""

    def overlaps(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` issued ahead of its use can overlap compute (Note: [reload at the unpack])."""
        return True

    def close(self) -> None:
        pass


INLINE_BYTES = 1 << 20
"""Copies up to this size run inline on the CPU when the copy thread is idle (Note: [inline copies]); a larger one
takes long enough for the copy thread to pay off where a core is free."""


class ThreadCopier(Copier):
    """Note: [inline copies]. On the CPU a copy handed to the copy thread costs two thread switches and the GIL
    handed over and back (about 40 us per copy on the 2-core VM: as long as a memcpy of a few hundred KiB), and it
    overlaps compute only while the thread has the GIL released inside the copy and a core is free. So a copy of
    known size up to ``inline_bytes`` runs inline in ``submit`` while no copy is queued or running on the thread
    (issue order is kept: nothing submitted earlier is still pending), outside the Python dispatch modes of the
    caller (as on the copy thread, where none is entered: the runtime's footprint counts no copy), and returns the
    shared handle :data:`LANDED`; larger copies, copies of unknown size and copies submitted behind a pending one go
    to the thread in issue order (tests/test_copier.py)."""

    def __init__(self, inline_bytes: int | None = None) -> None:
        self.inline_bytes = INLINE_BYTES if inline_bytes is None else inline_bytes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending = 0  # copies given to the thread and not finished (written under ``_lock``)
        self._lock = _thread.allocate_lock()
        self.inline = 0
        """Copies run inline (cumulative)."""

    def submit(self, fn: Callable[[bool], None], on_done: Callable[[], None] | None = None,
               nbytes: int | None = None) -> Copy:
        if nbytes is not None and nbytes <= self.inline_bytes and not self._pending:
            self.inline += 1
            try:
                with torch._C._DisableTorchDispatch():  # as on the copy thread: no dispatch mode sees the copy
                    fn(False)
                if on_done is not None:
                    on_done()
            except BaseException as exc:  # reported to the waiter, as from the thread
                copy = Copy(None, None, _SET)
                copy.error, copy.finished = exc, True
                return copy
            return LANDED
        copy = Copy(fn, on_done)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="adaptive-mem-copy", daemon=True)
            self._thread.start()
        with self._lock:
            self._pending += 1
        self._queue.put(copy)
        return copy

    def overlaps(self, nbytes: int) -> bool:
        """Note: [reload at the unpack]. A copy this copier runs inline overlaps nothing, wherever it is issued; a
        reload issued a layer ahead of its unpack then only brings its bytes in early, and they are cold again by
        the unpack (the layers between run their backward): on the 2-core VM a whole-layer swap of llama-tiny's
        layers 0-2 cost +7.2 % over plain with each reload a layer ahead, +3.9 % with each at its unpack
        (benchmarks/README "The floor under the swap engine"). So the engine reloads what this copier would run
        inline at the unpack (tests/test_swap_engine.py)."""
        return nbytes > self.inline_bytes

    def _run(self) -> None:
        while True:
            copy = self._queue.get()
            if copy is None:
                return
            try:
                copy.fn(False)
                if copy.on_done is not None:
                    copy.on_done()
            except BaseException as exc:  # reported to the waiter
                copy.error = exc
            copy.fn = copy.on_done = None
            copy.finished = True
            copy.landed.set()
            with self._lock:
                self._pending -= 1

    def wait(self, copy: Copy) -> float:
        if copy.landed.is_set():
            return 0.0
        start = time.perf_counter()
        copy.landed.wait()
        return time.perf_counter() - start

    def sync(self, copy: Copy) -> None:
        copy.landed.wait()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


BATCH_BYTES = 16 << 20
"""Queued bytes at which a stream copier issues its batch without waiting for a flush (Note: [batched issue])."""


class StreamCopier(Copier):
    """Copies on one side stream; the compute stream waits on events, never the host.

    Note: [batched issue]. ``submit`` only queues a copy. ``flush`` issues the queued copies together: the side
    stream waits once for the compute stream (which covers every producer of a queued source and every allocation
    of a queued destination, all made before the flush), the copies run in submit order, and one event, reused once
    its batch has landed, marks the batch. A batch starts by itself once it holds ``BATCH_BYTES`` (a copy of unknown
    size counts as that much): device memory waiting for its offload stays bounded, and copies that large cost
    far more than their issue anyway. The engine flushes at each layer change of its offloads, at the end of
    forward and after each backward trigger, and issues a reload asked for outside a trigger (the adaptive loop's
    prefetch) at once; ``wait`` and ``sync`` flush a copy not yet issued first. A source
    stays referenced by its record until its batch is reaped, so nothing is freed under a copy (tests/test_copier.py,
    on emulated streams)."""

    asynchronous_issue = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.Stream(device=device)
        self._queued: list[Copy] = []
        self._queued_bytes = 0
        self._inflight: list[tuple[Any, list[Copy]]] = []  # (event, copies) per issued batch, in issue order
        self._events: list[Any] = []  # events of reaped batches, for reuse

    def submit(self, fn: Callable[[bool], None], on_done: Callable[[], None] | None = None,
               nbytes: int | None = None) -> Copy:
        copy = Copy(fn, on_done)
        self._queued.append(copy)
        self._queued_bytes += BATCH_BYTES if nbytes is None else nbytes
        if self._inflight:
            self.reap()
        if self._queued_bytes >= BATCH_BYTES:
            self.flush()
        return copy

    def flush(self) -> None:
        queued = self._queued
        if not queued:
            return
        self._queued, self._queued_bytes = [], 0
        event = self._events.pop() if self._events else torch.Event(device=self.device)
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        with self.stream:
            for copy in queued:
                fn, copy.fn = copy.fn, None
                try:
                    fn(True)
                except BaseException as exc:  # reported to the waiter, as from a copy thread
                    copy.error = exc
                copy.event = event
            event.record(self.stream)
        self._inflight.append((event, queued))

    def wait(self, copy: Copy) -> float:
        if copy.event is None and not copy.finished:
            self.flush()
        if not copy.finished:
            torch.accelerator.current_stream(self.device).wait_event(copy.event)
        return 0.0

    def sync(self, copy: Copy) -> None:
        if copy.event is None and not copy.finished:
            self.flush()
        if not copy.finished:
            copy.event.synchronize()
            self.reap()

    def reap(self) -> None:
        """Finish the landed batches: one stream runs them in issue order, so the first one still running ends it."""
        inflight = self._inflight
        done = 0
        while done < len(inflight) and inflight[done][0].query():
            event, copies = inflight[done]
            for copy in copies:
                self._finish(copy)
            self._events.append(event)
            done += 1
        if done:
            del inflight[:done]

    def _finish(self, copy: Copy) -> None:
        try:
            if copy.on_done is not None:
                copy.on_done()
        except BaseException as exc:  # reported to the waiter
            copy.error = exc
        copy.on_done = None
        copy.finished = True
        copy.landed.set()

    def close(self) -> None:
        self.flush()
        self.stream.synchronize()
        self.reap()



def make_copier(device: torch.device) -> Copier:
    if device.type == "cpu":
        return ThreadCopier()
    return StreamCopier(device)
