"""Throughput mode: the micro-batch size and the plan chosen together (``maximize_throughput``).

For each batch size, the profile at that size (given, or scaled: Note: [batch scaling]) is searched
under the same device budget; the fastest plan's predicted step time gives tokens per second
(``batch_size * seq_len / step_time``; samples per second when the profile has no ``seq_len``). The
batch size with the most tokens per second wins. A batch size whose most memory-saving plan exceeds
the budget "does not fit".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from profiler import HardwareSpec, Profile

from ._budget import Budget, BudgetError, min_candidates, device_shortfall, minimum_budget
from ._model import StepModel
from ._registry import get_solver
from ._scaling import profile_for_batch
from ._simulator import simulate_assignment
from ._sizes import fmt_bytes
from ._solver import (InfeasibleBudgetError, PredictedCost, Problem, SolveResult, Solver, SolverStats, fmt_seconds,
                      plan_from_assignment)

__all__ = ["BatchSizesError", "ThroughputRow", "ThroughputResult", "maximize_throughput", "parse_batch_sizes"]

_FORM = "positive integers and ranges such as 1,2,4,8 or 1-16"
_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
MAX_BATCH_SIZES = 4096


class BatchSizesError(ValueError):
    """``--batch-sizes`` is not a list of positive integers and ranges."""


def parse_batch_sizes(text: str | Iterable[int], *, key: str = "--batch-sizes") -> list[int]:
    """``"1,2,4,8"`` / ``"1-16"`` / ``"1-4,8"`` (or ints) -> sorted distinct sizes; one-line error otherwise."""
    if not isinstance(text, str):
        sizes = list(text)
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in sizes):
            raise BatchSizesError(f"{key}={sizes!r}: expected {_FORM}")
        return sorted(set(sizes))
    out: set[int] = set()
    for item in text.split(","):
        m = _ITEM.match(item)
        if m is None:
            raise BatchSizesError(f"{key}={text!r}: {item.strip()!r} is not a batch size; expected {_FORM}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo <= 0:
            raise BatchSizesError(f"{key}={text!r}: batch size {lo} is not positive; expected {_FORM}")
        if hi < lo:
            raise BatchSizesError(f"{key}={text!r}: range {lo}-{hi} is empty; expected {_FORM}")
        if hi - lo + len(out) >= MAX_BATCH_SIZES:
            raise BatchSizesError(f"{key}={text!r}: more than {MAX_BATCH_SIZES} batch sizes; expected {_FORM}")
        out.update(range(lo, hi + 1))
    return sorted(out)


@dataclass(frozen=True)
class ThroughputRow:
    batch_size: int
    source: str
    """``"profiled"``, ``"interpolated between batches a, b"`` or ``"extrapolated from batch N"`` / ``"... from
    batches a, b"``."""
    result: SolveResult | None
    """The fastest plan under the budget; None when the batch size does not fit."""
    tokens_per_second: float | None = None
    note: str = ""
    """Why it does not fit (one line)."""

    @property
    def fits(self) -> bool:
        return self.result is not None

    @property
    def step_time(self) -> float | None:
        return self.result.cost.step_time if self.result is not None else None

    @property
    def peak_bytes(self) -> int | None:
        return self.result.plan.meta.get("predicted_peak_bytes") if self.result is not None else None

    def line(self, unit: str, best: bool) -> str:
        if self.result is None:
            return f"{self.batch_size:>6}  {'does not fit':>12}  {'':>14}  {'':>11}  {self.source}: {self.note}"
        mark = "  <- best" if best else ""
        return (f"{self.batch_size:>6}  {fmt_seconds(self.step_time):>12}  {self.tokens_per_second:>14,.1f}  "
                f"{fmt_bytes(self.peak_bytes):>11}  {self.source}, {len(self.result.plan.decisions)} decisions{mark}")


@dataclass(frozen=True)
class ThroughputResult:
    rows: list[ThroughputRow]
    budget: int
    unit: str = "tokens/s"
    best_row: ThroughputRow = field(init=False)

    def __post_init__(self) -> None:
        fitting = [r for r in self.rows if r.fits]
        if not fitting:
            first = self.rows[0]
            raise InfeasibleBudgetError(f"no batch size in {', '.join(str(r.batch_size) for r in self.rows)} fits "
                                        f"the budget {fmt_bytes(self.budget)}: batch {first.batch_size}: {first.note}")
        object.__setattr__(self, "best_row", max(fitting, key=lambda r: (r.tokens_per_second, -r.batch_size)))

    @property
    def best(self) -> tuple[int, SolveResult]:
        assert self.best_row.result is not None
        return self.best_row.batch_size, self.best_row.result

    def largest_fitting(self) -> ThroughputRow:
        return max((r for r in self.rows if r.fits), key=lambda r: r.batch_size)

    def table(self) -> str:
        head = f"{'batch':>6}  {'step':>12}  {self.unit:>14}  {'peak':>11}  profile"
        return "\n".join([head] + [r.line(self.unit, r is self.best_row) for r in self.rows])


def _source(profile: Profile) -> str:
    sizes = profile.model.get("extrapolated_from")
    if not sizes:
        return "profiled"
    if len(sizes) == 2 and min(sizes) < int(profile.model["batch_size"]) < max(sizes):
        return f"interpolated between batches {', '.join(map(str, sizes))}"
    return f"extrapolated from batch{'es' if len(sizes) > 1 else ''} {', '.join(map(str, sizes))}"


def _most_saving(model: StepModel, budget: int) -> SolveResult | None:
    """The fastest of the most memory-saving plans (full recompute, swap all, both) that fits, as the adaptive
    loop falls back to: a solver's space (the MILP's heuristic menus) may miss them."""
    fits = [(sim, asg) for asg in min_candidates(model)
            for sim in [simulate_assignment(model, asg)] if sim.peak_bytes <= budget]
    if not fits:
        return None
    sim, asg = min(fits, key=lambda f: f[0].step_time)
    plan = plan_from_assignment(model, asg)
    plan.meta.update({"solver": "most-saving", "predicted_step_time": round(sim.step_time, 9)})
    return SolveResult("most-saving", plan, PredictedCost.of(sim), SolverStats(0.0), budget, asg)


def _row(profile: Profile, batch: int, budget: int, solver: Solver, hardware: HardwareSpec | None) -> ThroughputRow:
    source = _source(profile)
    model = StepModel.build(profile, hardware=hardware)
    shortfall = device_shortfall(model.hardware, static=model.static_bytes)
    if shortfall:
        return ThroughputRow(batch, source, None, note=shortfall)
    try:
        result = solver.solve(Problem(model, budget))
    except InfeasibleBudgetError:
        result = _most_saving(model, budget)
        if result is None:
            least, _ = minimum_budget(model)
            return ThroughputRow(batch, source, None, note=f"no {solver.name} plan fits; the most memory-saving "
                                                           f"plans need {fmt_bytes(least)}")
    sim = simulate_assignment(model, result.assignment)
    if sim.peak_bytes > budget:  # a solver's plan over the budget is no plan for it
        return ThroughputRow(batch, source, None, note=f"the {result.solver} plan's peak {fmt_bytes(sim.peak_bytes)} "
                                                       f"is over the budget")
    seq = profile.model.get("seq_len") or 1
    result.plan.meta.update({"predicted_peak_bytes": sim.peak_bytes, "batch_size_source": source,
                             "tokens_per_second": round(batch * seq / sim.step_time, 3)})
    return ThroughputRow(batch, source, result, tokens_per_second=batch * seq / sim.step_time)


def maximize_throughput(*, profiles: Profile | Mapping[int, Profile], batch_sizes: str | Iterable[int],
                        budget: int | str | Budget, solver: str | Solver = "milp",
                        hardware: HardwareSpec | None = None) -> ThroughputResult:
    """The micro-batch size and plan with the most tokens per second under ``budget`` device bytes.

    ``profiles``: one profile, or profiles of one model keyed by their batch size; a batch size not among
    them is interpolated between the two around it, or beyond them scaled from the two nearest (Note: [batch
    scaling], Note: [bracketing profiles]); its row says "interpolated" or "extrapolated".
    ``budget``: bytes, a size string (``"80GB"``) or a :class:`Budget` with a total (a fraction of the
    keep-all activations means another budget at every batch size: refused). Raises
    :class:`InfeasibleBudgetError` when no batch size fits.
    """
    sizes = parse_batch_sizes(batch_sizes)
    if isinstance(profiles, Profile):
        profiles = {int(profiles.model.get("batch_size") or 1): profiles}
    if isinstance(budget, Budget):
        if budget.total is None:
            raise BudgetError(f"budget={budget.describe()!r}: throughput mode compares batch sizes under one device "
                              "budget; expected a total such as 80GB, not an activation fraction")
        total = budget.total
    elif isinstance(budget, int) and not isinstance(budget, bool):
        if budget <= 0:
            raise BudgetError(f"budget={budget!r}: expected a size > 0")
        total = budget
    else:
        total = Budget.parse(budget=budget).total
    assert total is not None
    solve = get_solver(solver) if isinstance(solver, str) else solver
    seq = next(iter(profiles.values())).model.get("seq_len")
    rows = [_row(profile_for_batch(profiles, b), b, total, solve, hardware) for b in sizes]
    return ThroughputResult(rows, total, unit="tokens/s" if seq else "samples/s")
