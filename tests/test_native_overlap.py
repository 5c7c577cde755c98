"""The native store's copies on its worker thread (Note: [overlapped native copies] in
``adaptive_mem/runtime/_swap_store.cpp``): device bytes leave once a copy out has landed, a prefetch by its trigger
brings the bytes back before the unpack (within the free room, deferred beyond it), an unused prefetch can be
evicted, dead records and in-place changes with copies in flight, the window on queued copies, and a planned step
bit for bit with every copy on the worker."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

from adaptive_mem import DeviceMemory
from adaptive_mem.runtime._native_swap import core_to_spare
from adaptive_mem.runtime._spill import HostBudget
from adaptive_mem.runtime._swap_engine import SwapEngine


def _engine(**kw) -> SwapEngine:
    engine = SwapEngine(device="cpu", num_layers=4, **kw)
    assert engine.store is not None, "the native extension is built in every test run (tests/test_cpu_allocator.py)"
    engine.store.overlap = True
    return engine


def _values(n: int, seed: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * (seed + 1)


def test_device_bytes_leave_once_the_copy_out_landed_and_a_prefetch_brings_them_back():
    engine = _engine()
    with DeviceMemory(track_existing=False) as mem:
        engine.begin_forward()
        t = _values(2500, 0)
        handle = engine.offload(t, label="layers.0", layer=0, prefetch=1)  # trigger: layer 1
        del t
        engine.end_forward()
        assert engine.drain() and mem.live == 0  # the copy landed and the caller dropped its source
        assert engine.wants_trigger(1) and not engine.wants_trigger(2)
        engine.on_backward(1)
        engine.drain()
        assert mem.live == 10_000  # prefetched: back on the device before the unpack
        out = handle.unpack()
        assert mem.live == 10_000  # served from the prefetched buffer
        assert torch.equal(out, _values(2500, 0))
        assert engine.stats.on_demand_reloads == 0 and engine.stats.reloaded_bytes == 10_000
        del out, handle
        gc.collect()
        assert mem.live == 0
    assert engine.store.in_use_bytes == 0
    engine.close()


def test_a_prefetch_over_the_free_room_waits_for_the_trigger_below_then_the_unpack():
    """Note: [budget-aware prefetch], on the native records."""
    engine = _engine()
    engine.headroom = lambda: 4_000
    engine.begin_forward()
    small, large = (engine.offload(_values(n, 1), label="x", layer=1, prefetch=1) for n in (500, 2500))
    engine.end_forward()
    with DeviceMemory(track_existing=False) as mem:
        engine.on_backward(2)
        engine.drain()
        assert mem.live == 2_000  # 2 kB fit the room, 10 kB did not
        assert engine.wants_trigger(1)  # deferred to the next trigger
        engine.headroom = lambda: 0
        engine.on_backward(1)
        engine.on_backward(0)
        assert torch.equal(large.unpack(), _values(2500, 1)) and torch.equal(small.unpack(), _values(500, 1))
    assert engine.stats.on_demand_reloads == 1  # the large one, reloaded at its unpack
    engine.close()


def test_an_unused_prefetch_is_evicted_and_comes_back_exact():
    engine = _engine()
    engine.begin_forward()
    handles = [engine.offload(_values(1000, i), label=f"layers.{i}", layer=i, prefetch=1) for i in range(3)]
    engine.end_forward()
    with DeviceMemory(track_existing=False) as mem:
        engine.on_backward(3)
        engine.on_backward(2)
        engine.on_backward(1)
        engine.drain()
        assert mem.live == 12_000
        assert engine.evict(4_000) == 4_000 and mem.live == 8_000  # the one needed last (layer 0) goes
        outs = [h.unpack() for h in reversed(handles)]
    assert all(torch.equal(o, _values(1000, 2 - i)) for i, o in enumerate(outs))
    engine.close()


def test_a_record_dying_or_changed_in_place_with_its_copy_in_flight():
    """A dead record waits for its copy before its host buffer goes back; Note: [in-place after save] still holds
    when the change lands before the worker's copy."""
    budget = HostBudget(1 << 20)
    engine = _engine(host_budget=budget)
    for k in range(20):
        engine.offload(_values(4000, k), label="x", layer=0, prefetch=1)  # dropped at once: copy in flight
    assert engine.store.in_use_bytes == 0
    t = torch.ones(10)
    handle = engine.offload(t, label="layers.0", layer=0, prefetch=0)
    t.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation .*layers.0"):
        handle.unpack()
    del handle
    engine.close()
    assert budget.used == 0


def test_saves_beyond_the_window_wait_for_their_copies_and_all_come_back_exact():
    engine = _engine()
    engine.store.window_bytes = 8_000
    engine.begin_forward()
    handles = [engine.offload(_values(1500, i), label="x", layer=0, prefetch=0) for i in range(40)]
    assert all(torch.equal(h.unpack(), _values(1500, i)) for i, h in enumerate(handles))
    assert engine.stats.offloaded_bytes == engine.stats.reloaded_bytes == 40 * 6_000
    engine.close()


def test_the_worker_is_used_where_the_compute_leaves_a_core_free():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = SwapEngine(device="cpu", num_layers=1)
        torch.set_num_threads(max(threads, 64))
        many = SwapEngine(device="cpu", num_layers=1)
    finally:
        torch.set_num_threads(threads)
    assert core_to_spare(1) == (len(os.sched_getaffinity(0)) > 1)
    assert one.store.overlap == core_to_spare(1) and not many.store.overlap
    one.close()
    many.close()


def test_overlapped_the_store_takes_storages_above_the_inline_size():
    """Inline, a storage above the copier's inline size goes to the Python records (their copy thread overlaps
    it); with the worker, the store takes it and its copy overlaps there."""
    inline = SwapEngine(device="cpu", num_layers=1)
    inline.store.overlap = False
    big = _values(inline.copier.inline_bytes // 4 + 1024, 3)
    assert type(inline.offload(big, label="x", layer=0, prefetch=0)).__name__ == "Packed"
    engine = _engine()
    handle = engine.offload(big, label="x", layer=0, prefetch=0)
    assert type(handle).__name__ == "SwapHandle" and handle.record.nbytes == big.untyped_storage().nbytes()
    assert torch.equal(handle.unpack(), _values(inline.copier.inline_bytes // 4 + 1024, 3))
    inline.close()
    engine.close()


def test_a_child_forked_with_copies_queued_finishes_them_and_exits():
    """A process forked while the worker ran (a DataLoader's worker process) has no worker thread: its first call
    runs the unfinished copies inline, its unpacks are exact, and closing joins nothing (no hang)."""
    engine = _engine()
    engine.store.window_bytes = 1 << 30  # queue them all: ~50 ms of copies, still running at the fork
    expected = [_values(1 << 24, i) for i in range(4)]
    handles = [engine.offload(t.clone(), label="x", layer=0, prefetch=0) for t in expected]
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 when every unpack is exact and the close returns
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # killed even inside C (no Python handler runs there)
            signal.alarm(20)  # a child waiting for the parent's thread would hang
            torch.set_num_threads(1)  # as a DataLoader's worker does: OpenMP's threads are not the child's
            ok = all(torch.equal(h.unpack(), t) for h, t in zip(handles, expected))
            del handles
            engine.close()
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert all(torch.equal(h.unpack(), t) for h, t in zip(handles, expected))
    engine.close()
