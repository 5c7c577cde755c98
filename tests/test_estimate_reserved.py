"""``estimate(ac="ours")`` plans in reserved bytes: the plan it returns fits the device as ``fits`` judges it (the
caching allocator's reserve over the allocated peak), where a search under the device's memory in allocated bytes
would not (Note: [ours in reserved bytes])."""

from __future__ import annotations

import dataclasses

import pytest

import adaptive_mem as am
from adaptive_mem import _estimate as est
from search import InfeasibleBudgetError
from _profiles import SyntheticUnit, synthetic_profile

MiB = 1 << 20
_LAYER = [SyntheticUnit("norm", 8 * MiB, 1e-3, 2e-3), SyntheticUnit("mlp.matmul", 30 * MiB, 4e-3, 8e-3),
          SyntheticUnit("act", 12 * MiB, 1e-3, 2e-3), SyntheticUnit("out.matmul", 8 * MiB, 3e-3, 6e-3)]


def _on_h100(capacity_below_keep_all: int):
    """A synthetic step on a CUDA target (the reserve modelled) whose device is ``capacity_below_keep_all`` bytes
    smaller than the keep-all peak."""
    profile = synthetic_profile(layers=[_LAYER] * 4, static=100 * MiB)
    keep = am.search(profile, budget="100%").peak_bytes
    profile.hardware = dataclasses.replace(profile.hardware, name="h100", device_memory=keep - capacity_below_keep_all)
    return profile, keep - capacity_below_keep_all


def test_a_search_in_allocated_bytes_overshoots_and_ours_does_not():
    profile, capacity = _on_h100(40 * MiB)
    old = am.search(profile, budget=capacity)  # the device's memory as an allocated budget
    assert est.reserved_bytes(old.peak_bytes, profile) > capacity  # 284 MiB allocated, 316 MiB reserved
    found = est._search_fitting(profile, "milp")
    assert est.reserved_bytes(found.peak_bytes, profile) <= capacity < est.reserved_bytes(old.peak_bytes, profile)
    assert found.step_time >= old.step_time


def test_a_plan_overshooting_in_reserved_bytes_shrinks_the_budget(monkeypatch):
    """The first plan found overshoots (as a rank's chunks together may): the budget shrinks by the overshoot."""
    profile, capacity = _on_h100(40 * MiB)
    budgets = []

    def overshooting_once(prof, *, budget, solver):
        budgets.append(budget)
        found = am.search(prof, budget=budget, solver=solver)
        return dataclasses.replace(found, peak_bytes=found.peak_bytes + 16 * MiB) if len(budgets) == 1 else found

    monkeypatch.setattr(est, "search", overshooting_once)
    found = est._search_fitting(profile, "milp")
    assert len(budgets) == 2 and budgets[1] < budgets[0]
    assert est.reserved_bytes(found.peak_bytes, profile) <= capacity


def test_no_plan_fitting_in_reserved_bytes_is_refused():
    profile, _ = _on_h100(300 * MiB)  # below the static memory and the reserve
    with pytest.raises(InfeasibleBudgetError, match="--ac='ours'"):
        est._search_fitting(profile, "milp")
