"""The eager baselines in the bench: no checkpointing, full recompute, Hugging Face's own
gradient checkpointing, Megatron's selective recompute and torchtitan-style op-level SAC."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ._policy_base import Applied, Policy, _checkpointed, _undo_all, _wrap_forward, layers_of

__all__ = ["FullRecompute", "HFGradientCheckpointing", "MegatronSelective", "NoCheckpointing", "OpLevelSAC",
           "op_sac_policy"]


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
