"""FLOPs and bytes moved by one aten op, and a roofline time estimate from a hardware spec."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ._profile import HardwareSpec

__all__ = ["op_flops", "op_bytes", "estimate_seconds"]

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


def estimate_seconds(hardware: HardwareSpec, *, flops: int, nbytes: int) -> float:
    """Roofline: the op is bound by compute or by memory traffic, whichever takes longer."""
    return max(flops / hardware.peak_flops, nbytes / hardware.memory_bandwidth)
