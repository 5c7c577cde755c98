"""The plan cache: a second run with the same fingerprint skips profiling; any change misses."""

from __future__ import annotations

import logging

import torch

from adaptive_mem import PlanCache, adaptive_optimize
from adaptive_mem.adaptive._plan_cache import CachedPlan, plan_key
from search import Plan

from _adaptive_common import assert_grads, bundle, optimizer, reference, train

BUDGET = 8_000_000
STEPS = 10


def _run(tmp_path, steps: int, grads=None, **overrides):
    b = bundle(**overrides)
    opt = optimizer(b.model)
    check = (lambda s: assert_grads(b.model, grads[s], s)) if grads is not None else None
    with adaptive_optimize(b.model, budget=BUDGET, optimizer=opt, cache_dir=tmp_path) as am:
        peaks = train(b, opt, steps, cap=BUDGET, check=check)
    assert max(peaks) <= BUDGET
    return am


def test_second_run_reuses_the_plan_and_changes_miss(tmp_path, caplog):
    grads, _ = reference(STEPS)
    first = _run(tmp_path, STEPS, grads)
    assert first.profiles_run == 1 and first.cache_hits == 0 and first.converged
    assert len(list(tmp_path.glob("*.json"))) == 1

    caplog.set_level(logging.INFO, logger="adaptive_mem.adaptive._loop")
    second = _run(tmp_path, 3, grads)
    assert second.profiles_run == 0 and second.cache_hits == 1, "same fingerprint: no profiling"
    assert second.plan.decisions == first.plan.decisions
    assert second.history[0].kind == "cached" and second.converged_at == 1
    assert "reusing the cached plan" in caplog.text

    other_model = _run(tmp_path, 1, model_args={"num_layers": 3})
    assert other_model.profiles_run == 1 and other_model.cache_hits == 0
    other_shape = _run(tmp_path, 1, batch_size=2)
    assert other_shape.profiles_run == 1 and other_shape.cache_hits == 0


def test_key_covers_every_field():
    b = bundle()
    inputs = list(b.batch(seed=0))
    key, fields = plan_key(b.model, inputs=inputs, budget=BUDGET)
    assert set(fields) == {"structure", "inputs", "dtype", "device", "parallel", "version", "budget"}
    assert plan_key(b.model, inputs=inputs, budget=BUDGET)[0] == key
    assert plan_key(b.model, inputs=inputs, budget=BUDGET + 1)[0] != key
    assert plan_key(b.model, inputs=inputs, budget=BUDGET, parallel={"tp": 2})[0] != key
    assert plan_key(b.model, inputs=[t[:, :64] for t in inputs], budget=BUDGET)[0] != key
    assert plan_key(b.model.to(torch.float64), inputs=inputs, budget=BUDGET)[0] != key
    assert plan_key(bundle(model_args={"num_layers": 3}).model, inputs=inputs, budget=BUDGET)[0] != key


def test_unreadable_entries_are_misses_not_crashes(tmp_path, caplog):
    cache = PlanCache(tmp_path)
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers.0": "recompute"}})
    cache.save("k", CachedPlan(plan, 123, {"budget": 1}))
    assert cache.load("k").plan.decisions == plan.decisions and cache.load("k").target == 123
    assert cache.load("missing") is None
    for text in ("{not json", '{"format": "other"}', '{"format": "adaptive-mem-plan-cache", "target": -1}',
                 '{"format": "adaptive-mem-plan-cache", "target": 5, "fields": {}, "plan": {"format": "x"}}'):
        (tmp_path / "bad.json").write_text(text)
        assert cache.load("bad") is None
    assert caplog.text.count("planning again") == 4
