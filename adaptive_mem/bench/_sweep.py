"""The predicted Pareto sweep: each solver's plan over activation budgets from 1/N to 1, costed by the
step model (``adaptive-mem pareto`` and the bench's simulated section plot it)."""

from __future__ import annotations

import logging

from search import Budget, InfeasibleBudgetError, StepModel, get_solver
from search.planning import simulate_assignment

__all__ = ["sweep"]

log = logging.getLogger(__name__)


def sweep(model: StepModel, solvers: list[str], points: int, *, progress: bool = False) -> dict[str, list]:
    """solver -> [(fraction, peak bytes, step seconds)] for the budgets it meets."""
    from tqdm import tqdm
    out: dict[str, list] = {name: [] for name in solvers}
    fractions = [k / points for k in range(1, points + 1)]
    with tqdm(total=len(fractions) * len(solvers), desc="pareto", disable=not progress, leave=False) as bar:
        for f in fractions:
            problem = Budget(activation_fraction=f).problem(model)
            for name in solvers:
                try:
                    r = get_solver(name).solve(problem)
                    sim = simulate_assignment(model, r.assignment)  # the step's own peak, not the solved proxy's
                    out[name].append((f, sim.peak_bytes, sim.step_time))
                except InfeasibleBudgetError as exc:
                    log.debug("%s at %.2f: %s", name, f, exc)
                bar.update(1)
    return out
