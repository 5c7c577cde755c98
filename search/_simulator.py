"""The step simulator: Profile + Plan + hardware -> peak memory, step time, stalls, timeline.

It implements the Semantics section of ``docs/plan-format.md`` (the executor implements the
same rules). Memory is released at the end of a segment's backward (a segment = one position,
or one group of layers); within a segment nothing is freed, so a segment's peak is just before
its release. The MILP (``_milp.py``) writes exactly these event sums as its memory rows.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from profiler._profile import HardwareSpec, Profile

from ._model import StepModel
from ._plan import Action, Plan, PlanError
from ._timeline import Interval, Simulation, Timeline

__all__ = ["Assignment", "Segment", "couple", "position_segment", "read_by_recompute", "resolve", "segments", "simulate", "simulate_assignment"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    """A plan resolved onto units: one action and prefetch distance per unit, plus groups."""

    actions: tuple[Action, ...]
    """Per unit (``StepModel.units`` order)."""
    prefetch: tuple[int, ...]
    """Per unit: ``backward_prefetch`` of swapped units (ignored for the others)."""
    groups: tuple[tuple[int, int], ...] = ()
    """(first position, last position) of each group of layers checkpointed together."""
    inputs: tuple[tuple[int, int], ...] = ()
    """(position, prefetch) of each layer recomputed as a whole whose checkpoint input is swapped
    (Note: [swapped checkpoint input])."""

    @functools.cached_property
    def grouped(self) -> frozenset[int]:
        """Positions inside a checkpoint group."""
        return frozenset(p for a, b in self.groups for p in range(a, b + 1))


@dataclass
class Segment:
    positions: tuple[int, ...]
    mode: str
    """``plain`` (no recompute), ``sac`` (op-level recompute) or ``full`` (whole layer / group)."""
    units: list[int]
    hold: dict[int, int]
    """Bytes each unit leaves on the device at its forward end (swapped bytes excluded)."""
    inputs: int
    """Bytes of inputs a full checkpoint holds that are not saved anyway."""
    swaps: list[int]
    transient: int
    replay: float
    in_swap: int = 0
    """Bytes of the checkpoint input swapped out after the forward and back before the replay (held by the
    previous position: only the copies and the reload are this segment's)."""
    in_prefetch: int = 1

    @property
    def held(self) -> int:
        return self.inputs + sum(self.hold.values())


def resolve(model: StepModel, plan: Plan) -> Assignment:
    """Apply targets (Note: [one resolution rule]), groups and the coupling rule to every unit."""
    actions: list[Action] = []
    prefetch: list[int] = []
    for u in model.units:
        decision = plan.decide(u.name)
        if decision.action is Action.RECOMPUTE and model.layer_of(u.position) is None:
            raise PlanError(f"plan: unit {u.name!r} is decided recompute outside the repeated layers; expected "
                            f"recompute targets inside {_layer_pattern(model)}")
        actions.append(decision.action)
        prefetch.append(decision.backward_prefetch if decision.action is Action.SWAP else 1)
    info = model.profile.layer_info()
    paths = [info.layer_path(i) for i in range(info.count)] if info is not None else []
    groups = _groups(model, plan, paths)
    grouped = {p for a, b in groups for p in range(a, b + 1)}
    inputs: list[tuple[int, int]] = []
    for layer, (target, decision) in sorted(plan.swapped_inputs(paths).items()):
        if layer + 1 in grouped:
            raise PlanError(f"plan.decisions.{target!r}: swap_input on a layer of a checkpoint group; expected it on "
                            "layers recomputed alone")
        inputs.append((layer + 1, decision.backward_prefetch))
    return couple(model, Assignment(tuple(actions), tuple(prefetch), tuple(groups), tuple(inputs)))


def _groups(model: StepModel, plan: Plan, paths: list[str]) -> list[tuple[int, int]]:
    """(first position, last position) of each checkpoint group; :class:`PlanError` for a group that is not of
    layers recomputed as a whole in one stack."""
    groups: list[tuple[int, int]] = []
    n = model.num_layers
    for g in plan.groups:
        if g[-1] >= n:
            raise PlanError(f"plan.groups={plan.groups!r}: layer {g[-1]} out of range (model has {n} layers)")
        for layer in g:
            if plan.layer_actions(paths[layer]) != {Action.RECOMPUTE}:
                raise PlanError(f"plan.groups: layer {layer} of group {g} must be decided recompute as a whole layer")
        if not any(a <= g[0] + 1 and g[-1] + 1 <= b for a, b in model.stack_ranges()):
            raise PlanError(f"plan.groups: group {g} spans two stacks of layers; expected the layers of one stack")
        groups.append((g[0] + 1, g[-1] + 1))
    return groups


def read_by_recompute(model: StepModel, asg: Assignment, i: int) -> bool:
    """Whether a recomputed unit (or a layer of a checkpoint group) consumes unit ``i``'s output: the coupling rule
    drops a swap of ``i``."""
    return any(asg.actions[c] is Action.RECOMPUTE or model.units[c].position in asg.grouped
               for c in model.units[i].consumers)


def couple(model: StepModel, asg: Assignment) -> Assignment:
    """The coupling rule: a swap is dropped for a unit whose output a recomputed unit consumes."""
    actions = list(asg.actions)
    for u in model.units:
        if actions[u.index] is Action.SWAP and read_by_recompute(model, asg, u.index):
            log.info("swap of %s dropped: its output is consumed by a recomputed unit", u.name)
            actions[u.index] = Action.KEEP
    return Assignment(tuple(actions), asg.prefetch, asg.groups, asg.inputs)


def _full(model: StepModel, positions: tuple[int, ...]) -> Segment:
    members = [i for p in positions for i in model.positions[p]]
    inside = set(positions)
    if len(positions) == 1:
        pinned = {i for i in members if model.units[i].pinned}
        inputs = model.input_extra[positions[0]]
    else:
        pinned = {i for i in members if any(model.units[c].position not in inside for c in model.units[i].consumers)}
        inputs, seen = 0, set()
        for u in model.units:
            if u.position in inside or u.saved or u.index in seen:
                continue
            if any(model.units[c].position in inside for c in u.consumers):
                seen.add(u.index)
                inputs += u.output
    hold = {i: model.units[i].saved for i in pinned}
    return Segment(positions, "full", members, hold, inputs, [], sum(model.units[i].saved for i in members),
                   sum(model.units[i].fwd for i in members))


def position_segment(model: StepModel, p: int, acts: list[Action]) -> Segment:
    """The segment of one position given its units' (resolved) actions."""
    members = model.positions[p]
    recompute = [i for i, a in zip(members, acts) if a is Action.RECOMPUTE]
    if members and len(recompute) == len(members):
        return _full(model, (p,))
    swaps = [i for i, a in zip(members, acts) if a is Action.SWAP]
    hold: dict[int, int] = {}
    sac = bool(recompute)
    transient, replay = 0, 0.0
    for i, a in zip(members, acts):
        u = model.units[i]
        if a is Action.RECOMPUTE:
            # Note: [SAC policy] a recomputed unit frees its saved bytes unless it is the layer output
            hold[i] = u.saved if u.pinned else 0
            transient += u.saved
            replay += u.sac_replay_all
        else:
            hold[i] = (0 if a is Action.SWAP else u.saved) + (u.sac_extra if sac else 0)
            # swapped units' ops are MUST_SAVE (their cached outputs are what is swapped)
            replay += u.sac_replay if sac and a is not Action.SWAP else 0.0
            if a is Action.SWAP:  # Note: [swap compute] charged before the layer's backward, as replay is
                replay += model.swap_compute(u.saved)
    if sac:  # Note: [swap compute]: the policy's dispatch, in forward and replay, charged likewise
        replay += model.sac_overhead(sum(model.units[i].ops for i in members))
    return Segment((p,), "sac" if sac else "plain", members, hold, 0, swaps, transient, replay)


def segments(model: StepModel, asg: Assignment) -> list[Segment]:
    """The segments of a step in forward order, with what each holds, replays and swaps."""
    group_of = {a: b for a, b in asg.groups}
    swapped_in = dict(asg.inputs)
    out: list[Segment] = []
    p = 0
    while p < len(model.positions):
        if p in group_of:
            out.append(_full(model, tuple(range(p, group_of[p] + 1))))
            p = group_of[p] + 1
            continue
        members = model.positions[p]
        seg = position_segment(model, p, [asg.actions[i] for i in members])
        if p in swapped_in and seg.mode == "full" and model.input_swap[p]:
            seg.in_swap, seg.in_prefetch = model.input_swap[p], swapped_in[p]
        out.append(seg)
        p += 1
    return out


def simulate_assignment(model: StepModel, asg: Assignment, *, in_flight: int = 1,
                        record: bool = False) -> Simulation:
    """Run the event timeline of one step (see the module docstring for the release rule)."""
    segs = segments(model, asg)
    units = model.units
    events: list[tuple[float, int, int]] = []  # (time, +bytes / -bytes, order)
    intervals: list[Interval] = []

    def add(time: float, delta: int) -> None:
        if delta:
            events.append((time, delta, len(events)))

    held_total = sum(s.held for s in segs)
    add(0.0, (in_flight - 1) * held_total)
    t, stream = 0.0, 0.0
    swapped = 0
    spilled: dict[int, int] = {}  # unit -> bytes of its swap on the disk tier (beyond model.host_budget)
    for seg in segs:
        add(t, seg.inputs)
        start = t
        swaps = set(seg.swaps)
        for i in seg.units:
            u = units[i]
            t += u.fwd
            add(t, seg.hold.get(i, 0))
            if i in swaps:
                add(t, u.saved)
                c0 = max(stream, t)
                spilled[i] = model.spill(swapped, u.saved)
                stream = c0 + model.d2h(u.saved, spilled[i])
                add(stream, -u.saved)
                swapped += u.saved
                if record:
                    intervals.append(Interval("copy", "d2h", c0, stream, u.name))
        if seg.in_swap:  # Note: [swapped checkpoint input]: copied out once the layer's forward returned
            p = seg.positions[0]
            c0 = max(stream, t)
            spilled[-p] = model.spill(swapped, seg.in_swap)
            stream = c0 + model.d2h(seg.in_swap, spilled[-p])
            add(stream, -seg.in_swap)
            swapped += seg.in_swap
            if record:
                intervals.append(Interval("copy", "d2h", c0, stream, f"{_seg_name(model, seg)} input"))
        if record and seg.units:
            intervals.append(Interval("compute", "forward", start, t, _seg_name(model, seg)))

    last = len(model.positions) - 1
    issue: dict[int, list[int]] = {}
    for seg in segs:
        for i in seg.swaps:
            d = asg.prefetch[i]
            if d > 0:
                issue.setdefault(min(units[i].position + d, last), []).append(i)
        if seg.in_swap and seg.in_prefetch > 0:  # an input is keyed -position (unit keys are >= 0)
            issue.setdefault(min(seg.positions[0] + seg.in_prefetch, last), []).append(-seg.positions[0])
    land: dict[int, float] = {}

    def reload(key: int, label: str) -> None:
        nonlocal stream
        nbytes = units[key].saved if key >= 0 else model.input_swap[-key]
        add(t, nbytes)
        c0 = max(stream, t)
        stream = land[key] = c0 + model.h2d(nbytes, spilled.get(key, 0))
        if record:
            intervals.append(Interval("copy", "h2d", c0, stream, label))

    def wait(key: int, label: str) -> None:
        nonlocal t, stall
        if land[key] > t:
            if record:
                intervals.append(Interval("compute", "stall", t, land[key], label))
            stall += land[key] - t
            t = land[key]

    segs_at = {seg.positions[0]: seg for seg in segs}
    stall = replay = 0.0
    add(t, model.boundary)
    for k, seg in enumerate(reversed(segs)):
        due = sorted((i for p in seg.positions for i in issue.get(p, [])),
                     key=lambda i: (i, -(1 << 62)) if i < 0 else (-units[i].position, -i))
        for i in due:
            reload(i, units[i].name if i >= 0 else f"{_seg_name(model, segs_at[-i])} input")
        if seg.in_swap:
            key = -seg.positions[0]
            if seg.in_prefetch == 0:
                reload(key, f"{_seg_name(model, seg)} input")
            wait(key, f"{_seg_name(model, seg)} input")
        temp = max(model.grad_temp[p] for p in seg.positions) if model.grad_temp else 0
        add(t, seg.transient + temp)  # temp: a new gradient before its accumulation (resident gradients)
        add(t, sum(model.grads[p] for p in seg.positions))
        if seg.replay:
            if record:
                intervals.append(Interval("compute", "recompute", t, t + seg.replay, _seg_name(model, seg)))
            t += seg.replay
            replay += seg.replay
        start = t
        swaps = set(seg.swaps)
        for i in reversed(seg.units):
            u = units[i]
            if i in swaps:
                if asg.prefetch[i] == 0:
                    reload(i, u.name)
                wait(i, u.name)
            t += u.bwd
        if record and seg.units:
            intervals.append(Interval("compute", "backward", start, t, _seg_name(model, seg)))
        add(t, -(seg.held + seg.transient + temp + sum(units[i].saved for i in seg.swaps)))
        if k == 0:
            add(t, -model.boundary)

    # In time order; at equal times in order of occurrence (a copy completion is known when issued).
    events.sort(key=lambda e: (e[0], e[2]))
    level, peak = 0, 0
    memory: list[tuple[float, int]] = []
    for time, delta, _ in events:
        level += delta
        peak = max(peak, level)
        if record:
            memory.append((time, model.base + level))
    timeline = Timeline(intervals, memory) if record else None
    return Simulation(peak_bytes=model.base + peak, step_time=t + model.other_time, stall_time=stall,
                      recompute_time=replay, activation_peak=peak, swapped_bytes=swapped, timeline=timeline,
                      spilled_bytes=sum(spilled.values()))


def _seg_name(model: StepModel, seg: Segment) -> str:
    names = []
    for p in seg.positions:
        layer = model.layer_of(p)
        names.append(f"layer {layer}" if layer is not None else ("pre" if p == 0 else "post"))
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def _layer_pattern(model: StepModel) -> str:
    info = model.profile.layer_info()
    return " or ".join(f"{c}.N" if c else "N" for c in info.containers) if info else "the layers"


def simulate(profile: Profile | StepModel, plan: Plan, *, hardware: HardwareSpec | None = None, in_flight: int = 1,
             record: bool = False) -> Simulation:
    """Predicted peak device memory, step time and stalls of ``plan`` on ``profile``."""
    model = profile if isinstance(profile, StepModel) else StepModel.build(profile, hardware=hardware)
    known = {u.name for u in model.units}
    modules = {n.rsplit(".", k)[0] for n in known for k in range(1, n.count(".") + 1)}
    plan.check_targets(units=known, modules=modules)
    return simulate_assignment(model, resolve(model, plan), in_flight=in_flight, record=record)
