"""Resolve a Plan onto a model before anything is installed: validation and per-layer modes.

Everything that can be wrong with a plan for a model is found here, so
``optimize`` either installs the whole plan or nothing.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from profiler.naming import named_modules
from profiler.naming import ModelStructure
from profiler.naming import COLLECTIVE_LABELS, LayerInfo, join, leaf_label
from search import Action, Decision, Plan, PlanError
from search.planning import matches

from adaptive_mem.runtime._functions import function_labels

__all__ = ["LayerMode", "Resolution", "resolve_plan", "decide", "is_collective_unit", "kept_collectives", "log_plan",
           "OUTSIDE_BEFORE"]

log = logging.getLogger(__name__)

OUTSIDE_BEFORE = -1
"""Layer index of units before the repeated layers (embeddings); units after them use ``num_layers``."""

_LABEL = re.compile(r"^[a-z][a-z0-9_]*$")


class LayerMode(str, enum.Enum):
    PLAIN = "plain"
    """Nothing to do: the layer runs untouched."""
    WHOLE = "whole"
    """Every unit recomputed: non-reentrant checkpoint of the layer."""
    SAC = "sac"
    """Some units recomputed: checkpoint with the selective policy (Note: [SAC policy])."""
    SWAP = "swap"
    """No recompute, some saved tensors swapped through the saved-tensor hooks."""


@dataclass
class Resolution:
    layers: LayerInfo | None
    """The repeated blocks, or None for a model without them."""
    modes: list[LayerMode] = field(default_factory=list)
    """Per layer index."""
    groups: list[list[int]] = field(default_factory=list)
    """Checkpoint groups of more than one layer."""
    swap_outside_sac: bool = False
    """Some swap target covers units outside SAC layers: the tracker and saved-tensor hooks are needed."""
    provisional: list[str] = field(default_factory=list)
    """Targets that look like op units of non-leaf modules; verified by a trace."""
    input_swaps: dict[int, int] = field(default_factory=dict)
    """Layer index -> ``backward_prefetch`` of the whole-layer recomputes whose checkpoint input is swapped."""

    @property
    def active(self) -> bool:
        return any(m is not LayerMode.PLAIN for m in self.modes) or self.swap_outside_sac


def decide(plan: Plan, unit: str) -> Decision:
    """The unit's decision: :meth:`search.Plan.decide` (Note: [one resolution rule] in ``search/_plan.py``)."""
    return plan.decide(unit)


def is_collective_unit(name: str) -> bool:
    """``layers.0.attention.wo.all_reduce``, ``..._1``: a collective's unit (Note: [collective units])."""
    return re.sub(r"_\d+$", "", name.rpartition(".")[2]) in COLLECTIVE_LABELS


def kept_collectives(plan: Plan, units: Iterable[str]) -> frozenset[str]:
    """Collective units a target decides ``keep`` (not the default keep of unmatched units): their outputs are
    cached in an op-level layer, so its replay does not issue them again (tests/test_parallel_comm.py)."""
    return frozenset(u for u in units if is_collective_unit(u) and decide(plan, u).action is Action.KEEP
                     and any(matches(t, u) for t in plan.decisions))


def _is_op_label(label: str) -> bool:
    """``add``, ``add_1``, ``matmul``, ``flash_attention``...: labels the unit namer gives aten ops."""
    if not _LABEL.match(label):
        return False
    base = re.sub(r"_\d+$", "", label)
    return base in ("matmul", "flash_attention") or hasattr(torch.ops.aten, base) or hasattr(torch.ops.aten, "_" + base)


def _catalogue(model: nn.Module) -> tuple[set[str], set[str], set[str]]:
    """Module paths, leaf unit names, non-leaf module paths (their op units need a trace)."""
    modules, leaves, inner = set(), set(), set()
    for path, module in named_modules(model):  # Note: [compile wrapper names]
        if not path:
            continue
        modules.add(path)
        if next(module.children(), None) is None:
            leaves.add(join(path, leaf_label(module)))
        else:
            inner.add(path)
    return modules, leaves, inner


def _check_targets(plan: Plan, structure: ModelStructure, units: Iterable[str] | None) -> list[str]:
    """Raise :class:`PlanError` for a target that names nothing in ``model``; return the provisional ones (op
    units of non-leaf modules and collectives, checked against a trace at the first forward)."""
    modules, leaves, inner = _catalogue(structure.model)
    known_units = set(units) if units is not None else None
    provisional: list[str] = []
    for target in plan.decisions:
        if target in modules or target in leaves or (known_units is not None and target in known_units):
            continue
        head, _, label = target.rpartition(".")
        if known_units is None and is_collective_unit(target) and (head in modules or head == ""):
            provisional.append(target)  # Note: [collective units]: a layout's collectives exist only under it
            continue
        if known_units is None and (head in inner or head == "") and (
                _is_op_label(label) or re.sub(r"_\d+$", "", label) in function_labels()):
            provisional.append(target)
            continue
        known = modules | leaves | (known_units or set())
        sample = sorted(u for u in (known_units or leaves))
        hint = ", ".join(sample[:6]) + (", ..." if len(sample) > 6 else "")
        raise PlanError(_not_in_its_layer(target, structure, known) or f"plan.decisions.{target!r}: no such unit or "
                        f"module in this model; expected a module path or a unit name such as {hint}")
    return provisional


def resolve_plan(plan: Plan, model: nn.Module, *, units: Iterable[str] | None = None,
                 structure: ModelStructure | None = None) -> Resolution:
    """Check every target, group and action against ``model`` (its ``structure`` when found already); raise
    :class:`PlanError` or return the modes."""
    structure = structure.of_model(model) if structure is not None else ModelStructure.of(model)
    provisional = _check_targets(plan, structure, units)
    layers = structure.layers
    paths = structure.layer_paths
    plan.check_recompute_inside(paths, layers.containers if layers is not None else ())
    modes = [_layer_mode(plan, path) for path in paths]
    groups = _checked_groups(plan, layers, modes, paths)
    input_swaps = _input_swaps(plan, paths, modes, groups)
    swap_outside = False
    for target, decision in plan.decisions.items():
        if decision.action is not Action.SWAP:
            continue
        owner = next((i for i, p in enumerate(paths) if target == p or target.startswith(p + ".")), None)
        if owner is None or modes[owner] is LayerMode.SWAP:
            swap_outside = True
    if plan.distribute_saved_activations and not any(m is LayerMode.WHOLE for m in modes):
        log.warning("distribute_saved_activations is set but no layer is recomputed as a whole: nothing to distribute")
    return Resolution(layers=layers, modes=modes, groups=groups, swap_outside_sac=swap_outside,
                      provisional=provisional, input_swaps=input_swaps)


def _layer_mode(plan: Plan, path: str) -> LayerMode:
    """The mode of the layer at ``path``: from the decision covering it and the targets inside it."""
    actions = plan.layer_actions(path)
    if Action.RECOMPUTE not in actions:
        return LayerMode.SWAP if Action.SWAP in actions else LayerMode.PLAIN
    if actions == {Action.RECOMPUTE}:
        return LayerMode.WHOLE
    return LayerMode.SAC


def _checked_groups(plan: Plan, layers: LayerInfo | None, modes: list[LayerMode], paths: list[str]) -> list[list[int]]:
    """The plan's checkpoint groups of more than one layer: whole-layer recomputes of one stack, disjoint."""
    count = len(paths)
    groups = []
    for g, group in enumerate(plan.groups):
        for i in group:
            if i >= count:
                raise PlanError(f"plan.groups[{g}]={group}: layer {i} does not exist; expected indices below {count}")
            if modes[i] is not LayerMode.WHOLE:
                raise PlanError(f"plan.groups[{g}]={group}: layer {i} is not decided recompute as a whole layer; "
                                f"expected '{paths[i]}: recompute' for every layer of a group")
        if len(group) > 1:
            if len({layers.stack_of(i) for i in group}) > 1:
                raise PlanError(f"plan.groups[{g}]={group}: spans {' and '.join(layers.containers)}; expected the "
                                "layers of one stack in a group")
            groups.append(list(group))
    seen: set[int] = set()
    for group in groups:
        if seen & set(group):
            raise PlanError(f"plan.groups: layer(s) {sorted(seen & set(group))} in two groups; expected disjoint groups")
        seen |= set(group)
    return groups


def _input_swaps(plan: Plan, paths: list[str], modes: list[LayerMode], groups: list[list[int]]) -> dict[int, int]:
    """Layer index -> ``backward_prefetch`` of each whole-layer recompute whose checkpoint input is swapped."""
    input_swaps: dict[int, int] = {}
    grouped = {i for g in groups for i in g}
    for i, (target, decision) in plan.swapped_inputs(paths).items():
        if i in grouped:
            raise PlanError(f"plan.decisions.{target!r}: swap_input on layer {i} of a checkpoint group; expected "
                            "it on layers recomputed alone")
        if plan.distribute_saved_activations:
            raise PlanError(f"plan.decisions.{target!r}: swap_input with distribute_saved_activations=true; "
                            "expected one of the two for a layer input")
        input_swaps[i] = decision.backward_prefetch
    return input_swaps


def _not_in_its_layer(target: str, structure: ModelStructure, known: set[str]) -> str | None:
    """Note: [layer kinds]: the refusal of a target naming a module (or a unit below one) that other layers have but
    not its own (``model.layers.1.linear_attn`` on a full-attention layer of Qwen3-Next), naming the layer's kind
    and what it has instead; None when no other layer has it either."""
    layers = structure.layers
    index, local = layers.split(target) if layers is not None else (None, "")
    if index is None or not local:
        return None
    parts = local.split(".")
    for k in range(1, len(parts) + 1):
        name = ".".join(parts[:k])
        if f"{layers.layer_path(index)}.{name}" in known:
            continue
        elsewhere = [j for j in range(layers.count) if f"{layers.layer_path(j)}.{name}" in known]
        if not elsewhere:
            return None
        kinds = structure.kinds
        have = [m for m in kinds.modules[index] if "." not in m]
        shown = ", ".join(map(str, elsewhere[:8])) + (", ..." if len(elsewhere) > 8 else "")
        return (f"plan.decisions.{target!r}: layer {index} ({layers.layer_path(index)}) is a layer "
                f"{kinds.describe(index)} and has no {name} (layer{'s' if len(elsewhere) > 1 else ''} {shown} "
                f"{'have' if len(elsewhere) > 1 else 'has'} it); expected a module or unit of layer {index}: "
                f"{', '.join(have)}")
    return None


def log_plan(plan: Plan, res: Resolution) -> None:
    """The per-layer lines of the MindFormers logs."""
    if res.layers is None:
        return
    for i, mode in enumerate(res.modes):
        path = res.layers.layer_path(i)
        cover = decide(plan, path)
        if mode is LayerMode.WHOLE:
            log.info("Set full recompute at layer %d", i)
        if cover.action is Action.SWAP and not any(t.startswith(path + ".") for t in plan.decisions):
            log.info("Set layer swap at layer %d and value is: %d", i, cover.backward_prefetch)
        inner = [(t[len(path) + 1:], d) for t, d in plan.decisions.items() if t.startswith(path + ".")]
        rec = [t for t, d in inner if d.action is Action.RECOMPUTE]
        swp = [f"{t}, value={d.backward_prefetch}" for t, d in inner if d.action is Action.SWAP]
        if rec:
            log.info("Set select recompute at layer %d: %s", i, ", ".join(rec))
        if swp:
            log.info("Set op_swap at layer %d: %s", i, ", ".join(swp))
