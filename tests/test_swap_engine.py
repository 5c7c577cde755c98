"""SwapEngine on its own, its Python records: storage-level copies, prefetch triggers, the known offloader failure
modes. The records of accelerators, of copies above the CPU's inline size, of the file store and of the rescues;
the CPU's native records (Note: [native swap records]) are tests/test_native_swap.py's."""

from __future__ import annotations

import gc
import threading

import torch

from adaptive_mem import DeviceMemory
from adaptive_mem.runtime._swap_engine import SwapEngine


def _engine(num_layers: int = 4, *, overlapping: bool = False, native: bool = False, **kw) -> SwapEngine:
    """``overlapping``: every copy to the copy thread, where a reload issued ahead overlaps compute (as on a stream):
    the prefetch triggers' work; the default copier reloads what it runs inline at the unpack (Note: [reload at the
    unpack] in ``_copier.py``)."""
    engine = SwapEngine(device="cpu", num_layers=num_layers, native=native, **kw)
    if overlapping:
        engine.copier.inline_bytes = 0
    return engine


def _gate(engine: SwapEngine) -> threading.Event:
    gate = threading.Event()
    engine.copier.submit(lambda non_blocking: gate.wait())
    return gate


def test_view_round_trip_is_exact_and_copies_the_storage_once():
    engine = _engine()
    base = torch.randn(6, 8)
    expected = base.clone()
    view_a, view_b = base.t(), base[2:4, 1:5]
    engine.begin_forward()
    pa = engine.offload(view_a, label="a", layer=0, prefetch=0)
    pb = engine.offload(view_b, label="a", layer=0, prefetch=0)
    pa2 = engine.offload(view_a, label="a", layer=0, prefetch=0)  # the same tensor saved twice
    assert engine.stats.offloaded_bytes == base.untyped_storage().nbytes()
    del base, view_a, view_b
    out_a, out_b, out_a2 = pa.unpack(), pb.unpack(), pa2.unpack()
    assert torch.equal(out_a, expected.t()) and out_a.stride() == expected.t().stride()
    assert torch.equal(out_b, expected[2:4, 1:5]) and torch.equal(out_a2, expected.t())
    assert engine.stats.reloaded_bytes == expected.untyped_storage().nbytes()
    engine.close()


def test_reload_never_races_its_own_offload():
    engine = _engine()
    gate = _gate(engine)  # the offload copy below cannot start yet
    t = torch.arange(1000, dtype=torch.float32)
    packed = engine.offload(t, label="x", layer=0, prefetch=0)
    threading.Timer(0.2, gate.set).start()
    out = packed.unpack()  # on-demand reload queued behind the offload: waits, then exact
    assert torch.equal(out, torch.arange(1000, dtype=torch.float32))
    assert engine.stats.late_reloads == 1
    engine.close()


def test_prefetch_trigger_issues_reload_before_unpack():
    engine = _engine(num_layers=4, overlapping=True)
    engine.begin_forward()
    packed = {layer: engine.offload(torch.full((100,), float(layer)), label=f"l{layer}", layer=layer, prefetch=2)
              for layer in range(4)}
    engine.end_forward()
    engine.on_backward(4)  # backward begins: layers 2, 3 (2 + 2 >= 4) are due
    assert engine.stats.reloaded_bytes == 2 * 400
    engine.on_backward(3)  # layer 1's trigger
    assert engine.stats.reloaded_bytes == 3 * 400
    engine.on_backward(2)  # layer 0's trigger
    assert engine.stats.reloaded_bytes == 4 * 400
    for layer in reversed(range(4)):
        assert torch.equal(packed[layer].unpack(), torch.full((100,), float(layer)))
    assert engine.stats.on_demand_reloads == 0


def test_skipped_trigger_still_reloads_in_time():
    engine = _engine(num_layers=4, overlapping=True)
    early = engine.offload(torch.ones(10), label="a", layer=0, prefetch=1)  # trigger: layer 1
    engine.on_backward(0)  # layer 1's trigger never fired (its output had no grad): issued now
    assert engine.stats.reloaded_bytes == 40 and engine.stats.on_demand_reloads == 0
    assert torch.equal(early.unpack(), torch.ones(10))
    engine.close()
    engine.close()


def test_dropped_record_releases_device_memory_and_host_buffer_at_once():
    """Note: [cancelled offload]: a handle that dies before its copy ran leaves nothing behind."""
    engine = _engine()
    with DeviceMemory(track_existing=False) as mem:
        gate = _gate(engine)
        t = torch.empty(10_000, dtype=torch.uint8)
        packed = engine.offload(t, label="x", layer=0, prefetch=1)
        del t
        assert mem.live == 10_000  # held for the queued copy
        del packed
        gc.collect()
        assert mem.live == 0
        assert engine.pool.in_use_bytes == 0
        gate.set()
    engine.close()


def test_a_storage_saved_again_after_its_first_save_died_is_swapped_again():
    """Note: [dead record]: the first save's handle dies in forward (topk's node freed with its values), the
    storage lives on and is saved again: a new record copies it, and the unpack is exact."""
    engine = _engine()
    engine.begin_forward()
    indices = torch.arange(64, dtype=torch.int64).reshape(32, 2)
    first = engine.offload(indices, label="router", layer=0, prefetch=1)
    del first
    gc.collect()
    again = engine.offload(indices, label="router", layer=0, prefetch=1)
    engine.end_forward()
    engine.on_backward(1)
    assert torch.equal(again.unpack(), torch.arange(64, dtype=torch.int64).reshape(32, 2))
    assert engine.pool.in_use_bytes == 0
    engine.close()


def test_host_pool_is_reused_across_steps():
    engine = _engine()
    sizes = []
    for step in range(5):
        engine.begin_forward()
        packs = [engine.offload(torch.randn(64 * (i + 1)), label="x", layer=i, prefetch=1) for i in range(4)]
        engine.end_forward()
        for layer in (4, 3, 2, 1, 0):
            engine.on_backward(layer)
        for p in reversed(packs):
            p.unpack()
        del packs
        sizes.append(engine.host_bytes)
        assert engine.pool.in_use_bytes == 0
    assert len(set(sizes)) == 1 and sizes[0] == sum(64 * (i + 1) * 4 for i in range(4))
    engine.close()


def test_file_store_round_trip(tmp_path):
    engine = _engine(host_store="file", host_dir=str(tmp_path))
    t = torch.randn(3, 5, dtype=torch.float64)
    expected = t.clone()
    packed = engine.offload(t, label="x", layer=0, prefetch=0)
    del t
    assert torch.equal(packed.unpack(), expected)
    path = engine.pool.path
    engine.close()
    assert not (tmp_path / path).exists()


def test_budget_aware_prefetch_issues_only_what_fits_and_the_rest_on_demand():
    """Note: [budget-aware prefetch]: a prefetch never takes room the step does not have."""
    engine = _engine(num_layers=4, overlapping=True)
    room = {"free": 900}
    engine.headroom = lambda: room["free"]
    engine.prefetch_reserve = 100
    packed = {layer: engine.offload(torch.full((100,), float(layer)), label=f"l{layer}", layer=layer, prefetch=4)
              for layer in range(4)}
    engine.on_backward(4)  # all four due; 800 bytes of room after the reserve: two fit (400 each)
    assert engine.stats.reloaded_bytes == 800
    room["free"] = 0
    engine.on_backward(3)  # the other two wait: no room
    assert engine.stats.reloaded_bytes == 800
    for layer in reversed(range(4)):
        assert torch.equal(packed[layer].unpack(), torch.full((100,), float(layer)))
    assert engine.stats.on_demand_reloads == 2
    assert engine.pool.in_use_bytes == 0
    engine.close()


def test_evict_drops_an_unused_prefetch_and_it_comes_back_exact():
    engine = _engine(num_layers=2, overlapping=True)
    with DeviceMemory(track_existing=False) as mem:
        t = torch.arange(2500, dtype=torch.float32)
        packed = engine.offload(t, label="x", layer=0, prefetch=2)
        del t
        engine.copier.sync(packed.record.d2h)
        assert mem.live == 0
        engine.on_backward(2)  # prefetched
        engine.copier.sync(packed.record.h2d)
        assert mem.live == 10_000
        assert engine.evict(1) == 10_000  # not yet used: its device copy goes, the host copy stays
        assert mem.live == 0 and engine.pool.in_use_bytes == 10_000
        engine.on_backward(0)  # due again at its own layer
        out = packed.unpack()
        assert torch.equal(out, torch.arange(2500, dtype=torch.float32))
        assert engine.evict(1) == 0  # served: never evicted
        assert engine.pool.in_use_bytes == 0
        del out, packed
    engine.close()


def test_a_rescue_inside_a_reload_allocation_does_not_deadlock():
    """Note: [a lock per record]: the reload of one record allocates under its lock; the out-of-memory hook it runs
    swaps another storage out on the copy thread and waits for it, which takes that record's lock."""
    engine = SwapEngine(device="cpu", num_layers=1, native=False)
    engine.copier.inline_bytes = 0  # every copy on the copy thread
    landed: list[bool] = []
    try:
        with DeviceMemory(track_existing=False) as mem:
            a, b = torch.randn(256, 256), torch.randn(256, 256)
            expected = a.clone()
            first = engine.offload(a, label="a", layer=0, prefetch=0)
            engine.copier.sync(first.record.d2h)
            del a

            def rescue(needed: int) -> bool:
                second = engine.offload(b, label="b", layer=0, prefetch=0)
                landed.append(second.record.d2h.landed.wait(timeout=5.0))
                mem.cap = None  # the room the rescue made
                return True

            mem.cap = mem.live + 1024  # the reload's allocation runs the hook
            mem.add_oom_hook(rescue)
            first.record.reload()
            assert landed == [True]
            assert torch.equal(first.unpack(), expected)
    finally:
        engine.close()


def test_a_reload_the_copier_runs_inline_waits_for_its_unpack():
    """Note: [reload at the unpack]: on the CPU copier a reload it would run inline is no prefetch (it would overlap
    nothing): no trigger is due, a trigger issues nothing, the unpack reloads exactly, and that counts as no
    on-demand reload; a copy above the inline size still prefetches."""
    engine = _engine(num_layers=4)
    engine.begin_forward()
    small = engine.offload(torch.full((100,), 2.0), label="small", layer=0, prefetch=1)
    assert not engine.wants_trigger(0)  # no trigger due anywhere
    engine.copier.inline_bytes = 100  # the next one (400 bytes) is above the inline size
    large = engine.offload(torch.full((100,), 3.0), label="large", layer=1, prefetch=1)
    engine.end_forward()
    assert small.record.at_unpack and not large.record.at_unpack
    assert engine.wants_trigger(2) and not engine.wants_trigger(3)  # the large record's trigger only
    engine.on_backward(4)
    engine.on_backward(2)
    assert engine.stats.reloaded_bytes == 400  # the large one, prefetched at layer 2's trigger
    engine.on_backward(1)
    engine.on_backward(0)
    assert engine.stats.reloaded_bytes == 400  # the small one waits for its unpack
    assert torch.equal(large.unpack(), torch.full((100,), 3.0)) and torch.equal(small.unpack(), torch.full((100,), 2.0))
    assert engine.stats.reloaded_bytes == 800 and engine.stats.on_demand_reloads == 0
    engine.close()
