"""``ConfigError`` and the helpers that word it: key path, value, accepted form."""

from __future__ import annotations

import difflib
import reprlib
from typing import Any, Iterable

__all__ = ["ConfigError", "check_keys", "expect_bool", "expect_int", "fmt"]


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
