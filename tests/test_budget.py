"""Budgets: size parsing, activation fractions, and the minimum-feasible error."""

from __future__ import annotations

import pytest

from search import Budget, BudgetError, InfeasibleBudgetError, StepModel
from _profiles import SyntheticUnit, synthetic_profile
from search import minimum_budget, parse_bytes
from search.planning import check_feasible

MiB = 1 << 20


@pytest.mark.parametrize("text, expected", [
    ("40GiB", 40 << 30), ("512MiB", 512 << 20), ("1.5KiB", 1536), ("80GB", 80 * 10**9), ("7 MB", 7 * 10**6),
    ("3kb", 3000), ("100B", 100), ("2TiB", 2 << 40),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["40", "40GiBs", "forty GiB", "-1GiB", "0GiB", "1e3MB", ""])
def test_parse_bytes_refuses(text):
    with pytest.raises(BudgetError, match="--budget"):
        parse_bytes(text)


def _model() -> StepModel:
    layer = [SyntheticUnit("a", 4 * MiB, 1e-3, 2e-3), SyntheticUnit("b", 2 * MiB, 1e-3, 2e-3)]
    return StepModel.build(synthetic_profile(layers=[layer] * 3, static=100 * MiB, bandwidth=1e9))


def test_activation_fraction_is_of_the_unoptimized_activation_peak():
    model = _model()
    assert Budget(activation_fraction=1.0).resolve(model) == 100 * MiB + 18 * MiB
    assert Budget(activation_fraction=0.5).resolve(model) == 100 * MiB + 9 * MiB
    assert Budget.parse(budget="1GiB").resolve(model) == 1 << 30


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "half"])
def test_bad_activation_fraction(value):
    with pytest.raises(BudgetError, match="--activation-budget"):
        Budget.parse(activation_budget=value)


def test_exactly_one_kind_of_budget():
    with pytest.raises(BudgetError, match="exactly one"):
        Budget.parse(budget="1GiB", activation_budget="0.5")
    with pytest.raises(BudgetError, match="exactly one"):
        Budget.parse()


def test_below_minimum_names_the_minimum_and_what_dominates():
    model = _model()
    minimum, what = minimum_budget(model)
    assert 100 * MiB < minimum < 118 * MiB
    assert "parameters" in what and "optimizer state" in what
    check_feasible(model, minimum)  # at the minimum: fine
    with pytest.raises(InfeasibleBudgetError) as err:
        check_feasible(model, minimum - 1)
    message = str(err.value)
    assert "minimum feasible" in message and str(minimum) in message and "\n" not in message
