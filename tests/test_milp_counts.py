"""The counts program (identical layers): its bound is a true lower bound over the per-layer menu space.

Note: [counts relaxation] every plan that takes one menu option per layer, in any order, and fits
the budget must simulate no faster than the counts program's bound.
"""

from __future__ import annotations

import random

import pytest

from search import Budget
from search._counts import identical_layers, solve_counts
from search._menu import layer_menu
from search import StepModel
from search import Action
from search.planning import Assignment, simulate_assignment
from search import get_solver
from search import Problem
from _profiles import random_profile


def _random_plan(model, menus, rng):
    actions = [Action.KEEP] * len(model.units)
    prefetch = [1] * len(model.units)
    for p in model.layer_positions:
        o = rng.choice(menus[p])
        for i, a in zip(model.positions[p], o.acts):
            actions[i], prefetch[i] = a, o.d
    return Assignment(tuple(actions), tuple(prefetch))


@pytest.mark.parametrize("seed,in_flight", [(0, 1), (1, 1), (2, 2)])
def test_counts_bound_is_below_every_menu_plan_that_fits(seed, in_flight):
    rng = random.Random(seed)
    model = StepModel.build(random_profile(rng, num_layers=6, units_per_layer=10, bandwidth=rng.choice([1e9, 1e10])))
    cache: dict = {}
    menus = {p: layer_menu(model, p, cache=cache, exact=False) for p in model.layer_positions}
    assert identical_layers(model, menus)
    layers = list(model.layer_positions)
    plans = [_random_plan(model, menus, rng) for _ in range(300)]
    sims = [simulate_assignment(model, a, in_flight=in_flight) for a in plans]
    checked = 0
    for fraction in (0.3, 0.5, 0.7, 0.9):
        budget = Budget(activation_fraction=fraction).resolve(model, in_flight=in_flight)
        out = solve_counts(Problem(model, budget, in_flight=in_flight), (menus[layers[1]], menus[layers[-1]], menus[layers[0]]),
                           rel_gap=1e-9, time_limit=2.0)
        for sim in sims:
            if sim.peak_bytes <= budget:
                checked += 1
                assert out.bound <= sim.step_time * (1 + 1e-9), (fraction, out.bound, sim.step_time)
        if out.best is not None:
            assert out.bound <= out.best[0] * (1 + 1e-9)
            assert simulate_assignment(model, out.best[1], in_flight=in_flight).peak_bytes <= budget
    assert checked > 0


def test_milp_uses_counts_on_identical_layers_and_reports_gap():
    model = StepModel.build(random_profile(random.Random(5), num_layers=40, units_per_layer=16, bandwidth=1e9))
    budget = Budget(activation_fraction=0.4).resolve(model)
    result = get_solver("milp").solve(Problem(model, budget))
    assert result.stats.extra["mode"].endswith("counts")  # counts program, alone or continued per layer
    assert result.stats.lower_bound is not None and result.stats.lower_bound <= result.cost.step_time
    assert result.cost.peak_bytes <= budget
