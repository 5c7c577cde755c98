"""The CPU swap engine's native records (Note: [native swap records] in ``adaptive_mem/runtime/_swap_store.cpp``):
exact round trips by storage, device bytes by the counting allocator, host buffers reused and given back to the
budget, in-place changes refused, the dispatch modes of the caller untouched, the Python records beside them, and
a planned step's gradients bit for bit through them."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_mem import DeviceMemory, build_model, optimize
from adaptive_mem.runtime._spill import HostBudget
from adaptive_mem.runtime._swap_engine import Packed, SwapEngine
from profiler.naming import find_layers
from search import Action, Decision, Plan


def _engine(overlap: bool = False, **kw) -> SwapEngine:
    """A CPU engine with its native store, copies inline (or on the store's worker: Note: [overlapped native
    copies], tests/test_native_overlap.py)."""
    engine = SwapEngine(device="cpu", num_layers=4, **kw)
    assert engine.store is not None, "the native extension is built in every test run (tests/test_cpu_allocator.py)"
    engine.store.overlap = overlap
    return engine


def _native(handle: object) -> bool:
    return type(handle).__name__ == "SwapHandle"


def test_views_of_one_storage_share_one_copy_and_come_back_exact():
    engine = _engine()
    base = torch.randn(6, 8)
    expected = base.clone()
    view_a, view_b = base.t(), base[2:4, 1:5]
    engine.begin_forward()
    handles = [engine.offload(v, label="a", layer=0, prefetch=1) for v in (view_a, view_b, view_a)]
    assert all(_native(h) for h in handles)
    assert engine.stats.offloaded_bytes == base.untyped_storage().nbytes()
    assert engine.store.records == 1
    del base, view_a, view_b
    out_a, out_b, out_a2 = (h.unpack() for h in handles)
    assert torch.equal(out_a, expected.t()) and out_a.stride() == expected.t().stride()
    assert torch.equal(out_b, expected[2:4, 1:5]) and torch.equal(out_a2, expected.t())
    assert out_a.untyped_storage().data_ptr() == out_b.untyped_storage().data_ptr()  # one reload
    assert engine.stats.reloaded_bytes == expected.untyped_storage().nbytes()
    assert engine.stats.on_demand_reloads == 0  # prefetch asked, reloaded at the unpack by design
    engine.close()


def test_device_bytes_leave_with_the_save_and_come_back_at_the_unpack():
    engine = _engine()
    with DeviceMemory(track_existing=False) as mem:
        t = torch.arange(2500, dtype=torch.float32)
        handle = engine.offload(t, label="x", layer=0, prefetch=0)
        assert _native(handle)
        del t
        assert mem.live == 0  # the host copy is no device memory
        out = handle.unpack()
        assert mem.live == 10_000 and torch.equal(out, torch.arange(2500, dtype=torch.float32))
        assert engine.stats.on_demand_reloads == 1  # the plan asked no prefetch
        del out, handle
        gc.collect()
        assert mem.live == 0
    assert engine.store.in_use_bytes == 0
    engine.close()


def test_a_storage_saved_again_after_its_first_save_died_gets_a_new_record():
    """Note: [dead record]."""
    engine = _engine()
    engine.begin_forward()
    indices = torch.arange(64, dtype=torch.int64).reshape(32, 2)
    first = engine.offload(indices, label="router", layer=0, prefetch=1)
    del first
    again = engine.offload(indices, label="router", layer=0, prefetch=1)
    assert engine.store.records == 2
    assert torch.equal(again.unpack(), torch.arange(64, dtype=torch.int64).reshape(32, 2))
    engine.close()


def test_host_buffers_are_reused_across_steps_and_given_back_on_close():
    budget = HostBudget(1 << 20)
    engine = _engine(host_budget=budget)
    sizes = []
    for _ in range(4):
        engine.begin_forward()
        handles = [engine.offload(torch.randn(64 * (i + 1)), label="x", layer=i, prefetch=1) for i in range(4)]
        engine.end_forward()
        for h in reversed(handles):
            h.unpack()
        del handles
        sizes.append(engine.host_bytes)
        assert engine.store.in_use_bytes == 0
    assert set(sizes) == {sum(64 * (i + 1) * 4 for i in range(4))} and budget.used == sizes[0]
    engine.close()
    assert budget.used == 0


def test_a_buffer_released_after_close_goes_back_to_the_budget():
    budget = HostBudget(1 << 20)
    engine = _engine(host_budget=budget)
    handle = engine.offload(torch.randn(100), label="x", layer=0, prefetch=0)
    engine.close()
    assert budget.used == 400  # still held by the live save
    del handle
    assert budget.used == 0


def test_over_the_host_budget_or_the_inline_size_the_python_records_take_the_save():
    engine = _engine(host_budget=HostBudget(1000))
    kept = engine.offload(torch.full((200,), 1.0), label="a", layer=0, prefetch=0)  # 800 B: within the budget
    over = engine.offload(torch.full((200,), 2.0), label="b", layer=0, prefetch=0)  # 800 more: over it
    engine.copier.inline_bytes = 100
    large = engine.offload(torch.full((50,), 3.0), label="c", layer=0, prefetch=0)  # above the inline size
    assert _native(kept) and isinstance(over, Packed) and isinstance(large, Packed)
    assert engine.stats.spilled_bytes == 800  # the Python records' disk tier took it
    for h, v in ((large, 3.0), (over, 2.0), (kept, 1.0)):
        assert torch.equal(h.unpack(), torch.full((200 if v < 3 else 50,), v))
    engine.close()


def test_an_in_place_change_after_the_save_fails_the_unpack():
    """Note: [in-place after save]: autograd's own message, never the stale bytes."""
    engine = _engine()
    t = torch.ones(10)
    handle = engine.offload(t, label="layers.0", layer=0, prefetch=0)
    t.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation .*layers.0"):
        handle.unpack()
    engine.close()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_dispatch_mode_of_the_caller_sees_the_stores_ops():
    engine = _engine()
    t = torch.randn(4, 4)
    with _Ops() as ops:
        handle = engine.offload(t, label="x", layer=0, prefetch=0)
        out = handle.unpack()
    assert _native(handle) and ops.seen == [] and torch.equal(out, t)
    engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlapped"])
def test_a_planned_whole_layer_swap_runs_through_the_native_records_bit_for_bit(overlap):
    bundle = build_model("hf:llama", batch_size=2, seq_len=16, seed=0)
    batch = bundle.batch(seed=1)
    planned = copy.copy(bundle)
    planned.model = copy.deepcopy(bundle.model)
    paths = [find_layers(planned.model).layer_path(i) for i in range(2)]
    handle = optimize(planned.model, plan=Plan(decisions={p: Decision(Action.SWAP) for p in paths}))
    handle._executor.engine.store.overlap = overlap
    grads = []
    for spec in (bundle, planned):
        for _ in range(2):  # the second step reuses the host buffers
            spec.model.zero_grad(set_to_none=True)
            spec.loss(batch).backward()
        grads.append([p.grad for p in spec.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    stats, store = handle.swap_stats, handle._executor.engine.store
    assert store.records > 0 and stats.offloaded_bytes == stats.reloaded_bytes > 0
    assert store.in_use_bytes == 0 and handle.host_bytes == store.allocated_bytes
    assert stats.on_demand_reloads == 0  # each prefetched by its trigger (overlapped) or reloaded at the unpack
    handle.remove()


def test_an_engine_collected_unclosed_gives_its_host_bytes_back():
    budget = HostBudget(1 << 20)
    engine = _engine(host_budget=budget)
    engine.offload(torch.randn(100), label="x", layer=0, prefetch=0).unpack()
    assert budget.used == 400  # the free buffer, kept for the next step
    del engine
    gc.collect()
    assert budget.used == 0


def test_the_saves_of_one_storage_share_one_record():
    engine = _engine()
    engine.begin_forward()
    base, other = torch.randn(4, 4), torch.randn(4)
    a, b, c = (engine.offload(t, label="x", layer=0, prefetch=1) for t in (base, base.t(), other))
    assert a.record is b.record and a.record is not c.record
    assert (a.record.nbytes, a.record.label, c.record.nbytes) == (64, "x", 16)
    engine.close()
