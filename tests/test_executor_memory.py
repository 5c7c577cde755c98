"""Acceptance: what recompute and swap do to measured device memory (DeviceMemory on CPU).

The bytes a plan should remove are computed here independently of the
executor: a dispatch mode marks the storages an op produced, saved-tensor
hooks mark what autograd saves.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_mem import DeviceMemory, build_model, optimize
from search import Plan


def _plan(decisions: dict, **extra) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, **extra})


class _Producers(TorchDispatchMode):
    """Storage id -> bytes of outputs of ops whose name contains ``needle``."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.needle in func.__name__:
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    self.storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return out


def _saved_bytes_of(bundle, batch, needle: str) -> int:
    saved: dict[int, torch.Tensor] = {}

    def pack(t):
        saved[t.untyped_storage()._cdata] = t
        return t

    mode = _Producers(needle)
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        bundle.loss(batch)
    return sum(n for key, n in mode.storages.items() if key in saved)


def _step_peak(bundle, batch, plan: Plan | None) -> int:
    bundle.model.zero_grad(set_to_none=True)
    handle = optimize(bundle.model, plan=plan) if plan is not None else None
    try:
        gc.collect()
        mem = DeviceMemory(track_existing=False)
        mem.track(bundle.model, batch)
        with mem:
            base = mem.live
            bundle.loss(batch).backward()
    finally:
        if handle is not None:
            handle.remove()
    return mem.peak - base


@pytest.mark.parametrize("prefetch", [0, 1])
def test_swapping_flash_attention_removes_exactly_its_saved_bytes(prefetch: int):
    bundle = build_model("llama-tiny", seed=0, batch_size=4, seq_len=128)
    batch = bundle.batch(seed=0)
    expected = _saved_bytes_of(bundle, batch, "scaled_dot_product")
    assert expected > 0
    plain = _step_peak(bundle, batch, None)
    swap = {f"layers.{i}.attention.flash_attention": {"action": "swap", "backward_prefetch": prefetch}
            for i in range(4)}
    # The offload copies run on a copy thread; a tensor leaves device memory when its copy lands. On a loaded
    # machine the thread can lag past the step's peak (2 runs in 8 beside two busy processes here, 1 in CI), which
    # only adds bytes to the peak: the least of three steps is the lag-free one.
    swapped = min(_step_peak(bundle, batch, _plan(swap)) for _ in range(3))
    assert abs((plain - swapped) - expected) <= 0.02 * expected, (plain, swapped, expected)


def _forward_activation_bytes(bundle, batch, plan: Plan | None) -> int:
    """Device bytes the forward leaves alive for backward (activations), measured at the loss."""
    handle = optimize(bundle.model, plan=plan) if plan is not None else None
    try:
        gc.collect()
        mem = DeviceMemory(track_existing=False)
        mem.track(bundle.model, batch)
        with mem:
            base = mem.live
            loss = bundle.loss(batch)
            held = mem.live - base
            del loss
    finally:
        if handle is not None:
            handle.remove()
    return held


def test_full_recompute_cuts_llama_small_activation_memory_by_85_percent():
    bundle = build_model("llama-small", seed=0)
    batch = bundle.batch(seed=0)
    plain = _forward_activation_bytes(bundle, batch, None)
    recomputed = _forward_activation_bytes(bundle, batch, _plan({"layers": "recompute"}))
    assert recomputed <= 0.15 * plain, (plain, recomputed)


def test_fifty_steps_bounded_pool_and_no_growth():
    bundle = build_model("llama-tiny", seed=0)
    model = bundle.model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    plan = _plan({"layers.0": {"action": "swap", "backward_prefetch": 2},
                  "layers.1.attention.flash_attention": {"action": "swap", "backward_prefetch": 0},
                  "layers.2.feed_forward.w1.activation.silu": "recompute",
                  "layers.2.feed_forward.w3": {"action": "swap", "backward_prefetch": 1},
                  "layers.3": "recompute"})
    gc.collect()
    mem = DeviceMemory(track_existing=False)
    mem.track(model, opt)
    with optimize(model, plan=plan) as handle, mem:
        lives, pools = [], []
        for step in range(50):
            before = mem.live
            loss = bundle.loss(bundle.batch(seed=step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
            if step > 0:  # step 0 creates the momentum buffers
                assert mem.live == before, f"step {step}: device live bytes {before} -> {mem.live}"
            lives.append(mem.live)
            pools.append(handle.host_bytes)
        assert handle.swap_stats.offloaded_bytes > 0
    assert len(set(pools[1:])) == 1, "host pool grew after the first step"
    assert len(set(lives[1:])) == 1
    assert pools[-1] > 0


def test_file_backed_host_store_moves_bytes_out_of_ram():
    bundle = build_model("llama-tiny", seed=0, batch_size=4, seq_len=128)
    batch = bundle.batch(seed=0)
    plain_peak = _step_peak(bundle, batch, None)
    bundle.model.zero_grad(set_to_none=True)
    ref = bundle.loss(batch)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in bundle.model.named_parameters()}
    bundle.model.zero_grad(set_to_none=True)
    plan = _plan({"layers": {"action": "swap", "backward_prefetch": 1}})
    gc.collect()
    mem = DeviceMemory(track_existing=False)
    mem.track(bundle.model, batch)
    with optimize(bundle.model, plan=plan, host_store="file") as handle, mem:
        pool = handle._executor.engine.pool
        base = mem.live
        loss = bundle.loss(batch)
        assert os.path.getsize(pool.path) > 0
        loss.backward()
        peak = mem.peak - base
        assert os.path.getsize(pool.path) == pool.allocated_bytes
    assert torch.equal(loss, ref)
    for n, p in bundle.model.named_parameters():
        assert torch.equal(p.grad, ref_grads[n]), n
    assert peak < plain_peak
    assert not os.path.exists(pool.path), "swap file left behind after remove()"


def test_plan_prefetch_stays_under_an_accounted_cap(monkeypatch):
    """Note: [budget-aware prefetch]: prefetching every layer at once would pass the cap; under it
    the plan's reloads wait for room and the step completes with the same gradients. Copies on the copy thread,
    where a reload is prefetched (Note: [reload at the unpack] in ``_copier.py``)."""
    monkeypatch.setattr("adaptive_mem.runtime._copier.INLINE_BYTES", 0)
    bundle = build_model("llama-tiny", seed=0, batch_size=4, seq_len=128)
    batch = bundle.batch(seed=0)

    def step(plan: Plan, cap: int | None) -> tuple[int, dict]:
        bundle.model.zero_grad(set_to_none=True)
        with optimize(bundle.model, plan=plan):
            gc.collect()
            mem = DeviceMemory(track_existing=False, cap=cap)
            mem.track(bundle.model, batch)
            with mem:
                bundle.loss(batch).backward()
        return mem.peak, {n: p.grad.clone() for n, p in bundle.model.named_parameters()}

    def swap_all(prefetch: int) -> Plan:
        return _plan({f"layers.{i}": {"action": "swap", "backward_prefetch": prefetch} for i in range(4)})

    lazy_peak, grads = step(swap_all(0), None)
    eager_peak, _ = step(swap_all(4), None)  # no cap: all four layers come back when backward begins
    cap = eager_peak - 1  # so a step that ignored the cap would pass it
    assert lazy_peak + cap // 10 < cap, (lazy_peak, eager_peak)
    peak, capped = step(swap_all(4), cap)
    assert peak <= cap
    assert all(torch.equal(capped[n], grads[n]) for n in grads)
