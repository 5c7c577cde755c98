"""The ``Plan`` data type: keep / recompute / swap for each unit of a model.

Every solver returns a Plan, every config front-end produces one, and the
executor applies one. The file form (YAML or JSON, same schema) is documented
in ``docs/plan-format.md`` and loaded with safe parsers only.
"""

from __future__ import annotations

import enum
import json
import logging
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from profiler.naming import COMPILE_CHILD, module_path

from ._buckets import seq_len_bucket
from ._plan_buckets import PlanError, buckets_to_list, parse_buckets
from ._yaml import load_document

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "Action", "Decision", "Plan", "PlanError", "KEEP"]

log = logging.getLogger(__name__)

PLAN_FORMAT = "adaptive-mem-plan"
PLAN_VERSION = 1
MAX_PREFETCH = 2**31 - 1
"""The largest ``backward_prefetch``: any count past the layers left already means "at the start of backward"."""


class Action(str, enum.Enum):
    KEEP = "keep"
    """Leave the saved activations on the device until backward."""
    RECOMPUTE = "recompute"
    """Drop them after forward and run the forward again before backward needs them."""
    SWAP = "swap"
    """Copy them to host memory after forward, prefetch them back before backward."""


def _check_options(action: Action, prefetch: Any, swap_input: Any, *, where: str) -> None:
    """``backward_prefetch`` and ``swap_input`` of a decision (``where``: the key prefix the message names)."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 0 <= prefetch <= MAX_PREFETCH:
        raise PlanError(f"{where}backward_prefetch={_short(prefetch)}: expected an integer >= 0 and <= {MAX_PREFETCH}")
    if not isinstance(swap_input, bool):
        raise PlanError(f"{where}swap_input={_short(swap_input)}: expected true or false")
    if swap_input and action is not Action.RECOMPUTE:
        raise PlanError(f"{where}swap_input=true with action {action.value}: expected action recompute (the input "
                        "of a layer recomputed as a whole)")


@dataclass(frozen=True)
class Decision:
    action: Action
    """What to do with the target's saved activations."""
    backward_prefetch: int = 1
    """Swap (and ``swap_input``): the reload starts this many layers before the using layer's backward; 0 = when
    unpacked."""
    swap_input: bool = False
    """Recompute of a whole layer only: its checkpoint input (the hidden states it is called with) also leaves
    the device after the layer's forward and is reloaded before its recompute (Note: [swapped checkpoint input])."""

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):
            object.__setattr__(self, "action", _action(self.action, "action"))
        _check_options(self.action, self.backward_prefetch, self.swap_input, where="")

    def to_dict(self) -> dict[str, Any]:
        if self.action is Action.SWAP:
            return {"action": self.action.value, "backward_prefetch": self.backward_prefetch}
        if self.swap_input:
            return {"action": self.action.value, "swap_input": True, "backward_prefetch": self.backward_prefetch}
        return {"action": self.action.value}


KEEP = Decision(Action.KEEP)


def _action(value: Any, where: str) -> Action:
    if isinstance(value, Action):
        return value
    if isinstance(value, str) and value in Action._value2member_map_:
        return Action(value)
    raise PlanError(f"{where}={_short(value)}: expected one of keep, recompute, swap")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong, _REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 24, 2, 5, 5


def _short(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters: a YAML alias can make a value of 10**9 items."""
    return _REPR.repr(value)


def _check_model(model: dict[str, Any]) -> None:
    """The described fields are compared with the profile or model a plan is used on: they must be of their form."""
    for key in ("batch_size", "seq_len", "num_layers"):
        value = model.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise PlanError(f"plan.model.{key}={_short(value)}: expected a positive integer or null")
    for key in ("spec", "dtype"):
        value = model.get(key)
        if value is not None and not isinstance(value, str):
            raise PlanError(f"plan.model.{key}={_short(value)}: expected a string or null")


def _parse_decision(target: Any, spec: Any) -> Decision:
    """One ``plan.decisions`` entry: ``recompute`` (short form) or ``{action: ..., backward_prefetch: N,
    swap_input: B}``."""
    where = f"plan.decisions.{target}"
    if not isinstance(target, str) or not target:
        raise PlanError(f"plan.decisions key {_short(target)}: expected a unit or module name")
    if isinstance(spec, str):
        spec = {"action": spec}
    if not isinstance(spec, dict):
        raise PlanError(f"{where}={_short(spec)}: expected {{action: keep|recompute|swap, backward_prefetch: N}}")
    extra = [k for k in spec if k not in ("action", "backward_prefetch", "swap_input")]
    if extra:
        raise PlanError(f"{where}.{extra[0]}: unknown key; expected action, backward_prefetch, swap_input")
    if "action" not in spec:
        raise PlanError(f"{where}.action: missing; expected one of keep, recompute, swap")
    action = _action(spec["action"], f"{where}.action")
    prefetch, swap_input = spec.get("backward_prefetch", 1), spec.get("swap_input", False)
    _check_options(action, prefetch, swap_input, where=f"{where}.")
    return Decision(action, prefetch, swap_input)


# Note: [one resolution rule]
# A plan decides each unit by one rule, here, for the simulator (``search/_simulator.py`` resolve) and the
# executor (``adaptive_mem/runtime/_resolve.py``) alike: a target matches a unit when it is the unit's name or a
# module path above it (``matches``, on dotted-name boundaries: ``layers.1`` covers ``layers.1.mlp`` but not
# ``layers.10``); the longest matching target decides, and between equal-length targets marked recompute and
# swap, recompute takes effect (two targets matching one unit with equal length are the same path, so a plan
# only meets the tie through targets built by hand; the config front-ends apply their coupling before). A unit
# no target matches is kept. tests/test_one_rule.py checks that the
# simulator's assignment and the executor's resolution agree unit by unit on real profiles.
def matches(target: str, unit: str) -> bool:
    """A target names a unit, or a module path covering every unit below it (Note: [one resolution rule])."""
    return not target or unit == target or unit.startswith(target + ".")


def _module_paths(decisions: dict[str, Decision]) -> dict[str, Decision]:
    """Targets named as the plain model names its modules: ``layers.0._orig_mod.mlp`` is ``layers.0.mlp``
    (Note: [compile wrapper names] in ``profiler/_paths.py``)."""
    if not any(COMPILE_CHILD in target for target in decisions):
        return decisions
    out: dict[str, Decision] = {}
    for target, decision in decisions.items():
        path = module_path(target)
        if path in out and out[path] != decision:
            raise PlanError(f"plan.decisions.{target!r}: names {path!r} (torch.compile's _orig_mod is no part of a "
                            f"path), which another target decides {out[path].to_dict()}; expected one decision per "
                            "unit or module")
        out[path] = decision
    return out


@dataclass
class Plan:
    decisions: dict[str, Decision] = field(default_factory=dict)
    """Target -> decision. A target is a unit name (``layers.3.feed_forward.mul``) or a module
    path covering all units under it (``layers.3`` = the whole layer). Units matched by no
    target are kept; the longest matching target decides."""
    fingerprint: str | None = None
    """Fingerprint of the model and input shapes the plan was made for; checked when applied."""
    model: dict[str, Any] = field(default_factory=dict)
    """Human-readable description of that model (spec, num_layers, batch_size, seq_len, dtype)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance: solver, budget, predicted peak and step time."""
    groups: list[list[int]] = field(default_factory=list)
    """Runs of consecutive layer indices checkpointed together as one unit (Megatron ``uniform``
    with ``--recompute-num-layers`` > 1): only the first layer's input is saved. Every layer of a
    group must be decided ``recompute`` as a whole layer."""
    distribute_saved_activations: bool = False
    """Shard the saved checkpoint inputs of recomputed layers across the default ``torch.distributed``
    group and all-gather them in backward (Megatron ``--distribute-saved-activations``)."""
    version: int = PLAN_VERSION
    """Schema version."""
    buckets: list[tuple[int, "Plan"]] = field(default_factory=list)
    """``(seq_len, plan)`` per sequence-length bucket, ascending; empty (and not written) for a plan of one shape.
    Note: [plan buckets]."""

    def __post_init__(self) -> None:
        self.decisions = _module_paths(self.decisions)

    def target_for(self, unit: str) -> str | None:
        """The target that decides ``unit``, None when no target matches it (Note: [one resolution rule])."""
        best: str | None = None
        for target, decision in self.decisions.items():
            if not matches(target, unit):
                continue
            if best is None or len(target) > len(best):
                best = target
            elif len(target) == len(best) and decision.action is Action.RECOMPUTE \
                    and self.decisions[best].action is Action.SWAP:
                log.info("Unit %s is marked recompute and swap: recompute takes effect, swap does not", unit)
                best = target
        return best

    def decide(self, unit: str) -> Decision:
        """The decision that takes effect on ``unit``: its target's, keep when none matches
        (Note: [one resolution rule])."""
        target = self.target_for(unit)
        return KEEP if target is None else self.decisions[target]

    decision_for = decide

    def layer_actions(self, path: str) -> set[Action]:
        """The actions deciding the layer at module path ``path``: its own target's (keep when none) and those of
        the targets inside it. ``{recompute}`` = recomputed as a whole (Note: [one resolution rule])."""
        return {self.decide(path).action} | {d.action for t, d in self.decisions.items() if t.startswith(path + ".")}

    def check_recompute_inside(self, layer_paths: list[str], containers: tuple[str, ...] | list[str]) -> None:
        """:class:`PlanError` for a recompute target outside the repeated layers: inside one of ``layer_paths`` or
        naming a whole stack of them (one of ``containers``) it may be; elsewhere (embedding, head, loss) nothing
        re-runs it in backward (Note: [one resolution rule])."""
        for target, decision in self.decisions.items():
            if decision.action is not Action.RECOMPUTE or target in containers:
                continue
            if not any(target == p or target.startswith(p + ".") for p in layer_paths):
                where = (" or ".join(f"{c}.N" if c else "N" for c in containers) if containers
                         else "repeated layers (none found in this model)")
                raise PlanError(f"plan.decisions.{target!r}: action recompute outside the repeated layers; expected "
                                f"recompute targets inside {where}")

    def swapped_inputs(self, layer_paths: list[str]) -> dict[int, tuple[str, Decision]]:
        """Layer index -> (target, decision) of each layer recomputed as a whole whose checkpoint input is swapped
        (Note: [swapped checkpoint input]); :class:`PlanError` for a ``swap_input`` target covering part of a
        layer. The layer's own decision carries ``swap_input`` (Note: [one resolution rule])."""
        out: dict[int, tuple[str, Decision]] = {}
        for target, decision in self.decisions.items():
            if not decision.swap_input:
                continue
            covered = [i for i, p in enumerate(layer_paths) if matches(target, p) and self.decide(p) == decision]
            if not covered or any(self.layer_actions(layer_paths[i]) != {Action.RECOMPUTE} for i in covered):
                raise PlanError(f"plan.decisions.{target!r}: swap_input covers part of a layer; expected a "
                                "whole-layer target (the layer's module path) decided recompute")
            for i in covered:
                out.setdefault(i, (target, decision))
        return out

    def for_seq_len(self, seq_len: int) -> "Plan":
        """The plan for inputs of ``seq_len`` tokens: the smallest bucket's at least that long (Note: [plan
        buckets]); this plan when it has no buckets. A length above every bucket raises
        :class:`search.SeqLenBucketError`."""
        if not self.buckets:
            return self
        return dict(self.buckets)[seq_len_bucket(seq_len, tuple(s for s, _ in self.buckets))]

    def targets(self, action: Action) -> list[str]:
        return [t for t, d in self.decisions.items() if d.action is action]

    def check_targets(self, *, units: Iterable[str], modules: Iterable[str]) -> None:
        """Raise :class:`PlanError` for a target that is neither a unit nor a module path."""
        known = set(units) | set(modules)
        for target in self.decisions:
            if target not in known:
                sample = ", ".join(sorted(u for u in known if "." in u)[:5])
                raise PlanError(f"plan.decisions.{target!r}: no such unit or module; expected names like {sample}")

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        data = {
            "format": PLAN_FORMAT,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "model": dict(self.model),
            "decisions": {t: d.to_dict() for t, d in self.decisions.items()},
            "groups": [list(g) for g in self.groups],
            "distribute_saved_activations": self.distribute_saved_activations,
            "meta": dict(self.meta),
        }
        if self.buckets:
            data["buckets"] = buckets_to_list(self.buckets)
        return data

    def dumps(self, *, fmt: str = "yaml") -> str:
        if fmt == "json":
            return json.dumps(self.to_dict(), indent=1) + "\n"
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.dumps(fmt="json" if path.suffix == ".json" else "yaml"))

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"plan: expected a mapping, got {type(data).__name__}")
        allowed = {"format", "version", "fingerprint", "model", "decisions", "groups", "distribute_saved_activations",
                   "meta", "buckets"}
        for key in data:
            if key not in allowed:
                raise PlanError(f"plan.{key}: unknown key; expected one of {sorted(allowed)}")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"plan.format={_short(data.get('format'))}: expected {PLAN_FORMAT!r}")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"plan.version={_short(data.get('version'))}: expected {PLAN_VERSION}")
        fingerprint = data.get("fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise PlanError(f"plan.fingerprint={_short(fingerprint)}: expected a string or null")
        for key in ("model", "meta"):
            if not isinstance(data.get(key, {}), dict):
                raise PlanError(f"plan.{key}={_short(data[key])}: expected a mapping")
        _check_model(data.get("model", {}))
        if "decisions" not in data:
            raise PlanError("plan.decisions: missing; expected a mapping of unit or module name to decision "
                            "({} keeps every unit)")
        raw = data["decisions"]
        if not isinstance(raw, dict):
            raise PlanError(f"plan.decisions={_short(raw)}: expected a mapping of unit or module name to decision")
        decisions = {target: _parse_decision(target, spec) for target, spec in raw.items()}
        groups = data.get("groups", [])
        if not isinstance(groups, list) or not all(
            isinstance(g, list) and g and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in g)
            and g == list(range(g[0], g[0] + len(g))) for g in groups
        ):
            raise PlanError(f"plan.groups={_short(groups)}: expected a list of runs of consecutive layer indices")
        distribute = data.get("distribute_saved_activations", False)
        if not isinstance(distribute, bool):
            raise PlanError(f"plan.distribute_saved_activations={_short(distribute)}: expected true or false")
        plan = cls(decisions=decisions, fingerprint=fingerprint, model=dict(data.get("model", {})),
                   meta=dict(data.get("meta", {})), groups=[list(g) for g in groups],
                   distribute_saved_activations=distribute)
        if "buckets" in data:
            plan.buckets = parse_buckets(data["buckets"], plan)
        return plan

    @classmethod
    def loads(cls, text: str, *, source: str = "<string>") -> "Plan":
        data = load_document(text, what=f"plan file {source!r}", expected="a plan mapping", error=PlanError,
                             syntax="YAML/JSON")  # YAML is a superset of JSON
        if data is None:
            raise PlanError(f"plan file {source!r}: empty; expected a mapping with format: {PLAN_FORMAT}")
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PlanError(f"plan file {str(path)!r}: cannot read ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise PlanError(f"plan file {str(path)!r}: not UTF-8 text; expected a YAML or JSON plan") from None
        return cls.loads(text, source=str(path))
