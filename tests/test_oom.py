"""The allocator hook: the accounted CPU path, catch-and-retry at the op, and fault injection."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from adaptive_mem import DeviceMemory, RetryOnOom, SwapManager, optimize
from adaptive_mem.memory._oom import AccountedHook, make_hook, shortfall_of
from search import Plan

from _adaptive_common import assert_grads, bundle, reference

TINY = dict(batch_size=2, seq_len=32)


def test_shortfall_is_read_from_both_allocators_messages():
    assert shortfall_of(torch.OutOfMemoryError("device memory cap exceeded: aten.mm.default needs 360448 bytes "
                                               "with 10 live of cap 20")) == 360448
    cuda = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB"
    assert shortfall_of(torch.OutOfMemoryError(cuda)) == 20 << 20
    assert shortfall_of(torch.OutOfMemoryError("out of memory")) is None


def test_catch_and_retry_at_the_op_path():
    """The path for accelerators without the pluggable allocator, driven here by DeviceMemory without hooks."""
    grads, peak = reference(1)
    budget = int(0.6 * peak)
    b = bundle()
    with DeviceMemory(cap=budget, track_existing=False) as mem:
        mem.track(b.model)
        with pytest.raises(torch.OutOfMemoryError):
            b.loss(b.batch(seed=0)).backward()  # no rescue: the cap wins
    b = bundle()
    manager = SwapManager(b.model)
    manager.attach()
    retry = RetryOnOom(manager.rescue)
    try:
        with DeviceMemory(cap=budget, track_existing=False) as mem:
            mem.track(b.model)
            with retry:  # entered inside DeviceMemory: the op's failure passes through it
                b.loss(b.batch(seed=0)).backward()
            assert mem.peak <= budget
        assert retry.retries > 0 and manager.stats.rescues > 0
        assert_grads(b.model, grads[0], 0)
    finally:
        manager.close()


def test_cuda_observer_hook_rescues_once_per_failure():
    """The CUDA hook's logic without a GPU: the observer rescues the shortfall, the op's retry does not
    rescue again for the same failure (the hook itself ran on an H200: benchmarks/README "GPU (lent H200)")."""
    from adaptive_mem.memory._cuda_allocator import CudaOomHook, _current, _observer
    from adaptive_mem.memory._hook import OomHook

    calls = []
    hook = CudaOomHook.__new__(CudaOomHook)  # __init__ needs CUDA: set up what it would
    OomHook.__init__(hook, lambda n: calls.append(n) or True)
    hook._rescued, hook.device, hook._entered = 0, torch.device("cuda"), False
    hook.mode = RetryOnOom(hook._retry_rescue)
    _observer(0, 3000, 10, 1000)  # no hook entered: nothing happens
    assert calls == []
    _current.append(hook)
    try:
        _observer(0, 3000, 10, 1000)  # asked 3000 bytes with 1000 free
        assert calls == [2000]
        assert hook._retry_rescue(3000) is True and calls == [2000]  # the retry after it: no second rescue
        assert hook._retry_rescue(500) is True and calls == [2000, 500]  # a failure the observer did not see
        assert hook.retries == 2
    finally:
        _current.remove(hook)


def test_cuda_observer_asks_the_whole_allocation_where_a_fraction_set_the_limit():
    """A per-process memory fraction fails an allocation while the device has far more free than asked: the
    rescue is asked for the whole allocation, not one byte (seen on an H200: one storage per rescue)."""
    from adaptive_mem.memory._cuda_allocator import observed_shortfall

    assert observed_shortfall(3000, 1000) == 2000  # the device itself is full
    assert observed_shortfall(64 << 20, 137 << 30) == 64 << 20  # a fraction's limit, the device nearly empty
    assert observed_shortfall(3000, -1) == 3000 and observed_shortfall(0, 5) == 1


def test_a_rescue_waits_on_the_host_for_its_copies():
    """Note: [rescue waits on the host]: the storage a rescue swaps out is released before ``rescue`` returns,
    on any copier (a stream copier's ``wait`` would only make the compute stream wait)."""
    grads, _ = reference(1)
    b = bundle()
    manager = SwapManager(b.model)
    manager.attach()
    calls = []
    copier = manager.engine.copier
    wait, sync = copier.wait, copier.sync
    copier.wait = lambda copy: calls.append("wait") or wait(copy)
    copier.sync = lambda copy: calls.append("sync") or sync(copy)
    try:
        loss = b.loss(b.batch(seed=0))
        needed = max(g.nbytes for g in manager.groups())
        assert manager.rescue(needed) and "sync" in calls and "wait" not in calls
        swapped = [g for g in manager.groups() if g.record is not None]
        assert sum(g.nbytes for g in swapped) >= needed
        assert all(g.record.d2h.landed.is_set() for g in swapped)  # landed before rescue returned
        loss.backward()
        assert_grads(b.model, grads[0], 0)
    finally:
        manager.close()


def test_a_late_plan_offload_is_waited_for_not_rescued():
    """Note: [late offloads are waited for]: an allocation over the budget while the applied plan's offload copy
    is still queued waits for it to land (its storage is released then) and swaps nothing of its own; with no
    copy in flight the same request is a rescue."""
    import threading

    from adaptive_mem.runtime._swap_engine import SwapEngine

    b = bundle()
    manager = SwapManager(b.model)
    engine = SwapEngine(device="cpu", num_layers=1, native=False)  # a Python record: its copy can lag
    gate = threading.Event()
    engine.copier.submit(lambda non_blocking: gate.wait(5.0))  # the copy thread is busy: the offload lags
    with DeviceMemory(track_existing=False) as mem:
        t = torch.randn(256, 256)
        expected = t.clone()
        nbytes = t.untyped_storage().nbytes()
        packed = engine.offload(t, label="x", layer=0, prefetch=0)
        del t  # the record's reference keeps the storage until its copy lands
        cap = mem.live + nbytes // 2
        manager.headroom = lambda: cap - mem.live
        manager.engines = lambda: [engine]
        threading.Timer(0.05, gate.set).start()
        assert manager.rescue(nbytes // 2)
        assert (manager.stats.waits, manager.stats.rescues) == (1, 0)
        assert mem.live <= cap - nbytes // 2 and packed.record.d2h.landed.is_set()
        assert torch.equal(packed.unpack(), expected)
    manager.headroom = lambda: 0  # nothing in flight: waiting frees nothing, the request is rescued
    manager.attach()
    try:
        loss = b.loss(b.batch(seed=0))
        needed = max(g.nbytes for g in manager.groups())
        assert manager.rescue(needed) and (manager.stats.waits, manager.stats.rescues) == (1, 1)
        loss.backward()
    finally:
        manager.close()
        engine.close()


def test_make_hook_picks_the_device_path(caplog):
    assert isinstance(make_hook(lambda n: False, torch.device("cpu")), AccountedHook)
    caplog.set_level(logging.WARNING)
    hook = make_hook(lambda n: False, torch.device("cuda"), pluggable=True)  # no CUDA here: falls back
    assert hook.name == "retry"
    assert "pluggable allocator unavailable" in caplog.text


class _FaultyMemory(DeviceMemory):
    """Fails allocation number ``fail_at`` of the step once: the hooks must make room, then it succeeds
    (a transient allocator failure, as when another stream frees later). The fault is injected in the
    accounting itself (the C++ allocator hook on CPU): the hooks run from inside the failing allocation."""

    def __init__(self, *, fail_at: int, needed: int) -> None:
        super().__init__(track_existing=False)
        self.inject_fault(at=fail_at, needed=needed)


_PLAN = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {
    "layers.1": {"action": "swap", "backward_prefetch": 1}, "layers.2": "recompute",
    "layers.3.attention.flash_attention": {"action": "swap", "backward_prefetch": 0}}})


def test_fault_injection_hundred_seeded_trials_all_exact():
    b = bundle(**TINY)
    grads = _grads_at_init(b, 4)
    counter = _FaultyMemory(fail_at=1 << 62, needed=0)
    with counter:
        b.loss(b.batch(seed=0)).backward()  # the first step allocates a few one-time things: not counted
        b.model.zero_grad(set_to_none=True)
        counter.allocations = 0
        b.loss(b.batch(seed=0)).backward()
    counter_allocations = int(0.95 * counter.allocations)
    assert counter_allocations > 100
    b.model.zero_grad(set_to_none=True)
    plain = _trials(b, grads, range(0, 50), counter_allocations, plan=None)
    with_plan = _trials(b, grads, range(50, 100), counter_allocations, plan=_PLAN)
    rescued = plain + with_plan
    assert rescued >= 60, f"only {rescued} of 100 injected faults found something to swap"


def _trials(b, grads, trials, allocations: int, *, plan: Plan | None) -> int:
    handle = optimize(b.model, plan=plan) if plan is not None else None
    manager = SwapManager(b.model)
    manager.attach()  # after the plan: innermost
    rescued = 0
    try:
        for trial in trials:
            rng = random.Random(trial)
            mem = _FaultyMemory(fail_at=rng.randrange(1, allocations), needed=rng.randrange(1, 1 << 20))
            hook = AccountedHook(manager.rescue)
            before = manager.stats.rescues
            with mem:
                mem.track(b.model)
                mem.allocations = 0  # count the step's allocations only
                hook.begin_step()
                b.loss(b.batch(seed=trial % 4)).backward()
            hook.remove()
            assert mem.faults == 1, f"trial {trial}: the fault did not fire"
            assert_grads(b.model, grads[trial % 4], trial)
            rescued += manager.stats.rescues > before
            b.model.zero_grad(set_to_none=True)
    finally:
        manager.close()
        if handle is not None:
            handle.remove()
    return rescued


def _grads_at_init(b, seeds: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in range(seeds):
        b.loss(b.batch(seed=seed)).backward()
        out.append({n: p.grad.clone() for n, p in b.model.named_parameters()})
        b.model.zero_grad(set_to_none=True)
    return out
