"""FLOPs and bytes moved by one aten op, and a roofline time estimate from a hardware spec.

Note: [op pricing] one rule prices every estimated op (the recorder's per-op times, the optimizer step): its
compute at the peak of the dtype it computes in (``HardwareSpec.half_flops`` for bf16/fp16, ``fp32_flops`` for
fp32, ``peak_flops`` when the spec does not know that dtype's peak) times the efficiency of its kernel class
(``attention_efficiency`` for the fused SDPA kernels, ``matmul_efficiency`` for every other op with FLOPs:
mm, bmm, addmm, baddbmm, convolution), its memory traffic at ``memory_bandwidth x memory_efficiency``; the op
takes the longer of the two, plus the spec's ``kernel_latency`` (what one kernel costs beyond its roofline:
launch, ramp-up and tail; the optimizer step, a few multi-tensor kernels, is charged none). The dtype is the one
of its first floating-point tensor argument: under autocast the recorder sees the kernels after the cast, so an
amp-bf16 matmul is priced as bf16 whatever the parameters' dtype. The CUDA flash kernels' efficiency also follows
their shape (Note: [flash attention shape]). Guarded by ``tests/test_hardware_specs.py``.

Note: [causal attention FLOPs] ``op_flops`` counts an SDPA call's full ``S x S`` score matrix (as
``torch.utils.flop_counter`` does), causal or not; a causal flash / memory-efficient kernel skips the blocks above
the diagonal and does about half of that work, and the published kernel TFLOPS the efficiencies come from count
causal runs' FLOPs halved the same way. A causal call is therefore priced at half its counted FLOPs (its recorded
``flops`` stay the counted ones); its efficiency is the causal one of Note: [flash attention shape] for the CUDA
flash kernels, the non-causal one for the others.

Note: [flash attention shape] on a CUDA target the flash kernels (:data:`FLASH_OPS`: PyTorch's FlashAttention-2
backend, for a fp16/bf16 query without a mask) do not reach one fraction of the peak: shorter sequences, the
causal mask and the backward pass reach less. The FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608,
figures "Attention forward / backward speed, head dim 128 (H100 80GB SXM5)") measures FlashAttention-2 at 512 to
16k positions (:data:`_FA2_TFLOPS`). A flash call is
priced at ``attention_efficiency x curve(direction, causal, seq) / curve(forward, non-causal, 4608)``: the spec's
efficiency is PyTorch's flash backend forward, non-causal, at seq 4608 (``profiler/_hardware.py``), and the curve
carries it to the call's shape (log-linear in the sequence length between the measured points, flat beyond them).
Assumed where no figure was published: the head-dim-128 curve for every head dim, the H100's relative curve on the
other CUDA parts, and the backward's causal / non-causal ratio equal to the forward's at the same length.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ._profile import HardwareSpec
from ._target_kernels import is_cuda_hardware

__all__ = ["ATTENTION_OPS", "FLASH_OPS", "compute_dtype", "estimate_seconds", "flash_shape_factor", "is_causal",
           "memory_seconds", "op_bytes", "op_flops", "op_seconds"]

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
                     attention: bool = False, shape_factor: float = 1.0) -> float:
    """Roofline (Note: [op pricing]): the op is bound by compute or by memory traffic, whichever takes longer, plus
    the spec's per-kernel latency. ``dtype``: the dtype it computes in (None: ``peak_flops``); ``attention``: a
    fused attention kernel, whose efficiency is scaled by ``shape_factor`` (Note: [flash attention shape])."""
    efficiency = hardware.attention_efficiency * shape_factor if attention else hardware.matmul_efficiency
    compute = flops / (_peak(hardware, dtype) * efficiency) if flops else 0.0
    return max(compute, memory_seconds(hardware, nbytes)) + hardware.kernel_latency


def is_causal(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether an attention call is causal: its ``is_causal`` argument (False for ops without one)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "is_causal":
            if arg.name in kwargs:
                return bool(kwargs[arg.name])
            return bool(args[i]) if i < len(args) else bool(arg.has_default_value() and arg.default_value)
    return False


FLASH_OPS = frozenset(getattr(_aten, name) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
) if hasattr(_aten, name))
"""The FlashAttention-2 kernels of a CUDA target, whose efficiency follows their shape (Note: [flash attention
shape]): the CUDA flash ops, and the CPU flash op a fake pass runs in their place (Note: [fake attention on a CUDA
target], ``profiler/_target_kernels.py``)."""

_FA2_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
_FA2_TFLOPS = {
    ("forward", False): (309, 350, 362, 368, 370, 370),
    ("forward", True): (191, 260, 298, 319, 333, 335),
    ("backward", False): (214, 260, 291, 310, 318, 322),
}
"""FlashAttention-2 TFLOPS on an H100 80GB SXM5, head dim 128, bf16, at :data:`_FA2_SEQS` positions (Shah et al.
2024, arXiv 2407.08608, "Attention forward speed" with and without the causal mask, "Attention backward speed";
causal runs' FLOPs halved). No causal backward figure is published (Note: [flash attention shape])."""
_FA2_REFERENCE_SEQ = 4608
"""The sequence length of the spec's ``attention_efficiency`` (PyTorch's flash forward, non-causal)."""


def _fa2_tflops(direction: str, causal: bool, seq: int) -> float:
    """The measured curve at ``seq`` positions, log-linear between the points and flat beyond them."""
    if direction == "backward" and causal:
        return _fa2_tflops("backward", False, seq) * _fa2_tflops("forward", True, seq) / _fa2_tflops(
            "forward", False, seq)
    points = _FA2_TFLOPS[(direction, causal)]
    x = min(max(math.log2(max(seq, 1)), math.log2(_FA2_SEQS[0])), math.log2(_FA2_SEQS[-1]))
    i = min(int(x - math.log2(_FA2_SEQS[0])), len(_FA2_SEQS) - 2)
    t = x - math.log2(_FA2_SEQS[i])
    return points[i] + t * (points[i + 1] - points[i])


def flash_shape_factor(seq: int, *, causal: bool, backward: bool) -> float:
    """A flash call's efficiency over the spec's (Note: [flash attention shape]): its curve point over the
    reference's (forward, non-causal, 4608 positions)."""
    direction = "backward" if backward else "forward"
    return _fa2_tflops(direction, causal, seq) / _fa2_tflops("forward", False, _FA2_REFERENCE_SEQ)


def _flash_factor(hardware: HardwareSpec, func: torch._ops.OpOverload, args: tuple, kwargs: dict,
                  causal: bool) -> float:
    """The shape factor of a call of :data:`FLASH_OPS` on a CUDA target that dispatches to the flash kernel (a
    4-D fp16/bf16 query, no attention mask): its query's sequence length (dim -2 of SDPA's ``(B, H, S, D)``, dim 1
    of the ``(B, S, H, D)`` ``_flash_attention_*`` ops), forward or backward by the op's name; 1 otherwise."""
    if func.overloadpacket not in FLASH_OPS or not is_cuda_hardware(hardware.name):
        return 1.0
    backward = func.overloadpacket.__name__.endswith("_backward")
    query = args[1] if backward and len(args) > 1 else (args[0] if args else None)
    if (not isinstance(query, torch.Tensor) or query.dim() != 4 or kwargs.get("attn_mask") is not None
            or query.dtype not in (torch.float16, torch.bfloat16)):
        return 1.0
    seq_dim = 1 if func.overloadpacket.__name__.startswith("_flash_attention") else 2
    return flash_shape_factor(int(query.shape[seq_dim]), causal=causal, backward=backward)


def op_seconds(hardware: HardwareSpec, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object,
               flops: int) -> float:
    """Estimated seconds of one aten call with ``flops`` FLOPs on ``hardware`` (Note: [op pricing])."""
    packet = func.overloadpacket
    attention = packet in ATTENTION_OPS
    causal = attention and is_causal(func, args, kwargs)
    if causal:
        flops //= 2  # Note: [causal attention FLOPs]
    factor = _flash_factor(hardware, func, args, kwargs, causal)
    return estimate_seconds(hardware, flops=flops, nbytes=op_bytes(args, kwargs, out),
                            dtype=compute_dtype(args, kwargs), attention=attention, shape_factor=factor)
