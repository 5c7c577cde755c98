"""Checks of a profile file's fields: each value of its declared scalar type, numbers finite, no key twice, objects
built field by field. Every failure is a :class:`ProfileError` naming the field's path and its value, cut short."""

from __future__ import annotations

import reprlib
from dataclasses import MISSING, fields
from typing import Any

__all__ = ["ProfileError", "build_record", "check_field", "check_number", "field_list", "is_type", "short",
           "unique_keys"]


class ProfileError(ValueError):
    """A profile file or dict is not of the documented form."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ProfileError(f"profile: duplicate key {key!r}; expected each key once")
        out[key] = value
    return out


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong, _REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 24, 2, 5, 5
_LIMIT = 2**63
"""Integers from 2**63 up are no byte count, FLOP count or index of a real step (and overflow float math)."""


def short(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters, for one-line errors (a file can hold anything)."""
    return _REPR.repr(value)


def check_number(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not 0 <= value < float("inf"):
        raise ProfileError(f"{where}={short(value)}: expected a number, finite and >= 0")
    if value >= _LIMIT:
        raise ProfileError(f"{where}={short(value)}: expected a number below 2**63")


_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
}


def field_list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise ProfileError(f"profile.{key}={type(value).__name__}: expected a list")
    return value


def build_record(kind: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected an object, got {type(data).__name__}")
    known = {f.name: f for f in fields(kind)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ProfileError(f"{where}.{unknown[0]}: unknown key; expected one of {sorted(known)}")
    for name, f in known.items():
        if name not in data:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise ProfileError(f"{where}.{name}: missing")
        check_field(f"{where}.{name}", data[name], str(f.type))
    return kind(**data)


def is_type(value: Any, t: str) -> bool:
    if t == "None":
        return value is None
    return isinstance(value, _TYPES[t]) and not (t != "bool" and isinstance(value, bool))


def check_field(where: str, value: Any, annotation: str) -> None:
    """Check scalars (``int``, ``float | None``...) and lists of scalars (``list[int]``); other types are built by the caller."""
    expected = annotation.split(" | ")
    if all(t in _TYPES or t == "None" for t in expected):
        if not any(is_type(value, t) for t in expected):
            raise ProfileError(f"{where}={short(value)}: expected {' or '.join(expected)}")
        check_number(where, value)
        return
    if len(expected) == 1 and expected[0].startswith("dict[") and not isinstance(value, dict):
        raise ProfileError(f"{where}={type(value).__name__}: expected an object")
    if len(expected) == 1 and expected[0].startswith("list[") and expected[0][5:-1] in _TYPES:
        item = expected[0][5:-1]
        if not isinstance(value, list):
            raise ProfileError(f"{where}={type(value).__name__}: expected a list of {item}")
        for i, element in enumerate(value):
            if not is_type(element, item):
                raise ProfileError(f"{where}[{i}]={short(element)}: expected {item}")
            check_number(f"{where}[{i}]", element)
