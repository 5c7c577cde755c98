"""Fake tensors for ops whose meta kernel is stricter than their real kernel.

Note: [fake op fallbacks]. ``aten._grouped_mm``'s meta kernel accepts bf16 only, while the CPU and
CUDA kernels run fp32 too (Hugging Face MoE experts with transformers' default
``experts_implementation="grouped_mm"``). :func:`install_fake_fallbacks` registers a fake
implementation for that op with ``FakeTensorMode`` (once per process): for non-bf16 inputs the fake
output is built from the meta kernel's size rule in the dtype the real kernel returns; bf16 inputs
still get the meta kernel. So every fake pass (profile on meta, unit-name traces, the selective
checkpoint trace) runs the op per op instead of failing the whole model, without the error-level
traceback FakeTensorMode logs for a failing meta kernel, and recording dispatch modes still see
``_grouped_mm`` itself (unit names agree with the real run). Installed on ``import adaptive_mem``
and by each fake pass of the runtime; guarded by tests/test_hf_zoo.py (mixtral, qwen2_moe).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install_fake_fallbacks"]

_BF16_ONLY = {torch.ops.aten._grouped_mm.default} if hasattr(torch.ops.aten, "_grouped_mm") else set()
_installed = False


def _grouped_mm_size(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """Output size of ``_grouped_mm(a, b, offs)`` (the meta kernel's rule, without its dtype check)."""
    if a.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
    return [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]


def _grouped_mm_fake(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    named = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), args)) | kwargs
    a, b = named["mat_a"], named["mat_b"]
    if a.dtype == torch.bfloat16 or a.dim() not in (2, 3) or b.dim() not in (2, 3):
        return NotImplemented  # the meta kernel's own answer (and its own errors)
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    with in_kernel_invocation_manager(fake_mode):
        out = torch.empty(_grouped_mm_size(a, b, named.get("offs")), dtype=named.get("out_dtype") or a.dtype,
                          device="meta")
    return FakeTensor(fake_mode, out, a.device)


def install_fake_fallbacks() -> None:
    """Register the fallbacks with ``FakeTensorMode``, once per process: Note: [fake op fallbacks]."""
    global _installed
    if _installed or not _BF16_ONLY:
        return
    from torch._subclasses import fake_impls

    fake_impls.register_op_impl(lambda func: func in _BF16_ONLY)(_grouped_mm_fake)
    _installed = True
