"""``milp``: the cross-layer mixed-integer program over per-layer menus, on scipy's HiGHS.

Each layer picks one option of its menu (``_menu.py``: keep / recompute / swap per unit plus a
prefetch distance). Memory rows are the simulator's segment-end events, exactly; the time rows
bound the stalls of the single copy stream from below (a relaxation: exact where copies do not
queue behind each other). Every candidate the program returns is simulated; a candidate whose
simulated cost differs from the program's is cut off (no-good cut) and the program re-solved,
until the best simulated plan is within ``rel_gap`` of the program's bound. So the result is the
simulator's optimum over the menu space, with a proven bound and gap.

Repeated layers (heuristic menus, the layers between the first and the last alike) go to the
counts program first (``_counts.py``: option counts instead of per-layer binaries, a bound valid
for every order of the layers); this per-layer program decides only when that finds no plan.

Units: MiB for bytes, milliseconds for time (keeps HiGHS' tolerances meaningful).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from ._counts import identical_layers, solve_counts
from ._menu import Option, exact_menus, layer_menu
from ._plan import Action
from ._simulator import Assignment, simulate_assignment
from ._solver import InfeasibleBudgetError, Problem, Solver, fmt_bytes, register_solver

__all__ = ["MilpSolver"]

log = logging.getLogger(__name__)

MIB = float(1 << 20)
MS = 1e3
WINDOW = 16
"""Layers ahead whose queued reloads the window rows account for."""


class _Rows:
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
class _Program:
    menus: dict[int, list[Option]]
    """Layer position -> options."""
    zcol: dict[int, int]
    """Layer position -> column of its first option variable."""
    rows: _Rows
    c: np.ndarray
    integrality: np.ndarray
    const: float
    """Seconds added to the objective (forward, backward, other)."""
    cuts: list[dict[int, float]] = field(default_factory=list)


def _build(problem: Problem, prefetch: tuple[int, ...], limit: int) -> _Program:
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
    stall = {p: nz + j for j, p in enumerate(layers)}
    suf_s = {p: nz + n + j for j, p in enumerate(layers)}      # S_p = sum_{q>=p} (replay_q + stall_q)
    suf_x = {p: nz + 2 * n + j for j, p in enumerate(layers)}  # X_p = sum_{q>=p} h2d_q
    suf_y = {p: nz + 3 * n + j for j, p in enumerate(layers)}  # Y_p = sum_{q>=p} d2h_q
    cum = {p: nz + 4 * n + j for j, p in enumerate(layers)}    # C_p = sum_{q<=p} held_q
    dend = nz + 5 * n                                          # D = end of the last device->host copy
    queue = {p: dend + 1 + j for j, p in enumerate(layers)}    # E_p = end of the copies out of layers <= p
    pend = {p: dend + 1 + n + j for j, p in enumerate(layers)}  # P_p = bytes not yet copied out at p's forward end
    pend_post = dend + 1 + 2 * n                               # ... at the end of the forward
    nvars = pend_post + 1
    rows = _Rows(nvars)

    def z(p: int) -> list[tuple[int, Option]]:
        return [(zcol[p] + k, o) for k, o in enumerate(menus[p])]

    pre, post = 0, n + 1
    units = model.units
    held_fixed = {q: sum(units[i].saved for i in model.positions[q]) for q in (pre, post)}
    bwd = {q: sum(units[i].bwd for i in model.positions[q]) for q in range(n + 2)}
    k_in = problem.in_flight
    cap = (problem.budget - model.base - (k_in - 1) * (held_fixed[pre] + held_fixed[post]) - held_fixed[pre]) / MIB
    cap += 1e-6  # HiGHS feasibility tolerance; the simulator has the last word

    # one_option:   sum_k z[p,k] = 1
    for p in layers:
        rows.add("one_option", {j: 1.0 for j, _ in z(p)}, 1, 1)
    # prefix_held:  C_p - C_{p-1} - sum_k held_k z[p,k] = 0
    for p in layers:
        coefs = {cum[p]: 1.0, **{j: -o.held / MIB for j, o in z(p)}}
        if p - 1 in cum:
            coefs[cum[p - 1]] = -1.0
        rows.add("prefix_held", coefs, 0, 0)
    # suffix sums:  S_p - S_{p+1} - sum_k replay_k z - stall_p = 0;  X_p, Y_p likewise with h2d, d2h
    for p in layers:
        nxt = p + 1 if p + 1 in suf_s else None
        for var, attr, extra in ((suf_s, "replay", True), (suf_x, "h2d", False), (suf_y, "d2h", False)):
            coefs = {var[p]: 1.0, **{j: -getattr(o, attr) * MS for j, o in z(p)}}
            if nxt is not None:
                coefs[var[nxt]] = -1.0
            if extra:
                coefs[stall[p]] = -1.0
            rows.add(f"suffix_{attr}", coefs, 0, 0)
    # memory_layer: at the end of layer L's backward, before its release:
    #   (k-1) C_n + C_L + sum_k (transient_k + swapped_k) z[L,k]
    #   + sum_{l<L} sum_{k: d_k >= L-l, swap} swapped_k z[l,k]   (reloads already issued)   <= cap
    last = layers[-1] if layers else None
    for L in layers:
        coefs: dict[int, float] = {cum[L]: 1.0}
        if k_in > 1:
            coefs[cum[last]] = coefs.get(cum[last], 0.0) + (k_in - 1)
        for j, o in z(L):
            coefs[j] = (o.transient + o.swapped) / MIB
        for l in layers:
            if l >= L:
                break
            for j, o in z(l):
                if o.swapped and o.d >= 1 and o.d >= L - l:
                    coefs[j] = coefs.get(j, 0.0) + o.swapped / MIB
        grads_so_far = sum(model.grads[q] for q in range(L, post + 1)) / MIB  # gradients of L and above exist
        rows.add("memory_layer", coefs, -np.inf, cap - grads_so_far)
    # memory_post:  k C_n + sum_{l,k: d_k>=1, l+d_k >= post} swapped_k z[l,k] <= cap - held_post - boundary
    if layers:
        coefs = {cum[last]: float(k_in), pend_post: 1.0}
        for l in layers:
            for j, o in z(l):
                if o.swapped and o.d >= 1 and l + o.d >= post:
                    coefs[j] = o.swapped / MIB
        rows.add("memory_post", coefs, -np.inf, cap - (held_fixed[post] + model.boundary + model.grads[post]) / MIB)

    # memory_forward: after the forward of unit v of position L (layer or post), with copies to host
    # still running (a copy of u cannot end before its in-layer chain  c_u = max(c_prev, fe_u) + d2h_u):
    #   (k-1) C_n + C_{L-1} + prefix_{k,v} z[L,k] + sum_{l<=L} sum_k pending_{k}(fe_v) z[l,k] <= cap
    chains: dict[int, list[list[tuple[float, float, int]]]] = {}
    for p in layers:
        per = []
        for o in menus[p]:
            chain, c_prev = [], 0.0
            for m, a in enumerate(o.acts):
                if a is Action.SWAP:
                    u = units[model.positions[p][m]]
                    c_prev = max(c_prev, u.fwd_end) + model.d2h(u.saved)
                    chain.append((u.fwd_end, c_prev, u.saved))
            per.append(chain)
        chains[p] = per
    latest = {p: max((c for chain in chains[p] for _, c, _ in chain), default=0.0) for p in layers}
    for L in layers + ([post] if model.positions[post] else []):
        for m, v in enumerate(model.positions[L]):
            t_v = units[v].fwd_end
            coefs = {}
            if k_in > 1:
                coefs[cum[last]] = float(k_in - 1)
            prev = L - 1 if L != post else last
            if prev in cum:
                coefs[cum[prev]] = coefs.get(cum[prev], 0.0) + 1.0
            rhs = cap
            if L == post:
                rhs -= sum(units[i].saved for i in model.positions[post][:m + 1]) / MIB
            for l in layers:
                if l > L:
                    break
                if l != L and latest[l] <= t_v:
                    continue
                for k, chain in enumerate(chains[l]):
                    val = sum(b for fe, c, b in chain if fe <= t_v < c)
                    if l == L:
                        val += menus[L][k].prefix[m]
                    if val:
                        coefs[zcol[l] + k] = coefs.get(zcol[l] + k, 0.0) + val / MIB
            rows.add("memory_forward", coefs, -np.inf, rhs)

    bwd_above = {L: bwd[post] + sum(bwd[q] for q in layers if q > L) for L in layers}
    # on_demand:    stall_L >= sum_{k: d_k = 0} h2d_k z[L,k]      (each on-demand reload waits its copy)
    for L in layers:
        rows.add("on_demand", {stall[L]: 1.0, **{j: -o.h2d * MS for j, o in z(L) if o.swapped and o.d == 0}},
                 0, np.inf)
    # issue:  reloads issued when backward starts position I = min(L+d, post) land before their needs:
    #   (S_{L+1} - S_{I+1}) + sum_{L<r<=I} bwd_r + stall_L >= sum_{k: d_k = d} lead_k z[L,k]
    for L in layers:
        for d in sorted({o.d for o in menus[L] if o.swapped and o.d >= 1}):
            issue = min(L + d, post)
            coefs = {stall[L]: 1.0}
            if L + 1 in suf_s:
                coefs[suf_s[L + 1]] = 1.0
            if issue + 1 in suf_s:
                coefs[suf_s[issue + 1]] = coefs.get(suf_s[issue + 1], 0.0) - 1.0
            for j, o in z(L):
                if o.swapped and o.d == d:
                    coefs[j] = -o.lead * MS
            const = sum(bwd[r] for r in range(L + 1, issue + 1)) * MS
            rows.add("issue", coefs, -const, np.inf)
    # window: reloads of layers L..J are all issued no earlier than backward start of I = min(J + dmax, post)
    # and run one at a time, so they end after Bstart_I + their copy times; all are needed by L's last need:
    #   (S_{L+1} - S_{I+1}) + sum_{L<r<=I} bwd_r + stall_L >= (X_{L+1} - X_{J+1}) + lead(z_L)
    dmax = max((o.d for p in layers for o in menus[p] if o.swapped), default=0)
    for L in layers:
        for J in range(L + 1, min(L + WINDOW, layers[-1]) + 1):
            issue = min(J + dmax, post)
            coefs = {stall[L]: 1.0}
            if L + 1 in suf_x:
                coefs[suf_x[L + 1]] = -1.0
            if J + 1 in suf_x:
                coefs[suf_x[J + 1]] = coefs.get(suf_x[J + 1], 0.0) + 1.0
            if L + 1 in suf_s:
                coefs[suf_s[L + 1]] = 1.0
            if issue + 1 in suf_s:
                coefs[suf_s[issue + 1]] = coefs.get(suf_s[issue + 1], 0.0) - 1.0
            for j, o in z(L):
                coefs[j] = -o.lead * MS if o.swapped else 0.0
            rows.add("window", coefs, -sum(bwd[r] for r in range(L + 1, issue + 1)) * MS, np.inf)
    # fifo: all reloads of layers >= L land before L's last need, after backward starts and after
    # the last device->host copy (one copy stream, issue order):
    #   T_f + bwd_above_L + S_{L+1} + stall_L >= max(T_f, D) + X_{L+1} + lead(z_L)
    for L in layers:
        coefs = {stall[L]: 1.0}
        if L + 1 in suf_x:
            coefs[suf_x[L + 1]] = -1.0
        if L + 1 in suf_s:
            coefs[suf_s[L + 1]] = 1.0
        for j, o in z(L):
            coefs[j] = -o.lead * MS if o.swapped else 0.0
        rows.add("fifo_after_forward", dict(coefs), -bwd_above[L] * MS, np.inf)
        coefs[dend] = -1.0
        rows.add("fifo_after_d2h", coefs, -(bwd_above[L] + model.forward_time) * MS, np.inf)
    # d2h_chain:    D >= Y_q + (start_q + first_swap_end_k) z[q,k]   (copies of layers >= q start no earlier)
    for q in layers:
        first = units[model.positions[q][0]] if model.positions[q] else None
        start = (first.fwd_end - first.fwd) if first else 0.0
        coefs = {dend: 1.0, suf_y[q]: -1.0,
                 **{j: -(start + o.first_swap_end) * MS for j, o in z(q) if o.swapped}}
        rows.add("d2h_chain", coefs, 0, np.inf)
    # d2h_queue: copies out run one at a time in forward order (E in ms):
    #   E_q >= E_{q-1} + sum_k d2h_k z[q,k];   E_q >= (start_q + first_swap_end_k + d2h_k) z[q,k];   D >= E_last
    rate = model.hardware.d2h_bandwidth / MIB / MS  # MiB copied per ms
    for q in layers:
        first = units[model.positions[q][0]] if model.positions[q] else None
        start = (first.fwd_end - first.fwd) if first else 0.0
        coefs = {queue[q]: 1.0, **{j: -o.d2h * MS for j, o in z(q) if o.swapped}}
        if q - 1 in queue:
            coefs[queue[q - 1]] = -1.0
        rows.add("d2h_queue", coefs, 0, np.inf)
        rows.add("d2h_queue", {queue[q]: 1.0, **{j: -(start + o.first_swap_end + o.d2h) * MS for j, o in z(q)
                                                 if o.swapped}}, 0, np.inf)
    if layers:
        rows.add("d2h_queue", {dend: 1.0, queue[last]: -1.0}, 0, np.inf)
    # memory_pending: what is still queued for the host is still on the device (a tensor is freed when its
    # copy completes):  P_L >= rate (E_L - t_L),  (k-1) C_n + C_L + P_L <= cap   at layer L's forward end t_L
    t_end = sum(units[i].fwd for i in model.positions[pre])
    for L in layers:
        t_end = units[model.positions[L][-1]].fwd_end if model.positions[L] else t_end  # empty: another stage's
        rows.add("memory_pending", {pend[L]: 1.0, queue[L]: -rate}, -rate * t_end * MS, np.inf)
        coefs = {cum[L]: 1.0, pend[L]: 1.0}
        if k_in > 1:
            coefs[cum[last]] = coefs.get(cum[last], 0.0) + (k_in - 1)
        rows.add("memory_pending", coefs, -np.inf, cap)
    if layers:
        rows.add("memory_pending", {pend_post: 1.0, queue[last]: -rate}, -rate * model.forward_time * MS, np.inf)
    # coupling: a swapped layer output cannot coexist with recompute of its consumer (the rule would
    # drop the swap, which another option already represents):  sum_{A_u} z + sum_{R_u,q} z <= 1
    for p in layers:
        pinned = {k for o in menus[p] for k in o.swaps_pinned}
        for k in pinned:
            uidx = model.positions[p][k]
            for q in {units[c].position for c in units[uidx].consumers if units[c].position in zcol}:
                local = {i: m for m, i in enumerate(model.positions[q])}
                cons = [local[c] for c in units[uidx].consumers if c in local]
                coefs = {j: 1.0 for j, o in z(p) if k in o.swaps_pinned}
                coefs.update({j: 1.0 for j, o in z(q) if any(o.acts[m] is Action.RECOMPUTE for m in cons)})
                rows.add("coupling", coefs, -np.inf, 1)

    c = np.zeros(nvars)
    if layers:
        c[suf_s[layers[0]]] = 1.0  # objective: S_1 = total replay + total stall (ms)
    integrality = np.zeros(nvars)
    integrality[:nz] = 1
    const = model.forward_time + model.backward_time + model.other_time
    log.debug("milp: %d variables (%d binary), rows %s", nvars, nz, rows.groups)
    return _Program(menus, zcol, rows, c, integrality, const)


class MilpSolver(Solver):
    """Exact (over its menus) step-time minimisation under the peak budget; see the module docstring."""

    name = "milp"

    def __init__(self, *, prefetch: tuple[int, ...] = (0, 1, 2), menu_limit: int = 40, rel_gap: float | None = None,
                 time_limit: float = 30.0, max_rounds: int = 200, polish_time: float = 1.0,
                 large_rounds: int = 6, round_time: float = 1.5, counts: bool = True,
                 counts_time: float = 1.6, counts_gap: float = 0.01) -> None:
        self.prefetch = tuple(prefetch)
        self.menu_limit = menu_limit
        self.rel_gap = rel_gap
        self.time_limit = time_limit
        self.max_rounds = max_rounds
        self.polish_time = polish_time
        self.large_rounds = large_rounds
        self.round_time = round_time
        self.counts = counts
        self.counts_time = counts_time
        self.counts_gap = counts_gap  # above it, the per-layer program goes on from the counts plan and bound

    def choose(self, problem: Problem) -> tuple[Assignment, dict]:
        start = time.perf_counter()
        model = problem.model
        exact = exact_menus(model, self.prefetch)
        rel_gap = self.rel_gap if self.rel_gap is not None else (1e-7 if exact else 2e-3)
        counted = None
        if not exact and self.counts:
            counted = self._counts(problem, rel_gap, start)
            if counted is not None and counted[1]["extra"]["gap"] <= self.counts_gap:
                return counted[0], counted[1]
        prog = _build(problem, self.prefetch, self.menu_limit)
        layers = list(model.layer_positions)
        build_time = time.perf_counter() - start
        ub = np.where(prog.integrality == 1, 1.0, np.inf)
        lp_bound = -np.inf
        mode = "exact"
        if not exact:
            # Large menus: the LP relaxation gives the bound (it is tight here: repeated layers make the
            # program nearly totally unimodular); the integer program then runs on the LP's support only.
            mode = "lp-support"
            res = milp(prog.c, constraints=[prog.rows.constraint()], integrality=np.zeros_like(prog.c),
                       bounds=Bounds(np.zeros_like(ub), ub))
            if res.x is None:
                raise InfeasibleBudgetError(f"milp: no plan in its space fits the budget {fmt_bytes(problem.budget)}")
            lp_bound = prog.const + res.fun / MS
            for p in layers:
                z = res.x[prog.zcol[p]:prog.zcol[p] + len(prog.menus[p])]
                ub[prog.zcol[p]:prog.zcol[p] + len(z)] = (z > 1e-7).astype(float)
        seeds = _seeds(problem) if mode == "lp-support" else []
        if counted is not None:  # the counts program's plan competes; its bound holds for this menu space too
            seeds.append((simulate_assignment(model, counted[0], in_flight=problem.in_flight).step_time, counted[0]))
        for _, asg in seeds:  # baseline plans join the support where the menus hold them
            for p in layers:
                key = tuple(asg.actions[i] for i in model.positions[p])
                d = next((asg.prefetch[i] for i in model.positions[p] if asg.actions[i] is Action.SWAP), 0)
                for k, o in enumerate(prog.menus[p]):
                    if o.acts == key and o.d == d:
                        ub[prog.zcol[p] + k] = 1.0
        incumbent = min(seeds, key=lambda sd: sd[0]) if seeds else None
        best, bound, rounds, status = self._rounds(problem, prog, ub, rel_gap, start, lp_bound, incumbent)
        if best is None and mode == "lp-support" and status == "optimal":  # support infeasible
            mode = "full"  # the support held no plan the simulator accepts: search the whole menu
            ub = np.where(prog.integrality == 1, 1.0, np.inf)
            best, bound, more, status = self._rounds(problem, prog, ub, rel_gap, start, lp_bound, incumbent)
            rounds += more
        if best is None:
            raise InfeasibleBudgetError(f"milp: no plan in its space fits the budget {fmt_bytes(problem.budget)}"
                                        + ("" if status == "optimal" else f" ({status})"))
        if mode == "lp-support":
            bound = lp_bound  # the restricted program's bound covers the support only
            if best[0] > bound * (1 + rel_gap) and self.polish_time > 0:
                # close the gap on the whole menu for a bounded time: better plan and/or better bound
                polish = Bounds(np.zeros_like(ub), np.where(prog.integrality == 1, 1.0, np.inf))
                res = milp(prog.c, constraints=[prog.rows.constraint()], integrality=prog.integrality,
                           bounds=polish, options={"time_limit": self.polish_time, "mip_rel_gap": rel_gap / 2})
                rounds += 1
                dual = getattr(res, "mip_dual_bound", None)
                if dual is not None and np.isfinite(dual):
                    bound = max(bound, prog.const + dual / MS)
                if res.x is not None:
                    choice = {p: int(np.argmax(res.x[prog.zcol[p]:prog.zcol[p] + len(prog.menus[p])])) for p in layers}
                    asg = _assignment(model, prog.menus, choice)
                    sim = simulate_assignment(model, asg, in_flight=problem.in_flight)
                    if sim.peak_bytes <= problem.budget and sim.step_time < best[0]:
                        best = (sim.step_time, asg)
                mode = "lp-support+polish"
        if counted is not None:
            bound = max(bound, counted[2]) if np.isfinite(bound) else counted[2]
            mode += "+counts"
        lower = min(best[0], bound) if np.isfinite(bound) else best[0]
        return best[1], {"lower_bound": lower, "iterations": rounds,
                         "extra": {"status": status, "mode": mode, "build_time": round(build_time, 3),
                                   "rel_gap": rel_gap, "menu_sizes": sorted({len(m) for m in prog.menus.values()}),
                                   "rows": dict(prog.rows.groups)}}

    def _counts(self, problem: Problem, rel_gap: float, start: float) -> tuple[Assignment, dict, float] | None:
        """Repeated layers: the counts program (``_counts.py``) -> (plan, stats, bound); None when it does
        not apply or finds no plan."""
        model = problem.model
        cache: dict = {}
        menus = {p: layer_menu(model, p, prefetch=self.prefetch, limit=self.menu_limit, cache=cache, exact=False)
                 for p in model.layer_positions}
        if not identical_layers(model, menus):
            return None
        seeds = _seeds(problem, cheap=True)
        incumbent = min(seeds, key=lambda sd: sd[0]) if seeds else None
        layers = list(model.layer_positions)
        menu = menus[layers[1]]
        out = solve_counts(problem, (menu, menus[layers[-1]], menus[layers[0]]), rel_gap=rel_gap, incumbent=incumbent,
                           time_limit=max(0.1, self.counts_time - (time.perf_counter() - start)))
        if out.bound == np.inf:
            raise InfeasibleBudgetError(f"milp: no plan in its space fits the budget {fmt_bytes(problem.budget)}")
        if out.best is None:
            return None  # the relaxation admits plans the simulator rejects: the per-layer program decides
        lower = min(out.best[0], out.bound)
        gap = (out.best[0] - lower) / out.best[0]
        return out.best[1], {"lower_bound": lower, "iterations": out.rounds,
                             "extra": {"status": "optimal" if out.best[0] <= out.bound * (1 + rel_gap) else "gap",
                                       "mode": "lp-support+counts", "rel_gap": rel_gap, "menu_sizes": [len(menu)],
                                       "gap": gap, "build_time": round(time.perf_counter() - start, 3)}}, out.bound

    def _rounds(self, problem: Problem, prog: _Program, ub: np.ndarray, rel_gap: float, start: float,
                lp_bound: float, incumbent: tuple[float, Assignment] | None = None,
                ) -> tuple[tuple[float, Assignment] | None, float, int, str]:
        """Solve, simulate, cut off candidates the simulator disagrees with, until the gap closes."""
        model = problem.model
        layers = list(model.layer_positions)
        best = incumbent
        if best is not None and np.isfinite(lp_bound) and best[0] <= lp_bound * (1 + rel_gap):
            return best, lp_bound, 0, "optimal"  # a baseline already meets the LP bound
        bound = -np.inf
        rounds = 0
        bar = _progress(problem.progress, self.max_rounds)
        status = "optimal"
        limit = self.max_rounds if not np.isfinite(lp_bound) else min(self.max_rounds, self.large_rounds)
        while rounds < limit:
            remaining = self.time_limit - (time.perf_counter() - start)
            if remaining <= 0:
                status = "time limit"
                break
            if np.isfinite(lp_bound):
                remaining = min(remaining, self.round_time)  # repeated-layer path: short rounds, LP bound
            res = milp(prog.c, constraints=[prog.rows.constraint()], integrality=prog.integrality,
                       bounds=Bounds(np.zeros_like(ub), ub),
                       options={"time_limit": remaining, "mip_rel_gap": rel_gap / 2, "presolve": True})
            rounds += 1
            if bar is not None:
                bar.update(1)
            if res.x is None:
                if res.status == 2 or "infeasible" in str(res.message).lower():
                    bound = np.inf  # nothing left under the budget
                else:
                    status = str(res.message)
                break
            value = prog.const + res.fun / MS
            dual = getattr(res, "mip_dual_bound", None)
            bound = prog.const + (dual if dual is not None and np.isfinite(dual) else res.fun) / MS
            choice = {p: int(np.argmax(res.x[prog.zcol[p]:prog.zcol[p] + len(prog.menus[p])])) for p in layers}
            asg = _assignment(model, prog.menus, choice)
            sim = simulate_assignment(model, asg, in_flight=problem.in_flight)
            if sim.peak_bytes <= problem.budget and (best is None or sim.step_time < best[0]):
                best = (sim.step_time, asg)
            if sim.peak_bytes > problem.budget and np.isfinite(lp_bound):
                # repeated-layer path: memory the program does not see (copies queued across layers);
                # leave that much room and go on (the LP bound stays a valid bound)
                prog.rows.tighten_memory((sim.peak_bytes - problem.budget) / MIB)
            target = max(bound, lp_bound) if np.isfinite(lp_bound) else bound
            if best is not None and best[0] <= target * (1 + rel_gap) + 1e-12:
                break
            log.debug("milp round %d: program %.6f s, simulated %.6f s, peak %s", rounds, value, sim.step_time,
                      fmt_bytes(sim.peak_bytes))
            # no_good:  sum_p z[p, choice_p] <= |layers| - 1   (this exact combination is known)
            prog.rows.add("no_good", {prog.zcol[p] + k: 1.0 for p, k in choice.items()}, -np.inf, len(layers) - 1)
        else:
            status = "round limit"
        if bar is not None:
            bar.close()
        return best, bound, rounds, status


def _seeds(problem: Problem, *, cheap: bool = False) -> list[tuple[float, Assignment]]:
    """Feasible plans of the cheap baselines, simulated: incumbents for the repeated-layer path
    (``cheap``: only those that take one simulation each)."""
    from ._baselines import FullRecompute, GreedyKnapsack, MegatronBlock, NoneBaseline, SwapOnly
    out = []
    for cls in (NoneBaseline, FullRecompute) if cheap else (NoneBaseline, GreedyKnapsack, SwapOnly, MegatronBlock,
                                                            FullRecompute):
        asg, _ = cls().choose(problem)
        sim = simulate_assignment(problem.model, asg, in_flight=problem.in_flight)
        if sim.peak_bytes <= problem.budget:
            out.append((sim.step_time, asg))
    return out


def _assignment(model, menus: dict[int, list[Option]], choice: dict[int, int]) -> Assignment:
    actions = [Action.KEEP] * len(model.units)
    prefetch = [1] * len(model.units)
    for p, k in choice.items():
        o = menus[p][k]
        for i, a in zip(model.positions[p], o.acts):
            actions[i] = a
            prefetch[i] = o.d
    return Assignment(tuple(actions), tuple(prefetch))


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="milp rounds", unit="solve", leave=False)


register_solver("milp", MilpSolver)
