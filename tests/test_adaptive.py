"""Acceptance of the adaptive loop (``--adaptive-memory-optimization``) on CPU with an accounted budget."""

from __future__ import annotations

import argparse
import logging
import time

import pytest
import torch

import adaptive_mem
from adaptive_mem import AdaptiveBudgetError, DeviceMemory, adaptive_optimize, apply_arguments
from search import Problem, StepModel, get_solver, simulate

from _adaptive_common import assert_grads, bundle, optimizer, reference, train

STEPS = 10


@pytest.fixture(scope="module")
def ref():
    return reference(STEPS)


def test_sixty_percent_budget_ooms_without_the_flag_and_trains_exactly_with_it(ref, tmp_path, caplog):
    grads, peak = ref
    budget = int(0.6 * peak)
    b = bundle()
    with pytest.raises(torch.OutOfMemoryError):
        train(b, optimizer(b.model), 1, cap=budget)

    b = bundle()
    opt = optimizer(b.model)
    caplog.set_level(logging.INFO, logger="adaptive_mem.adaptive._loop")
    with adaptive_optimize(b.model, budget=budget, optimizer=opt, cache_dir=tmp_path) as am:
        peaks = train(b, opt, STEPS, cap=budget, check=lambda s: assert_grads(b.model, grads[s], s))
        assert len(am.history) == STEPS
        assert max(peaks) <= budget, (peaks, budget)
        assert am.converged_at is not None and am.converged_at <= 10, [r.decision for r in am.history]
        assert am.history[0].kind == "warmup" and am.history[0].rescues > 0, "the warm-up step needed rescues"
        assert am.plan is not None and am.plan.decisions, "a plan was applied"
        # Note: [profile under rescue]: the profile describes the plain step, not the budget it ran under
        profiled = am.profiler.profile.peak_memory
        assert profiled == pytest.approx(peak, rel=0.1), (profiled, peak)
    text = caplog.text
    assert "profiled the model" in text and "warm-up done: applying the plan" in text and "converged at target" in text
    assert not b.model._forward_pre_hooks and not b.model._forward_hooks, "remove() left hooks behind"


def test_converged_plan_is_within_ten_percent_of_the_offline_milp_plan(ref, tmp_path):
    """Plan side of the timing criterion (the measured times are in benchmarks/bench_adaptive.py): on the
    same profile, the simulated step time of the converged plan is within 10% of milp's plan for the budget."""
    _, peak = ref
    budget = int(0.6 * peak)
    b = bundle()
    opt = optimizer(b.model)
    with adaptive_optimize(b.model, budget=budget, optimizer=opt, cache=False) as am:
        peaks = train(b, opt, STEPS, cap=budget)
        model: StepModel = am.planner.step_model
        offline = get_solver("milp").solve(Problem(model, budget))
        adaptive = simulate(model, am.plan)
        assert am.converged
        assert adaptive.step_time <= 1.10 * offline.cost.step_time, (adaptive.step_time, offline.cost.step_time)
        assert am.target <= budget
        steady = [r for r in am.history if r.kind == "steady"]
        assert steady and all(r.peak <= budget for r in steady)
    assert max(peaks) <= budget


def test_budget_below_the_minimum_is_an_error_with_the_numbers_and_no_partial_step(ref):
    b = bundle()
    opt = optimizer(b.model)
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    param_bytes = sum(p.untyped_storage().nbytes() for p in b.model.parameters())
    # below the parameters (no device could hold the model: no cap), then above parameters + gradients
    for budget, cap in ((param_bytes // 2, None), (2 * param_bytes + 200_000, 2 * param_bytes + 200_000)):
        start = time.perf_counter()
        with pytest.raises(AdaptiveBudgetError) as info:  # below the parameters: refused by adaptive_optimize itself
            with adaptive_optimize(b.model, budget=budget, optimizer=opt, cache=False):
                train(b, opt, 1, cap=cap)
        message = str(info.value)
        assert "needed" in message and "budget" in message and f"{budget} bytes" in message, message
        assert "largest unswappable tensor" in message, message
        assert time.perf_counter() - start < 60
        for n, p in b.model.named_parameters():
            assert p.grad is None, f"{n}: a gradient was written by a failed step"
            assert torch.equal(p.detach(), before[n]), f"{n}: parameters changed"


def test_new_input_shape_plans_again(tmp_path):
    """Another length is planned on the profile scaled to it (tests/test_adaptive_shapes.py); another batch size is
    another shape: profiled again, at its first step (64 tokens at batch 4 keep all: no plan is in force)."""
    b = bundle()
    opt = optimizer(b.model)
    with adaptive_optimize(b.model, budget=8_000_000, optimizer=opt, cache_dir=tmp_path) as am:
        with DeviceMemory(cap=8_000_000, track_existing=False) as mem:
            mem.track(b.model, opt)
            for batch, seq in ((4, 128), (4, 128), (4, 64), (2, 64), (2, 64), (2, 64)):
                ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(seq))
                b.loss((ids[:, :-1], ids[:, 1:])).backward()
                opt.zero_grad(set_to_none=True)
        assert am.profiles_run == 2, [r.decision for r in am.history]
        assert am.history[2].kind in ("adapt", "steady")
        assert am.history[3].kind == "warmup"


def _args(flags: list[str]) -> argparse.Namespace:
    return adaptive_mem.add_arguments(argparse.ArgumentParser()).parse_args(flags)


@pytest.mark.parametrize("flags, match", [
    (["--adaptive-memory-optimization", "--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--recompute-granularity full: incompatible"),
    (["--adaptive-memory-optimization", "--memory-plan", "plan.yaml"], "--memory-plan plan.yaml: incompatible"),
    (["--memory-budget", "1GiB"], "without --adaptive-memory-optimization"),
])
def test_flag_incompatibilities_are_errors_before_anything_is_applied(flags, match):
    b = bundle()
    with pytest.raises(ValueError, match=match):
        apply_arguments(b.model, _args(flags))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in b.model.modules())


def test_single_flag_applies_the_adaptive_loop(tmp_path):
    args = _args(["--adaptive-memory-optimization", "--memory-budget", "9MB", "--memory-plan-cache", str(tmp_path)])
    b = bundle()
    handle = apply_arguments(b.model, args)
    try:
        assert isinstance(handle, adaptive_mem.AdaptiveMemory)
        assert handle.budget == 9_000_000 and handle.cache.directory == tmp_path
    finally:
        handle.remove()
    assert apply_arguments(b.model, _args([])) is None


def test_two_entries_one_return_type_each_and_a_manual_plan_excludes_the_loop():
    b = bundle()
    with adaptive_optimize(b.model, budget="9MB", cache=False) as handle:
        assert isinstance(handle, adaptive_mem.AdaptiveMemory) and handle.budget == 9_000_000
        with pytest.raises(ValueError, match="already applied"):
            adaptive_optimize(b.model, budget=9_000_000)
    for extra in ({}, {"plan": {"format": "adaptive-mem-plan", "version": 1}}):
        with pytest.raises(adaptive_mem.OptimizeArgumentError) as info:
            adaptive_mem.optimize(b.model, budget="9MB", **extra)
        assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
        assert str(info.value) == ("optimize: budget='9MB': optimize applies a fixed plan; expected "
                                   "adaptive_mem.adaptive_optimize(model, budget=...) for the adaptive loop")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in b.model.modules())
    manual = {"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers.1": "recompute"}}
    with adaptive_mem.optimize(b.model, plan=manual):
        with pytest.raises(ValueError, match="already has a plan applied"):
            adaptive_optimize(b.model, budget=9_000_000)


class _Boom(Exception):
    pass


@pytest.mark.parametrize("fail_at", [1, 3], ids=["warm-up profile", "step with a plan"])
def test_a_failed_forward_leaves_nothing_alive(ref, fail_at):
    """Note: [pack without a cycle]: a forward that raises under the loop (in the warm-up's profile, or at a later
    step with a plan and the SwapManager's rescues) leaves nothing of the step or the model alive once the handle is
    removed: no slot, no swap record, no device byte."""
    import gc
    import weakref

    from adaptive_mem.memory._storage import Slot
    from adaptive_mem.runtime._swap_engine import Packed

    _, peak = ref
    b = bundle()
    opt = optimizer(b.model)
    model = weakref.ref(b.model)
    step = {"n": 0}

    def boom(module, args):
        if step["n"] == fail_at:
            raise _Boom
    b.model.layers[2].register_forward_pre_hook(boom)
    am = adaptive_optimize(b.model, budget=int(0.7 * peak), optimizer=opt, cache=False)
    with DeviceMemory(cap=int(0.7 * peak), track_existing=False) as mem:
        mem.track(b.model, opt)
        with pytest.raises(_Boom):
            for step["n"] in range(1, fail_at + 1):
                b.loss(b.batch(seed=step["n"])).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert fail_at == 1 or am.plan is not None and am.plan.decisions, "no plan was applied before the failure"
        am.remove()
        del am, b, opt
        gc.collect()
        assert model() is None, "the failed forward keeps the model alive"
        assert not [o for o in gc.get_objects() if type(o) in (Slot, Packed)]
        assert mem.live == 0, f"{mem.live} device bytes of the step are still alive"


FAULTS = 40  # with tests/test_parallel_adaptive_layouts.py's 30 under DDP and 30 under FSDP2: 100 injected faults


def test_injected_out_of_memory_faults_at_random_allocations_change_nothing(ref):
    """Out-of-memory faults injected at random allocations of adaptive steps (warm-up profile, plan changes, converged
    steps): every step survives, with the gradients of the run without the loop."""
    import random

    grads, peak = ref
    b = bundle()
    opt = optimizer(b.model)
    rng = random.Random(0)
    with adaptive_optimize(b.model, budget=int(0.7 * peak), optimizer=opt, cache=False) as am:
        with DeviceMemory(cap=int(0.7 * peak), track_existing=False) as mem:
            mem.track(b.model, opt)
            for step in range(STEPS):
                mem.allocations = 0
                for _ in range(FAULTS // STEPS):
                    mem.inject_fault(at=rng.randrange(1, 400), needed=rng.randrange(1, 1 << 20))
                b.loss(b.batch(seed=step)).backward()
                assert mem.allocations > 400, "a fault may lie beyond the step's allocations"
                assert_grads(b.model, grads[step], step)
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert mem.faults == FAULTS
        assert am.manager.stats.rescues >= FAULTS // 2, am.manager.stats
