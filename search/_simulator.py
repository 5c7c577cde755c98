"""The step simulator: Profile + Plan + hardware -> peak memory, step time, stalls, timeline.

It implements the Semantics section of ``docs/plan-format.md`` (the executor implements the
same rules). Memory is released at the end of a segment's backward (a segment = one position,
or one group of layers); within a segment nothing is freed, so a segment's peak is just before
its release. The MILP (``_milp.py``) writes exactly these event sums as its memory rows.
"""

from __future__ import annotations

import logging

from profiler import HardwareSpec, Profile

from ._assignment import Assignment, Segment
from ._machinery import MachineryCalls, count_calls, machinery_time, position_calls, select_region
from ._model import StepModel
from ._plan import Action, Plan, PlanError
from ._step_run import StepRun
from ._timeline import Simulation

__all__ = ["Assignment", "Segment", "couple", "position_segment", "read_by_recompute", "resolve", "segments", "simulate", "simulate_assignment",
           "machinery_calls"]

log = logging.getLogger(__name__)


def resolve(model: StepModel, plan: Plan) -> Assignment:
    """Apply targets (Note: [one resolution rule]), groups and the coupling rule to every unit."""
    info = model.profile.layer_info()
    paths = [info.layer_path(i) for i in range(info.count)] if info is not None else []
    plan.check_recompute_inside(paths, info.containers if info is not None else ())
    actions: list[Action] = []
    prefetch: list[int] = []
    for u in model.units:
        decision = plan.decide(u.name)
        actions.append(decision.action)
        prefetch.append(decision.backward_prefetch if decision.action is Action.SWAP else 1)
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
    replay = sum(model.units[i].fwd for i in members) + sum(model.replay_extra[p] for p in positions)
    return Segment(positions, "full", members, hold, inputs, [], sum(model.units[i].saved for i in members), replay)


def position_segment(model: StepModel, p: int, acts: list[Action]) -> Segment:
    """The segment of one position given its units' (resolved) actions."""
    members = model.positions[p]
    recompute = [i for i, a in zip(members, acts) if a is Action.RECOMPUTE]
    if members and len(recompute) == len(members):
        return _full(model, (p,))
    swaps = [i for i, a in zip(members, acts) if a is Action.SWAP]
    hold: dict[int, int] = {}
    sac = bool(recompute)
    # Note: [narrowed select recompute]: the checkpoint covers the region's units, the layer's others run plainly
    region = set(select_region(model, p, acts) or members) if sac else set()
    transient, replay = 0, 0.0
    for i, a in zip(members, acts):
        u = model.units[i]
        if a is Action.RECOMPUTE:
            # Note: [SAC policy] a recomputed unit frees its saved bytes unless it is the layer output
            hold[i] = u.saved if u.pinned else 0
            transient += u.saved
            replay += u.sac_replay_all
        else:
            hold[i] = (0 if a is Action.SWAP else u.saved) + (u.sac_extra if i in region else 0)
            # swapped units' ops are MUST_SAVE (their cached outputs are what is swapped)
            replay += u.sac_replay if i in region and a is not Action.SWAP else 0.0
            if a is Action.SWAP:  # Note: [swap compute] charged before the layer's backward, as replay is
                replay += model.swap_compute(u.saved)
    if sac:  # Note: [swap compute]: the policy's dispatch, in forward and replay, charged likewise
        replay += model.sac_overhead(sum(model.units[i].ops for i in region))
    replay += machinery_time(model, position_calls(model, p, acts))  # Note: [machinery calls]
    # Note: [selective checkpoint input]. A layer under a selective checkpoint runs in a non-reentrant
    # ``torch.utils.checkpoint`` like a whole-layer one: the checkpoint saves the layer's inputs for the replay
    # (``_CheckpointFrame.save_inputs``), whatever the policy caches. Inputs autograd saves anyway (an fp32 block
    # input read by the RMSNorm) are held by their producer and not counted twice; the others (``input_extra``: a
    # bf16 block input, which the norm upcasts before saving) are this segment's, as in ``_full``. The menus'
    # ``held`` and so the MILP's memory rows read them from here.
    inputs = model.input_extra[p] if sac else 0
    return Segment((p,), "sac" if sac else "plain", members, hold, inputs, swaps, transient, replay)


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
    """Run the event timeline of one step (see the module docstring for the release rule; ``_step_run.py``)."""
    return StepRun(model, asg, segments(model, asg), in_flight=in_flight, record=record).run()


def simulate(profile: Profile | StepModel, plan: Plan, *, hardware: HardwareSpec | None = None, in_flight: int = 1,
             record: bool = False) -> Simulation:
    """Predicted peak device memory, step time and stalls of ``plan`` on ``profile``."""
    model = profile if isinstance(profile, StepModel) else StepModel.build(profile, hardware=hardware)
    known = {u.name for u in model.units}
    modules = {n.rsplit(".", k)[0] for n in known for k in range(1, n.count(".") + 1)}
    plan.check_targets(units=known, modules=modules)
    return simulate_assignment(model, resolve(model, plan), in_flight=in_flight, record=record)


def machinery_calls(profile: Profile | StepModel, plan: Plan) -> MachineryCalls:
    """The runtime's Python dispatch, pack and unpack calls per step of ``plan`` on ``profile``, as the simulator
    charges them (Note: [machinery calls] in ``_machinery.py``)."""
    model = profile if isinstance(profile, StepModel) else StepModel.build(profile)
    return count_calls(model, resolve(model, plan))
