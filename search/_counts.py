"""The counts program: the cross-layer MILP for repeated layers, written over option counts.

When the layers between the first and the last share one menu (``_menu.py``), which of them takes
which option only matters through their order. The program forgets that order: ``n_k`` = number
of middle layers taking option ``k`` (integer, ``sum_k n_k = L - 2``), plus one-hot ``top_k`` /
``bot_k`` over the last layer's (first in backward) and the first layer's own menus. Its rows are
valid for every order of the middle layers (Note: [counts relaxation]), so its optimum is a true
lower bound on the simulator's step time over the menu space (one option per layer, any order).
``k`` = micro-batches in flight, ``H`` = the layers' held bytes, times in ms, bytes in MiB:

* ``pending``:       P >= rate (start_1 + Y - T_f): bytes still queued for the host when backward
  starts (copies out run back to back from then on; ``Y`` = total copy-out time);
* ``memory_post``:   k H + P + top's reloads issued at backward start <= cap - held(post) - boundary
  - grads(post) - temp(post);
* ``memory_top``:    k H + top (transient + swapped) <= cap - grads(top layer .. post) - temp(top);
* ``memory_bottom``: (k-1) H + bot (held + transient + swapped) <= cap - grads(all) - temp(bottom)
  (temp: with resident gradients, a new gradient before its accumulation, ``StepModel.grad_temp``);
  (reloads of other layers in flight only add memory: leaving them out relaxes);
* ``on_demand``:     stall >= sum_{k: d_k = 0} n_k h2d_k  (each on-demand reload waits its copy);
* ``top_lead`` / ``top_after_d2h``: the top layer's reloads start at backward start, after every
  copy out, and must land by their need in its backward;
* ``fifo`` / ``fifo_after_d2h``: every reload runs on the one copy stream after the start of
  backward and after every copy out, and lands before the layers' backward ends.

A plan is made from an integer solution by placing ``bot`` first, ``top`` last and the middle
layers in a few layouts (options interleaved at three phases; interleaved with the top m layers
swapping nothing, m = 2..32; held ascending / descending); each is simulated and the best within
the budget kept. A candidate none of whose layouts fits takes ``tau`` MiB off the memory rows
(its least excess, then bisection between too little and enough); a candidate whose layouts all
stall more than predicted charges its swap options the unseen stall. The loop stops when the best
simulated plan is within ``rel_gap`` of the bound, at ``time_limit``, or when candidates repeat.
Only the first (untightened, uncharged) program gives the bound: max(its LP optimum, its integer
program's dual bound).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ._menu import Option, assign
from ._model import StepModel
from ._simulator import Assignment, simulate_assignment
from ._solver import Problem

__all__ = ["CountsResult", "identical_layers", "solve_counts"]

log = logging.getLogger(__name__)

MIB = float(1 << 20)
MS = 1e3


@dataclass
class CountsResult:
    best: tuple[float, Assignment] | None
    """Best simulated plan within the budget (step seconds, assignment), or None."""
    bound: float
    """Lower bound (seconds) on every plan of the menu space; +inf: no plan of it fits."""
    rounds: int


def identical_layers(model: StepModel, menus: dict[int, list[Option]]) -> bool:
    """Whether the layers between the first and the last share one menu (``layer_menu``'s cache)."""
    layers = list(model.layer_positions)
    return len(layers) >= 3 and all(model.positions[p] for p in layers) and all(
        menus[p] is menus[layers[1]] for p in layers[1:-1])


class _Counts:
    """Columns: n_k (middle layers), top_k, bot_k, stall; times in ms, bytes in MiB."""

    def __init__(self, problem: Problem, menus: tuple[list[Option], list[Option], list[Option]]) -> None:
        model = problem.model
        self.model, self.k_in = model, problem.in_flight
        self.menu, self.top_menu, self.bot_menu = menus
        n = self.n = model.num_layers
        assert n >= 3
        K, KT, KB = self.K, self.KT, self.KB = len(self.menu), len(self.top_menu), len(self.bot_menu)
        self.nvars = K + KT + KB + 2
        ncol, tcol, bcol, s = np.arange(K), K + np.arange(KT), K + KT + np.arange(KB), K + KT + KB
        self.cols = (ncol, tcol, bcol)
        self.layers = slice(0, K + KT + KB)
        self.menus = menus
        self._A: list[np.ndarray] = []
        self._lb: list[float] = []
        self._ub: list[float] = []
        self.names: list[str] = []
        self.row("layers", [(ncol, 1.0)], n - 2, n - 2)
        self.row("one_top", [(tcol, 1.0)], 1, 1)
        self.row("one_bottom", [(bcol, 1.0)], 1, 1)
        first = model.units[model.positions[1][0]]
        start1 = (first.fwd_end - first.fwd) * MS  # the first layer's forward start
        self._memory_rows(problem.budget, start1)
        self._time_rows(start1)
        self.A, self.lb, self.ub = np.array(self._A), np.array(self._lb), np.array(self._ub)
        replay = self.vec("replay", MS)
        self.c = np.zeros(self.nvars)
        self.c[self.layers] = replay
        self.c[s] = 1.0
        self.swapped = self.vec("swapped") > 0
        self.const = model.forward_time + model.backward_time + model.other_time
        self.integrality = np.ones(self.nvars)
        self.integrality[s:] = 0
        self.upper = np.concatenate([np.full(K, n - 2), np.ones(KT + KB), [np.inf, np.inf]])

    def vec(self, attr: str, scale: float = 1.0) -> np.ndarray:
        """One quantity of every option, in column order."""
        return np.concatenate([[getattr(o, attr) * scale for o in m] for m in self.menus])

    def row(self, name: str, coefs: list, lo: float, hi: float) -> None:
        v = np.zeros(self.nvars)
        for cols, vals in coefs:
            v[cols] += vals
        self._A.append(v)
        self._lb.append(lo)
        self._ub.append(hi)
        self.names.append(name)

    def _memory_rows(self, budget: int, start1: float) -> None:
        """``pending`` and the three memory rows of the module docstring."""
        model, n, k, lay = self.model, self.n, self.k_in, self.layers
        _, tcol, bcol = self.cols
        pcol = self.nvars - 1
        pre, post = 0, n + 1
        units = model.units
        held_pre = sum(units[i].saved for i in model.positions[pre])
        held_post = sum(units[i].saved for i in model.positions[post])
        cap = (budget - model.base - (k - 1) * (held_pre + held_post) - held_pre) / MIB + 1e-6
        held = self.vec("held", 1 / MIB)
        peak = np.concatenate([[(o.transient + o.swapped) / MIB for o in m] for m in self.menus])
        grads = lambda lo: sum(model.grads[q] for q in range(lo, post + 1)) / MIB  # noqa: E731
        d2h, tf = self.vec("d2h", MS), model.forward_time * MS
        rate = model.hardware.d2h_bandwidth / MIB / MS  # MiB per ms
        issued = np.array([o.swapped / MIB if o.swapped and o.d >= 1 else 0.0 for o in self.top_menu])
        # pending: bytes still queued for the host at the end of the forward (P >= rate (start1 + Y - T_f))
        self.row("pending", [(pcol, 1.0), (lay, -rate * d2h)], rate * (start1 - tf), np.inf)
        self.memory_rows = [len(self._A), len(self._A) + 1, len(self._A) + 2]
        temp = [v / MIB for v in (model.grad_temp or [0] * (n + 2))]
        self.row("memory_post", [(lay, k * held), (pcol, 1.0), (tcol, issued)], -np.inf,
                 cap - (held_post + model.boundary + model.grads[post]) / MIB - temp[post])
        self.row("memory_top", [(lay, k * held), (tcol, peak[tcol])], -np.inf, cap - grads(n) - temp[n])
        self.row("memory_bottom", [(lay, (k - 1) * held), (bcol, held[bcol] + peak[bcol])], -np.inf,
                 cap - grads(1) - temp[1])

    def _time_rows(self, start1: float) -> None:
        """``on_demand``, ``top_lead`` / ``top_after_d2h`` and ``fifo`` / ``fifo_after_d2h`` of the module
        docstring."""
        model, lay, s = self.model, self.layers, self.nvars - 2
        _, tcol, _ = self.cols
        post = self.n + 1
        bwd = [sum(model.units[i].bwd for i in model.positions[q]) for q in range(self.n + 2)]
        d2h, h2d, replay = self.vec("d2h", MS), self.vec("h2d", MS), self.vec("replay", MS)
        tf = model.forward_time * MS
        on_demand = np.concatenate([[o.h2d * MS if o.swapped and o.d == 0 else 0.0 for o in m] for m in self.menus])
        self.row("on_demand", [(s, 1.0), (lay, -on_demand)], 0, np.inf)
        avail = (bwd[post] + sum(bwd[1:post])) * MS
        # top layer: its reloads go after every copy out, and its backward waits for them after post's
        lead = np.array([o.lead * MS if o.swapped else 0.0 for o in self.top_menu])
        self.row("top_lead", [(s, 1.0), (tcol, -lead)], -bwd[post] * MS, np.inf)
        self.row("top_after_d2h", [(s, 1.0), (tcol, -lead), (lay, -d2h)], start1 - tf - bwd[post] * MS, np.inf)
        self.row("fifo", [(s, 1.0), (lay, replay - h2d)], -avail, np.inf)
        self.row("fifo_after_d2h", [(s, 1.0), (lay, replay - h2d - d2h)], start1 - model.forward_time * MS - avail,
                 np.inf)

    def solve(self, *, c: np.ndarray | None = None, ub: np.ndarray | None = None, integral: bool = True,
              time_limit: float = 1.0, gap: float = 1e-4):
        cons = LinearConstraint(self.A, self.lb, self.ub if ub is None else ub)
        return milp(self.c if c is None else c, constraints=[cons], bounds=Bounds(np.zeros(self.nvars), self.upper),
                    integrality=self.integrality if integral else np.zeros(self.nvars),
                    options={"time_limit": max(time_limit, 0.05), "mip_rel_gap": gap})

    def decode(self, x: np.ndarray) -> tuple[tuple[int, ...], int, int]:
        ncol, tcol, bcol = self.cols
        counts = tuple(int(round(v)) for v in x[ncol])
        return counts, int(np.argmax(x[tcol])), int(np.argmax(x[bcol]))

    def orders(self, counts: tuple[int, ...]) -> list[list[int]]:
        """Middle layers' options (bottom first) in a few placements."""
        held = [o.held for o in self.menu]
        asc = [j for j in sorted(range(self.K), key=lambda j: held[j]) for _ in range(counts[j])]
        used = [j for j in range(self.K) if counts[j]]
        spreads = [[j for _, j in sorted(((i + phase) / counts[j], j) for j in used for i in range(counts[j]))]
                   for phase in (0.5, 0.0, 1.0)]
        calm = [self._calm_top(spreads[0], m) for m in (2, 4, 8, 12, 16, 24, 32)]
        out = []
        for mid in (*spreads, *calm, asc):
            if mid not in out:
                out.append(mid)
        return out

    def _calm_top(self, mid: list[int], m: int) -> list[int]:
        """``mid`` with its top ``m`` layers swapping nothing where possible (no copies queued or reloads
        issued around the start of backward)."""
        mid = list(mid)
        swapped = [self.menu[j].swapped > 0 for j in mid]
        for pos in range(len(mid) - 1, max(-1, len(mid) - 1 - m), -1):
            if not swapped[pos]:
                continue
            below = next((q for q in range(pos - 1, -1, -1) if not swapped[q]), None)
            if below is None:
                break
            mid[pos], mid[below] = mid[below], mid[pos]
            swapped[pos], swapped[below] = False, True
        return mid

    def assignment(self, mid: list[int], top: int, bot: int) -> Assignment:
        options = [self.bot_menu[bot]] + [self.menu[j] for j in mid] + [self.top_menu[top]]
        return assign(self.model, zip(self.model.layer_positions, options))


def _undominated(menu: list[Option]) -> list[Option]:
    """The middle layers' options no other option beats in every quantity the counts rows read.

    Dropping a dominated column leaves the program's optimum (the bound) unchanged: held, peak,
    copy times and on-demand reloads only tighten rows, and a lower replay lowers the objective by
    at least what it can loosen the FIFO rows.
    """
    def key(o: Option) -> tuple:
        return (o.held, o.transient + o.swapped, o.replay, o.h2d, o.d2h, o.h2d if o.swapped and o.d == 0 else 0.0)

    keys = [key(o) for o in menu]
    out = []
    for j, kj in enumerate(keys):
        if not any(i != j and all(a <= b for a, b in zip(ki, kj)) and (ki != kj or i < j)
                   for i, ki in enumerate(keys)):
            out.append(menu[j])
    return out


@dataclass
class _Tightening:
    """MiB taken off the memory rows: the last (``tau``), the largest found too loose, the smallest found enough."""

    tau: float = 0.0
    over: float | None = None
    ok: float | None = None

    def record(self, state: str) -> None:
        if state == "over":
            self.over = self.tau if self.over is None else max(self.over, self.tau)
        elif state == "ok":
            self.ok = self.tau if self.ok is None else min(self.ok, self.tau)

    def advance(self, state: str, excess: float) -> None:
        if state == "slow":
            return  # the charged costs move the program
        if self.ok is None:
            self.tau = self.over + max(excess, 1.0)
        elif self.over is not None and self.ok - self.over > 16.0:
            self.tau = (self.over + self.ok) / 2  # bisect the tightening between too loose and enough


def _simulate_layouts(prog: _Counts, problem: Problem, x: np.ndarray, c: np.ndarray, predicted: float,
                      rel_gap: float, best: tuple[float, Assignment] | None
                      ) -> tuple[tuple[str, float], tuple[float, Assignment] | None]:
    """Simulate the layouts of one integer solution ``x``: its verdict (state, excess MiB) and the best plan
    within the budget so far. A solution whose layouts all stall more than predicted charges its swap options
    in ``c`` the unseen stall."""
    counts, top, bot = prog.decode(x)
    good, over, fastest, fits = False, [], np.inf, False
    for mid in prog.orders(counts):
        asg = prog.assignment(mid, top, bot)
        sim = simulate_assignment(problem.model, asg, in_flight=problem.in_flight)
        fastest = min(fastest, sim.step_time)
        close = sim.step_time <= predicted * (1 + rel_gap) + 1e-12  # a layout as fast as the program says
        if sim.peak_bytes <= problem.budget:
            if best is None or sim.step_time < best[0]:
                best = (sim.step_time, asg)
            good, fits = good or close, True
        else:
            over.append(((not close), (sim.peak_bytes - problem.budget) / MIB))
    # ok: a layout as fast as predicted fits; over: none fits, tighten by the least excess (of the
    # layouts as fast as predicted first); slow: only slower layouts fit
    verdict = ("ok" if good else "slow" if fits else "over", min(over, default=(0, 0.0))[1])
    unseen = fastest - predicted
    swaps = np.flatnonzero(np.round(x[prog.layers]) * prog.swapped)
    if not good and unseen > 1e-9 and len(swaps):
        # every layout stalls more than the rows see: charge the swap options that stall
        c[swaps] += unseen * MS / float(np.round(x[swaps]).sum())
    return verdict, best


def solve_counts(problem: Problem, menus: tuple[list[Option], list[Option], list[Option]], *, rel_gap: float,
                 time_limit: float, incumbent: tuple[float, Assignment] | None = None) -> CountsResult:
    """Bound + best simulated plan; ``menus`` = (middle layers' shared menu, top layer's, bottom layer's)."""
    start = time.perf_counter()
    prog = _Counts(problem, (_undominated(menus[0]), menus[1], menus[2]))
    # Note: [counts relaxation] the first solve is a relaxation of the per-layer program over every
    # order of the middle layers: its optimum is the reported bound (tests/test_milp_counts.py).
    lp = prog.solve(integral=False)
    if lp.x is None:
        return CountsResult(None, np.inf, 1)
    res = prog.solve(time_limit=min(time_limit / 3, 0.4), gap=1e-3)
    if res.x is None:
        if res.status == 2 or "infeasible" in str(res.message).lower():
            return CountsResult(None, np.inf, 1)
        return CountsResult(incumbent, prog.const + lp.fun / MS, 1)
    dual = getattr(res, "mip_dual_bound", None)
    bound = prog.const + max(lp.fun, dual if dual is not None and np.isfinite(dual) else lp.fun) / MS
    best = incumbent
    c = prog.c.copy()
    rounds, repeats = 1, 0
    tight = _Tightening()
    seen: dict = {}
    while True:
        key = prog.decode(res.x)
        if key in seen:
            repeats += 1
        else:
            repeats = 0
            predicted = prog.const + float(c @ res.x) / MS
            log.debug("counts round %d (tighten %.0f MiB): %s top %d bot %d, predicted %.6f", rounds, tight.tau,
                      {j: v for j, v in enumerate(key[0]) if v}, key[1], key[2], predicted)
            seen[key], best = _simulate_layouts(prog, problem, res.x, c, predicted, rel_gap, best)
        state, excess = seen[key]
        tight.record(state)
        if best is not None and best[0] <= bound * (1 + rel_gap) + 1e-12:
            break
        remaining = time_limit - (time.perf_counter() - start)
        if remaining <= 0.05 or rounds >= 40 or repeats >= 3:
            break
        tight.advance(state, excess)
        ub = prog.ub.copy()
        ub[prog.memory_rows] -= tight.tau
        res = prog.solve(c=c, ub=ub, time_limit=min(remaining, 0.2), gap=2e-3)
        rounds += 1
        if res.x is None:
            if tight.ok is None:
                break  # tightened past every plan
            tight.over, tight.tau = None, tight.ok  # back to the last tightening that worked
            res = prog.solve(c=c, ub=prog.ub - np.isin(np.arange(len(prog.ub)), prog.memory_rows) * tight.tau,
                             time_limit=min(remaining, 0.2), gap=2e-3)
            if res.x is None:
                break
    log.debug("milp counts: %d rounds, bound %.6f s, best %s", rounds, bound, None if best is None else best[0])
    return CountsResult(best, bound, rounds)
