"""The policies a bench run compares: one small class each, behind one interface.

A policy is prepared once per budget in the parent process (``prepare``: solve a plan,
predict its cost) and applied in a fresh worker process (``apply``) to a model built from
the same spec, seed and batch as every other policy. ``apply`` returns an :class:`Applied`:
the step to time and what to take off afterwards.

This module is the base every policy module imports (``_policy_eager``, ``_policy_torch``,
``_policy_ours``); the registry in ``_policies`` imports those, never the other way round.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["Applied", "Policy", "PolicyError", "compile_whole_model", "layers_of"]


class PolicyError(ValueError):
    """An unknown policy name, or a policy that does not apply to the model."""


@dataclass
class Applied:
    """What a policy leaves on the model in the worker."""

    bundle: Any
    """The ModelBundle whose ``loss(batch)`` runs one forward (possibly a wrapped/compiled model)."""
    remove: Callable[[], None] = lambda: None
    """Takes the policy off again."""
    warmup_until: Callable[[], bool] | None = None
    """Extra warm-up: run steps until this returns True (bounded by the worker)."""
    accounted_warmup: int | None = None
    """Run warm-up under ``DeviceMemory(cap=this)`` (the adaptive loop reads the cap as its budget)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Policy-specific facts for the report (compile seconds, chosen knobs)."""


class Policy:
    """Base: ``name`` (CLI/report key), ``label`` (one line for people), and the flags below."""

    name = ""
    label = ""
    budgeted = False
    """Runs once per budget (else once, whatever the budgets)."""
    eager = True
    """An eager-mode competitor: part of the "no slower beyond 2%" comparison."""
    ours = False
    """One of adaptive-mem's own policies."""
    predict_solver: str | None = None
    """The search solver whose plan describes this policy (for predicted peak/time), if any."""
    compiled_profile = False
    """Plans on the profile of the model compiled per block (``profiler.profile_compiled``)."""

    def label_for(self, backend: str) -> str:
        """The label of a run whose ``torch.compile`` backend is ``backend`` (for policies that compile)."""
        return self.label

    def unavailable(self, spec: str) -> str | None:
        """Why this policy cannot run on ``spec`` (None: it can)."""
        return None

    def prepare(self, ctx: Any, budget: float | None) -> dict[str, Any]:
        """Parent-side work for one run (plan files, predictions); JSON-able, passed to ``apply``.

        ``ctx`` is the runner's :class:`~adaptive_mem.bench._prepare.PrepareContext`."""
        if self.predict_solver is None:
            return {}
        return ctx.predict(self.predict_solver, self.name, budget=None)

    def apply(self, bundle: Any, optimizer: torch.optim.Optimizer, job: dict[str, Any]) -> Applied:
        raise NotImplementedError


def compile_whole_model(model: nn.Module, *, backend: str, budget: float) -> tuple[nn.Module, Callable[[], None]]:
    """``torch.compile(model)`` with ``activation_memory_budget`` = ``budget``; returns it and the undo."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = float(budget)
    compiled = torch.compile(model, backend=backend, dynamic=False)

    def undo() -> None:
        functorch_config.activation_memory_budget = 1.0
        torch._dynamo.reset()
    return compiled, undo


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the profiler's notion of a layer)."""
    from profiler.naming import find_layers

    info = find_layers(model)
    if info is None:
        raise PolicyError(f"model {type(model).__name__}: no repeated layers found; expected a ModuleList of blocks")
    return [model.get_submodule(info.layer_path(i)) for i in range(info.count)]


def _wrap_forward(layer: nn.Module, make: Callable[[Callable], Callable]) -> Callable[[], None]:
    original = layer.forward
    layer.forward = make(original)

    def undo() -> None:
        layer.forward = original
    return undo


def _checkpointed(forward: Callable, context_fn: Callable | None = None) -> Callable:
    from torch.utils.checkpoint import checkpoint

    extra = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)
    return run


def _undo_all(undos: list[Callable[[], None]]) -> Callable[[], None]:
    def remove() -> None:
        for undo in reversed(undos):
            undo()
    return remove
