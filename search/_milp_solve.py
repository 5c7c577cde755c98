"""One HiGHS solve of the ``milp`` program (``_milp_model.py``) and the plan read back from it."""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.optimize import Bounds, milp

from ._menu import Option, assign
from ._milp_model import Program
from ._simulator import Assignment, simulate_assignment
from ._solver import Problem
from ._timeline import Simulation

__all__ = ["assignment", "choice_of", "extract", "full_ub", "run_highs"]


def full_ub(prog: Program) -> np.ndarray:
    """Upper bounds that leave every option of every menu open (1 for binaries, inf otherwise)."""
    return np.where(prog.integrality == 1, 1.0, np.inf)


def run_highs(prog: Program, ub: np.ndarray, *, relax: bool = False, **options: Any):
    """scipy's ``milp`` (HiGHS) on ``prog`` under the variable bounds ``0 <= x <= ub``
    (``relax``: the LP relaxation); returns scipy's result."""
    return milp(prog.c, constraints=[prog.rows.constraint()],
                integrality=np.zeros_like(prog.c) if relax else prog.integrality,
                bounds=Bounds(np.zeros_like(ub), ub), options=options or None)


def choice_of(prog: Program, x: np.ndarray) -> dict[int, int]:
    """Layer position -> index of the option the solution picks."""
    return {p: int(np.argmax(x[prog.zcol[p]:prog.zcol[p] + len(prog.menus[p])])) for p in prog.menus}


def assignment(model, menus: dict[int, list[Option]], choice: dict[int, int]) -> Assignment:
    return assign(model, ((p, menus[p][k]) for p, k in choice.items()))


def extract(problem: Problem, prog: Program, x: np.ndarray) -> tuple[dict[int, int], Assignment, Simulation]:
    """The solution's choice, its plan, and the simulator's verdict on that plan."""
    choice = choice_of(prog, x)
    asg = assignment(problem.model, prog.menus, choice)
    return choice, asg, simulate_assignment(problem.model, asg, in_flight=problem.in_flight)
