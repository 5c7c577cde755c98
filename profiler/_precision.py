"""Precision recipes as data: what a training run stores per parameter, what it computes in, what ZeRO shards.

A recipe names the bytes per parameter element of the parameters as stored, their gradients, fp32 master weights
kept beside them, and one optimizer state tensor (Adam keeps two: ``OPTIMIZERS`` counts them), the dtype the forward
computes in (under ``torch.autocast`` or with parameters cast to it) and the ZeRO stage the recipe shards at by
itself on several data-parallel ranks. ``static_memory`` counts a step's static bytes from it, ``rank_static``
shards them per ``SHARDED_FROM``, and a profile under a recipe runs its forward the recipe's way
(``profile_step(..., precision=)``, ``adaptive-mem profile --precision``).

Note: [autocast on fake tensors] a fake profile's tensors report the device they were made from (``cpu`` for a
model built on ``meta``; fake ``meta`` tensors have no autocast), so the recipe's autocast runs there with the CPU
autocast op lists. They agree with CUDA's where the bytes are: matmuls, linears and scaled-dot-product attention
compute in bf16, and the losses (cross-entropy: the logits upcast) in fp32. CUDA also upcasts a few elementwise
ops on bf16 inputs (softmax, layer_norm, exp, pow, rsqrt, sum) that CPU autocast leaves in bf16; models that
upcast themselves (RMSNorm and eager softmax in float32) save the same bytes under both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ._layout import Layout

__all__ = ["PRECISIONS", "SHARDED_FROM", "Precision", "PrecisionError", "autocast_loss", "check_model_dtype",
           "precision_layout", "precision_of"]


class PrecisionError(ValueError):
    """A precision recipe name (or a model it does not fit)."""


@dataclass(frozen=True)
class Precision:
    name: str
    parameters: int
    """Bytes per parameter element of the parameters as the run stores them."""
    gradients: int
    """Bytes per trainable element of the gradients the optimizer reads."""
    master: int
    """Bytes per trainable element of master weights kept beside lower-precision parameters (0: none)."""
    state: int
    """Bytes per trainable element of one optimizer state tensor (Adam keeps two moments)."""
    compute: str
    """The dtype the forward computes matmuls in: ``float32`` or ``bfloat16``."""
    autocast: bool
    """The forward runs under ``torch.autocast(dtype=compute)`` on ``float32`` parameters."""
    zero: int
    """The ZeRO stage the recipe shards at by itself over several data-parallel ranks (0: what the layout says)."""
    source: str
    """Where the numbers come from."""

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype of the parameters the forward reads: ``float32`` under autocast, else the compute dtype."""
        return torch.float32 if self.autocast else getattr(torch, self.compute)


SHARDED_FROM: dict[str, int] = {"optimizer_state": 1, "master": 1, "gradients": 2, "parameters": 3}
"""The ZeRO stage from which each static figure is sharded over the data-parallel ranks (Rajbhandari et al. 2020,
"ZeRO": stage 1 the optimizer states, fp32 master weights among them; stage 2 the gradients; stage 3 the
parameters; FSDP's full shard is stage 3)."""

PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(
        "fp32", parameters=4, gradients=4, master=0, state=4, compute="float32", autocast=False, zero=0,
        source="torch.optim.Adam on fp32 parameters: its moments are zeros_like(param) (torch/optim/adam.py "
               "_init_group): 4 + 4 + 2 x 4 = 16 B per parameter"),
    "bf16": Precision(
        "bf16", parameters=2, gradients=2, master=0, state=2, compute="bfloat16", autocast=False, zero=0,
        source="model.to(torch.bfloat16) with torch.optim.AdamW: parameters, gradients and the two moments "
               "(zeros_like(param)) all bf16: 2 + 2 + 2 x 2 = 8 B per parameter"),
    "amp-bf16": Precision(
        "amp-bf16", parameters=4, gradients=4, master=0, state=4, compute="bfloat16", autocast=True, zero=0,
        source="torch.amp / Hugging Face Trainer bf16=True: fp32 parameters (the optimizer steps them), fp32 "
               "gradients, fp32 Adam moments, forward under torch.autocast(dtype=torch.bfloat16): 16 B per "
               "parameter; autocast's bf16 weight copies live in the step (activations)"),
    "fsdp2-bf16": Precision(
        "fsdp2-bf16", parameters=4, gradients=4, master=0, state=4, compute="bfloat16", autocast=False, zero=3,
        source="FSDP2 fully_shard with MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype="
               "torch.float32): fp32 sharded parameters the optimizer steps (no separate master), bf16 gathered "
               "copies for forward and backward, gradients reduced in fp32 into fp32 shards, fp32 Adam moments "
               "(torch/distributed/fsdp/_fully_shard/_fsdp_api.py): 16 B per parameter sharded"),
    "megatron-bf16": Precision(
        "megatron-bf16", parameters=2, gradients=4, master=4, state=4, compute="bfloat16", autocast=False, zero=1,
        source="Megatron-LM --bf16 --use-distributed-optimizer: bf16 parameters, fp32 main grads "
               "(accumulate_allreduce_grads_in_fp32), fp32 main parameters and Adam moments sharded over the "
               "data-parallel ranks: 18 B per parameter, 6 + 12/d distributed (Megatron Core "
               "docs/source/distrib_optimizer.md, 'bf16 param, fp32 grads')"),
}


def precision_of(name: str | Precision | None, *, key: str = "precision",
                 optional: bool = True) -> Precision | None:
    """The recipe named ``name`` (None, where ``optional``: no recipe, the model's own dtypes count); a
    :class:`PrecisionError` naming ``key`` otherwise."""
    if (name is None and optional) or isinstance(name, Precision):
        return name
    recipe = PRECISIONS.get(name.lower()) if isinstance(name, str) else None
    if recipe is None:
        raise PrecisionError(f"{key}={name!r}: expected one of {', '.join(PRECISIONS)}")
    return recipe


def precision_layout(layout: Layout, precision: Precision | None) -> Layout:
    """``layout`` with the ZeRO stage the recipe shards at by itself, on several data-parallel ranks."""
    if precision is None or layout.data_parallel == 1 or layout.zero >= precision.zero:
        return layout
    return replace(layout, zero=precision.zero)


def check_model_dtype(precision: Precision, dtype: torch.dtype) -> None:
    """The model's parameters must be in the dtype the recipe's forward reads them in."""
    if dtype != precision.model_dtype:
        wanted = str(precision.model_dtype).removeprefix("torch.")
        raise PrecisionError(f"precision={precision.name!r}: the model's parameters are "
                             f"{str(dtype).removeprefix('torch.')}; expected {wanted} (build the model in it)")


def autocast_loss(loss: Callable[[], torch.Tensor], precision: Precision | None,
                  device_type: str) -> Callable[[], torch.Tensor]:
    """``loss`` run under the recipe's autocast on ``device_type`` (the tensors' device: fake tensors report theirs,
    Note: [autocast on fake tensors]); ``loss`` itself when the recipe has none."""
    if precision is None or not precision.autocast:
        return loss
    dtype = getattr(torch, precision.compute)

    def run() -> torch.Tensor:
        with torch.autocast(device_type, dtype=dtype):
            return loss()

    return run
