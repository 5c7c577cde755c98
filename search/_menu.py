"""Per-layer menus: the op-level choices of one layer, reduced to the ones worth offering.

A menu option is one assignment of keep / recompute / swap to the units of a layer plus a
prefetch distance, with the numbers the cross-layer program (``_milp.py``) needs. Identical
layers share one menu. Small layers (<= ``EXACT_UNITS`` units) get every option, pruned only
where pruning is sound for the simulator; larger layers get a heuristic menu (Pareto front of
recompute subsets + swap variants of the largest tensors).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ._compiled_space import attributed, compiled_blocks, honoured, project
from ._model import StepModel
from ._plan import Action
from ._simulator import Assignment, position_segment

__all__ = ["EXACT_UNITS", "Option", "assign", "exact_menus", "layer_menu"]

EXACT_UNITS = 8
"""Layers with at most this many units may get the complete option set..."""
EXACT_OPTIONS = 3000
"""...when the complete sets of all layers hold at most this many options together."""

K, R, S = Action.KEEP, Action.RECOMPUTE, Action.SWAP


@dataclass(frozen=True)
class Option:
    acts: tuple[Action, ...]
    """Action per unit of the layer (forward order)."""
    d: int
    """Prefetch distance of the swapped units (0 = on demand)."""
    held: int
    """Non-swapped bytes the layer holds from its forward to the end of its backward: its segment's ``held``, the
    checkpoint's inputs not saved anyway included (Note: [selective checkpoint input])."""
    swapped: int
    """Bytes swapped out and reloaded."""
    transient: int
    """Recompute memory during the layer's backward."""
    replay: float
    """Recompute seconds."""
    h2d: float
    d2h: float
    need: float
    """Seconds from the layer's backward start (stalls excluded) to the need of its last-needed reload."""
    first_swap_end: float
    """Forward end time of the first swapped unit, relative to the layer's forward start."""
    lead: float = 0.0
    """Seconds before the layer's backward start its reloads must be issued to avoid a stall:
    max over swapped units u of (copy time of the reloads needed up to u) - (u's need offset)."""
    swaps_pinned: tuple[int, ...] = ()
    """Local indices of swapped units read by other positions (coupling with their recompute)."""
    prefix: tuple[int, ...] = ()
    """Held bytes after each unit's forward (for sound dominance of non-swap options)."""
    coupled: tuple[int, ...] = ()
    """Local indices of layer outputs kept in a whole-layer swap because a consumer is recomputed (the coupling rule;
    Note: [compiled search space]): the milp takes the option only with that recompute."""
    input_swap: bool = False
    """Whole-layer recompute whose checkpoint input is swapped (Note: [swapped checkpoint input]): ``swapped`` is
    that input, ``held`` is net of it (the previous position holds it until its own backward)."""

    @property
    def recomputes(self) -> bool:
        return R in self.acts


def assign(model: StepModel, choices: Iterable[tuple[int, Option]]) -> Assignment:
    """The assignment of one option per layer position (``(position, option)`` pairs); other units keep. On a model
    compiled per block, a whole-layer swap with its outputs kept but no recomputed consumer swaps them too."""
    actions = [K] * len(model.units)
    prefetch = [1] * len(model.units)
    inputs = []
    for p, o in choices:
        for i, a in zip(model.positions[p], o.acts):
            actions[i] = a
            prefetch[i] = o.d
        if o.input_swap:
            inputs.append((p, o.d))
    return project(model, Assignment(tuple(actions), tuple(prefetch), (), tuple(inputs)))  # Note: [compiled search space]


def _signature(model: StepModel, p: int) -> tuple:
    members = model.positions[p]
    local = {i: k for k, i in enumerate(members)}
    return (model.input_extra[p], model.input_swap[p], model.replay_extra[p]) + tuple(
        (u.local_name, u.saved, u.output, u.fwd, u.bwd, u.pinned, u.sac_extra, u.sac_replay, u.sac_replay_all, u.ops,
         tuple(local.get(c, -1) for c in u.consumers), model.spill_bound[u.index] if model.spill_bound else 0)
        for u in (model.units[i] for i in members))


def _option(model: StepModel, p: int, acts: tuple[Action, ...], d: int) -> Option | None:
    members = model.positions[p]
    units = [model.units[i] for i in members]
    local = {i: k for k, i in enumerate(members)}
    for k, a in enumerate(acts):
        if a is S and any(c in local and acts[local[c]] is R for c in units[k].consumers):
            return None  # the coupling rule turns this swap into keep: same as another option
    seg = position_segment(model, p, list(acts))
    swaps = [k for k, a in enumerate(acts) if a is S] if seg.mode != "full" else []
    sw = sum(units[k].saved for k in swaps)
    start = (units[0].fwd_end - units[0].fwd) if units else 0.0
    need = seg.replay + (sum(u.bwd for u in units[swaps[0] + 1:]) if swaps else 0.0)
    lead, cum = -float("inf"), 0.0
    for k in reversed(swaps):  # need order: later units first
        cum += model.unit_h2d(members[k])
        lead = max(lead, cum - (seg.replay + sum(u.bwd for u in units[k + 1:])))
    prefix, level = [], seg.inputs
    for i in members:
        level += seg.hold.get(i, 0)
        prefix.append(level)
    return Option(acts=acts, d=d if swaps else 0, held=seg.held, swapped=sw, transient=seg.transient,
                  replay=seg.replay, h2d=sum(model.unit_h2d(members[k]) for k in swaps),
                  d2h=sum(model.unit_d2h(members[k]) for k in swaps), need=need,
                  first_swap_end=(units[swaps[0]].fwd_end - start) if swaps else 0.0,
                  lead=lead if swaps else 0.0,
                  swaps_pinned=tuple(k for k in swaps if units[k].pinned), prefix=tuple(prefix))


def _input_swaps(model: StepModel, p: int, prefetch: tuple[int, ...]) -> list[Option]:
    """Whole-layer recompute with its checkpoint input swapped, one option per prefetch distance: the input is
    copied out when the layer's forward returns and is needed first thing in its backward (the replay)."""
    nbytes = model.input_swap[p]
    members = model.positions[p]
    full = _option(model, p, tuple([R] * len(members)), 0) if members else None
    if not nbytes or full is None:
        return []
    h2d, d2h = model.h2d(nbytes), model.d2h(nbytes)
    duration = sum(model.units[i].fwd for i in members)
    prefix = full.prefix[:-1] + (full.prefix[-1] - nbytes,)  # from its forward end the copy is pending instead
    return [Option(acts=full.acts, d=d, held=full.held - nbytes, swapped=nbytes, transient=full.transient,
                   replay=full.replay, h2d=h2d, d2h=d2h, need=0.0, first_swap_end=duration, lead=h2d,
                   prefix=prefix, input_swap=True) for d in prefetch]


def _dominated(a: Option, b: Option) -> bool:
    """``b`` is no worse than ``a`` in every quantity the simulator reads (non-swap options only)."""
    return (b.replay <= a.replay and b.transient <= a.transient
            and all(x <= y for x, y in zip(b.prefix, a.prefix)) and b.held <= a.held)


def _prune_plain(options: list[Option]) -> list[Option]:
    options = sorted(options, key=lambda o: (o.replay, o.held, o.transient))
    kept: list[Option] = []
    for o in options:
        if not any(_dominated(o, k) for k in kept):
            kept.append(o)
    return kept


def _exact(model: StepModel, p: int, prefetch: tuple[int, ...]) -> list[Option]:
    n = len(model.positions[p])
    plain, swaps = [], []
    for acts in itertools.product((K, R, S), repeat=n):
        if S in acts:
            for d in prefetch:
                o = _option(model, p, acts, d)
                if o is not None:
                    swaps.append(o)
        else:
            o = _option(model, p, acts, 0)
            assert o is not None
            plain.append(o)
    return _prune_plain(plain) + swaps + _input_swaps(model, p, prefetch)


def _pareto_subsets(model: StepModel, p: int, limit: int) -> list[tuple[Action, ...]]:
    """Recompute subsets on the (held, transient, replay) Pareto front, at most ``limit`` of them."""
    members = model.positions[p]
    units = [model.units[i] for i in members]
    cand = [k for k, u in enumerate(units) if u.saved > 0 and not u.pinned]
    cand = sorted(cand, key=lambda k: -units[k].saved)[:16]
    m = len(cand)
    bits = ((np.arange(1, 1 << m)[:, None] >> np.arange(m)[None, :]) & 1).astype(bool)
    saved = np.array([units[k].saved for k in cand], dtype=np.float64)
    extra = np.array([units[k].sac_extra for k in cand], dtype=np.float64)
    gain = np.array([units[k].sac_replay_all - units[k].sac_replay for k in cand])
    total_extra = sum(u.sac_extra for u in units)
    total_replay = sum(u.sac_replay for u in units)
    held = sum(u.saved for u in units) + total_extra - bits @ (saved + extra)
    tr = bits @ saved
    rc = total_replay + bits @ gain
    order = np.lexsort((tr, held, rc))
    front: list[int] = []
    best_held = np.inf
    for idx in order:  # sweep by replay: keep points that lower held (2-D front; transient follows held)
        if held[idx] < best_held - 1e-9:
            best_held = held[idx]
            front.append(int(idx))
    if len(front) > limit:
        front = [front[int(round(j))] for j in np.linspace(0, len(front) - 1, limit)]
    out = []
    for idx in front:
        acts = [K] * len(units)
        for j, k in enumerate(cand):
            if bits[idx, j]:
                acts[k] = R
        out.append(tuple(acts))
    return out


def _heuristic(model: StepModel, p: int, prefetch: tuple[int, ...], limit: int) -> list[Option]:
    members = model.positions[p]
    units = [model.units[i] for i in members]
    n = len(units)
    bases = [tuple([K] * n)] + _pareto_subsets(model, p, limit)
    options = [o for acts in bases + [tuple([R] * n)] if (o := _option(model, p, acts, 0)) is not None]
    for acts in bases[:: max(1, len(bases) // 6)]:
        swappable = sorted((k for k, a in enumerate(acts) if a is K and not units[k].pinned and units[k].saved),
                           key=lambda k: -units[k].saved)
        for size in range(1, min(4, len(swappable)) + 1):
            variant = list(acts)
            for k in swappable[:size]:
                variant[k] = S
            for d in prefetch:
                o = _option(model, p, tuple(variant), d)
                if o is not None:
                    options.append(o)
    for k, u in enumerate(units):  # each tensor swapped alone (covers attention-core swap policies)
        if not u.pinned and u.saved and u.saved * 20 >= max(v.saved for v in units):
            single = tuple(S if j == k else K for j in range(n))
            options += [o for d in prefetch if (o := _option(model, p, single, d)) is not None]
    everything = tuple(S if u.saved else K for u in units)  # the least memory short of recompute
    unpinned = tuple(S if u.saved and not u.pinned else K for u in units)
    for acts in {everything, unpinned}:
        options += [o for d in prefetch if (o := _option(model, p, acts, d)) is not None]
    plain = _prune_plain([o for o in options if not o.swapped])
    return plain + [o for o in options if o.swapped] + _input_swaps(model, p, prefetch)


def _whole_swaps(model: StepModel, p: int, menu: list[Option], prefetch: tuple[int, ...]) -> list[Option]:
    """A compiled layer's whole-layer swaps missing from ``menu``: every unit swapped, and the same with its outputs
    kept (what the coupling rule leaves of it when a consumer in another layer is recomputed)."""
    members = model.positions[p]
    if not members:
        return []
    have = {(o.acts, o.d) for o in menu}
    whole = tuple([S] * len(members))
    pinned = tuple(k for k, i in enumerate(members) if model.units[i].pinned)
    out = [o for d in prefetch if (whole, d) not in have and (o := _option(model, p, whole, d)) is not None]
    if pinned and len(pinned) < len(members):
        kept = tuple(K if k in pinned else S for k in range(len(members)))
        out += [dataclasses.replace(o, coupled=pinned) for d in prefetch if (o := _option(model, p, kept, d)) is not None]
    return out


def exact_menus(model: StepModel, prefetch: tuple[int, ...]) -> bool:
    """Whether every layer gets its complete option set (small models: the MILP is then exact)."""
    sizes = [len(model.positions[p]) for p in model.layer_positions]
    return all(k <= EXACT_UNITS for k in sizes) and sum(3 ** k * len(prefetch) for k in sizes) <= EXACT_OPTIONS


def layer_menu(model: StepModel, p: int, *, prefetch: tuple[int, ...] = (0, 1, 2), limit: int = 40,
               cache: dict | None = None, exact: bool = True) -> list[Option]:
    """The options of position ``p``; identical layers share one computation through ``cache``."""
    whole_only = compiled_blocks(model) and not attributed(model)  # Note: [compiled search space]
    key = (_signature(model, p), prefetch, limit, exact, whole_only)
    if cache is not None and key in cache:
        return cache[key]
    if exact and len(model.positions[p]) <= EXACT_UNITS:
        menu = _exact(model, p, prefetch)
    else:
        menu = _heuristic(model, p, prefetch, limit)
    if whole_only:  # a layer swaps as a whole or not at all
        menu = [o for o in menu if o.input_swap or honoured(model, p, o.acts)] + _whole_swaps(model, p, menu, prefetch)
    if cache is not None:
        cache[key] = menu
    return menu
