"""What applying a plan changes: :class:`PlanSummary`, the one INFO line ``optimize`` logs (docs/plan-format.md,
"What ``optimize`` reports")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from profiler import Profile, ProfileError
from search import StepModel
from search import Action, Plan
from search.planning import Assignment, segments

from ._resolve import LayerMode, Resolution

__all__ = ["PlanSummary", "summarize"]


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
