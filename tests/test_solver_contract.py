"""One contract for every solver (like optuna's sampler test suite): same problem in, one result type out.

Every solver's plan fits its budget, is a valid Plan that round-trips through its file form,
and simulates to exactly the cost the result reports. The MILP is never beaten by a baseline,
and a larger budget never makes it slower.
"""

from __future__ import annotations

import random

import pytest

from search import (
    Action,
    Budget,
    InfeasibleBudgetError,
    Plan,
    Problem,
    SolveResult,
    StepModel,
    UnknownSolverError,
    get_solver,
    simulate,
    solver_names,
)

from _profiles import random_profile

SOLVERS = solver_names()
FAST = {"optuna": {"trials": 40}}


def _model(seed: int = 7, layers: int = 6, units: int = 10) -> StepModel:
    return StepModel.build(random_profile(random.Random(seed), num_layers=layers, units_per_layer=units,
                                          bandwidth=2e9))


def _solve(name: str, model: StepModel, budget: int) -> SolveResult:
    return get_solver(name, **FAST.get(name, {})).solve(Problem(model, budget))


def test_every_solver_is_registered():
    assert {"milp", "optuna", "none", "full", "selective", "uniform", "block", "sqrt", "greedy",
            "mindformers-swap", "swap-only"} <= set(SOLVERS)


def test_unknown_solver():
    with pytest.raises(UnknownSolverError, match="unknown solver"):
        get_solver("simulated-annealing")


@pytest.mark.parametrize("name", SOLVERS)
@pytest.mark.parametrize("fraction", [0.6, 1.0])
def test_plan_fits_budget_and_simulates_to_reported_cost(name, fraction):
    model = _model()
    budget = Budget(activation_fraction=fraction).resolve(model)
    try:
        result = _solve(name, model, budget)
    except InfeasibleBudgetError:
        assert name not in ("milp", "none", "greedy") or fraction < 1.0
        return
    assert isinstance(result, SolveResult) and result.solver == name
    assert result.cost.peak_bytes <= budget
    assert result.stats.solve_time >= 0
    again = Plan.loads(result.plan.dumps())
    sim = simulate(model, again)
    assert sim.peak_bytes == result.cost.peak_bytes
    assert sim.step_time == pytest.approx(result.cost.step_time, rel=1e-12)
    assert again.meta["solver"] == name and again.meta["budget"] == budget


@pytest.mark.parametrize("name", SOLVERS)
def test_budget_below_anything_raises(name):
    model = _model()
    with pytest.raises(InfeasibleBudgetError):
        _solve(name, model, model.base + 1)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_milp_is_never_beaten_by_another_solver(seed):
    model = _model(seed, layers=4, units=4)  # small enough for the complete menus
    for fraction in (0.5, 0.8):
        budget = Budget(activation_fraction=fraction).resolve(model)
        best = _solve("milp", model, budget)
        for name in SOLVERS:
            if name == "milp":
                continue
            try:
                other = _solve(name, model, budget)
            except InfeasibleBudgetError:
                continue
            assert best.cost.step_time <= other.cost.step_time * (1 + 1e-9), (name, fraction)


def test_milp_larger_budget_is_never_slower():
    model = _model(11, layers=4, units=4)
    keep = Budget(activation_fraction=1.0).resolve(model)
    times = []
    for k in range(40, 101, 6):
        budget = model.base + (keep - model.base) * k // 100
        try:
            times.append(_solve("milp", model, budget).cost.step_time)
        except InfeasibleBudgetError:
            assert not times, "a larger budget became infeasible"
    assert len(times) >= 5
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:])), times


def test_milp_reports_bound_and_gap_on_a_large_model():
    # 80 layers x 16 units: the repeated-layer path (LP bound + integer program on its support)
    model = StepModel.build(random_profile(random.Random(3), num_layers=80, units_per_layer=16, bandwidth=1e9))
    budget = Budget(activation_fraction=0.3).resolve(model)
    result = _solve("milp", model, budget)
    assert result.stats.lower_bound is not None and result.stats.lower_bound <= result.cost.step_time
    assert result.stats.gap is not None and result.stats.gap <= 0.005
    assert result.stats.extra["mode"].startswith("lp-support")
    assert result.plan.decisions  # the budget needs recompute or swap
