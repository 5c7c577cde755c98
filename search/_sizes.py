"""Sizes in bytes: the one parser of ``40GiB`` / ``512MiB`` / ``80GB`` flags and the one formatter of byte counts,
and the base of the errors a budget or a size gets."""

from __future__ import annotations

import re

__all__ = ["BudgetError", "fmt_bytes", "parse_bytes"]

_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


class BudgetError(ValueError):
    """A budget or a size that cannot be read, or one that cannot be met: the base of
    :class:`~search.InfeasibleBudgetError`, :class:`~search.DeviceMemoryError` and
    ``adaptive_mem.AdaptiveBudgetError``."""


def parse_bytes(text: str, *, key: str = "--budget", plain: bool = False) -> int:
    """``40GiB`` -> 42949672960. Units: B, KiB, MiB, GiB, TiB (binary), KB, MB, GB, TB and K, M, G, T (decimal),
    any case. ``plain``: a number without a unit is bytes (``--device-memory-cap 4000000000``); without it a
    bare number is refused (``--budget 40`` is more likely 40GiB than 40 bytes)."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    known = unit in _UNITS or (plain and unit == "")
    value = int(float(match.group(1)) * _UNITS.get(unit, 1)) if match and known else 0
    if value <= 0:
        examples = "4000000000, 512MiB or 2GiB" if plain else "40GiB, 512MiB or 80GB"
        raise BudgetError(f"{key}={text!r}: expected a positive size such as {examples} (units B, KiB, MiB, GiB, "
                          f"TiB, KB, MB, GB, TB{'; a plain number is bytes' if plain else ''})")
    return value


def fmt_bytes(n: float, *, exact: bool = False) -> str:
    """``1.50 GiB``; ``exact``: followed by the count, ``1.50 GiB (1610612736 bytes)``."""
    text = f"{int(n)} B"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            text = f"{n / size:.2f} {unit}"
            break
    return f"{text} ({int(n)} bytes)" if exact else text
