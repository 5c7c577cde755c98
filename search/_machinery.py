"""What a plan's machinery costs in Python calls: the one rule the simulator and the calibration count with.

Note: [machinery calls]. Beside its copies and replays, a plan costs the runtime's Python calls: a dispatch call for
each op its dispatch modes or selective-checkpoint policy see, a pack call for each saved tensor its saved-tensor
hooks see and an unpack call for each of those in backward (the runtime counts them: ``FOOTPRINT``,
``adaptive_mem/runtime/_footprint.py``). The count follows a runtime that intercepts only where a decision needs it:

* a layer swapped as a whole: its saved tensors pass the pack hook (and the unpack hook), no op is dispatched in
  Python (every tensor the layer saves is swapped: nothing to tell apart);
* a layer or group recomputed as a whole: nothing of ours (the checkpoint's own hooks are part of its replay);
* an op-level decision (a unit swapped or recomputed in a layer that is not swapped or recomputed as a whole, or a
  unit outside the layers): each forward op of the unit is dispatched once, twice when recomputed (forward and
  replay); the saved tensors of a swapped unit pass the pack and unpack hooks.

Each dispatch call costs ``hardware.dispatch_call_time`` seconds and each pack or unpack call
``hardware.hook_call_time``, both measured by ``adaptive_mem.calibrate`` (0 in profiles without them: the term
vanishes). A position's calls are charged with its replay, before its backward (``position_segment``, as Note:
[swap compute] charges the other mechanism costs), so the simulator and the solvers' menus see them. A whole-layer
recompute with its input swapped (Note: [swapped checkpoint input]) is counted as a whole-layer recompute. A profile recorded without per-op saved-tensor counts (``OpRecord.saved_tensors`` = 0) prices no hook
call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ._assignment import Assignment
from ._model import StepModel
from ._plan import Action

__all__ = ["MachineryCalls", "count_calls", "machinery_time", "position_calls"]


@dataclass(frozen=True)
class MachineryCalls:
    """Python calls of one step's machinery (Note: [machinery calls])."""

    dispatch: int = 0
    pack: int = 0
    unpack: int = 0


def _saved_tensors(model: StepModel, unit: int) -> int:
    ops = model.profile.ops
    return sum(ops[oi].saved_tensors for oi in model.profile.units[model.units[unit].index].ops)


def position_calls(model: StepModel, p: int, acts: Sequence[Action]) -> MachineryCalls:
    """The dispatch, pack and unpack calls per step of position ``p`` with its units' actions ``acts``, outside a
    checkpoint group (Note: [machinery calls])."""
    members = model.positions[p]
    in_layer = model.layer_of(p) is not None
    if not members or (in_layer and all(a is Action.RECOMPUTE for a in acts)):
        return MachineryCalls()
    if in_layer and all(a is Action.SWAP for a in acts):
        pack = sum(_saved_tensors(model, i) for i in members)
        return MachineryCalls(pack=pack, unpack=pack)
    dispatch = pack = 0
    for i, a in zip(members, acts):
        if a is Action.SWAP:
            dispatch += model.units[i].ops
            pack += _saved_tensors(model, i)
        elif a is Action.RECOMPUTE:
            dispatch += 2 * model.units[i].ops
    return MachineryCalls(dispatch=dispatch, pack=pack, unpack=pack)


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
