"""Memory budgets: absolute (``40GiB``) or a fraction of the unoptimized activation memory.

Also the minimum feasible budget and what dominates it, for the error a too-small budget gets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._model import StepModel
from ._plan import Action
from ._simulator import Assignment, segments, simulate_assignment
from ._solver import InfeasibleBudgetError, fmt_bytes

__all__ = ["Budget", "BudgetError", "parse_bytes", "minimum_budget", "check_feasible"]

_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


class BudgetError(ValueError):
    """A budget that cannot be read."""


def parse_bytes(text: str, *, key: str = "--budget") -> int:
    """``40GiB`` -> 42949672960. Units: B, KiB, MiB, GiB, TiB (binary), KB, MB, GB, TB (decimal)."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise BudgetError(f"{key}={text!r}: expected a size like 40GiB, 512MiB or 80GB "
                          f"(units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise BudgetError(f"{key}={text!r}: expected a size > 0")
    return value


@dataclass(frozen=True)
class Budget:
    total: int | None = None
    """Peak device bytes, parameters, gradients and optimizer state included."""
    activation_fraction: float | None = None
    """Fraction of the unoptimized activation memory allowed on top of the static memory:
    budget = parameters + gradients + optimizer state + F x in-flight micro-batches x (saved activation
    bytes + loss workspace)."""

    def __post_init__(self) -> None:
        if (self.total is None) == (self.activation_fraction is None):
            raise BudgetError("budget: give exactly one of --budget or --activation-budget")
        f = self.activation_fraction
        if f is not None and (isinstance(f, bool) or not 0 < f <= 1):
            raise BudgetError(f"--activation-budget={f!r}: expected a fraction in (0, 1]")

    @classmethod
    def parse(cls, *, budget: str | None = None, activation_budget: str | float | None = None) -> "Budget":
        if activation_budget is not None:
            try:
                fraction = float(activation_budget)
            except (TypeError, ValueError):
                raise BudgetError(f"--activation-budget={activation_budget!r}: expected a fraction in (0, 1]") from None
            if budget is not None:
                raise BudgetError("budget: give exactly one of --budget or --activation-budget, not both")
            return cls(activation_fraction=fraction)
        return cls(total=None if budget is None else parse_bytes(budget))

    def resolve(self, model: StepModel, *, in_flight: int = 1) -> int:
        """Absolute peak bytes for ``model``."""
        if self.total is not None:
            return self.total
        assert self.activation_fraction is not None
        static = model.base + sum(model.grads)
        activations = in_flight * (model.activation_bytes + model.boundary)
        return static + int(self.activation_fraction * activations)

    def describe(self) -> str:
        if self.total is not None:
            return fmt_bytes(self.total)
        return f"{self.activation_fraction:g} of activation memory"


def _min_candidates(model: StepModel) -> list[Assignment]:
    n = len(model.units)
    full = Assignment(tuple(Action.RECOMPUTE if model.layer_of(u.position) is not None else Action.KEEP
                            for u in model.units), tuple([1] * n))
    swap = Assignment(tuple(Action.SWAP for _ in model.units), tuple([0] * n))
    mixed = Assignment(tuple(Action.RECOMPUTE if model.layer_of(u.position) is not None else Action.SWAP
                             for u in model.units), tuple([0] * n))
    return [full, swap, mixed]


def minimum_budget(model: StepModel, *, in_flight: int = 1) -> tuple[int, str]:
    """Smallest peak of the most memory-saving plans, and what dominates it (one line)."""
    best = None
    for asg in _min_candidates(model):
        sim = simulate_assignment(model, asg, in_flight=in_flight)
        if best is None or sim.peak_bytes < best[0]:
            best = (sim.peak_bytes, asg)
    assert best is not None
    peak, asg = best
    static = model.profile.static
    parts = [("optimizer state", static.optimizer_state), ("parameters", static.parameters),
             ("gradients", static.gradients), ("activations left on the device", peak - static.total)]
    parts.sort(key=lambda kv: -kv[1])
    largest = max(((model.units[i].saved, model.units[i].name) for s in segments(model, asg)
                   for i, b in s.hold.items() if b), default=None)
    what = ", ".join(f"{name} {fmt_bytes(value)}" for name, value in parts)
    if largest:
        what += f"; largest unswappable tensor {largest[1]} {fmt_bytes(largest[0])}"
    return peak, what


def check_feasible(model: StepModel, budget: int, *, in_flight: int = 1) -> None:
    """Raise :class:`InfeasibleBudgetError` naming the minimum feasible budget when ``budget`` is below it."""
    minimum, what = minimum_budget(model, in_flight=in_flight)
    if budget < minimum:
        raise InfeasibleBudgetError(f"budget {fmt_bytes(budget)} is below the minimum feasible "
                                    f"{fmt_bytes(minimum)} ({minimum} bytes): {what}")
