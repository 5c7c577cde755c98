"""``ConfigError`` and the helpers that word it: key path, value, accepted form; op keys matched to local names."""

from __future__ import annotations

import difflib
import logging
import re
import reprlib
from functools import lru_cache
from typing import Any, Iterable

__all__ = ["ConfigError", "check_keys", "expect_bool", "expect_int", "fmt", "match_key", "nearest_names"]

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A training config (MindFormers YAML or Megatron flags) cannot be turned into a plan."""


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong, _REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 24, 3, 8, 5


def fmt(value: Any) -> str:
    """A short rendering of a config value for an error message.

    Bounded before it is built: a YAML alias can make a value of 10**9 items from a few lines.
    """
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_keys(section: Any, path: str, allowed: Iterable[str]) -> dict:
    """``section`` must be a mapping whose keys are all in ``allowed``; suggests the nearest key."""
    allowed = list(allowed)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}={fmt(section)}: expected a mapping with keys {', '.join(allowed)}")
    for key in section:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"{path}.{key}: unknown key; {hint}expected one of {', '.join(allowed)}")
    return section


def expect_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}={fmt(value)}: expected True or False")
    return value


def expect_int(value: Any, path: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ConfigError(f"{path}={fmt(value)}: expected an integer >= {minimum}{upper}")
    return value


def nearest_names(key: str, names: Iterable[str], *, n: int = 5) -> list[str]:
    """The ``n`` local names most like ``key`` (difflib ratio; a regex's ``\\.`` read as ``.``)."""
    plain = re.sub(r"\\(.)", r"\1", key)
    return difflib.get_close_matches(plain, list(dict.fromkeys(names)), n=n, cutoff=0.0)


def match_key(pattern: Any, path: str, *, modules: tuple[str, ...], units: tuple[str, ...],
              where: str = "") -> tuple[str, ...]:
    """Local names of a layer that the op key ``pattern`` selects; ConfigError naming the 5 nearest if none
    (``where`` says which layers' names were searched, `` of layers 0, 2 (with conv)``).

    Note: [key matching] (docs/plan-format.md, "Unit names and keys"; tests/test_units_cli.py):
    ``pattern`` is a regex over local module paths and unit names. It selects every name it matches whole
    (``re.fullmatch``); if it matches none whole, every name it matches from the start up to a ``.`` or ``_``
    (``re.match`` of ``(?:pattern)(?=[._]|$)``), so ``mlp\\.act`` names GPT-2's ``mlp.act`` and Qwen2's
    ``mlp.act_fn``; if none that way either, every name whose dotted tail it matches whole, so
    ``DenseReluDense`` names T5's ``layer.1.DenseReluDense``. A selected name below another selected one is
    dropped: the module covers it.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"{path}={fmt(pattern)}: expected a regular expression naming ops of a layer, "
                          f"like {', '.join(units[:3])}")
    hits, prefix = _match(pattern, path, modules, units, where)
    if prefix:
        log.info("%s=%r matches no local name whole; as a prefix it selects %s", path, pattern, ", ".join(hits))
    return hits


@lru_cache(maxsize=512)
def _match(pattern: str, path: str, modules: tuple[str, ...], units: tuple[str, ...],
           where: str) -> tuple[tuple[str, ...], bool]:
    try:
        whole = re.compile(pattern)
        start = re.compile(f"(?:{pattern})(?=[._]|$)")
    except re.error as exc:
        raise ConfigError(f"{path}={pattern!r}: not a valid regular expression ({exc})") from None
    names = tuple(dict.fromkeys(modules + units))
    hits = [name for name in names if whole.fullmatch(name)]
    prefix = not hits
    if prefix:
        hits = [name for name in names if start.match(name)]
    if not hits:  # a bare submodule name below the layer's top level (T5's layer.1.DenseReluDense)
        inner = re.compile(rf"(?:.*\.)?(?:{pattern})")
        hits = [name for name in names if inner.fullmatch(name)]
    if not hits:
        raise ConfigError(f"{path}={pattern!r}: matches no op of a layer{where}; nearest local names: "
                          f"{', '.join(nearest_names(pattern, names))}; expected a regular expression matching "
                          f"local unit or module names such as {', '.join(units[:3])} "
                          "(all of them: adaptive-mem units --model SPEC)")
    return tuple(h for h in hits if not any(h.startswith(other + ".") for other in hits if other != h)), prefix
