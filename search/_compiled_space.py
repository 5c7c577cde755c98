"""The plans searched on a profile of a compiled model.

Note: [compiled search space]. A profile of the model compiled per block or whole (``profile.compiled["layout"]``)
measures what the compiled graphs save. When its rows carry ``units`` (what each block's partitioned forward graph
saves, per unit: Note: [compiled profile]), its per-unit figures are the graph's, and every plan the eager model
takes is in the space: the executor runs op-level recompute through the compiled selective-checkpoint policy and
every swap inside the compiled graphs (the block's or the whole model's), mixed in one layer or not. Without
``units`` (profiles written before they were read from the graph), a block's bytes are spread over its units in
proportion and are good for whole-layer decisions only: a layer position then takes no swap (any keep / recompute
mix, the whole layer recomputed with or without its input swapped) or every unit swapped at one prefetch
distance; positions outside the layers take anything. The milp's menus hold only these options, every solver's
assignment is projected into the space before it is judged (a layer with swaps and no recompute swaps whole, one
mixing swaps with recompute is recomputed whole), and the plan names a whole-layer swap by the layer's path.
Guarded by tests/test_compiled_space.py.
"""

from __future__ import annotations

from ._model import StepModel
from ._plan import Action
from ._simulator import Assignment, couple, read_by_recompute

__all__ = ["attributed", "compiled_blocks", "honoured", "project", "whole_swap"]


def compiled_blocks(model: StepModel) -> bool:
    """Whether ``model``'s layers run compiled (a profile measured compiled per block or whole)."""
    compiled = model.profile.compiled
    return compiled is not None and compiled.get("layout") in ("per-block", "whole-model")


def attributed(model: StepModel) -> bool:
    """Whether ``model``'s compiled profile says what each block's graph saves per unit (every row's ``units``;
    Note: [compiled search space])."""
    rows = model.profile.compiled["layers"] if compiled_blocks(model) else []
    return bool(rows) and all("units" in row for row in rows)


def honoured(model: StepModel, p: int, acts: tuple[Action, ...] | list[Action]) -> bool:
    """Whether position ``p`` with the units' actions ``acts`` (before coupling) is in the space: judged on figures
    good for it (Note: [compiled search space])."""
    if model.layer_of(p) is None or not compiled_blocks(model) or Action.SWAP not in acts or attributed(model):
        return True
    return all(a is Action.SWAP for a in acts)


def whole_swap(model: StepModel, asg: Assignment, p: int) -> bool:
    """Whether layer position ``p`` is swapped as a whole in ``asg`` (after coupling): every unit swapped at one
    prefetch distance, but for layer outputs whose swap the coupling rule dropped (a recomputed consumer)."""
    members = model.positions[p]
    if not members or model.layer_of(p) is None:
        return False
    swaps = [i for i in members if asg.actions[i] is Action.SWAP]
    if not swaps or len({asg.prefetch[i] for i in swaps}) > 1:
        return False
    return all(asg.actions[i] is Action.SWAP or (asg.actions[i] is Action.KEEP and model.units[i].pinned
                                                 and read_by_recompute(model, asg, i)) for i in members)


def project(model: StepModel, asg: Assignment) -> Assignment:
    """``asg`` with every layer position outside the space brought into it: a layer with swaps and no recompute
    swaps every unit (less memory held; the distance of its first swap); a layer mixing swaps with recompute is
    recomputed as a whole (the layers a whole-layer recompute frees, no swap inside a block's checkpoint)."""
    if not compiled_blocks(model):
        return asg
    actions, prefetch = list(asg.actions), list(asg.prefetch)
    changed = False
    for p in model.layer_positions:
        members = model.positions[p]
        acts = [actions[i] for i in members]
        if honoured(model, p, acts) or whole_swap(model, asg, p):
            continue
        changed = True
        if Action.RECOMPUTE in acts:
            for i in members:
                actions[i] = Action.RECOMPUTE
        else:
            d = next(prefetch[i] for i in members if actions[i] is Action.SWAP)
            for i in members:
                actions[i], prefetch[i] = Action.SWAP, d
    if not changed:
        return asg
    return couple(model, Assignment(tuple(actions), tuple(prefetch), asg.groups, asg.inputs))
