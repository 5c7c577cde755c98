"""The adaptive loop on steps whose sequence lengths vary (dynamic padding): plans per length bucket, each bucket's
own plan in force at its steps, a new bucket planned on a scaled profile, ``--max-seq-len``, per-bucket cache keys.

Budgets are accounted by ``DeviceMemory`` on CPU, as in tests/test_adaptive.py.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

import adaptive_mem
from adaptive_mem import DeviceMemory, adaptive_optimize, apply_arguments, build_model
from adaptive_mem.adaptive._plan_cache import PlanCache, plan_key
from adaptive_mem.runtime._accounting import host_allocations
from search.planning import SeqLenBucketError

from _adaptive_common import assert_grads, optimizer
from _deterministic import deterministic  # noqa: F401

pytestmark = pytest.mark.usefixtures("deterministic")

LENGTHS = (32, 128, 64, 128, 96, 32, 128, 128, 64, 128)
"""The issue's eight steps (lengths cycling 32-128), then two more: convergence is asked within ten."""
BUDGET = 5 * 2**20
"""llama-tiny at batch 2: the plain step at 128 tokens does not fit, at 32 and 64 it does."""


def _bundle(spec: str):
    args = {"num_hidden_layers": 2} if spec.startswith("hf:") else None
    return build_model(spec, model_args=args, batch_size=2, seq_len=128, seed=0)


def _batch(b, step: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, b.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _reference(spec: str) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Per-step gradients without the loop (kept on the host side), and its plain peak."""
    b = _bundle(spec)
    opt = optimizer(b.model)
    grads, peak = [], 0
    with DeviceMemory(track_existing=False) as mem:
        mem.track(b.model, opt)
        for step, seq in enumerate(LENGTHS):
            mem.reset_peak()
            b.loss(_batch(b, step, seq)).backward()
            peak = max(peak, mem.peak)
            with host_allocations():
                grads.append({n: p.grad.clone() for n, p in b.model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return grads, peak


def _train(spec: str, budget: int, grads, *, in_force: list | None = None, **loop) -> adaptive_mem.AdaptiveMemory:
    """The loop on ``LENGTHS``, gradients checked at every step; ``in_force`` gets, per step, the bucket and plan
    in force during its forward."""
    b = _bundle(spec)
    opt = optimizer(b.model)
    with adaptive_optimize(b.model, budget=budget, optimizer=opt, cache=False, **loop) as am:
        if in_force is not None:
            b.model.register_forward_pre_hook(lambda m, a: None if am.profiler.busy else in_force.append(
                (am._bucket.shape.bucket, am.plan)))
        with DeviceMemory(cap=budget, track_existing=False) as mem:
            mem.track(b.model, opt)
            for step, seq in enumerate(LENGTHS):
                b.loss(_batch(b, step, seq)).backward()
                assert_grads(b.model, grads[step], step)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return am


@pytest.fixture(scope="module")
def llama():
    return _reference("llama-tiny")


def _rescued(am) -> list[int]:
    return [r.step for r in am.history if r.rescues]


def _converged_by(am, step: int) -> bool:
    return any("converged at target" in r.decision for r in am.history[:step])


def test_cycling_lengths_plan_per_bucket_without_profiling_again(llama):
    """Note: [each bucket its own plan]: each step runs under its own bucket's plan, switched in before its call."""
    grads, peak = llama
    assert peak > BUDGET, "the plain step at 128 tokens must not fit the budget"
    in_force: list = []
    am = _train("llama-tiny", BUDGET, grads, in_force=in_force)
    decisions = [r.decision for r in am.history]
    assert am.profiles_run == 1, decisions  # 64 and 128 are planned on the profile at 32 scaled, not profiled
    buckets = {b.shape.bucket: b for b in am.buckets.buckets.values()}
    assert sorted(buckets) == [32, 64, 128]  # 96 is 128's
    assert len(_rescued(am)) <= 3, (_rescued(am), decisions)  # at most one rescued step per new bucket
    assert am.plan is not None and am.plan.decisions and am.target <= BUDGET
    from search.planning import seq_len_bucket
    assert [b for b, _ in in_force] == [seq_len_bucket(n) for n in LENGTHS]
    first = {seq_len_bucket(n): LENGTHS.index(n) + 1 for n in reversed(LENGTHS)}  # each bucket's first step
    # a rescue comes only at a bucket's first step (its plan searched on a scaled profile); an offload that lands
    # late is waited for, not rescued (Note: [late offloads are waited for])
    assert set(_rescued(am)) <= set(first.values()) and _converged_by(am, 10), decisions
    if am.buckets.converged_at() is not None:  # each step after the warm-up ran its bucket's final plan
        assert all(plan is buckets[b].plan for b, plan in in_force[3:]), "a step after the warm-up ran another plan"


def test_offloads_landing_late_are_waited_for_not_rescued(llama, monkeypatch):
    """Note: [late offloads are waited for]: a copy thread 3 ms late on every copy leaves steps of plans near the
    budget over it until their offloads land; the allocations wait for them: no step is rescued, the buckets
    converge and the gradients stay exact (``_train`` checks them at every step)."""
    import time

    from adaptive_mem.runtime._copier import ThreadCopier

    submit = ThreadCopier.submit
    # every copy through the copy thread: no native records (Note: [native swap records]), none inline
    monkeypatch.setattr("adaptive_mem.runtime._swap_engine.native_store", lambda *args: None)
    monkeypatch.setattr(ThreadCopier, "submit", lambda self, fn, on_done=None, *size, **sizes: submit(
        self, lambda non_blocking: (time.sleep(0.003), fn(non_blocking))[1], on_done))  # no size: on the thread
    grads, _ = llama
    for loop in ({}, {"max_seq_len": 128}):
        am = _train("llama-tiny", BUDGET, grads, **loop)
        assert _rescued(am) == [] and am.manager.stats.waits > 0, ([r.decision for r in am.history], loop)
        assert am.buckets.converged_at() is not None, ([r.decision for r in am.history], loop)


def test_a_shorter_bucket_runs_its_own_plan_faster_than_the_longest(llama):
    from search import Plan, simulate

    grads, _ = llama
    in_force: list = []
    am = _train("llama-tiny", BUDGET, grads, in_force=in_force)
    buckets = {b.shape.bucket: b for b in am.buckets.buckets.values()}
    short, longest = buckets[64], buckets[128]
    assert [plan for b, plan in in_force if b == 64] == [short.plan, short.plan]  # steps 3 and 9
    assert short.plan is not longest.plan
    on_short = [simulate(short.profile, p if p is not None else Plan(decisions={}))
                for p in (short.plan, longest.plan)]
    own, lent = on_short
    assert own.peak_bytes <= BUDGET and own.step_time <= lent.step_time
    # it keeps more: recomputes and swaps no more than the longest bucket's plan, and less of one of them
    assert own.recompute_time <= lent.recompute_time and own.swapped_bytes <= lent.swapped_bytes
    assert (own.recompute_time, own.swapped_bytes) != (lent.recompute_time, lent.swapped_bytes)


def test_max_seq_len_plans_the_longest_length_from_the_first_step(llama):
    grads, _ = llama
    am = _train("llama-tiny", BUDGET, grads, max_seq_len=128)
    assert am.history[0].kind == "warmup" and am.profiles_run == 1
    assert _rescued(am) == [] and _converged_by(am, 2), [r.decision for r in am.history]  # Note: [late offloads are waited for]
    assert [b.shape.bucket for b in am.buckets.buckets.values()] == [128]
    assert am.plan is not None and am.plan.decisions, "the plan for 128 tokens is in force after the first step"
    assert am.buckets.buckets[next(iter(am.buckets.buckets))].profile.model["seq_len"] == 128


def test_hf_qwen2_cycling_lengths_and_max_seq_len():
    grads, peak = _reference("hf:qwen2")
    budget = int(0.75 * peak)
    am = _train("hf:qwen2", budget, grads)
    assert am.profiles_run == 1 and len(_rescued(am)) <= 2, [r.decision for r in am.history]
    am = _train("hf:qwen2", budget, grads, max_seq_len=128)
    assert am.profiles_run == 1 and _rescued(am) == [], [r.decision for r in am.history]


def test_a_step_longer_than_the_maximum_is_an_error_before_its_forward():
    b = _bundle("llama-tiny")
    opt = optimizer(b.model)
    with adaptive_optimize(b.model, budget=BUDGET, optimizer=opt, cache=False, max_seq_len=64) as am:
        b.loss(_batch(b, 0, 64)).backward()
        opt.zero_grad(set_to_none=True)
        with pytest.raises(SeqLenBucketError, match="--max-seq-len=64: a step of 128 tokens"):
            b.loss(_batch(b, 1, 128))
        assert all(p.grad is None for p in b.model.parameters())
        b.loss(_batch(b, 2, 48)).backward()  # the loop goes on with the next step
        assert am.profiles_run == 1 and len(am.history) == 2


def test_a_longer_bucket_below_the_minimum_is_refused_naming_its_length():
    b = _bundle("llama-tiny")
    opt = optimizer(b.model)
    budget = int(2.4 * 2**20)  # the plain step at 32 tokens fits, no plan at 128 does
    with adaptive_optimize(b.model, budget=budget, optimizer=opt, cache=False) as am:
        with DeviceMemory(cap=budget, track_existing=False) as mem:
            mem.track(b.model, opt)
            b.loss(_batch(b, 0, 32)).backward()
            opt.zero_grad(set_to_none=True)
            # Note: [one reference refusing]: the step is profiled, and its own profile refuses
            with pytest.raises(adaptive_mem.AdaptiveBudgetError, match="at 128 tokens .profiled at 128 tokens"):
                b.loss(_batch(b, 1, 128))
            assert all(p.grad is None for p in b.model.parameters())
            b.loss(_batch(b, 2, 32)).backward()  # the shorter steps go on under their plan
        assert am.profiles_run == 2 and len(am.history) == 2


def test_one_short_reference_refusing_a_long_bucket_profiles_the_step(monkeypatch):
    """Note: [one reference refusing]: a profile scaled from 8 tokens to 256 that overstates the step (here made to:
    the reference's whole workspace, the gradients' share with it, added scaled with the length); a budget between
    its minimum and the step's own profile's runs, the long step profiled, exact."""
    from adaptive_mem.adaptive import _warmup

    scale = _warmup.scale_to_seq_len

    def overstated(refs, seq_len):
        scaled, (ref,) = scale(refs, seq_len), (refs if isinstance(refs, tuple) else (refs,))
        space = ref.peak_memory - (ref.static.total - ref.static.gradients) - ref.saved_bytes
        return dataclasses.replace(scaled, peak_memory=scaled.peak_memory + space * seq_len // ref.model["seq_len"])

    monkeypatch.setattr(_warmup, "scale_to_seq_len", overstated)
    budget = 6_000_000
    lengths = (8, 256, 256, 8)
    ref = _bundle("llama-tiny")
    ref_opt, grads = optimizer(ref.model), []
    for step, seq in enumerate(lengths):
        ref.loss(_batch(ref, step, seq)).backward()
        grads.append({n: p.grad.clone() for n, p in ref.model.named_parameters()})
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    b = _bundle("llama-tiny")
    opt = optimizer(b.model)
    with adaptive_optimize(b.model, budget=budget, optimizer=opt, cache=False) as am:
        with DeviceMemory(cap=budget, track_existing=False) as mem:
            mem.track(b.model, opt)
            for step, seq in enumerate(lengths):
                b.loss(_batch(b, step, seq)).backward()
                assert_grads(b.model, grads[step], step)
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert am.profiles_run == 2, [r.decision for r in am.history]
        assert sorted(k.shape.bucket for k in am.buckets.buckets.values()) == [8, 256]


def test_explicit_buckets_and_cache_keys_per_bucket(tmp_path):
    b = _bundle("llama-tiny")
    ids = [t for t in _batch(b, 0, 100)]
    key100, fields = plan_key(b.model, inputs=ids, budget=BUDGET, bucket=128)
    assert fields["seq_len_bucket"] == 128 and fields["inputs"][0][0] == [2, 128]
    assert plan_key(b.model, inputs=_batch(b, 0, 128), budget=BUDGET, bucket=128)[0] == key100
    assert plan_key(b.model, inputs=_batch(b, 0, 64), budget=BUDGET, bucket=64)[0] != key100
    assert "seq_len_bucket" not in plan_key(b.model, inputs=ids, budget=BUDGET)[1]  # a fixed shape: as before

    opt = optimizer(b.model)
    with adaptive_optimize(b.model, budget=BUDGET, optimizer=opt, cache_dir=tmp_path,
                           seq_len_buckets="48,128") as am:
        with DeviceMemory(cap=BUDGET, track_existing=False) as mem:
            mem.track(b.model, opt)
            for step, seq in enumerate((40, 100, 100, 100, 128, 128)):
                b.loss(_batch(b, step, seq)).backward()
                opt.zero_grad(set_to_none=True)
        assert sorted(bk.shape.bucket for bk in am.buckets.buckets.values()) == [48, 128]
    saved = [PlanCache(tmp_path).load(p.stem) for p in tmp_path.glob("*.json")]
    assert {c.fields["seq_len_bucket"] for c in saved} <= {48, 128} and saved, list(tmp_path.iterdir())


def test_dp_ranks_stepping_different_lengths_agree_on_one_plan_and_stay_exact(tmp_path):
    """Note: [one bucket per DP group]: the bucket follows the group's longest length of each step."""
    from _parallel_shapes_cases import LENGTHS, TIMEOUT, worker
    from _spawn import spawn_ranks

    ranks = spawn_ranks(worker, BUDGET, out=tmp_path, timeout=TIMEOUT)
    for rank, r in enumerate(ranks):
        for case in ("plain", "loop"):
            assert r[case]["error"] is None, f"rank {rank} {case}: {r[case]['error']}\n{r[case].get('trace')}"
        for step in range(len(LENGTHS[0])):
            for n, g in r["plain"]["grads"][step].items():
                assert torch.equal(r["loop"]["grads"][step][n], g), f"rank {rank} step {step + 1}: {n} differs"
    first, second = (r["loop"] for r in ranks)
    assert first["plans"] == second["plans"], "the ranks ran different plans"
    assert [h["decision"] for h in first["history"]] == [h["decision"] for h in second["history"]]
    assert first["profiles"] == second["profiles"] == 1
    assert first["plans"][-1] is not None and first["plans"][-1]["decisions"]


def _args(flags: list[str]) -> argparse.Namespace:
    return adaptive_mem.add_arguments(argparse.ArgumentParser()).parse_args(flags)


@pytest.mark.parametrize("flags, match", [
    (["--adaptive-memory-optimization", "--seq-len-buckets", "128,0"], "--seq-len-buckets='128,0': expected"),
    (["--adaptive-memory-optimization", "--seq-len-buckets", "a,b"], "expected positive integers"),
    (["--adaptive-memory-optimization", "--max-seq-len", "0"], "--max-seq-len=0: expected a positive"),
    (["--adaptive-memory-optimization", "--max-seq-len", "128", "--seq-len-buckets", "64,128"], "expected one of"),
    (["--max-seq-len", "128"], "without --adaptive-memory-optimization"),
])
def test_length_flags_are_checked_before_anything_is_applied(flags, match):
    b = _bundle("llama-tiny")
    with pytest.raises(ValueError, match=match):
        apply_arguments(b.model, _args(flags))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in b.model.modules())


def test_length_flags_reach_the_loop():
    b = _bundle("llama-tiny")
    handle = apply_arguments(b.model, _args(["--adaptive-memory-optimization", "--seq-len-buckets", "128,256"]))
    try:
        assert handle.buckets.lengths == (128, 256) and handle.buckets.max_seq_len is None
    finally:
        handle.remove()
    handle = apply_arguments(b.model, _args(["--adaptive-memory-optimization", "--max-seq-len", "512"]))
    try:
        assert handle.buckets.max_seq_len == 512
    finally:
        handle.remove()
