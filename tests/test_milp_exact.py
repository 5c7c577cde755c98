"""Acceptance: on random small instances the MILP's plan is the brute-force optimum of the simulator."""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Callable

import pytest

from search import StepModel
from search import Action
from search._simulator import couple
from search.planning import Assignment, simulate_assignment
from search import get_solver
from search import InfeasibleBudgetError, Problem
from _profiles import random_profile

PREFETCH = (0, 1, 2)
N_INSTANCES = 200


def brute_force(model: StepModel, budget: int, *, inputs: bool = True,
                space: Callable[[int, list[Action]], bool] | None = None) -> float | None:
    """Min simulated step time over every keep/recompute/swap assignment and per-layer prefetch distance, and for
    each layer recomputed as a whole: its input kept or swapped at each distance (Note: [swapped checkpoint input]).
    ``space(position, actions)``: the layer actions to enumerate (None: all)."""
    layers = [p for p in model.layer_positions if model.positions[p]]
    n = len(model.units)
    best = None
    for acts in itertools.product((Action.KEEP, Action.RECOMPUTE, Action.SWAP), repeat=n):
        if space is not None and not all(space(p, [acts[i] for i in model.positions[p]]) for p in layers):
            continue
        swap_layers = [p for p in layers if any(acts[i] is Action.SWAP for i in model.positions[p])]
        whole = [p for p in layers if inputs and model.input_swap[p] and all(acts[i] is Action.RECOMPUTE
                                                                  for i in model.positions[p])]
        for ds in itertools.product(PREFETCH, repeat=len(swap_layers)):
            pf = [1] * n
            for p, d in zip(swap_layers, ds):
                for i in model.positions[p]:
                    pf[i] = d
            for ins in itertools.product((None,) + PREFETCH, repeat=len(whole)):
                swapped_in = tuple((p, d) for p, d in zip(whole, ins) if d is not None)
                asg = couple(model, Assignment(acts, tuple(pf), (), swapped_in))
                sim = simulate_assignment(model, asg)
                if sim.peak_bytes <= budget and (best is None or sim.step_time < best):
                    best = sim.step_time
    return best


def _instance(seed: int) -> tuple[StepModel, int]:
    rng = random.Random(seed)
    if seed % 25 == 0:  # the largest instances: 8 units, 3^8 x prefetch choices to enumerate
        layers, per = 2, 4
    else:
        layers = rng.choice([1, 2, 2, 3])
        per = rng.randint(1, 6 // layers) if layers > 1 else rng.randint(2, 5)
    profile = random_profile(rng, num_layers=layers, units_per_layer=per, identical=rng.random() < 0.5)
    if seed % 3 == 0:  # Note: [swap compute]: copies that also take compute time, policy dispatch cost (CPU)
        hw, extra = profile.hardware, random.Random(seed + 10_000)
        share = extra.uniform(0.2, 2.0) * hw.h2d_bandwidth
        per_op = extra.uniform(0.0, 0.2) * max(u.fwd_time for u in profile.units)
        profile = dataclasses.replace(profile, hardware=dataclasses.replace(hw, swap_compute_bandwidth=share,
                                                                            sac_op_overhead=per_op))
    resident = seed % 4 == 3  # resident gradients: each position's largest new gradient before its accumulation
    if resident:
        sizes = random.Random(seed + 20_000)
        largest = [sizes.randint(0, max(1, profile.static.gradients // 4)) for _ in range(profile.num_layers + 2)]
        profile = dataclasses.replace(profile, gradient_largest=largest)
    model = StepModel.build(profile, gradients="persistent" if resident else "per-step")
    keep = simulate_assignment(model, Assignment(tuple([Action.KEEP] * len(model.units)), tuple([1] * len(model.units))))
    budget = model.base + int(rng.uniform(0.3, 1.05) * (keep.peak_bytes - model.base))
    return model, budget


@pytest.mark.parametrize("chunk", range(10))
def test_milp_equals_brute_force(chunk):
    per_chunk = N_INSTANCES // 10
    solver = get_solver("milp", prefetch=PREFETCH)
    for seed in range(chunk * per_chunk, (chunk + 1) * per_chunk):
        model, budget = _instance(seed)
        assert len(model.units) <= 8
        expected = brute_force(model, budget)
        if expected is None:
            with pytest.raises(InfeasibleBudgetError):
                solver.solve(Problem(model, budget))
            continue
        result = solver.solve(Problem(model, budget))
        assert result.cost.peak_bytes <= budget
        assert result.cost.step_time == pytest.approx(expected, rel=1e-6, abs=1e-9), seed
        assert result.stats.lower_bound is not None and result.stats.lower_bound <= result.cost.step_time + 1e-9
        assert result.stats.gap is not None and result.stats.gap <= 1e-5


def test_input_swaps_reach_a_budget_nothing_else_fits(monkeypatch):
    """Note: [swapped checkpoint input]: on this instance only a layer recomputed with its input swapped fits the
    budget; milp finds the brute-force optimum with it, and without the option in its menus finds nothing."""
    import search._menu

    model, budget = _instance(189)
    assert brute_force(model, budget, inputs=False) is None
    expected = brute_force(model, budget)
    assert expected is not None
    result = get_solver("milp", prefetch=PREFETCH).solve(Problem(model, budget))
    assert result.cost.step_time == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert result.assignment.inputs and any(d.swap_input for d in result.plan.decisions.values())
    monkeypatch.setattr(search._menu, "_input_swaps", lambda *args: [])
    with pytest.raises(InfeasibleBudgetError):
        get_solver("milp", prefetch=PREFETCH).solve(Problem(model, budget))
