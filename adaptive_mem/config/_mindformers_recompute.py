"""MindFormers ``recompute_config``: which layers are fully recomputed and which ops selectively.

Two modes, as in the seeds:

* normal: ``recompute``, and each pattern of ``select_recompute`` /
  ``select_comm_recompute``, give per-chunk layer *counts* (see ``_layers``);
* swap mode (``swap_config.swap: True``): the same keys take True/False or
  pipeline-agnostic lists of layer *indices*.

``select_recompute`` given as True/False/counts applies to the default patterns
(``feed_forward.mul`` and ``feed_forward.w1.activation.silu``; ``.*\\.norm`` for
``select_comm_recompute``); a list of regexes selects those ops in every layer that has them;
a mapping gives each regex its own value. Regexes select local names as
:func:`._errors.match_key` says (Note: [key matching]), in each layer that has them (Note: [keys per layer]).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ._collective_names import is_collective_name
from ._errors import ConfigError, check_keys, expect_bool, fmt
from ._layers import StageLayout
from ._names import LayerNames

__all__ = ["RECOMPUTE_KEYS", "LayerRecompute", "parse_recompute", "formative"]

log = logging.getLogger(__name__)

DEFAULT_SELECT = (r"feed_forward\.mul", r"feed_forward\.w1\.activation\.silu")
DEFAULT_COMM = (r".*\.norm",)
INACTIVE = {
    "parallel_optimizer_comm_recompute": "acts only on the AllGather of optimizer parallelism",
    "mp_comm_recompute": "acts only on the communication of model (tensor) parallelism",
    "recompute_slice_activation": "acts only on activations sliced by model parallelism",
}
RECOMPUTE_KEYS = ("recompute", "select_recompute", "select_comm_recompute", *INACTIVE)


@dataclass
class LayerRecompute:
    full: set[int] = field(default_factory=set)
    """Layers recomputed as a whole."""
    select: dict[int, list[str]] = field(default_factory=dict)
    """Layer -> local targets recomputed by ``select_recompute`` (empty for full layers)."""
    comm: dict[int, list[str]] = field(default_factory=dict)
    """Layer -> local targets recomputed by ``select_comm_recompute`` (empty for full layers)."""
    inactive: list[str] = field(default_factory=list)
    """Accepted keys that have no effect without their parallel mode."""
    keep_comm: bool = False
    """``mp_comm_recompute: False``: the collectives of recomputed layers are kept, not issued again."""
    collectives: tuple[str, ...] = ()
    """Local names of the collective units of a layer (tensor-parallel layout; Note: [collective units])."""


def _no_collective(where: str, key: str, value: Any, what: str) -> None:
    """Note: [collective units]: without a tensor-parallel layout a comm key has nothing to act on (one warning
    per config)."""
    log.warning("%s.%s=%s: accepted; inactive here: the layers issue no collective to act on (no tensor-parallel "
                "layout: apply the config after parallelize_module); %s", where, key, formative(value), what)


def formative(value: Any) -> str:
    """MindFormers' rendering of a normalized value; regex keys are printed as written (no repr escaping)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"'{k}': {formative(v)}" for k, v in value.items()) + "}"
    return str(value)


def _layer_indices(value: Any, path: str, num_layers: int) -> bool | list[int]:
    form = f"True/False or a list of layer indices 0..{num_layers - 1} (swap mode: pipeline-agnostic)"
    if isinstance(value, bool):
        return True if value else []
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}={fmt(value)}: expected {form}")
    out: list[int] = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(f"{path}[{i}]={fmt(item)}: expected a layer index; whole value expected {form}")
        if not 0 <= item < num_layers:
            raise ConfigError(f"{path}[{i}]={fmt(item)}: layer index out of range; expected 0..{num_layers - 1}")
        out.append(item)
    return out


def _normalize(value: Any, path: str, layout: StageLayout, swap_mode: bool) -> Any:
    if swap_mode:
        return _layer_indices(value, path, layout.num_layers)
    return layout.format_counts(value, path)


def _layers_of(normal: Any, layout: StageLayout, swap_mode: bool) -> list[int]:
    if swap_mode:
        return list(range(layout.num_layers)) if normal is True else sorted(set(normal))
    return layout.first_layers(normal)


def _select_dict(value: Any, path: str, defaults: tuple[str, ...], layout: StageLayout,
                 swap_mode: bool) -> tuple[dict[str, Any], set[str]]:
    """Normalized ``{regex: value}`` and the regexes the user wrote (always resolved, even if unused)."""
    if value is None:
        value = False
    if isinstance(value, (list, tuple)) and value and all(isinstance(p, str) for p in value):
        return {p: _normalize(True, f"{path}", layout, swap_mode) for p in value}, set(value)
    if isinstance(value, dict):
        out = {}
        for pattern, sub in value.items():
            if not isinstance(pattern, str):
                raise ConfigError(f"{path} key {fmt(pattern)}: expected a regular expression naming ops of a layer")
            out[pattern] = _normalize(sub, f"{path}.{pattern}", layout, swap_mode)
        return out, set(value)
    if isinstance(value, (list, tuple)) and any(isinstance(p, str) for p in value):
        raise ConfigError(f"{path}={fmt(value)}: mixes regexes and counts; expected a list of regexes, "
                          "a mapping regex -> value, or one value for the default ops")
    return {p: _normalize(value, path, layout, swap_mode) for p in defaults}, set()


def parse_recompute(section: Any, *, layout: StageLayout, names: LayerNames, swap_mode: bool,
                    where: str = "recompute_config") -> LayerRecompute:
    section = check_keys(section, where, RECOMPUTE_KEYS)
    result = LayerRecompute()
    raw = section.get("recompute", False)
    if raw is None:
        raw = False
    if isinstance(raw, (list, tuple)) and any(isinstance(r, str) for r in raw):
        raise ConfigError(f"{where}.recompute={fmt(raw)}: op names belong in select_recompute; expected "
                          + ("True/False or a list of layer indices" if swap_mode else
                             "True/False, per-stage layer counts or a 2-D list [interleave][stage]"))
    layer_recompute = _normalize(raw, f"{where}.recompute", layout, swap_mode)
    select, select_user = _select_dict(section.get("select_recompute"), f"{where}.select_recompute",
                                       DEFAULT_SELECT, layout, swap_mode)
    comm, comm_user = _select_dict(section.get("select_comm_recompute"), f"{where}.select_comm_recompute",
                                   DEFAULT_COMM, layout, swap_mode)
    log.info("Formative layer_recompute: %s", formative(layer_recompute))
    log.info("Formative select_recompute: %s", formative(select))
    log.info("Formative select_comm_recompute: %s", formative(comm))

    result.collectives = tuple(u for u in names.units if is_collective_name(u))
    for key, reason in INACTIVE.items():
        if section.get(key) is not None:
            value = expect_bool(section[key], f"{where}.{key}")
            if key == "mp_comm_recompute" and result.collectives:
                result.keep_comm = not value
            elif key == "mp_comm_recompute":
                if value:
                    result.inactive.append(key)
                _no_collective(where, key, value, "it changes nothing")
            elif value:
                result.inactive.append(key)
                log.info("%s.%s=True: accepted; inactive here (it %s, which this run does not use)", where, key,
                         reason)

    if section.get("select_comm_recompute") not in (None, False) and not result.collectives:
        _no_collective(where, "select_comm_recompute", section["select_comm_recompute"],
                       "the selected ops are recomputed as select_recompute would")
    result.full = set(_layers_of(layer_recompute, layout, swap_mode))
    for table, user, dest, key in ((select, select_user, result.select, "select_recompute"),
                                   (comm, comm_user, result.comm, "select_comm_recompute")):
        for pattern, normal in table.items():
            named = _layers_of(normal, layout, swap_mode)
            layers = [i for i in named if i not in result.full]
            if not layers and pattern not in user:
                continue
            # Note: [keys per layer]: matched in the layers the key names (full recompute covers some of them)
            selected = names.select(pattern, f"{where}.{key}.{pattern}" if pattern in user else f"{where}.{key}",
                                    named)
            for i in layers:
                ops = dest.setdefault(i, [])
                ops.extend(t for t in selected.get(i, ()) if t not in ops)
    return result
