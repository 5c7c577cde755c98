"""The named constraint groups of the ``milp`` program (``_milp_model.py``), one function each with its equation
above it, over the program's column layout (``_milp_rows.Columns``; the units and symbols are named there).
"""

from __future__ import annotations

import numpy as np

from ._milp_rows import MIB, MS, WINDOW, Columns
from ._plan import Action

__all__ = ["GROUPS"]


def one_option(cx: Columns) -> None:
    # one_option:   sum_k z[p,k] = 1
    for p in cx.layers:
        cx.rows.add("one_option", {j: 1.0 for j, _ in cx.z(p)}, 1, 1)


def prefix_held(cx: Columns) -> None:
    # prefix_held:  C_p - C_{p-1} - sum_k held_k z[p,k] = 0, with held_k = inputs_k + sum_u hold_u: the option's
    #   units' held bytes plus, under a whole-layer or selective checkpoint, its inputs not saved anyway
    #   (Note: [selective checkpoint input]), as the simulator's segment counts them
    for p in cx.layers:
        coefs = {cx.cum[p]: 1.0, **{j: -o.held / MIB for j, o in cx.z(p)}}
        if p - 1 in cx.cum:
            coefs[cx.cum[p - 1]] = -1.0
        cx.rows.add("prefix_held", coefs, 0, 0)


def suffix_sums(cx: Columns) -> None:
    # suffix sums:  S_p - S_{p+1} - sum_k replay_k z - stall_p = 0;  X_p, Y_p likewise with h2d, d2h
    for p in cx.layers:
        nxt = p + 1 if p + 1 in cx.suf_s else None
        for var, attr, extra in ((cx.suf_s, "replay", True), (cx.suf_x, "h2d", False), (cx.suf_y, "d2h", False)):
            coefs = {var[p]: 1.0, **{j: -getattr(o, attr) * MS for j, o in cx.z(p)}}
            if nxt is not None:
                coefs[var[nxt]] = -1.0
            if extra:
                coefs[cx.stall[p]] = -1.0
            cx.rows.add(f"suffix_{attr}", coefs, 0, 0)


def memory_layer(cx: Columns) -> None:
    # memory_layer: at the end of layer L's backward, before its release (temp_L: a gradient before accumulation):
    #   (k-1) C_n + C_L + sum_k (transient_k + swapped_k) z[L,k] + temp_L
    #   + sum_{l<L} sum_{k: d_k >= L-l, swap} swapped_k z[l,k]   (reloads already issued)   <= cap
    model, last = cx.model, cx.last
    for L in cx.layers:
        coefs: dict[int, float] = {cx.cum[L]: 1.0}
        if cx.k_in > 1:
            coefs[cx.cum[last]] = coefs.get(cx.cum[last], 0.0) + (cx.k_in - 1)
        for j, o in cx.z(L):
            coefs[j] = (o.transient + o.swapped) / MIB
        for l in cx.layers:
            if l >= L:
                break
            for j, o in cx.z(l):
                if o.swapped and o.d >= 1 and o.d >= L - l:
                    coefs[j] = coefs.get(j, 0.0) + o.swapped / MIB
        grads_so_far = sum(model.grads[q] for q in range(L, cx.post + 1)) / MIB  # gradients of L and above exist
        cx.rows.add("memory_layer", coefs, -np.inf, cx.cap - grads_so_far - cx.temp(L) / MIB)


def memory_post(cx: Columns) -> None:
    # memory_post:  k C_n + sum_{l,k: d_k>=1, l+d_k >= post} swapped_k z[l,k] <= cap - held_post - boundary - temp_post
    if not cx.layers:
        return
    model, post = cx.model, cx.post
    coefs = {cx.cum[cx.last]: float(cx.k_in), cx.pend_post: 1.0}
    for l in cx.layers:
        for j, o in cx.z(l):
            if o.swapped and o.d >= 1 and l + o.d >= post:
                coefs[j] = o.swapped / MIB
    held_post = sum(model.units[i].saved for i in model.positions[post])
    cx.rows.add("memory_post", coefs, -np.inf,
                cx.cap - (held_post + model.boundary + model.grads[post] + cx.temp(post)) / MIB)


def _copy_chains(cx: Columns) -> dict[int, list[list[tuple[float, float, int]]]]:
    """Per layer and option: (forward end, copy end, bytes) of each copy out, in order (a copy of u cannot end
    before its in-layer chain  c_u = max(c_prev, fe_u) + d2h_u)."""
    model, units = cx.model, cx.model.units
    chains: dict[int, list[list[tuple[float, float, int]]]] = {}
    for p in cx.layers:
        per = []
        for o in cx.menus[p]:
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
    return chains


def memory_forward(cx: Columns) -> None:
    # memory_forward: after the forward of unit v of position L (layer or post), with copies to host
    # still running:
    #   (k-1) C_n + C_{L-1} + prefix_{k,v} z[L,k] + sum_{l<=L} sum_k pending_{k}(fe_v) z[l,k] <= cap
    model, units, post, last = cx.model, cx.model.units, cx.post, cx.last
    chains = _copy_chains(cx)
    latest = {p: max((c for chain in chains[p] for _, c, _ in chain), default=0.0) for p in cx.layers}
    for L in cx.layers + ([post] if model.positions[post] else []):
        for m, v in enumerate(model.positions[L]):
            t_v = units[v].fwd_end
            coefs = {}
            if cx.k_in > 1:
                coefs[cx.cum[last]] = float(cx.k_in - 1)
            prev = L - 1 if L != post else last
            if prev in cx.cum:
                coefs[cx.cum[prev]] = coefs.get(cx.cum[prev], 0.0) + 1.0
            rhs = cx.cap
            if L == post:
                rhs -= sum(units[i].saved for i in model.positions[post][:m + 1]) / MIB
            for l in cx.layers:
                if l > L:
                    break
                if l != L and latest[l] <= t_v:
                    continue
                for k, chain in enumerate(chains[l]):
                    val = sum(b for fe, c, b in chain if fe <= t_v < c)
                    if l == L:
                        val += cx.menus[L][k].prefix[m]
                    if val:
                        coefs[cx.zcol[l] + k] = coefs.get(cx.zcol[l] + k, 0.0) + val / MIB
            cx.rows.add("memory_forward", coefs, -np.inf, rhs)


def on_demand(cx: Columns) -> None:
    # on_demand:    stall_L >= sum_{k: d_k = 0} h2d_k z[L,k]      (each on-demand reload waits its copy)
    for L in cx.layers:
        cx.rows.add("on_demand", {cx.stall[L]: 1.0, **{j: -o.h2d * MS for j, o in cx.z(L) if o.swapped and o.d == 0}},
                    0, np.inf)


def issue(cx: Columns) -> None:
    # issue:  reloads issued when backward starts position I = min(L+d, post) land before their needs:
    #   (S_{L+1} - S_{I+1}) + sum_{L<r<=I} bwd_r + stall_L >= sum_{k: d_k = d} lead_k z[L,k]
    suf_s = cx.suf_s
    for L in cx.layers:
        for d in sorted({o.d for o in cx.menus[L] if o.swapped and o.d >= 1}):
            at = min(L + d, cx.post)
            coefs = {cx.stall[L]: 1.0}
            if L + 1 in suf_s:
                coefs[suf_s[L + 1]] = 1.0
            if at + 1 in suf_s:
                coefs[suf_s[at + 1]] = coefs.get(suf_s[at + 1], 0.0) - 1.0
            for j, o in cx.z(L):
                if o.swapped and o.d == d:
                    coefs[j] = -o.lead * MS
            const = sum(cx.bwd(r) for r in range(L + 1, at + 1)) * MS
            cx.rows.add("issue", coefs, -const, np.inf)


def window(cx: Columns) -> None:
    # window: reloads of layers L..J are all issued no earlier than backward start of I = min(J + dmax, post)
    # and run one at a time, so they end after Bstart_I + their copy times; all are needed by L's last need:
    #   (S_{L+1} - S_{I+1}) + sum_{L<r<=I} bwd_r + stall_L >= (X_{L+1} - X_{J+1}) + lead(z_L)
    suf_s, suf_x = cx.suf_s, cx.suf_x
    dmax = max((o.d for p in cx.layers for o in cx.menus[p] if o.swapped), default=0)
    for L in cx.layers:
        for J in range(L + 1, min(L + WINDOW, cx.layers[-1]) + 1):
            at = min(J + dmax, cx.post)
            coefs = {cx.stall[L]: 1.0}
            if L + 1 in suf_x:
                coefs[suf_x[L + 1]] = -1.0
            if J + 1 in suf_x:
                coefs[suf_x[J + 1]] = coefs.get(suf_x[J + 1], 0.0) + 1.0
            if L + 1 in suf_s:
                coefs[suf_s[L + 1]] = 1.0
            if at + 1 in suf_s:
                coefs[suf_s[at + 1]] = coefs.get(suf_s[at + 1], 0.0) - 1.0
            for j, o in cx.z(L):
                coefs[j] = -o.lead * MS if o.swapped else 0.0
            cx.rows.add("window", coefs, -sum(cx.bwd(r) for r in range(L + 1, at + 1)) * MS, np.inf)


def fifo(cx: Columns) -> None:
    # fifo: all reloads of layers >= L land before L's last need, after backward starts and after
    # the last device->host copy (one copy stream, issue order):
    #   T_f + bwd_above_L + S_{L+1} + stall_L >= max(T_f, D) + X_{L+1} + lead(z_L)
    post = cx.post
    for L in cx.layers:
        bwd_above = cx.bwd(post) + sum(cx.bwd(q) for q in cx.layers if q > L)
        coefs = {cx.stall[L]: 1.0}
        if L + 1 in cx.suf_x:
            coefs[cx.suf_x[L + 1]] = -1.0
        if L + 1 in cx.suf_s:
            coefs[cx.suf_s[L + 1]] = 1.0
        for j, o in cx.z(L):
            coefs[j] = -o.lead * MS if o.swapped else 0.0
        cx.rows.add("fifo_after_forward", dict(coefs), -bwd_above * MS, np.inf)
        coefs[cx.dend] = -1.0
        cx.rows.add("fifo_after_d2h", coefs, -(bwd_above + cx.model.forward_time) * MS, np.inf)


def d2h_chain(cx: Columns) -> None:
    # d2h_chain:    D >= Y_q + (start_q + first_swap_end_k) z[q,k]   (copies of layers >= q start no earlier)
    for q in cx.layers:
        start = cx.layer_start(q)
        coefs = {cx.dend: 1.0, cx.suf_y[q]: -1.0,
                 **{j: -(start + o.first_swap_end) * MS for j, o in cx.z(q) if o.swapped}}
        cx.rows.add("d2h_chain", coefs, 0, np.inf)


def d2h_queue(cx: Columns) -> None:
    # d2h_queue: copies out run one at a time in forward order (E in ms):
    #   E_q >= E_{q-1} + sum_k d2h_k z[q,k];   E_q >= (start_q + first_swap_end_k + d2h_k) z[q,k];   D >= E_last
    queue = cx.queue
    for q in cx.layers:
        start = cx.layer_start(q)
        coefs = {queue[q]: 1.0, **{j: -o.d2h * MS for j, o in cx.z(q) if o.swapped}}
        if q - 1 in queue:
            coefs[queue[q - 1]] = -1.0
        cx.rows.add("d2h_queue", coefs, 0, np.inf)
        cx.rows.add("d2h_queue", {queue[q]: 1.0, **{j: -(start + o.first_swap_end + o.d2h) * MS
                                                    for j, o in cx.z(q) if o.swapped}}, 0, np.inf)
    if cx.layers:
        cx.rows.add("d2h_queue", {cx.dend: 1.0, queue[cx.last]: -1.0}, 0, np.inf)


def memory_pending(cx: Columns) -> None:
    # memory_pending: what is still queued for the host is still on the device (a tensor is freed when its
    # copy completes):  P_L >= rate (E_L - t_L),  (k-1) C_n + C_L + P_L <= cap   at layer L's forward end t_L
    model, units = cx.model, cx.model.units
    rate = model.hardware.d2h_bandwidth / MIB / MS  # MiB copied per ms
    t_end = sum(units[i].fwd for i in model.positions[0])
    for L in cx.layers:
        t_end = units[model.positions[L][-1]].fwd_end if model.positions[L] else t_end  # empty: another stage's
        cx.rows.add("memory_pending", {cx.pend[L]: 1.0, cx.queue[L]: -rate}, -rate * t_end * MS, np.inf)
        coefs = {cx.cum[L]: 1.0, cx.pend[L]: 1.0}
        if cx.k_in > 1:
            coefs[cx.cum[cx.last]] = coefs.get(cx.cum[cx.last], 0.0) + (cx.k_in - 1)
        cx.rows.add("memory_pending", coefs, -np.inf, cx.cap)
    if cx.layers:
        cx.rows.add("memory_pending", {cx.pend_post: 1.0, cx.queue[cx.last]: -rate},
                    -rate * model.forward_time * MS, np.inf)


def _recomputing(cx: Columns, uidx: int) -> dict[int, list[int]]:
    """Per layer position reading unit ``uidx``: the columns of its options that recompute a reader."""
    model, units = cx.model, cx.model.units
    out = {}
    for q in {units[c].position for c in units[uidx].consumers if units[c].position in cx.zcol}:
        local = {i: m for m, i in enumerate(model.positions[q])}
        cons = [local[c] for c in units[uidx].consumers if c in local]
        out[q] = [j for j, o in cx.z(q) if any(o.acts[m] is Action.RECOMPUTE for m in cons)]
    return out


def coupling(cx: Columns) -> None:
    # coupling: a swapped layer output cannot coexist with recompute of its consumer (the rule would
    # drop the swap, which another option already represents):  sum_{A_u} z + sum_{R_u,q} z <= 1
    for p in cx.layers:
        for k in {k for o in cx.menus[p] for k in o.swaps_pinned}:
            for cols in _recomputing(cx, cx.model.positions[p][k]).values():
                coefs = {j: 1.0 for j, o in cx.z(p) if k in o.swaps_pinned}
                coefs.update({j: 1.0 for j in cols})
                cx.rows.add("coupling", coefs, -np.inf, 1)


def compiled_coupled(cx: Columns) -> None:
    # compiled_coupled: a whole-layer swap with its outputs kept needs a recomputed consumer (Note: [compiled
    # search space]):  z[p,o] - sum_{q, o' recomputing a consumer of u} z[q,o'] <= 0  for u in coupled(o)
    for p in cx.layers:
        for j, o in cx.z(p):
            for k in o.coupled:
                coefs = {j: 1.0}
                for cols in _recomputing(cx, cx.model.positions[p][k]).values():
                    coefs.update({jq: -1.0 for jq in cols})
                cx.rows.add("compiled_coupled", coefs, -np.inf, 0)


GROUPS = (one_option, prefix_held, suffix_sums, memory_layer, memory_post, memory_forward, on_demand, issue, window,
          fifo, d2h_chain, d2h_queue, memory_pending, coupling, compiled_coupled)
"""Every constraint group, in the order of the program's rows."""
