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
vanishes). A profile recorded without per-op saved-tensor counts (``OpRecord.saved_tensors`` = 0) prices no hook
call.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._assignment import Assignment
from ._model import StepModel
from ._plan import Action

__all__ = ["MachineryCalls", "count_calls", "machinery_time"]


@dataclass(frozen=True)
class MachineryCalls:
    """Python calls of one step's machinery (Note: [machinery calls])."""

    dispatch: int = 0
    pack: int = 0
    unpack: int = 0


def _saved_tensors(model: StepModel, unit: int) -> int:
    ops = model.profile.ops
    return sum(ops[oi].saved_tensors for oi in model.profile.units[model.units[unit].index].ops)


def count_calls(model: StepModel, asg: Assignment) -> MachineryCalls:
    """The dispatch, pack and unpack calls per step of ``asg`` on ``model`` (Note: [machinery calls])."""
    dispatch = pack = 0
    layers = set(model.layer_positions)
    for p, members in enumerate(model.positions):
        acts = [asg.actions[i] for i in members]
        if p in asg.grouped or not members:
            continue
        if p in layers and all(a is Action.RECOMPUTE for a in acts):
            continue
        if p in layers and all(a is Action.SWAP for a in acts):
            pack += sum(_saved_tensors(model, i) for i in members)
            continue
        for i, a in zip(members, acts):
            if a is Action.SWAP:
                dispatch += model.units[i].ops
                pack += _saved_tensors(model, i)
            elif a is Action.RECOMPUTE:
                dispatch += 2 * model.units[i].ops
    return MachineryCalls(dispatch=dispatch, pack=pack, unpack=pack)


def machinery_time(model: StepModel, asg: Assignment) -> float:
    """Seconds the machinery's Python calls add to a step of ``asg`` (Note: [machinery calls])."""
    hw = model.hardware
    per_dispatch, per_hook = hw.dispatch_call_time, hw.hook_call_time
    if per_dispatch <= 0 and per_hook <= 0:
        return 0.0
    calls = count_calls(model, asg)
    return calls.dispatch * per_dispatch + (calls.pack + calls.unpack) * per_hook
