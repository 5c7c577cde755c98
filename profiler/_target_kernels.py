"""The target device's attention kernel on fake tensors.

Note: [fake attention on a CUDA target]. Fake tensors of a ``device="meta"`` profile are CPU tensors,
so ``F.scaled_dot_product_attention`` dispatches as on a CPU: without dropout to
``aten._scaled_dot_product_flash_attention_for_cpu``, whose autograd node saves what the CUDA flash
and cuDNN kernels save (q, k, v, the output and the fp32 logsumexp ``[B, H, S]``); with dropout to the
math decomposition, which saves the ``[B, H, S, S]`` attention matrix and its dropout mask. A CUDA
kernel never materialises that matrix: flash attention draws its dropout mask again in backward from
the saved RNG state (``rng_state``, two uint64, plus one unused uint64 in PyTorch's
``_scaled_dot_product_flash_attention``). On a CUDA target (:data:`CUDA_HARDWARE`) the fake pass
therefore runs an SDPA call with dropout as the kernel PyTorch's CUDA dispatch picks (``sdp_utils.cpp``,
flash before memory-efficient): ``aten._scaled_dot_product_flash_attention`` for fp16/bf16 4-D inputs without
an attention mask and one head dim of at most 256, else ``aten._scaled_dot_product_efficient_attention`` for
fp16/bf16/fp32 inputs with head dims divisible by 8 (a mask allowed; logsumexp padded to a multiple of 32,
RNG seed and offset saved). Their meta kernels give the CUDA kernels' outputs and their autograd formulas save
them. Every other call keeps the CPU dispatch. Guarded by ``tests/test_target_kernels.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CUDA_HARDWARE", "cuda_attention", "is_cuda_hardware"]

CUDA_HARDWARE = ("h100", "h200", "a100")
"""Hardware specs of ``profiler._hardware`` that are NVIDIA GPUs (CUDA kernels, the CUDA caching allocator)."""

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention.default
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def is_cuda_hardware(name: str | None) -> bool:
    """Whether hardware ``name`` runs CUDA kernels: a spec of :data:`CUDA_HARDWARE`, or ``cuda`` (a spec measured on
    a CUDA device); ``cpu``, ``ascend-910b``, ``npu``... do not."""
    key = str(name or "").lower()
    return key in CUDA_HARDWARE or key == "cuda"


def _cuda_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, named: dict[str, Any]) -> str | None:
    """``flash`` or ``efficient`` where the CUDA dispatch picks that kernel and the CPU one would not (Note: [fake
    attention on a CUDA target]); None to keep the CPU dispatch."""
    if not named.get("dropout_p") or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    if k.size(1) != q.size(1) and not (named.get("enable_gqa") and named.get("attn_mask") is None):
        return None
    if (named.get("attn_mask") is None and q.dtype in (torch.float16, torch.bfloat16)
            and q.size(-1) == k.size(-1) == v.size(-1) <= 256):
        return "flash"
    if k.size(1) == q.size(1) and q.size(-1) == k.size(-1) and q.size(-1) % 8 == 0 == v.size(-1) % 8 \
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "efficient"
    return None


class _CudaAttention(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        named = dict(zip(_SDPA_ARGS, args)) | kwargs
        q, k, v = named["query"], named["key"], named["value"]
        if torch.is_autocast_enabled(q.device.type) and q.dtype == torch.float32:
            half = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(half), k.to(half), v.to(half)
        kernel = _cuda_kernel(q, k, v, named)
        dropout, causal = float(named.get("dropout_p") or 0.0), bool(named.get("is_causal", False))
        if kernel == "flash":
            return _FLASH(q, k, v, dropout, causal, scale=named.get("scale"))[0]
        if kernel == "efficient":
            return _EFFICIENT(q, k, v, named.get("attn_mask"), True, dropout, causal, scale=named.get("scale"))[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_attention(hardware: str | None) -> Iterator[None]:
    """On a CUDA ``hardware``, SDPA with dropout saves what the CUDA flash kernel saves (Note: [fake attention on
    a CUDA target]); on any other hardware nothing changes."""
    if not is_cuda_hardware(hardware):
        yield
        return
    with _CudaAttention():
        yield
