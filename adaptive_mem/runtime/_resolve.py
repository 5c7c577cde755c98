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

from profiler._profile import Profile, ProfileError
from profiler._units import COLLECTIVE_LABELS, LayerInfo, find_layers, join, leaf_label
from search._model import StepModel
from search._plan import Action, Decision, Plan, PlanError, matches
from search._simulator import Assignment, segments

from adaptive_mem.runtime._functions import function_labels

__all__ = ["LayerMode", "Resolution", "resolve_plan", "decide", "is_collective_unit", "kept_collectives", "log_plan",
           "OUTSIDE_BEFORE", "PlanSummary", "summarize"]

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
    """The unit's decision: longest matching target; among equal lengths recompute wins (coupling rule 1)."""
    best: list[str] = []
    for target in plan.decisions:
        if matches(target, unit):
            if not best or len(target) > len(best[0]):
                best = [target]
            elif len(target) == len(best[0]):
                best.append(target)
    if not best:
        return Decision(Action.KEEP)
    actions = {plan.decisions[t].action for t in best}
    if Action.RECOMPUTE in actions and Action.SWAP in actions:
        log.info("Unit %s is marked recompute and swap: recompute takes effect, swap does not", unit)
        return Decision(Action.RECOMPUTE)
    return plan.decisions[best[0]]


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
    for path, module in model.named_modules():
        if not path:
            continue
        modules.add(path)
        if next(module.children(), None) is None:
            leaves.add(join(path, leaf_label(module)))
        else:
            inner.add(path)
    return modules, leaves, inner


def resolve_plan(plan: Plan, model: nn.Module, *, units: Iterable[str] | None = None) -> Resolution:
    """Check every target, group and action against ``model``; raise :class:`PlanError` or return the modes."""
    modules, leaves, inner = _catalogue(model)
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
        sample = sorted(u for u in (known_units or leaves))
        hint = ", ".join(sample[:6]) + (", ..." if len(sample) > 6 else "")
        raise PlanError(f"plan.decisions.{target!r}: no such unit or module in this model; expected a module path "
                        f"or a unit name such as {hint}")

    layers = find_layers(model)
    count = layers.count if layers is not None else 0
    paths = [layers.layer_path(i) for i in range(count)] if layers else []
    for target, decision in plan.decisions.items():
        if decision.action is not Action.RECOMPUTE:
            continue
        inside = any(target == p or target.startswith(p + ".") for p in paths)
        covers_layers_only = layers is not None and target in layers.containers
        if not inside and not covers_layers_only:
            where = (" or ".join(f"{c}.N" for c in layers.containers) if layers
                     else "repeated layers (none found in this model)")
            raise PlanError(f"plan.decisions.{target!r}: action recompute outside the repeated layers; expected "
                            f"recompute targets inside {where}")

    modes: list[LayerMode] = []
    for path in paths:
        cover = decide(plan, path).action
        inner_targets = [t for t in plan.decisions if t.startswith(path + ".")]
        actions = {cover} | {plan.decisions[t].action for t in inner_targets}
        if Action.RECOMPUTE not in actions:
            modes.append(LayerMode.SWAP if Action.SWAP in actions else LayerMode.PLAIN)
        elif actions == {Action.RECOMPUTE}:
            modes.append(LayerMode.WHOLE)
        else:
            modes.append(LayerMode.SAC)

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

    input_swaps: dict[int, int] = {}
    grouped = {i for g in groups for i in g}
    for target, decision in plan.decisions.items():
        if not decision.swap_input:
            continue
        covered = [i for i, p in enumerate(paths) if matches(target, p) and decide(plan, p) == decision]
        if not covered or any(modes[i] is not LayerMode.WHOLE for i in covered):
            raise PlanError(f"plan.decisions.{target!r}: swap_input covers part of a layer; expected a whole-layer "
                            "target (the layer's module path) decided recompute")
        for i in covered:
            if i in grouped:
                raise PlanError(f"plan.decisions.{target!r}: swap_input on layer {i} of a checkpoint group; expected "
                                "it on layers recomputed alone")
            if plan.distribute_saved_activations:
                raise PlanError(f"plan.decisions.{target!r}: swap_input with distribute_saved_activations=true; "
                                "expected one of the two for a layer input")
            input_swaps[i] = decision.backward_prefetch

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


@dataclass(frozen=True)
class PlanSummary:
    """What ``optimize`` applied (``OptimizeHandle.summary()``); ``str()`` is the one INFO line it logs."""

    requested: bool
    """The plan decides recompute or swap for some target."""
    layers_recomputed: int
    """Layers recomputed as a whole (checkpointed)."""
    layers_selective: int
    """Layers with some units recomputed (selective checkpoint)."""
    layers_swapping: int
    """Layers that swap some saved tensors and recompute nothing."""
    units_kept: int | None = None
    units_recomputed: int | None = None
    units_swapped: int | None = None
    """Units of the step by the action that takes effect (coupling rules applied where a profile
    gives consumers); None when the units are unknown (neither ``profile`` nor ``example_inputs``)."""
    saved_bytes: int | None = None
    """Planned device bytes of saved activations the plan frees (the simulator's rules); None without a profile."""
    activation_bytes: int | None = None
    """Saved activation bytes the step holds without a plan; None without a profile."""
    not_applied: tuple[tuple[str, str], ...] = ()
    """``(target, why it takes no effect)`` for each recompute/swap target that changes nothing."""

    @property
    def takes_effect(self) -> bool:
        """Some recompute or swap takes effect (and, with a profile, frees device bytes)."""
        if not self.requested:
            return False
        if self.units_recomputed is not None and self.units_recomputed + (self.units_swapped or 0) == 0:
            return False
        return self.saved_bytes is None or self.saved_bytes > 0

    def causes(self) -> str:
        """Why nothing takes effect, for the warning."""
        if self.not_applied:
            return "; ".join(f"{target} ({why})" for target, why in self.not_applied)
        return f"the recomputed/swapped units free no saved bytes (planned saving {self.saved_bytes} bytes)"

    def __str__(self) -> str:
        if not self.requested:
            return "optimize: nothing to recompute or swap (the plan keeps every unit); nothing saved"
        parts = [f"{self.layers_recomputed} layers recomputed, {self.layers_selective} selectively recomputed, "
                 f"{self.layers_swapping} swapping"]
        if self.units_kept is None:
            parts.append("units not counted without a profile or example_inputs")
        else:
            parts.append(f"units: {self.units_recomputed} recomputed, {self.units_swapped} swapped, "
                         f"{self.units_kept} kept")
        if not self.takes_effect:
            parts.append("nothing saved")
        elif self.saved_bytes is None:
            parts.append("bytes unknown without a profile")
        else:
            parts.append(f"planned saving {_size(self.saved_bytes)} of {_size(self.activation_bytes or 0)} activations")
        if self.not_applied:
            parts.append("not applied: " + ", ".join(f"{t} ({why})" for t, why in self.not_applied))
        return "optimize: " + "; ".join(parts)


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the value at 1 or more (``44.0 KiB``, ``1.2 MiB``)."""
    value, unit = float(n), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


def _prefixes(unit: str) -> list[str]:
    """The targets that can cover ``unit``, longest first (``a.b.c``, ``a.b``, ``a``, ``""``)."""
    parts = unit.split(".")
    return [".".join(parts[:k]) for k in range(len(parts), -1, -1)]


def summarize(plan: Plan, res: Resolution, *, units: Iterable[str] | None = None,
              profile: Profile | None = None) -> PlanSummary:
    """What ``plan`` changes on the step whose units are ``units`` (``profile``'s when given)."""
    requested = any(d.action is not Action.KEEP for d in plan.decisions.values())
    counts = dict(requested=requested, layers_recomputed=res.modes.count(LayerMode.WHOLE),
                  layers_selective=res.modes.count(LayerMode.SAC), layers_swapping=res.modes.count(LayerMode.SWAP))
    if units is None:
        return PlanSummary(**counts)
    names = [u.name for u in profile.units] if profile is not None else list(units)
    owners = [next((t for t in _prefixes(u) if t in plan.decisions), None) for u in names]
    actions = [plan.decisions[t].action if t is not None else Action.KEEP for t in owners]
    dropped: dict[int, str] = {}
    if profile is not None:  # the coupling rule: a swap is dropped for a unit a recomputed unit reads
        index = {n: i for i, n in enumerate(names)}
        grouped = {i for g in res.groups for i in g}
        for i, rec in enumerate(profile.units):
            if actions[i] is Action.SWAP:
                for c in rec.consumers:
                    j = index.get(c)
                    if j is not None and (actions[j] is Action.RECOMPUTE or profile.units[j].layer in grouped):
                        dropped[i] = c
                        break
        for i in dropped:
            actions[i] = Action.KEEP
    not_applied = _not_applied(plan, names, owners, actions, dropped, profile)
    saved = activations = None
    if profile is not None:
        try:
            model = StepModel.build(profile)
        except ProfileError:
            model = None
        if model is not None and len(model.units) == len(actions):
            ones = tuple(1 for _ in actions)
            groups = tuple((g[0] + 1, g[-1] + 1) for g in res.groups)
            held = sum(s.held for s in segments(model, Assignment(tuple(actions), ones, groups)))
            activations = sum(s.held for s in segments(model, Assignment((Action.KEEP,) * len(actions), ones)))
            saved = activations - held
    return PlanSummary(**counts, units_kept=actions.count(Action.KEEP),
                       units_recomputed=actions.count(Action.RECOMPUTE), units_swapped=actions.count(Action.SWAP),
                       saved_bytes=saved, activation_bytes=activations, not_applied=tuple(not_applied))


def _not_applied(plan: Plan, names: list[str], owners: list[str | None], actions: list[Action],
                 dropped: dict[int, str], profile: Profile | None) -> list[tuple[str, str]]:
    step = "profiled" if profile is not None else "traced"
    covered: dict[str, int] = {}
    for u in names:
        for t in _prefixes(u):
            if t in plan.decisions:
                covered[t] = covered.get(t, 0) + 1
    out: list[tuple[str, str]] = []
    for target, decision in plan.decisions.items():
        if decision.action is Action.KEEP:
            continue
        owned = [i for i, t in enumerate(owners) if t == target]
        effective = [i for i in owned if actions[i] is decision.action]
        if not covered.get(target):
            out.append((target, f"covers no unit of the {step} step: the module runs no ops"))
        elif not owned:
            out.append((target, "every unit under it is decided by a longer target"))
        elif not effective:
            first = next(i for i in owned if i in dropped)
            out.append((target, f"swap dropped: its output is consumed by recomputed {dropped[first]}"))
        elif profile is not None and not sum(profile.units[i].saved_bytes for i in effective):
            what = "nothing to swap" if decision.action is Action.SWAP else "recomputing frees nothing"
            out.append((target, f"its units save no bytes for backward: {what}"))
    return out
