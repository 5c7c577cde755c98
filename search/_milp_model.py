"""The cross-layer program of ``milp`` (``_milp.py``): its variables and named constraint groups.

Variables: one binary per (layer, menu option), then continuous suffix / prefix sums, stalls and
copy-queue times. Memory rows are the simulator's segment-end events, exactly; the time rows bound
the stalls of the single copy stream from below. Each group's equation is written above it.

Units: MiB for bytes, milliseconds for time (keeps HiGHS' tolerances meaningful).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from ._menu import Option
from ._milp_groups import GROUPS
from ._milp_rows import MIB, MS, WINDOW, Columns, Rows
from ._solver import Problem

__all__ = ["MIB", "MS", "WINDOW", "Program", "Rows", "build_program"]

log = logging.getLogger("search._milp")


@dataclass
class Program:
    menus: dict[int, list[Option]]
    """Layer position -> options."""
    zcol: dict[int, int]
    """Layer position -> column of its first option variable."""
    rows: Rows
    c: np.ndarray
    integrality: np.ndarray
    const: float
    """Seconds added to the objective (forward, backward, other)."""
    cuts: list[dict[int, float]] = field(default_factory=list)


def build_program(problem: Problem, prefetch: tuple[int, ...], limit: int) -> Program:
    """The per-layer program over the layer menus: one binary per (layer, option), the rest continuous; its rows
    are the constraint groups of ``_milp_groups.py``, each with its equation."""
    model = problem.model
    cx = Columns.layout(problem, prefetch, limit)
    for group in GROUPS:
        group(cx)
    c = np.zeros(cx.nvars)
    if cx.layers:
        c[cx.suf_s[cx.layers[0]]] = 1.0  # objective: S_1 = total replay + total stall (ms)
    integrality = np.zeros(cx.nvars)
    integrality[:cx.nz] = 1
    const = model.forward_time + model.backward_time + model.other_time
    log.debug("milp: %d variables (%d binary), rows %s", cx.nvars, cx.nz, cx.rows.groups)
    return Program(cx.menus, cx.zcol, cx.rows, c, integrality, const)
