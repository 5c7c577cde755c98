"""Solvers by name: the built-in solvers are listed here, and :func:`register_solver` adds more.

The solver modules do not know this registry (they only implement ``_solver.Solver``); they are
imported on the first look-up, so ``import search`` does not load scipy or optuna.
"""

from __future__ import annotations

from typing import Any, Callable

from ._solver import Solver

__all__ = ["REGISTRY", "UnknownSolverError", "get_solver", "register_solver", "solver_names"]


class UnknownSolverError(ValueError):
    """No solver of that name."""


REGISTRY: dict[str, Callable[..., Solver]] = {}
_loaded = False


def register_solver(name: str, factory: Callable[..., Solver]) -> None:
    REGISTRY[name] = factory


def solver_names() -> list[str]:
    _load()
    return list(REGISTRY)


def get_solver(name: str, **options: Any) -> Solver:
    _load()
    if name not in REGISTRY:
        raise UnknownSolverError(f"--solver={name!r}: unknown solver; expected one of {', '.join(REGISTRY)}")
    return REGISTRY[name](**options)


def _load() -> None:
    """Register the built-in solvers once, in this order (``solver_names()`` and the CLI's choices)."""
    global _loaded
    if _loaded:
        return
    from ._baselines import BASELINES
    from ._milp import MilpSolver
    from ._optuna import OptunaSolver
    for cls in (*BASELINES, MilpSolver, OptunaSolver):
        register_solver(cls.name, cls)
    _loaded = True
