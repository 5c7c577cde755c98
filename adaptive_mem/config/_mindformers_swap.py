"""MindFormers ``swap_config``: whole layers and single ops swapped to host, with their prefetch.

``swap: True`` with ``layer_swap`` and ``op_swap`` both None (absent) is the default
strategy: the attention core of every layer that has one, prefetch ``default_prefetch``.
Otherwise each ``layer_swap`` / ``op_swap`` entry names ``layers`` (True or a
list of indices) and a ``backward_prefetch``; for one layer (and one
``op_name``) the first entry listing it wins. An ``op_name`` applies in the
layers it names that have what it selects (Note: [keys per layer]).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigError, check_keys, expect_bool, expect_int, fmt
from ._names import LayerNames

__all__ = ["SWAP_KEYS", "LayerSwap", "OpSwap", "parse_swap"]

log = logging.getLogger(__name__)

SWAP_KEYS = ("swap", "default_prefetch", "layer_swap", "op_swap")
MAX_PREFETCH = 2**31 - 1
"""The largest ``backward_prefetch`` a plan file holds (any count past the layers left means "at once")."""


@dataclass(frozen=True)
class OpSwap:
    pattern: str
    """The ``op_name`` regex as written."""
    targets: tuple[str, ...]
    """Local targets it matched."""
    prefetch: int
    """``backward_prefetch`` of the entry that applies to this layer."""
    lead_dot: bool = False
    """Log the targets as ``.attention``: MindFormers does so for a one-part ``op_name`` (no ``\\.``)."""

    def describe(self) -> str:
        dot = "." if self.lead_dot else ""
        return ", ".join(f"{dot}{t}, value={self.prefetch}" for t in self.targets)


@dataclass
class LayerSwap:
    enabled: bool = False
    """``swap: True``."""
    layer: dict[int, int] = field(default_factory=dict)
    """Whole layers swapped -> backward_prefetch."""
    ops: dict[int, list[OpSwap]] = field(default_factory=dict)
    """Layer -> op swaps in log order."""
    default: bool = False
    """The default strategy (attention core of every layer) is in use."""


def _layers(value: Any, path: str, num_layers: int) -> list[int]:
    form = f"True or a list of layer indices 0..{num_layers - 1}"
    if value is True:
        return list(range(num_layers))
    if value is False:
        return []
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}={fmt(value)}: expected {form}")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(f"{path}[{i}]={fmt(item)}: expected a layer index; whole value expected {form}")
        if not 0 <= item < num_layers:
            raise ConfigError(f"{path}[{i}]={fmt(item)}: layer index out of range; expected 0..{num_layers - 1}")
    return list(value)


def _entries(value: Any, path: str, keys: tuple[str, ...]) -> list[dict]:
    if value is None:
        return []
    example = "{" + ", ".join(f"{k}: ..." for k in keys) + "}"
    if not isinstance(value, list):
        raise ConfigError(f"{path}={fmt(value)}: expected a list of {example}")
    out = []
    for i, entry in enumerate(value):
        entry = check_keys(entry, f"{path}[{i}]", keys)
        for key in keys:
            if key not in entry:
                raise ConfigError(f"{path}[{i}].{key}: missing; expected {example}")
        out.append(entry)
    return out


def parse_swap(section: Any, *, names: LayerNames, num_layers: int, where: str = "swap_config") -> LayerSwap:
    section = check_keys(section, where, SWAP_KEYS)
    swap, default_prefetch = section.get("swap"), section.get("default_prefetch")  # YAML `key:` (None) = default
    result = LayerSwap(enabled=expect_bool(False if swap is None else swap, f"{where}.swap"))
    default_prefetch = expect_int(1 if default_prefetch is None else default_prefetch, f"{where}.default_prefetch",
                                  maximum=MAX_PREFETCH)
    layer_entries = _entries(section.get("layer_swap"), f"{where}.layer_swap", ("backward_prefetch", "layers"))
    op_entries = _entries(section.get("op_swap"), f"{where}.op_swap", ("op_name", "backward_prefetch", "layers"))

    parsed_layers = []
    for i, entry in enumerate(layer_entries):
        path = f"{where}.layer_swap[{i}]"
        parsed_layers.append((expect_int(entry["backward_prefetch"], f"{path}.backward_prefetch", maximum=MAX_PREFETCH),
                              _layers(entry["layers"], f"{path}.layers", num_layers)))
    groups: dict[str, list[tuple[int, list[int]]]] = {}
    paths: dict[str, str] = {}
    for i, entry in enumerate(op_entries):
        path = f"{where}.op_swap[{i}]"
        pattern = entry["op_name"]
        names.select(pattern, f"{path}.op_name", ())  # a regex matching some layer's names, else ConfigError
        paths.setdefault(pattern, f"{path}.op_name")
        prefetch = expect_int(entry["backward_prefetch"], f"{path}.backward_prefetch", maximum=MAX_PREFETCH)
        groups.setdefault(pattern, []).append((prefetch,
                                               _layers(entry["layers"], f"{path}.layers", num_layers)))
    if not result.enabled:
        if layer_entries or op_entries or "default_prefetch" in section:
            log.info("%s.swap is False: default_prefetch, layer_swap and op_swap are inactive", where)
        return result

    if section.get("layer_swap") is None and section.get("op_swap") is None:  # None, not empty: as MindFormers
        result.default = True
        core = names.attention_core()
        for i, found in names.spread((core,), f"{where}.swap", list(range(num_layers)), key=True).items():
            result.ops[i] = [OpSwap(core, found, default_prefetch)]
        return result
    if "default_prefetch" in section:
        log.info("%s.default_prefetch is inactive: layer_swap or op_swap replaces the default strategy", where)
    # Note: [keys per layer]: an op_name applies in each layer its entries name that has what it selects
    targets = {pattern: names.select(pattern, paths[pattern], [i for _, layers in entries for i in layers])
               for pattern, entries in groups.items()}
    for layer in range(num_layers):
        for prefetch, layers in parsed_layers:
            if layer in layers:
                result.layer[layer] = prefetch
                break
        for pattern, entries in groups.items():
            for prefetch, layers in entries:
                if layer in layers:
                    if layer in targets[pattern]:
                        result.ops.setdefault(layer, []).append(
                            OpSwap(pattern, targets[pattern][layer], prefetch, lead_dot=r"\." not in pattern))
                    break
    return result
