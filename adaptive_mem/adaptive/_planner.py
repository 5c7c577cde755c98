"""The adaptive loop's planning call into ``search``: the fastest plan for a memory target on the profiled
step, or the most memory-saving plan when none fits; and the one-line description of a plan in the log.
"""

from __future__ import annotations

import logging
from typing import Any

from search import Plan, fmt_bytes


__all__ = ["Planner", "describe"]

log = logging.getLogger("adaptive_mem.adaptive._loop")  # Note: [the loop's logger]


class Planner:
    """Plans on the profiled step's model, solved once per target (one planner per input shape or length bucket)."""

    def __init__(self, solver: str) -> None:
        self.solver = solver
        self.step_model: Any = None
        """The ``search.StepModel`` of the last profile (None before it, or on a run served by the plan cache)."""
        self.min_needed = 0
        """The smallest target the profiled step can run under (bytes, the DP group's largest); 0 before it."""
        self._solved: dict[int, Plan] = {}

    def use(self, step_model: Any, *, min_needed: int) -> None:
        """Plan on ``step_model`` from now on; ``min_needed``: the smallest target it runs under."""
        self.step_model = step_model
        self.min_needed = min_needed
        self._solved.clear()

    def solve(self, target: int) -> Plan:
        from search import Problem, get_solver
        from search import InfeasibleBudgetError

        if target not in self._solved:
            try:
                plan = get_solver(self.solver).solve(Problem(self.step_model, target)).plan
            except InfeasibleBudgetError:
                plan = self._most_saving_plan()
                log.info("adaptive memory: no %s plan fits the target %s; using the most memory-saving plan "
                         "(%s)", self.solver, fmt_bytes(target, exact=True), describe(plan))
            self._solved[target] = plan
        return self._solved[target]

    def _most_saving_plan(self) -> Plan:
        from search.planning import plan_from_assignment, simulate_assignment
        from search.planning import min_candidates

        model = self.step_model
        best = min(min_candidates(model), key=lambda a: simulate_assignment(model, a).peak_bytes)
        plan = plan_from_assignment(model, best)
        plan.meta.update({"solver": "most-saving", "predicted_peak_bytes": simulate_assignment(model, best).peak_bytes,
                          "predicted_step_time": round(simulate_assignment(model, best).step_time, 9)})
        return plan


def describe(plan: Plan | None) -> str:
    """A plan in one phrase of the log: its actions counted, with the predicted peak and step time."""
    if plan is None:
        return "plain model"
    kinds: dict[str, int] = {}
    for d in plan.decisions.values():
        kinds[d.action.value] = kinds.get(d.action.value, 0) + 1
    meta = plan.meta
    pred = (f", predicted peak {fmt_bytes(meta['predicted_peak_bytes'], exact=True)}, step {meta['predicted_step_time']:.4f} s"
            if "predicted_peak_bytes" in meta else "")
    return f"plan {dict(sorted(kinds.items())) or 'keep all'}{pred}"
