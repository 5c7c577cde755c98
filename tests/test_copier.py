"""The copiers on their own: Note: [inline copies] (CPU) and Note: [batched issue] (streams, emulated here)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_mem.runtime import _copier
from adaptive_mem.runtime._copier import LANDED, StreamCopier, ThreadCopier


def test_a_small_copy_runs_inline_while_the_thread_is_idle():
    copier = ThreadCopier()
    done = []
    copy = copier.submit(lambda non_blocking: done.append(non_blocking), lambda: done.append("landed"), nbytes=64)
    assert copy is LANDED and done == [False, "landed"] and copier.inline == 1
    assert copier.wait(copy) == 0.0
    copier.close()


def test_a_copy_behind_a_pending_one_keeps_issue_order():
    copier = ThreadCopier()
    gate, order = threading.Event(), []
    held = copier.submit(lambda non_blocking: (gate.wait(), order.append("held")))  # unknown size: the thread
    later = copier.submit(lambda non_blocking: order.append("later"), nbytes=64)  # queued behind it, not inline
    assert later is not LANDED and copier.inline == 0 and order == []
    gate.set()
    copier.sync(later)
    assert held.finished and order == ["held", "later"]
    after = copier.submit(lambda non_blocking: order.append("after"), nbytes=64)  # idle again: inline
    assert after is LANDED and order[-1] == "after"
    copier.close()


def test_a_large_copy_goes_to_the_thread():
    copier = ThreadCopier(inline_bytes=100)
    copy = copier.submit(lambda non_blocking: None, nbytes=101)
    assert copy is not LANDED
    copier.sync(copy)
    assert copy.finished and copier.inline == 0
    copier.close()


def test_an_inline_failure_is_reported_to_the_waiter():
    copier = ThreadCopier()
    copy = copier.submit(lambda non_blocking: 1 / 0, nbytes=8)
    assert copy is not LANDED and copy.finished and isinstance(copy.error, ZeroDivisionError)
    assert LANDED.error is None


def test_no_dispatch_mode_sees_an_inline_copy():
    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    src, dst = torch.arange(8.0), torch.zeros(8)
    with Count():
        ThreadCopier().submit(lambda non_blocking: dst.copy_(src), nbytes=32)
    assert Count.calls == 0 and torch.equal(dst, src)


class _Event:
    """An event on one emulated stream: it lands with every event recorded before it."""

    made = 0
    recorded: list["_Event"] = []

    def __init__(self, device=None) -> None:
        _Event.made += 1
        self.done = False

    def record(self, stream) -> None:
        stream.log.append(("record", self))
        self.done = False
        _Event.recorded.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        for event in _Event.recorded[:_Event.recorded.index(self) + 1]:
            event.done = True


class _Stream:
    def __init__(self) -> None:
        self.log: list = []

    def wait_stream(self, other) -> None:
        self.log.append("wait_stream")

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", event))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@pytest.fixture
def stream_copier(monkeypatch):
    side, compute = _Stream(), _Stream()
    monkeypatch.setattr(torch, "Stream", lambda device: side)
    monkeypatch.setattr(torch, "Event", _Event)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device: compute)
    _Event.made, _Event.recorded = 0, []
    return StreamCopier(torch.device("cpu")), side, compute


def test_streams_issue_a_batch_with_one_wait_and_one_event(stream_copier):
    copier, side, compute = stream_copier
    ran, landed = [], []
    copies = [copier.submit(lambda nb, i=i: ran.append((i, nb)), lambda i=i: landed.append(i), nbytes=8)
              for i in range(3)]
    assert ran == [] and side.log == []  # queued, not issued
    copier.flush()
    assert ran == [(0, True), (1, True), (2, True)]
    assert side.log[0] == "wait_stream" and len(side.log) == 2 and _Event.made == 1
    event = copies[0].event
    assert all(c.event is event and not c.finished for c in copies)
    event.done = True
    copier.reap()
    assert landed == [0, 1, 2] and all(c.finished and c.landed.is_set() for c in copies)
    copier.submit(lambda nb: None, nbytes=8)
    copier.flush()
    assert _Event.made == 1  # the landed batch's event is reused


def test_streams_wait_and_sync_issue_an_unissued_copy_first(stream_copier):
    copier, side, compute = stream_copier
    first = copier.submit(lambda nb: None, nbytes=8)
    assert first.event is None
    copier.wait(first)
    assert first.event is not None and compute.log == [("wait_event", first.event)]
    second = copier.submit(lambda nb: None, nbytes=8)
    copier.sync(second)
    assert second.finished and first.finished  # one stream: the earlier batch landed first
    assert side.log.count("wait_stream") == 2


def test_make_copier_picks_by_device():
    assert isinstance(_copier.make_copier(torch.device("cpu")), ThreadCopier)


class _BatchLog(_copier.Copier):
    """A copier that issues only at ``flush`` (as a stream copier does), synchronously, logging each batch's size."""

    asynchronous_issue = True

    def __init__(self) -> None:
        self.queued: list = []
        self.batches: list[int] = []

    def submit(self, fn, on_done=None, nbytes=None):
        copy = _copier.Copy(fn, on_done)
        self.queued.append(copy)
        return copy

    def flush(self) -> None:
        queued, self.queued = self.queued, []
        if queued:
            self.batches.append(len(queued))
        for copy in queued:
            copy.fn(True)
            if copy.on_done is not None:
                copy.on_done()
            copy.finished = True
            copy.landed.set()

    def wait(self, copy) -> float:
        if not copy.finished:
            self.flush()
        return 0.0

    sync = wait


def test_the_engine_issues_a_batch_per_layer_and_per_trigger():
    """Note: [batched issue]: offloads go in one batch per layer, a trigger's reloads in one, a reload asked for
    outside a trigger (the adaptive loop's) at once; the round trip stays exact."""
    from adaptive_mem.runtime._swap_engine import SwapEngine

    engine = SwapEngine(device="cpu", num_layers=4, native=False)  # the Python records, on the logged copier
    engine.copier.close()
    engine.copier = log = _BatchLog()
    engine.begin_forward()
    values = {(layer, k): torch.randn(16) for layer in (0, 1) for k in range(3)}
    packed = {key: engine.offload(v, label="x", layer=key[0], prefetch=1) for key, v in values.items()}
    engine.end_forward()
    assert log.batches == [3, 3]
    engine.on_backward(2)  # layer 1's reloads (trigger 1 + 1)
    assert log.batches == [3, 3, 3]
    packed[(0, 0)].record.reload()  # outside a trigger: issued at once
    assert log.batches == [3, 3, 3, 1]
    assert all(torch.equal(p.unpack(), values[key]) for key, p in packed.items())
    assert log.batches == [3, 3, 3, 1, 1, 1]  # layer 0's other two on demand
    engine.close()


def test_streams_issue_a_batch_by_itself_once_it_holds_enough_bytes(stream_copier):
    copier, side, _ = stream_copier
    ran = []
    copier.submit(lambda nb: ran.append("small"), nbytes=1024)
    assert ran == []
    copier.submit(lambda nb: ran.append("large"), nbytes=_copier.BATCH_BYTES)
    assert ran == ["small", "large"] and side.log.count("wait_stream") == 1
    copier.submit(lambda nb: ran.append("unknown"))  # unknown size: issued at once
    assert ran[-1] == "unknown" and side.log.count("wait_stream") == 2
