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
from scipy.optimize import LinearConstraint
from scipy.sparse import coo_matrix

from ._menu import Option, exact_menus, layer_menu
from ._plan import Action
from ._solver import Problem

__all__ = ["MIB", "MS", "WINDOW", "Program", "Rows", "build_program"]

log = logging.getLogger("search._milp")

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
    """The per-layer program over the layer menus: one binary per (layer, option), the rest continuous."""
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
    rows = Rows(nvars)

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
    temp = model.grad_temp or [0] * (n + 2)
    # memory_layer: at the end of layer L's backward, before its release (temp_L: a gradient before accumulation):
    #   (k-1) C_n + C_L + sum_k (transient_k + swapped_k) z[L,k] + temp_L
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
        rows.add("memory_layer", coefs, -np.inf, cap - grads_so_far - temp[L] / MIB)
    # memory_post:  k C_n + sum_{l,k: d_k>=1, l+d_k >= post} swapped_k z[l,k] <= cap - held_post - boundary - temp_post
    if layers:
        coefs = {cum[last]: float(k_in), pend_post: 1.0}
        for l in layers:
            for j, o in z(l):
                if o.swapped and o.d >= 1 and l + o.d >= post:
                    coefs[j] = o.swapped / MIB
        rows.add("memory_post", coefs, -np.inf,
                 cap - (held_fixed[post] + model.boundary + model.grads[post] + temp[post]) / MIB)

    # memory_forward: after the forward of unit v of position L (layer or post), with copies to host
    # still running (a copy of u cannot end before its in-layer chain  c_u = max(c_prev, fe_u) + d2h_u):
    #   (k-1) C_n + C_{L-1} + prefix_{k,v} z[L,k] + sum_{l<=L} sum_k pending_{k}(fe_v) z[l,k] <= cap
    chains: dict[int, list[list[tuple[float, float, int]]]] = {}
    for p in layers:
        per = []
        for o in menus[p]:
            chain, c_prev = [], 0.0
            if o.input_swap:  # copied out when the layer's forward ends
                end = units[model.positions[p][-1]].fwd_end
                per.append([(end, end + o.d2h, o.swapped)])
                continue
            for m, a in enumerate(o.acts):
                if a is Action.SWAP:
                    u = units[model.positions[p][m]]
                    c_prev = max(c_prev, u.fwd_end) + model.unit_d2h(model.positions[p][m])
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
    def recomputing(uidx: int) -> dict[int, list[int]]:
        """Per layer position reading unit ``uidx``: the columns of its options that recompute a reader."""
        out = {}
        for q in {units[c].position for c in units[uidx].consumers if units[c].position in zcol}:
            local = {i: m for m, i in enumerate(model.positions[q])}
            cons = [local[c] for c in units[uidx].consumers if c in local]
            out[q] = [j for j, o in z(q) if any(o.acts[m] is Action.RECOMPUTE for m in cons)]
        return out

    # coupling: a swapped layer output cannot coexist with recompute of its consumer (the rule would
    # drop the swap, which another option already represents):  sum_{A_u} z + sum_{R_u,q} z <= 1
    for p in layers:
        for k in {k for o in menus[p] for k in o.swaps_pinned}:
            for cols in recomputing(model.positions[p][k]).values():
                coefs = {j: 1.0 for j, o in z(p) if k in o.swaps_pinned}
                coefs.update({j: 1.0 for j in cols})
                rows.add("coupling", coefs, -np.inf, 1)
    # compiled_coupled: a whole-layer swap with its outputs kept needs a recomputed consumer (Note: [compiled
    # search space]):  z[p,o] - sum_{q, o' recomputing a consumer of u} z[q,o'] <= 0  for u in coupled(o)
    for p in layers:
        for j, o in z(p):
            for k in o.coupled:
                coefs = {j: 1.0}
                for cols in recomputing(model.positions[p][k]).values():
                    coefs.update({jq: -1.0 for jq in cols})
                rows.add("compiled_coupled", coefs, -np.inf, 0)

    c = np.zeros(nvars)
    if layers:
        c[suf_s[layers[0]]] = 1.0  # objective: S_1 = total replay + total stall (ms)
    integrality = np.zeros(nvars)
    integrality[:nz] = 1
    const = model.forward_time + model.backward_time + model.other_time
    log.debug("milp: %d variables (%d binary), rows %s", nvars, nz, rows.groups)
    return Program(menus, zcol, rows, c, integrality, const)

