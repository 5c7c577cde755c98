"""``adaptive_optimize``'s arguments, checked before anything is applied to the model: the budget, the solver,
the tolerance, and a model that already carries a plan or the loop (the mark the loop leaves on its model)."""

from __future__ import annotations

from typing import Any

from torch import nn

from adaptive_mem.runtime._apply import _APPLIED

__all__ = ["check_arguments", "mark", "unmark"]

_MARK = "_adaptive_memory"
"""The attribute of a model under the adaptive loop: its ``AdaptiveMemory`` (one loop per model)."""


def mark(model: nn.Module, loop: Any) -> None:
    setattr(model, _MARK, loop)


def unmark(model: nn.Module, loop: Any) -> None:
    """Take ``loop``'s mark off ``model`` (a later loop's mark stays)."""
    if getattr(model, _MARK, None) is loop:
        delattr(model, _MARK)


def check_arguments(model: nn.Module, *, budget: Any, solver: str, tolerance: float) -> int | None:
    """``budget`` in bytes (None: the device capacity, found at the first step); ValueError for a bad argument."""
    from search import parse_bytes

    if isinstance(budget, str):
        budget = parse_bytes(budget, key="--memory-budget")
    elif budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"--memory-budget={budget!r}: expected a positive number of bytes or a size like 12GiB")
    if solver != "milp":
        from search import solver_names

        if solver not in solver_names():
            raise ValueError(f"solver={solver!r}: unknown; expected one of {', '.join(solver_names())}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r}: expected a fraction in (0, 1)")
    applied = _APPLIED.get(model)
    if applied is not None and applied() is not None and applied().active:
        raise ValueError("adaptive memory optimization: the model already has a plan applied (a manual recompute/"
                         "swap config); expected one of them: remove() its handle first")
    if getattr(model, _MARK, None) is not None:
        raise ValueError("adaptive memory optimization: already applied to this model; remove() it first")
    return budget
