"""The policies a bench run compares: one small class each, behind one interface.

A policy is prepared once per budget in the parent process (``prepare``: solve a plan,
predict its cost) and applied in a fresh worker process (``apply``) to a model built from
the same spec, seed and batch as every other policy. ``apply`` returns an :class:`Applied`:
the step to time and what to take off afterwards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["Applied", "Policy", "POLICIES", "get_policy", "policy_names", "layers_of", "PolicyError"]


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


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the profiler's notion of a layer)."""
    from profiler import find_layers

    info = find_layers(model)
    if info is None:
        raise PolicyError(f"model {type(model).__name__}: no repeated layers found; expected a ModuleList of blocks")
    return list(model.get_submodule(info.container))


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


class NoCheckpointing(Policy):
    name = "none"
    label = "no checkpointing (keep every activation)"
    predict_solver = "none"

    def apply(self, bundle, optimizer, job):
        return Applied(bundle)


class FullRecompute(Policy):
    name = "full"
    label = "full recompute: torch.utils.checkpoint around every layer"
    predict_solver = "full"

    def apply(self, bundle, optimizer, job):
        undos = [_wrap_forward(layer, _checkpointed) for layer in layers_of(bundle.model)]
        return Applied(bundle, _undo_all(undos))


class HFGradientCheckpointing(Policy):
    name = "hf-gc"
    label = "Hugging Face's own gradient checkpointing (activation_checkpointing_enable(), non-reentrant)"
    predict_solver = "full"

    def unavailable(self, spec):
        return None if spec.startswith("hf:") else "Hugging Face models only (hf:<family>)"

    def apply(self, bundle, optimizer, job):
        model = bundle.model
        # transformers 5 renamed gradient_checkpointing_enable (deprecated alias) to activation_checkpointing_enable.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            return Applied(bundle, model.activation_checkpointing_disable)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return Applied(bundle, model.gradient_checkpointing_disable)


class MegatronSelective(Policy):
    name = "megatron-selective"
    label = "Megatron --recompute-granularity selective (attention core), via the config front-end"
    predict_solver = "selective"

    def apply(self, bundle, optimizer, job):
        from adaptive_mem._optimize import optimize

        handle = optimize(bundle.model, config=["--recompute-granularity", "selective"])
        return Applied(bundle, handle.remove)


# torchtitan-style op-level SAC: keep the outputs of matmuls and attention, recompute everything else.
_SAVE_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "max")


def op_sac_policy() -> Callable:
    from torch.utils.checkpoint import CheckpointPolicy

    save = {getattr(torch.ops.aten, n).default for n in _SAVE_OPS if hasattr(torch.ops.aten, n)}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class OpLevelSAC(Policy):
    name = "op-sac"
    label = "op-level SAC (torchtitan-style): save matmul/SDPA outputs, recompute the rest, every layer"

    def apply(self, bundle, optimizer, job):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        context = functools.partial(create_selective_checkpoint_contexts, op_sac_policy())
        undos = [_wrap_forward(layer, lambda f: _checkpointed(f, context)) for layer in layers_of(bundle.model)]
        return Applied(bundle, _undo_all(undos))


def _registry() -> dict[str, Policy]:
    from ._policy_ours import AdaptivePolicy, MilpPolicy
    from ._policy_torch import CompileBudget, SacIlp

    out: dict[str, Policy] = {}
    for cls in (NoCheckpointing, FullRecompute, HFGradientCheckpointing, MegatronSelective, OpLevelSAC, SacIlp,
                CompileBudget, MilpPolicy, AdaptivePolicy):
        out[cls.name] = cls()
    return out


POLICIES: dict[str, Policy] = {}


def policy_names() -> list[str]:
    if not POLICIES:
        POLICIES.update(_registry())
    return list(POLICIES)


def get_policy(name: str) -> Policy:
    names = policy_names()
    if name not in POLICIES:
        raise PolicyError(f"--policies: {name!r} is not a policy; expected names from {', '.join(names)}")
    return POLICIES[name]
