"""FLOPs and bytes moved by one aten op, and a roofline time estimate from a hardware spec.

Note: [op pricing] one rule prices every estimated op (the recorder's per-op times, the optimizer step): its
compute at the peak of the dtype it computes in (``HardwareSpec.half_flops`` for bf16/fp16, ``fp32_flops`` for
fp32, ``peak_flops`` when the spec does not know that dtype's peak) times the efficiency of its kernel class
(``attention_efficiency`` for the fused SDPA kernels, ``matmul_efficiency`` for every other op with FLOPs:
mm, bmm, addmm, baddbmm, convolution), its memory traffic at ``memory_bandwidth x memory_efficiency``; the op
takes the longer of the two. The dtype is the one of its first floating-point tensor argument: under autocast
the recorder sees the kernels after the cast, so an amp-bf16 matmul is priced as bf16 whatever the parameters'
dtype. Guarded by ``tests/test_hardware_specs.py``.

Note: [causal attention FLOPs] ``op_flops`` counts an SDPA call's full ``S x S`` score matrix (as
``torch.utils.flop_counter`` does), causal or not; a causal flash / memory-efficient kernel skips the blocks above
the diagonal and does about half of that work, and the published kernel TFLOPS the efficiencies come from count
causal runs' FLOPs halved the same way. A causal call is therefore priced at half its counted FLOPs (its recorded
``flops`` stay the counted ones); the non-causal efficiency is assumed for it.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ._profile import HardwareSpec

__all__ = ["ATTENTION_OPS", "compute_dtype", "estimate_seconds", "is_causal", "memory_seconds", "op_bytes", "op_flops",
           "op_seconds"]

_aten = torch.ops.aten


def _cpu_sdpa(q, k, v, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(q.shape, _expand_kv(k, q).shape, _expand_kv(v, q).shape)


def _cpu_sdpa_backward(grad_out, q, k, v, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, q.shape, _expand_kv(k, q).shape, _expand_kv(v, q).shape)


def _expand_kv(kv: torch.Tensor, q: torch.Tensor) -> _Shaped:
    # Grouped-query attention: count FLOPs as if k/v had q's heads (what the kernel computes).
    if kv.dim() == 4 and kv.shape[1] != q.shape[1]:
        return _Shaped(torch.Size((kv.shape[0], q.shape[1], *kv.shape[2:])))
    return _Shaped(kv.shape)


class _Shaped:
    def __init__(self, shape: torch.Size) -> None:
        self.shape = shape


_EXTRA = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
    _aten._scaled_dot_product_flash_attention: _cpu_sdpa,
    _aten._scaled_dot_product_flash_attention_backward: _cpu_sdpa_backward,
}


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> int:
    """Forward FLOPs of one call (``torch.utils.flop_counter`` formulas; 0 for ops it has none for)."""
    packet = func.overloadpacket
    formula = _EXTRA.get(packet) or flop_registry.get(packet)  # ours first: grouped-query attention
    try:
        if formula is not None:
            return int(formula(*args, **kwargs, out_val=out))
    except (AssertionError, TypeError, ValueError, IndexError, RuntimeError):
        return 0
    return 0


def _tensor_bytes(tree: object) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def op_bytes(args: tuple, kwargs: dict, out: object) -> int:
    """Bytes read (tensor arguments) plus bytes written (outputs)."""
    return _tensor_bytes((args, kwargs)) + _tensor_bytes(out)


ATTENTION_OPS = frozenset(getattr(_aten, name) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward",
) if hasattr(_aten, name))
"""Fused attention kernels (their overload packets), priced at ``attention_efficiency`` (Note: [op pricing])."""


def compute_dtype(args: tuple, kwargs: dict | None = None) -> torch.dtype | None:
    """The dtype an op computes in: its first floating-point tensor argument's (None without one)."""
    for t in pytree.tree_leaves((args, kwargs or {})):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return None


def _peak(hardware: HardwareSpec, dtype: torch.dtype | None) -> float:
    if dtype in (torch.bfloat16, torch.float16) and hardware.half_flops > 0:
        return hardware.half_flops
    if dtype == torch.float32 and hardware.fp32_flops > 0:
        return hardware.fp32_flops
    return hardware.peak_flops


def memory_seconds(hardware: HardwareSpec, nbytes: float) -> float:
    """Seconds to move ``nbytes`` through device memory at the bandwidth memory-bound kernels reach."""
    return nbytes / (hardware.memory_bandwidth * hardware.memory_efficiency)


def estimate_seconds(hardware: HardwareSpec, *, flops: int, nbytes: int, dtype: torch.dtype | None = None,
                     attention: bool = False) -> float:
    """Roofline (Note: [op pricing]): the op is bound by compute or by memory traffic, whichever takes longer.
    ``dtype``: the dtype it computes in (None: ``peak_flops``); ``attention``: a fused attention kernel."""
    efficiency = hardware.attention_efficiency if attention else hardware.matmul_efficiency
    compute = flops / (_peak(hardware, dtype) * efficiency) if flops else 0.0
    return max(compute, memory_seconds(hardware, nbytes))


def is_causal(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether an attention call is causal: its ``is_causal`` argument (False for ops without one)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "is_causal":
            if arg.name in kwargs:
                return bool(kwargs[arg.name])
            return bool(args[i]) if i < len(args) else bool(arg.has_default_value() and arg.default_value)
    return False


def op_seconds(hardware: HardwareSpec, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object,
               flops: int) -> float:
    """Estimated seconds of one aten call with ``flops`` FLOPs on ``hardware`` (Note: [op pricing])."""
    attention = func.overloadpacket in ATTENTION_OPS
    if attention and is_causal(func, args, kwargs):
        flops //= 2  # Note: [causal attention FLOPs]
    return estimate_seconds(hardware, flops=flops, nbytes=op_bytes(args, kwargs, out),
                            dtype=compute_dtype(args, kwargs), attention=attention)
