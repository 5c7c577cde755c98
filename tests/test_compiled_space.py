"""Note: [compiled search space] (search/_compiled_space.py): on a compiled profile with the graph's per-unit figures
(``units``) the space is the eager one; without them a layer swaps as a whole or not at all. The milp finds the
brute-force optimum of either space, every solver's plan lies in it, the plan names a whole-layer swap by the
layer's path, and a searched plan (op-level swaps included) runs compiled (no block falls back to eager), exact
against the same compiled model without a plan, offloading the bytes the profile's graph figures name."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import sys

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import profiler
from adaptive_mem import build_model, optimize
from search import Action, Problem, get_solver, simulate, solver_names
from search.planning import resolve
from search._compiled_space import attributed, compiled_blocks, honoured, project, whole_swap
from search import StepModel
from search._simulator import couple
from search.planning import Assignment, simulate_assignment
from search import InfeasibleBudgetError
from _profiles import random_profile

sys.path.insert(0, os.path.dirname(__file__))

from _compile_common import compiled_step  # noqa: E402
from test_milp_exact import PREFETCH, _instance, brute_force  # noqa: E402

FIGURES = {"backend": "aot_eager", "layout": "per-block", "step_time": 1.0, "eager_step_time": 1.0, "layers": []}
K, R, S = Action.KEEP, Action.RECOMPUTE, Action.SWAP


def _per_block(model: StepModel, units: bool = False) -> StepModel:
    """``model`` as if profiled compiled per block; ``units``: with the graph's per-unit figures."""
    figures = FIGURES
    if units:
        fig = {"saved_bytes": 0, "fwd_time": 0.0, "bwd_time": 0.0}
        figures = {**FIGURES, "layers": [{"layer": i, "eager": fig, "keep": fig, "full": fig, "units": {}}
                                         for i in range(model.num_layers)]}
    return dataclasses.replace(model, profile=dataclasses.replace(model.profile, compiled=figures))


def _layer_decisions(plan, path: str) -> dict:
    return {t: d for t, d in plan.decisions.items() if t == path or t.startswith(path + ".")}


def _assert_in_space(model: StepModel, plan) -> None:
    for layer in range(model.num_layers):
        path = model.profile.layer_path(layer)
        inside = _layer_decisions(plan, path)
        if any(d.action is S for d in inside.values()) and not attributed(model):
            assert list(inside) == [path] and inside[path].action is S, inside


@pytest.mark.parametrize("units", [False, True], ids=["whole-layer", "units"])
@pytest.mark.parametrize("chunk", range(3))
def test_milp_equals_brute_force_of_the_compiled_space(chunk, units):
    solver = get_solver("milp", prefetch=PREFETCH)
    for seed in range(chunk * 20, (chunk + 1) * 20):
        eager, budget = _instance(seed)
        model = _per_block(eager, units)
        expected = brute_force(model, budget, space=lambda p, acts: honoured(model, p, acts))
        if expected is None:
            with pytest.raises(InfeasibleBudgetError):
                solver.solve(Problem(model, budget))
            continue
        result = solver.solve(Problem(model, budget))
        assert result.cost.step_time == pytest.approx(expected, rel=1e-6, abs=1e-9), seed
        _assert_in_space(model, result.plan)
        assert simulate(model, result.plan).step_time == pytest.approx(result.cost.step_time), seed


def test_with_units_the_space_is_eager_and_without_the_restriction_bites_somewhere():
    """With ``units`` the compiled optimum is the eager one; without, on some instance the eager optimum uses an
    op-level swap the whole-layer space lacks (so its optimum is slower), and never the other way round."""
    slower = 0
    for seed in range(40):
        eager, budget = _instance(seed)
        free = brute_force(eager, budget)
        units = brute_force(_per_block(eager, True), budget,
                            space=lambda p, acts, m=_per_block(eager, True): honoured(m, p, acts))
        whole = brute_force(_per_block(eager), budget, space=lambda p, acts, m=_per_block(eager): honoured(m, p, acts))
        assert (units is None) == (free is None) and (units is None or units == pytest.approx(free, abs=1e-12))
        if free is None:
            assert whole is None
            continue
        assert whole is None or whole >= free - 1e-12
        slower += whole is None or whole > free + 1e-12
    assert slower > 0


@pytest.mark.parametrize("units", [False, True], ids=["whole-layer", "units"])
def test_every_solver_plans_inside_the_space(units):
    profile = random_profile(random.Random(7), num_layers=4, units_per_layer=5)
    model = _per_block(StepModel.build(profile), units)
    keep = simulate_assignment(model, Assignment(tuple([K] * len(model.units)), tuple([1] * len(model.units))))
    swapped = 0
    for name in solver_names():
        for share in (0.9, 0.6, 0.4):
            budget = model.base + int(share * (keep.peak_bytes - model.base))
            try:
                result = get_solver(name).solve(Problem(model, budget))
            except InfeasibleBudgetError:
                continue
            _assert_in_space(model, result.plan)
            again = resolve(model, result.plan)
            assert again.actions == result.assignment.actions, (name, share)
            sim = simulate(model, result.plan)
            assert (sim.peak_bytes, sim.step_time) == (result.cost.peak_bytes, result.cost.step_time), (name, share)
            swapped += any(d.action is S for d in result.plan.decisions.values())
    assert swapped > 0


def test_project_swaps_a_layer_whole_or_recomputes_it_and_leaves_eager_profiles_alone():
    profile = random_profile(random.Random(3), num_layers=2, units_per_layer=4)
    eager = StepModel.build(profile)
    model = _per_block(eager)
    assert compiled_blocks(model) and not compiled_blocks(eager)
    n = len(model.units)
    first, second = model.positions[1], model.positions[2]
    partial = [K] * n
    partial[first[1]] = S
    mixed = list(partial)
    mixed[second[0]], mixed[second[2]] = R, S
    asg = couple(model, Assignment(tuple(mixed), tuple([2] * n)))
    out = project(model, asg)
    assert whole_swap(model, out, 1) and all(out.actions[i] is S for i in first if not model.units[i].pinned)
    assert [out.actions[i] for i in second] == [R] * len(second)
    assert project(eager, asg) is asg
    assert simulate_assignment(model, out).peak_bytes <= simulate_assignment(model, asg).peak_bytes
    with_units = _per_block(eager, True)
    assert attributed(with_units) and not attributed(model)
    assert project(with_units, asg) is asg  # the op-level swap and the mixed layer stay: both run compiled


def test_whole_layer_swap_round_trips_when_coupling_drops_the_layer_output():
    profile = random_profile(random.Random(11), num_layers=3, units_per_layer=3)
    model = _per_block(StepModel.build(profile))
    n = len(model.units)
    acts = [K] * n
    for i in model.positions[1]:
        acts[i] = S
    for i in model.positions[2]:
        acts[i] = R
    asg = couple(model, Assignment(tuple(acts), tuple([1] * n)))
    assert any(asg.actions[i] is K for i in model.positions[1])  # the layer output's swap dropped
    from search.planning import plan_from_assignment

    plan = plan_from_assignment(model, asg)
    assert plan.decisions[model.profile.layer_path(0)].action is S
    assert resolve(model, plan).actions == asg.actions


def test_a_searched_plan_runs_compiled_per_block_and_exact(caplog):
    """A swap plan searched on the compiled profile (op-level: the graph's per-unit figures are read) runs compiled,
    exact, and offloads per step what the profile's graph figures say its units save."""
    torch.set_num_threads(1)
    spec = dict(model_args={"num_layers": 2}, batch_size=2, seq_len=32, seed=0)
    bundle = build_model("llama-tiny", **spec)
    eager = profiler.profile_step(bundle, optimizer="adam", repeat=1, record=1)
    compiled = profiler.profile_compiled(bundle, eager, backend="aot_eager", repeat=1)
    model = StepModel.build(compiled)
    assert attributed(model)
    keep = simulate_assignment(model, Assignment(tuple([K] * len(model.units)), tuple([1] * len(model.units))))
    result = get_solver("swap-only").solve(Problem(model, keep.peak_bytes - 1))
    swaps = {t: d for t, d in result.plan.decisions.items() if d.action is S}
    assert swaps and all(t.startswith(("layers.0.", "layers.1.")) for t in swaps), result.plan.decisions
    tables = {row["layer"]: row["units"] for row in compiled.compiled["layers"]}
    expected = sum(tables[int(t.split(".")[1])].get(t.split(".", 2)[2], 0) for t in swaps)

    def run(plan):
        torch._dynamo.reset()
        counters.clear()
        fresh = build_model("llama-tiny", **spec)
        handle = optimize(fresh.model, plan=plan) if plan is not None else None
        for layer in fresh.model.layers:
            layer.compile(backend="aot_eager")
        out = compiled_step(fresh.model, fresh.model, fresh.batch(seed=0))
        breaks = sum(counters["graph_break"].values())
        stats = handle.swap_stats if handle is not None else None
        if handle is not None:
            handle.remove()
        return out, breaks, stats

    caplog.set_level(logging.WARNING)
    ref, _, _ = run(None)
    grads, breaks, stats = run(result.plan)
    assert breaks == 0 and expected > 0 and stats.offloaded_bytes == expected
    assert [r.getMessage() for r in caplog.records if r.name.startswith("adaptive_mem")] == []
    assert grads.keys() == ref.keys()
    for key in ref:
        assert torch.equal(grads[key], ref[key]), key
