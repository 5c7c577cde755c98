"""The parallel layout a search or profile is for: the given layout keys on top of a profile's recorded layout.

Shared by :func:`adaptive_mem.search` and the ``profile``/``search`` commands, which name the keys as flags.
"""

from __future__ import annotations

from typing import Any, Mapping

from profiler import Layout, LayoutError

__all__ = ["SHARDING", "layout_from_given", "merge_layout", "positive_int"]

SHARDING = ("tensor_parallel", "sequence_parallel", "data_parallel", "zero")
"""Keys fixed when a profile is cut to one rank; the pipeline keys may still change at search time."""


def positive_int(flag: str, value: str | int | None) -> int | None:
    """``--flag`` value as a positive int (None stays None); a one-line ValueError otherwise."""
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{flag}={value!r}: expected a positive integer") from None
    if number <= 0:
        raise ValueError(f"{flag}={value!r}: expected a positive integer")
    return number


def layout_from_given(given: Mapping[str, Any], *, base: Layout | None = None) -> Layout:
    """The layout the ``given`` keys name (None values are not given), on top of ``base`` (unnamed keys:
    ``base``'s, else the defaults); more than one virtual stage means the interleaved schedule by default."""
    given = {k: v for k, v in given.items() if v is not None}
    if "schedule" not in given and str(given.get("virtual_pipeline_stages", "1")) != "1":
        given["schedule"] = "interleaved-1f1b"
    return Layout.from_flags(base=base, **given)


def merge_layout(recorded: dict | None, given: Mapping[str, Any]) -> Layout:
    """A profile's recorded layout with the ``given`` keys on top; the sharding keys must agree (the profile is
    already one rank's share)."""
    base = Layout.from_dict(recorded, where="profile.model.layout") if recorded is not None else Layout()
    named = {k: v for k, v in given.items() if v is not None}
    for key in SHARDING:
        if key not in named:
            continue
        value = getattr(Layout.from_flags(base=base, **{key: named[key]}), key)
        if value != getattr(base, key):
            flag = "--" + key.replace("_", "-")
            raise LayoutError(f"{flag}={named[key]!r}: the profile was cut to one rank with {key}="
                              f"{getattr(base, key)!r}; expected the same, or a profile made with "
                              f"`adaptive-mem profile {flag} ...`")
    return layout_from_given(named, base=base)
