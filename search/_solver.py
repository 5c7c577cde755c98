"""The solver contract: a ``Problem`` in, one ``SolveResult`` out, for every solver.

A solver chooses an :class:`Assignment` (per-unit keep / recompute / swap and prefetch
distances); the result carries the plan, the simulator's verdict on it, and statistics.
Solvers are looked up by name with ``get_solver`` (``_registry.py``).
"""

from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ._compiled_space import compiled_blocks, project, whole_swap
from ._model import StepModel
from ._plan import Action, Decision, Plan
from ._simulator import Assignment, simulate_assignment
from ._sizes import BudgetError, fmt_bytes
from ._timeline import Simulation

__all__ = ["InfeasibleBudgetError", "Problem", "PredictedCost", "SolveResult", "Solver", "SolverStats", "fmt_bytes",
           "fmt_seconds", "plan_from_assignment"]

log = logging.getLogger(__name__)


class InfeasibleBudgetError(BudgetError):
    """No plan of the solver's space fits the memory budget."""


@dataclass(frozen=True)
class Problem:
    model: StepModel
    """Profile numbers arranged for the simulator."""
    budget: int
    """Peak device bytes allowed, static memory included."""
    in_flight: int = 1
    """Micro-batches whose activations the device holds at once (1F1B pipeline stage: min(P - s, M))."""
    progress: bool = False
    """Show progress on stderr for long searches."""


@dataclass(frozen=True)
class PredictedCost:
    peak_bytes: int
    """Predicted peak device memory of the plan."""
    step_time: float
    """Predicted seconds per step."""
    stall_time: float
    """Predicted seconds the compute stream waits for reloads."""

    @classmethod
    def of(cls, sim: Simulation) -> "PredictedCost":
        return cls(sim.peak_bytes, sim.step_time, sim.stall_time)


@dataclass(frozen=True)
class SolverStats:
    solve_time: float
    """Wall seconds the solver took."""
    lower_bound: float | None = None
    """Proven lower bound on the step time of any plan of the solver's space under the budget (None: no proof)."""
    gap: float | None = None
    """(step_time - lower_bound) / step_time, None when there is no bound."""
    iterations: int = 0
    """Solver-specific: MILP solves / optuna trials / candidate plans simulated."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Solver-specific details (menu sizes, status)."""


@dataclass(frozen=True)
class SolveResult:
    solver: str
    plan: Plan
    cost: PredictedCost
    stats: SolverStats
    budget: int
    assignment: Assignment


class Solver(abc.ABC):
    """Base of every solver: ``solve(problem) -> SolveResult``; the plan must fit ``problem.budget``."""

    name: str = ""

    @abc.abstractmethod
    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        """Return the chosen assignment and stats fields (``lower_bound``, ``iterations``, ``extra``)."""

    def solve(self, problem: Problem) -> SolveResult:
        start = time.perf_counter()
        asg, info = self.choose(problem)
        asg = project(problem.model, asg)  # Note: [compiled search space]
        elapsed = time.perf_counter() - start
        sim = simulate_assignment(problem.model, asg, in_flight=problem.in_flight)
        if sim.peak_bytes > problem.budget:
            raise InfeasibleBudgetError(
                f"solver {self.name!r}: its plan needs {fmt_bytes(sim.peak_bytes)} > budget {fmt_bytes(problem.budget)}")
        bound = info.get("lower_bound")
        gap = None if bound is None else max(0.0, (sim.step_time - bound) / sim.step_time)
        stats = SolverStats(solve_time=elapsed, lower_bound=bound, gap=gap, iterations=info.get("iterations", 0),
                            extra=info.get("extra", {}))
        plan = plan_from_assignment(problem.model, asg)
        plan.meta.update({"solver": self.name, "budget": problem.budget, "predicted_peak_bytes": sim.peak_bytes,
                          "predicted_step_time": round(sim.step_time, 9), "predicted_stall_time": round(sim.stall_time, 9)})
        if bound is not None:
            plan.meta.update({"lower_bound": round(bound, 9), "gap": round(gap or 0.0, 9)})
        log.debug("solver %s: peak %s (budget %s), step %.4f s, stall %.4f s, solved in %.2f s%s", self.name,
                 fmt_bytes(sim.peak_bytes), fmt_bytes(problem.budget), sim.step_time, sim.stall_time, elapsed,
                 "" if gap is None else f", gap {gap:.3%}")
        return SolveResult(self.name, plan, PredictedCost.of(sim), stats, problem.budget, asg)


def fmt_seconds(t: float) -> str:
    return f"{t:.4f} s" if abs(t) >= 1 else f"{t * 1e3:.3f} ms" if abs(t) >= 1e-3 else f"{t * 1e6:.2f} us"


def plan_from_assignment(model: StepModel, asg: Assignment) -> Plan:
    """Compact plan: ``<layer>: recompute`` for whole layers (and ``<layer>: swap`` on a model compiled per block),
    unit targets otherwise."""
    decisions: dict[str, Decision] = {}
    swapped_in = dict(asg.inputs)
    for p, members in enumerate(model.positions):
        layer = model.layer_of(p)
        acts = [asg.actions[i] for i in members]
        if layer is not None and members and all(a is Action.RECOMPUTE for a in acts):
            decisions[model.profile.layer_path(layer)] = (
                Decision(Action.RECOMPUTE, swapped_in[p], swap_input=True) if p in swapped_in
                else Decision(Action.RECOMPUTE))
            continue
        if compiled_blocks(model) and whole_swap(model, asg, p):  # Note: [compiled search space]: one decision, the layer's path
            decisions[model.profile.layer_path(layer)] = Decision(
                Action.SWAP, next(asg.prefetch[i] for i in members if asg.actions[i] is Action.SWAP))
            continue
        for i, a in zip(members, acts):
            if a is Action.SWAP:
                decisions[model.units[i].name] = Decision(Action.SWAP, asg.prefetch[i])
            elif a is Action.RECOMPUTE:
                decisions[model.units[i].name] = Decision(Action.RECOMPUTE)
    groups = [list(range(a - 1, b)) for a, b in asg.groups]
    prof = model.profile
    info = {k: prof.model.get(k) for k in ("spec", "batch_size", "seq_len", "dtype") if prof.model.get(k) is not None}
    info["num_layers"] = prof.num_layers
    return Plan(decisions=decisions, fingerprint=prof.model.get("fingerprint"), model=info, groups=groups)
