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

__all__ = ["Copy", "Copier", "ThreadCopier", "StreamCopier", "make_copier"]


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

    def __init__(self, fn: Callable[[], None], on_done: Callable[[], None] | None) -> None:
        self.fn = fn
        self.on_done = on_done
        self.landed = Landed()
        self.finished = False
        self.error: BaseException | None = None
        self.event: Any = None


class Copier:
    def submit(self, fn: Callable[[bool], None], on_done: Callable[[], None] | None = None) -> Copy:
        """Queue ``fn(non_blocking)``; returns a handle to wait on."""
        raise NotImplementedError

    def wait(self, copy: Copy) -> float:
        """Make the compute stream (or thread) wait for ``copy``; returns the seconds blocked."""
        raise NotImplementedError

    asynchronous_issue = False
    """True when a submitted copy may still be running on the device after ``submit`` returned
    without the host knowing (streams); a queued-but-unstarted copy can then not be cancelled."""

    def sync(self, copy: Copy) -> None:
        """Block the host until ``copy`` has landed."""
        raise NotImplementedError

    def reap(self) -> None:
        """Run ``on_done`` of copies that have landed."""

    def close(self) -> None:
        pass


class ThreadCopier(Copier):
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[bool], None], on_done: Callable[[], None] | None = None) -> Copy:
        copy = Copy(lambda: fn(False), on_done)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="adaptive-mem-copy", daemon=True)
            self._thread.start()
        self._queue.put(copy)
        return copy

    def _run(self) -> None:
        while True:
            copy = self._queue.get()
            if copy is None:
                return
            try:
                copy.fn()
                if copy.on_done is not None:
                    copy.on_done()
            except BaseException as exc:  # reported to the waiter
                copy.error = exc
            copy.fn = copy.on_done = None
            copy.finished = True
            copy.landed.set()

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


class StreamCopier(Copier):
    """Copies on one side stream; the compute stream waits on events, never the host."""

    asynchronous_issue = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.Stream(device=device)
        self._inflight: list[Copy] = []

    def submit(self, fn: Callable[[bool], None], on_done: Callable[[], None] | None = None) -> Copy:
        copy = Copy(lambda: None, on_done)
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        with self.stream:
            fn(True)
            copy.event = torch.Event(device=self.device)
            copy.event.record(self.stream)
        self._inflight.append(copy)
        self.reap()
        return copy

    def wait(self, copy: Copy) -> float:
        if not copy.finished:
            torch.accelerator.current_stream(self.device).wait_event(copy.event)
        return 0.0

    def sync(self, copy: Copy) -> None:
        if not copy.finished:
            copy.event.synchronize()
            self.reap()

    def reap(self) -> None:
        """Finish the landed copies: one stream runs them in issue order, so the first one still running ends it."""
        inflight = self._inflight
        done = 0
        while done < len(inflight) and inflight[done].event.query():
            self._finish(inflight[done])
            done += 1
        if done:
            del inflight[:done]

    def _finish(self, copy: Copy) -> None:
        if copy.on_done is not None:
            copy.on_done()
        copy.on_done = None
        copy.finished = True
        copy.landed.set()

    def close(self) -> None:
        self.stream.synchronize()
        self.reap()


def make_copier(device: torch.device) -> Copier:
    if device.type == "cpu":
        return ThreadCopier()
    return StreamCopier(device)
