"""The certificate of ``milp``: lower bounds on the step time of any plan of its menu space, and the gap.

Bounds come from the LP relaxation (repeated-layer path), from HiGHS' dual bound of each integer
solve, from a time-limited polish on the whole menu, and from the counts program (``_counts.py``).
"""

from __future__ import annotations

import numpy as np

from ._milp_model import MS, Program
from ._milp_solve import extract, full_ub, run_highs
from ._simulator import Assignment
from ._solver import Problem

__all__ = ["certified", "gap", "lp_support", "mip_dual", "polish", "round_bound"]


def lp_support(prog: Program) -> tuple[float, np.ndarray] | None:
    """The LP relaxation: (its bound in seconds, upper bounds that open only the options its solution
    uses); None when even the relaxation admits no plan under the budget."""
    ub = full_ub(prog)
    res = run_highs(prog, ub, relax=True)
    if res.x is None:
        return None
    lp_bound = prog.const + res.fun / MS
    for p in prog.menus:
        z = res.x[prog.zcol[p]:prog.zcol[p] + len(prog.menus[p])]
        ub[prog.zcol[p]:prog.zcol[p] + len(z)] = (z > 1e-7).astype(float)
    return lp_bound, ub


def mip_dual(res) -> float | None:
    """HiGHS' proven dual bound of an integer solve (program units), None when it has none."""
    dual = getattr(res, "mip_dual_bound", None)
    return dual if dual is not None and np.isfinite(dual) else None


def round_bound(prog: Program, res) -> float:
    """Seconds no plan of the program's (current) space beats: the dual bound, else the optimum found."""
    dual = mip_dual(res)
    return prog.const + (dual if dual is not None else res.fun) / MS


def polish(problem: Problem, prog: Program, best: tuple[float, Assignment], bound: float, *, rel_gap: float,
           time_limit: float) -> tuple[tuple[float, Assignment], float]:
    """Close the gap on the whole menu for a bounded time: better plan and/or better bound."""
    res = run_highs(prog, full_ub(prog), time_limit=time_limit, mip_rel_gap=rel_gap / 2)
    dual = mip_dual(res)
    if dual is not None:
        bound = max(bound, prog.const + dual / MS)
    if res.x is not None:
        _, asg, sim = extract(problem, prog, res.x)
        if sim.peak_bytes <= problem.budget and sim.step_time < best[0]:
            best = (sim.step_time, asg)
    return best, bound


def certified(step_time: float, bound: float, counts_bound: float | None = None) -> float:
    """The lower bound reported with a plan of ``step_time``: the best bound (the counts program's holds
    for this menu space too), never above the plan itself."""
    if counts_bound is not None:
        bound = max(bound, counts_bound) if np.isfinite(bound) else counts_bound
    return min(step_time, bound) if np.isfinite(bound) else step_time


def gap(step_time: float, lower: float) -> float:
    return (step_time - lower) / step_time
