"""What a plan's machinery costs in Python calls: the one rule the simulator and the calibration count with.

Note: [machinery calls]. Beside its copies and replays, a plan costs the runtime's Python calls: a dispatch call for
each op its dispatch modes or selective-checkpoint policy see, a pack call for each saved tensor its saved-tensor
hooks see and an unpack call for each of those in backward (the runtime counts them: ``FOOTPRINT``,
``adaptive_mem/runtime/_footprint.py``). The count follows a runtime that intercepts only where a decision needs it
(Note: [swap scopes] in ``_op_swap.py``, Note: [narrowed select recompute] in ``_sac_policy.py``); an op is
dispatched ``1 + view_ops`` times (its views with it), a saved tensor packed and unpacked once:

* a layer swapped as a whole: the tensors saved by its ops, and by the later ops reading their outputs, pass the
  pack hook; no op is dispatched in Python (every tensor the layer saves is swapped: nothing to tell apart);
* a layer or group recomputed as a whole: nothing of ours (the checkpoint's own hooks are part of its replay);
* op-level swaps: the ops of each swapped unit's module (its scope) are dispatched; the tensors they save, and
  those saved by the readers of their outputs, are packed; a scope whose swapped units all leave the module running
  them (or enter a module below it) before anything saves them dispatches nothing and packs only their readers'
  saved tensors (Note: [scopes by their boundaries] in ``_scope_marks.py``: after the first step; a reader in the
  same module's code that saves anything counts as saving the unit's tensor);
* op-level recompute in a layer of units that are modules of their own, read by modules of the layer (Note:
  [recompute at pack]): the readers' saved tensors pass the pack and unpack hooks, no op is dispatched;
* other op-level recompute in a layer: the policy sees the ops of the innermost module below the layer holding the
  recomputed units and their readers (the whole layer where there is none, or where the layer swaps too) once in
  forward; its calls in the replay, which stops early, are fewer and not counted; swapped units of such a layer
  pack their own saved tensors.

What the runtime does beyond this (hooks kept entered past a scope whose output holds a swapped storage up to its
last save, so the other saves between pack too: Note: [hooks leave after the last save] in
``adaptive_mem/runtime/_escapes.py``; the replay's calls) makes the counted calls differ from these by a small
factor; ``bench_machinery.py`` prints both.

Each dispatch call costs ``hardware.dispatch_call_time`` seconds and each pack or unpack call
``hardware.hook_call_time``, both measured by ``adaptive_mem.calibrate`` (0 in profiles without them: the term
vanishes). A position's calls are charged with its replay, before its backward (``position_segment``, as Note:
[swap compute] charges the other mechanism costs), so the simulator and the solvers' menus see them. A whole-layer
recompute with its input swapped (Note: [swapped checkpoint input]) is counted as a whole-layer recompute. A profile
recorded before ``OpRecord.saved_tensors`` and ``view_ops`` prices no hook call and one dispatch call per op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ._assignment import Assignment
from ._model import StepModel
from ._plan import Action

__all__ = ["MachineryCalls", "count_calls", "machinery_time", "position_calls", "select_region"]


@dataclass(frozen=True)
class MachineryCalls:
    """Python calls of one step's machinery (Note: [machinery calls])."""

    dispatch: int = 0
    pack: int = 0
    unpack: int = 0


def _unit_ops(model: StepModel, i: int) -> list[int]:
    return model.profile.units[model.units[i].index].ops


def _module(model: StepModel, i: int) -> str:
    ops = _unit_ops(model, i)
    return model.profile.ops[ops[0]].module if ops else ""


def _under(path: str, scope: str) -> bool:
    return path == scope or path.startswith(scope + ".")


def _dispatches(model: StepModel, ops: Iterable[int]) -> int:
    return sum(1 + model.profile.ops[o].view_ops for o in ops)


def _hooked(model: StepModel, ops: set[int]) -> int:
    """Pack calls of the tensors saved by ``ops`` and by the later ops that read their outputs."""
    prof = model.profile
    readers = {c for o in ops for c in prof.ops[o].consumers}
    return sum(prof.ops[o].saved_tensors for o in ops | readers)


def _at_pack(model: StepModel, p: int, recomputed: list[int]) -> bool:
    """Every recomputed unit of layer position ``p`` is recomputed at pack (Note: [recompute at pack] in
    ``adaptive_mem/runtime/_pack_recompute.py``): a module of its own, or one op of a module's code below the layer
    (Note: [single-op recompute at pack]), whose ops do not save their output, read by modules inside the layer
    and by no other recomputed unit
    (what the profile cannot tell, random numbers, in-place writes and the op's producers, is not checked)."""
    prof, layer = model.profile, model.profile.layer_path(model.layer_of(p))
    names = {model.units[i].name: i for i in model.positions[p]}
    again = {model.units[i].name for i in recomputed}
    for i in recomputed:
        ops = [prof.ops[o] for o in _unit_ops(model, i)]
        readers = prof.units[model.units[i].index].consumers
        if again.intersection(readers):  # a recipe would hold a recomputed output
            return False
        own = ops and all(op.module == model.units[i].name for op in ops)
        one_op = len(ops) == 1 and ops[0].module.startswith(layer + ".")
        if not (own or one_op) or any(op.saves_outputs for op in ops) or not readers \
                or any(r not in names or _module(model, names[r]) == layer for r in readers):
            return False
    return True


def select_region(model: StepModel, p: int, acts: Sequence[Action]) -> list[int] | None:
    """The units of layer position ``p`` a select recompute replays: the recomputed units alone when recomputed at
    pack (:func:`_at_pack`), else those of the innermost module below the layer holding the recomputed units and
    their readers in the layer (Note: [narrowed select recompute] in ``adaptive_mem/runtime/_sac_policy.py``); None
    for the whole layer (no such module, or the layer swaps too)."""
    members = model.positions[p]
    recomputed = [i for i, a in zip(members, acts) if a is Action.RECOMPUTE]
    if not recomputed or any(a is Action.SWAP for a in acts) or model.layer_of(p) is None:
        return None
    if _at_pack(model, p, recomputed):
        return recomputed
    names = {model.units[i].name: i for i in members}
    held = recomputed + [names[c] for i in recomputed for c in model.profile.units[model.units[i].index].consumers
                         if c in names]
    parts = _module(model, held[0]).split(".")
    for i in held[1:]:
        other = _module(model, i).split(".")
        n = next((k for k, (a, b) in enumerate(zip(parts, other)) if a != b), min(len(parts), len(other)))
        parts = parts[:n]
    scope = ".".join(parts)
    if not scope.startswith(model.profile.layer_path(model.layer_of(p)) + "."):
        return None
    return [i for i in members if _under(_module(model, i), scope)]


def position_calls(model: StepModel, p: int, acts: Sequence[Action]) -> MachineryCalls:
    """The dispatch, pack and unpack calls per step of position ``p`` with its units' actions ``acts``, outside a
    checkpoint group (Note: [machinery calls])."""
    members = model.positions[p]
    in_layer = model.layer_of(p) is not None
    swapped = [i for i, a in zip(members, acts) if a is Action.SWAP]
    recomputed = [i for i, a in zip(members, acts) if a is Action.RECOMPUTE]
    if not members or (in_layer and len(recomputed) == len(members)) or not (swapped or recomputed):
        return MachineryCalls()
    ops = {o for i in members for o in _unit_ops(model, i)}
    if in_layer and len(swapped) == len(members):
        pack = _hooked(model, ops)
        return MachineryCalls(pack=pack, unpack=pack)
    if recomputed and in_layer:  # the policy sees the region's ops (the replay's fewer calls are not counted)
        if not swapped and _at_pack(model, p, recomputed):  # no dispatch: hooks on the readers' saved tensors
            readers = {c for i in recomputed for o in _unit_ops(model, i) for c in model.profile.ops[o].consumers}
            pack = sum(model.profile.ops[o].saved_tensors for o in readers)
            return MachineryCalls(pack=pack, unpack=pack)
        inside = select_region(model, p, acts)
        region = ops if inside is None else {o for i in inside for o in _unit_ops(model, i)}
        pack = _hooked(model, {o for i in swapped for o in _unit_ops(model, i)})
        return MachineryCalls(dispatch=_dispatches(model, region), pack=pack, unpack=pack)
    scopes = {_module(model, i) for i in swapped if not _at_boundary(model, i)}  # the scopes keeping the tracker
    scoped = {o for i in swapped if _module(model, i) in scopes for o in _unit_ops(model, i)}
    scoped |= {o for o in ops if any(s and _under(model.profile.ops[o].module, s) for s in scopes)}
    found = {o for i in swapped if _module(model, i) not in scopes for o in _unit_ops(model, i)}
    prof = model.profile
    packed = scoped | {c for o in scoped | found for c in prof.ops[o].consumers}  # a found unit's own saves: none
    pack = sum(prof.ops[o].saved_tensors for o in packed)
    return MachineryCalls(dispatch=_dispatches(model, scoped), pack=pack, unpack=pack)


def _at_boundary(model: StepModel, i: int) -> bool:
    """Unit ``i``'s outputs leave the module running it, or enter a module below it, before anything saves them (Note:
    [scopes by their boundaries]): no op of it saves its output and no reader in the same module's code saves
    anything."""
    prof = model.profile
    ops = _unit_ops(model, i)
    own = set(ops)
    module = prof.ops[ops[0]].module if ops else None
    for o in ops:
        if prof.ops[o].saves_outputs:
            return False
        readers = (prof.ops[c] for c in prof.ops[o].consumers if c not in own)
        if any(r.module == module and r.saved_tensors for r in readers):
            return False
    return bool(ops)


def count_calls(model: StepModel, asg: Assignment) -> MachineryCalls:
    """The calls per step of ``asg`` on ``model``: the sum of :func:`position_calls` (Note: [machinery calls])."""
    dispatch = pack = unpack = 0
    for p, members in enumerate(model.positions):
        if p not in asg.grouped:
            calls = position_calls(model, p, [asg.actions[i] for i in members])
            dispatch, pack, unpack = dispatch + calls.dispatch, pack + calls.pack, unpack + calls.unpack
    return MachineryCalls(dispatch=dispatch, pack=pack, unpack=unpack)


def machinery_time(model: StepModel, calls: MachineryCalls) -> float:
    """Seconds ``calls`` take at the hardware's per-call costs (Note: [machinery calls])."""
    hw = model.hardware
    return calls.dispatch * hw.dispatch_call_time + (calls.pack + calls.unpack) * hw.hook_call_time
