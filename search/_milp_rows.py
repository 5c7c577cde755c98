"""The ``milp`` program's (``_milp_model.py``) column layout (:class:`Columns`) and sparse rows (:class:`Rows`); its
constraint groups are in ``_milp_groups.py``.

Units: MiB for bytes, milliseconds for time (keeps HiGHS' tolerances meaningful). ``k`` = micro-batches in
flight, ``C_p`` = held bytes of layers <= p, ``S``/``X``/``Y`` = suffix sums of replay + stall, reload and copy-out
times, ``D`` = end of the last device->host copy, ``E_p`` = end of the copies out of layers <= p, ``P_p`` = bytes
not yet copied out at p's forward end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import LinearConstraint
from scipy.sparse import coo_matrix

from ._menu import Option, exact_menus, layer_menu
from ._model import StepModel
from ._solver import Problem

__all__ = ["MIB", "MS", "WINDOW", "Columns", "Rows"]

MIB = float(1 << 20)
MS = 1e3
WINDOW = 16
"""Layers ahead whose queued reloads the window rows account for."""


class Rows:
    """Sparse constraint rows, kept in named groups for the log."""

    def __init__(self, nvars: int) -> None:
        self.nvars = nvars
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.groups: dict[str, int] = {}
        self.rows_of: dict[str, list[int]] = {}

    def add(self, group: str, coefs: dict[int, float], lb: float, ub: float) -> None:
        row = len(self.lb)
        for col, val in coefs.items():
            if val:
                self.r.append(row)
                self.c.append(col)
                self.v.append(val)
        self.lb.append(lb)
        self.ub.append(ub)
        self.groups[group] = self.groups.get(group, 0) + 1
        self.rows_of.setdefault(group, []).append(row)

    def tighten_memory(self, mib: float) -> None:
        """Lower the right-hand side of every memory row (the safety margin of the repeated-layer path)."""
        for group, rows in self.rows_of.items():
            if group.startswith("memory"):
                for r in rows:
                    if np.isfinite(self.ub[r]) and self.lb[r] == -np.inf:
                        self.ub[r] -= mib

    def constraint(self) -> LinearConstraint:
        a = coo_matrix((self.v, (self.r, self.c)), shape=(len(self.lb), self.nvars)).tocsr()
        return LinearConstraint(a, np.array(self.lb), np.array(self.ub))


@dataclass
class Columns:
    """The program's variables (one binary per (layer, option), then the continuous ones), its rows so far and
    what the groups read of the problem."""

    model: StepModel
    k_in: int
    menus: dict[int, list[Option]]
    layers: list[int]
    zcol: dict[int, int]
    nz: int
    stall: dict[int, int]
    suf_s: dict[int, int]
    suf_x: dict[int, int]
    suf_y: dict[int, int]
    cum: dict[int, int]
    dend: int
    queue: dict[int, int]
    pend: dict[int, int]
    pend_post: int
    nvars: int
    rows: Rows
    cap: float
    """MiB the layers' memory rows may use: the budget less static memory and the positions outside the layers."""

    @classmethod
    def layout(cls, problem: Problem, prefetch: tuple[int, ...], limit: int) -> "Columns":
        model = problem.model
        n = model.num_layers
        layers = list(model.layer_positions)
        cache: dict = {}
        exact = exact_menus(model, prefetch)
        menus = {p: layer_menu(model, p, prefetch=prefetch, limit=limit, cache=cache, exact=exact) for p in layers}
        col = 0
        zcol: dict[int, int] = {}
        for p in layers:
            zcol[p] = col
            col += len(menus[p])
        nz = col
        dend = nz + 5 * n                                           # D = end of the last device->host copy
        pend_post = dend + 1 + 2 * n                                # P at the end of the forward
        units = model.units
        held_pre, held_post = (sum(units[i].saved for i in model.positions[q]) for q in (0, n + 1))
        k_in = problem.in_flight
        cap = (problem.budget - model.base - (k_in - 1) * (held_pre + held_post) - held_pre) / MIB
        cap += 1e-6  # HiGHS feasibility tolerance; the simulator has the last word
        block = lambda first: {p: first + j for j, p in enumerate(layers)}  # noqa: E731
        return cls(model=model, k_in=k_in, menus=menus, layers=layers, zcol=zcol, nz=nz,
                   stall=block(nz), suf_s=block(nz + n),     # S_p = sum_{q>=p} (replay_q + stall_q)
                   suf_x=block(nz + 2 * n),                   # X_p = sum_{q>=p} h2d_q
                   suf_y=block(nz + 3 * n),                   # Y_p = sum_{q>=p} d2h_q
                   cum=block(nz + 4 * n),                     # C_p = sum_{q<=p} held_q
                   dend=dend, queue=block(dend + 1),          # E_p = end of the copies out of layers <= p
                   pend=block(dend + 1 + n),                  # P_p = bytes not yet copied out at p's forward end
                   pend_post=pend_post, nvars=pend_post + 1, rows=Rows(pend_post + 1), cap=cap)

    @property
    def post(self) -> int:
        return self.model.num_layers + 1

    @property
    def last(self) -> int | None:
        return self.layers[-1] if self.layers else None

    def z(self, p: int) -> list[tuple[int, Option]]:
        return [(self.zcol[p] + k, o) for k, o in enumerate(self.menus[p])]

    def bwd(self, q: int) -> float:
        return sum(self.model.units[i].bwd for i in self.model.positions[q])

    def temp(self, q: int) -> int:
        """A gradient before its accumulation (resident gradients: ``StepModel.grad_temp``), 0 without."""
        return self.model.grad_temp[q] if self.model.grad_temp else 0

    def layer_start(self, q: int) -> float:
        first = self.model.units[self.model.positions[q][0]] if self.model.positions[q] else None
        return (first.fwd_end - first.fwd) if first else 0.0
