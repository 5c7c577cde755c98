"""The SwapManager alone: what it tracks, what it frees, what it never touches."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from adaptive_mem import DeviceMemory, SwapExhaustedError, SwapManager
from adaptive_mem.memory._oom import AccountedHook
from adaptive_mem.memory._storage import SwapState

from _adaptive_common import assert_grads, bundle, optimizer, reference


def _managed(model, *, reserve: int = 0) -> tuple[SwapManager, AccountedHook]:
    manager = SwapManager(model)
    manager.attach()
    hook = AccountedHook(manager.rescue)
    manager.headroom = hook.headroom
    manager.prefetch_reserve = reserve
    hook.exhausted = manager.exhausted
    return manager, hook


def test_tracks_saved_activations_by_storage_with_their_producers():
    b = bundle()
    manager, _ = _managed(b.model)
    try:
        loss = b.loss(b.batch(seed=0))
        groups = manager.groups()
        assert groups and all(g.state is SwapState.DEVICE for g in groups)
        assert len({g.key for g in groups}) == len(groups)
        params = {p.untyped_storage()._cdata for p in b.model.parameters()}
        assert not params & {g.key for g in groups}, "parameters are never tracked"
        layers = sorted({g.layer for g in groups})
        assert layers[0] == -1 and layers[-1] == 4 and set(range(4)) <= set(layers)
        assert any(g.unit == "layers.2.feed_forward.w1" for g in groups)
        seqs = [g.seq for g in sorted(groups, key=lambda g: g.seq)]
        assert seqs == sorted(set(seqs))
        loss.backward()
        assert manager.groups() == [], "autograd released everything"
    finally:
        manager.close()


def test_rescue_frees_the_asked_bytes_furthest_use_first():
    b = bundle()
    manager, _ = _managed(b.model)
    try:
        with DeviceMemory(track_existing=False) as mem:
            mem.track(b.model)
            loss = b.loss(b.batch(seed=0))
            live = mem.live
            total = manager.in_flight_bytes()
            assert manager.rescue(total // 3)
            freed = live - mem.live
            assert total // 3 <= freed < total // 3 + max(g.nbytes for g in manager.groups())
            swapped = [g for g in manager.groups() if g.state is SwapState.HOST]
            kept = [g for g in manager.groups() if g.state is SwapState.DEVICE and manager._exclusive(g)]
            assert swapped and kept
            assert max(g.seq for g in swapped) < min(g.seq for g in kept), "a later-used tensor went first"
            assert manager.in_flight_bytes(SwapState.HOST) == sum(g.nbytes for g in swapped) == freed
            loss.backward()
            assert manager.stats.on_demand > 0 or manager.stats.prefetches > 0
    finally:
        manager.close()


class _RescueAtEveryOp(TorchDispatchMode):
    """Asks for everything at every forward op and records the op's inputs that were swapped."""

    def __init__(self, manager: SwapManager) -> None:
        super().__init__()
        self.manager = manager
        self.violations: list[str] = []
        self.rescues = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        keys = {t.untyped_storage()._cdata for t in inputs}
        self.rescues += self.manager.rescue(1 << 40)
        for g in self.manager.groups():
            if g.key in keys and g.state is not SwapState.DEVICE and g.storage() is not None:
                self.violations.append(f"{func}: input of {g.unit} swapped while the op reads it")
        return func(*args, **(kwargs or {}))


def test_never_swaps_a_tensor_a_running_op_is_reading():
    """Note: [never swap a tensor in use]: swapping everything before every op keeps the step exact."""
    grads, _ = reference(1)
    b = bundle()
    manager, _ = _managed(b.model)
    try:
        mode = _RescueAtEveryOp(manager)
        with mode:
            loss = b.loss(b.batch(seed=0))
        assert mode.rescues > 10 and not mode.violations, mode.violations[:3]
        loss.backward()
        assert_grads(b.model, grads[0], 0)
    finally:
        manager.close()


def test_accounted_budget_at_sixty_percent_with_the_manager_alone():
    grads, peak = reference(3)
    budget = int(0.6 * peak)
    b = bundle()
    opt = optimizer(b.model)
    manager, hook = _managed(b.model, reserve=budget // 10)
    try:
        with DeviceMemory(cap=budget, track_existing=False) as mem:
            mem.track(b.model, opt)
            hook.begin_step()
            for step in range(3):
                mem.reset_peak()
                b.loss(b.batch(seed=step)).backward()
                assert mem.peak <= budget
                assert_grads(b.model, grads[step], step)
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert manager.stats.rescues > 0 and manager.stats.swapped_out_bytes > 0
        assert manager.stats.prefetches > 0, "backward brought swapped tensors back ahead of use"
    finally:
        manager.close()


def test_nothing_swappable_left_is_a_clear_error():
    b = bundle()
    manager, hook = _managed(b.model)
    param_bytes = sum(p.untyped_storage().nbytes() for p in b.model.parameters())
    try:
        with DeviceMemory(cap=param_bytes + 300_000, track_existing=False) as mem:
            mem.track(b.model)
            hook.begin_step()
            with pytest.raises(SwapExhaustedError, match=r"needed \d+ more bytes, budget \d+ bytes, swappable left "
                                                         r"\d+ bytes .* largest unswappable tensor: .*, \d+ bytes"):
                b.loss(b.batch(seed=0)).backward()
        assert manager.stats.failed_rescues >= 1
    finally:
        manager.close()


def test_prefetched_but_unused_tensors_go_back_out_when_room_is_needed():
    grads, _ = reference(1)
    b = bundle()
    manager, _ = _managed(b.model)
    manager.headroom = lambda: 1 << 40  # prefetch everything
    try:
        with DeviceMemory(track_existing=False) as mem:
            mem.track(b.model)
            loss = b.loss(b.batch(seed=0))
            assert manager.rescue(1 << 40)
            out = mem.live
            manager._on_backward(0)  # as if backward reached layer 0: everything comes back
            assert manager.stats.prefetches > 0
            for g in manager.groups():
                if g.record is not None:
                    manager.engine.copier.wait(g.record.h2d)
            assert mem.live > out
            assert manager.rescue(1 << 40)
            assert manager.stats.evicted == manager.stats.prefetches
            assert mem.live == out, "the evicted copies left the device"
            loss.backward()
        assert_grads(b.model, grads[0], 0)
    finally:
        manager.close()


def test_rescue_drops_the_applied_plans_unused_prefetches_too():
    """Note: [budget-aware prefetch]: what the plan's engine brought back early is not stuck on the device."""
    from adaptive_mem.runtime._swap_engine import SwapEngine

    b = bundle()
    manager, _ = _managed(b.model)
    plan_engine = SwapEngine(device="cpu", num_layers=2, native=False)  # the Python records (the native ones:
    plan_engine.copier.inline_bytes = 0  # tests/test_native_overlap.py), copies on the thread: a prefetch overlaps
    manager.engines = lambda: [plan_engine]
    try:
        with DeviceMemory(track_existing=False) as mem:
            t = torch.randn(5000)
            expected = t.clone()
            packed = plan_engine.offload(t, label="plan", layer=0, prefetch=2)
            del t
            plan_engine.copier.sync(packed.record.d2h)
            before = mem.live
            plan_engine.on_backward(2)
            plan_engine.copier.sync(packed.record.h2d)
            assert mem.live == before + 20_000
            assert manager.rescue(10_000)  # the manager holds nothing of its own: the plan's prefetch goes
            assert mem.live == before and manager.stats.evicted == 1
            assert torch.equal(packed.unpack(), expected)
    finally:
        plan_engine.close()
        manager.close()


def test_a_graph_dropped_without_backward_leaks_nothing():
    """Note: [pack without a cycle]: a forward whose graph is dropped without backward (an evaluation under
    grad) leaves no saved activation, slot or model alive once the manager is closed."""
    import gc
    import weakref

    from adaptive_mem.memory._storage import Slot

    b = bundle()
    manager, hook = _managed(b.model)
    model = weakref.ref(b.model)
    try:
        with DeviceMemory(track_existing=False) as mem:
            mem.track(b.model)
            hook.begin_step()
            loss = b.loss(b.batch(seed=0))
            assert manager.groups(), "nothing was tracked"
            del loss
    finally:
        manager.close()
    del b, manager, hook, mem
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, Slot)]
    assert model() is None, "the dropped graph keeps the model alive"
