"""Fused RMSNorm and SwiGLU as Megatron-LM / MindSpeed run them: what each saves for backward.

The reference Llama's unfused ops save more than the fused kernels a Megatron run uses
(``LlamaConfig(fused_norm=True, fused_swiglu=True)`` switches to these):

- RMSNorm. ``F.rms_norm`` upcasts a bf16 input to fp32, and autograd saves that fp32 copy (for ``pow`` and
  ``mul``) and the fp32 normalised value (for the weight's ``mul``). Apex's ``FusedRMSNormAffineFunction``
  saves the input, the weight and the per-row inverse RMS (``invvar``, fp32); MindSpeed's
  ``--use-fused-rmsnorm`` (``torch_npu.npu_rms_norm``, which returns the output and ``rstd``) the same; both
  recompute the normalised value in backward: :class:`FusedRMSNormFunction`.
- SwiGLU. ``silu(gate) * up`` as two ops saves ``gate`` (for ``silu``), then ``silu(gate)`` and ``up`` (for
  ``mul``). Megatron's ``bias_swiglu_impl`` (``SwiGLUFunction``) saves its input only, the gate and up
  projections concatenated, and recomputes ``silu(gate)`` in backward (MindSpeed's ``--use-fused-swiglu`` runs ``torch_npu.npu_swiglu``
  on the same concatenated input): :class:`SwiGLUFunction` saves ``gate`` and ``up``, the bytes of their
  concatenation.

Note: [fused kernels' gradients]. Each backward runs, op for op, the kernels autograd runs for the unfused ops
(``mul`` and ``silu_backward`` for SwiGLU; ``mul``, ``rsqrt``, ``mean`` and ``pow`` of the composite
``rms_norm``, in fp32), so the gradients are the unfused model's to the bit where the norm's input is bf16.
With an fp32 input the composite's ``pow`` and ``mul`` read the input itself, and autograd adds their two
gradients to the residual's one by one where the fused norm hands back one sum: equal to fp32 rounding
(tests/test_fused_kernels.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FusedRMSNormFunction", "SwiGLU", "SwiGLUFunction"]


class FusedRMSNormFunction(torch.autograd.Function):
    """``rms_norm(x) * weight``; saves ``x`` (its dtype), ``weight`` and the fp32 inverse RMS of each row."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return (x32 * inv_rms * weight).type_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, inv_rms = ctx.saved_tensors
        x32, g32 = x.to(torch.float32), grad.to(torch.float32)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (g32 * (x32 * inv_rms)).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
        return _rms_norm_input_grad(g32 * weight, x32, inv_rms).to(x.dtype), grad_weight, None


def _rms_norm_input_grad(grad: torch.Tensor, x32: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
    """The gradient of ``x32 * rsqrt(mean(x32 ** 2) + eps)`` at ``x32`` for the fp32 ``grad`` of its output, op for
    op as autograd differentiates the composite ``rms_norm`` (``mul``, ``rsqrt``, ``mean``, ``pow``)."""
    through_mul = grad * inv_rms
    grad_inv = (grad * x32).sum(-1, keepdim=True)
    grad_mean = -0.5 * grad_inv * inv_rms.pow(3)
    grad_square = grad_mean.expand_as(x32) / x32.shape[-1]
    return through_mul + grad_square * (2 * x32)


class SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up``; saves ``gate`` and ``up`` only and recomputes ``silu(gate)`` in backward."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


class SwiGLU(nn.Module):
    """``silu(gate) * up`` fused (:class:`SwiGLUFunction`): one unit ``<path>.swiglu``."""

    unit_label = "swiglu"

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return SwiGLUFunction.apply(gate, up)
