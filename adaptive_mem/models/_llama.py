"""Reference Llama-style decoder with MindFormers module names.

The module tree follows MindFormers' ``LlamaModel`` so the unit names used in
its ``recompute_config`` / ``swap_config`` examples resolve verbatim::

    layers.{i}.attention_norm            RMSNorm          -> unit attention_norm.norm
    layers.{i}.attention.wq|wk|wv|wo     Linear           -> unit attention.wq.matmul ...
    layers.{i}.attention.apply_rotary_emb                 -> unit attention.apply_rotary_emb.rope
    layers.{i}.attention.flash_attention SDPA core        -> unit attention.flash_attention
    layers.{i}.ffn_norm                  RMSNorm          -> unit ffn_norm.norm
    layers.{i}.feed_forward.w1           Linear + SiLU    -> units feed_forward.w1.matmul,
                                                             feed_forward.w1.activation.silu
    layers.{i}.feed_forward.w3 | w2      Linear           -> units feed_forward.w3.matmul ...
    layers.{i}.feed_forward.mul          elementwise mul  -> unit feed_forward.mul

With ``fused_norm`` every RMSNorm runs a fused kernel (same unit names); with ``fused_swiglu`` the SiLU and
the mul are one fused op, ``layers.{i}.feed_forward.swiglu`` (unit ``feed_forward.swiglu``), and ``w1`` has
no activation child (:mod:`._fused` says what each saves). Parameter names are the same either way.

Leaf modules that stand for one logical op carry a ``unit_label`` attribute;
the unit namer in :mod:`profiler` reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._fused import FusedRMSNormFunction, SwiGLU

__all__ = ["LlamaConfig", "LlamaModel"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    """Vocabulary size of the embedding and output projection."""
    hidden_size: int = 4096
    """Model width."""
    intermediate_size: int = 11008
    """Width of the SwiGLU feed-forward block."""
    num_layers: int = 32
    """Number of decoder layers (``layers.{i}``)."""
    num_heads: int = 32
    """Attention heads; ``hidden_size`` must be divisible by it."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means ``num_heads``."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding."""
    max_seq_len: int = 4096
    """Longest sequence the rotary table is built for."""
    fused_norm: bool = False
    """Run every RMSNorm as a fused kernel saving its input and the inverse RMS (apex / Transformer Engine)."""
    fused_swiglu: bool = False
    """Run ``silu(w1 x) * w3 x`` as one fused op saving its two inputs only (Megatron's ``bias_swiglu_impl``)."""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{key}={value!r}: expected a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"LlamaConfig.hidden_size={self.hidden_size}: expected a multiple of num_heads={self.num_heads}"
            )
        kv = self.kv_heads
        if kv <= 0 or self.num_heads % kv:
            raise ValueError(f"LlamaConfig.num_kv_heads={self.num_kv_heads!r}: expected a divisor of num_heads")
        for key in ("fused_norm", "fused_swiglu"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"LlamaConfig.{key}={getattr(self, key)!r}: expected True or False")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """``F.rms_norm``, or with ``fused`` :class:`FusedRMSNormFunction` (the same parameter and unit name)."""

    unit_label = "norm"

    def __init__(self, dim: int, eps: float, *, fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return FusedRMSNormFunction.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(config: LlamaConfig) -> nn.Module:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, fused=config.fused_norm)


class SiLU(nn.Module):
    unit_label = "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


class Linear(nn.Module):
    """Bias-free projection with an optional activation submodule, as in MindFormers.

    The projection itself is unit ``<path>.matmul``; the activation is the child
    ``<path>.activation`` whose unit is ``<path>.activation.silu``.
    """

    def __init__(self, in_features: int, out_features: int, *, activation: nn.Module | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return out if self.activation is None else self.activation(out)


class Mul(nn.Module):
    unit_label = "mul"

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


class FlashAttention(nn.Module):
    """Causal scaled-dot-product attention core (Megatron's "core attention")."""

    unit_label = "flash_attention"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class RotaryEmbedding(nn.Module):
    unit_label = "rope"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.wq = Linear(config.hidden_size, config.num_heads * self.head_dim)
        self.wk = Linear(config.hidden_size, self.kv_heads * self.head_dim)
        self.wv = Linear(config.hidden_size, self.kv_heads * self.head_dim)
        self.wo = Linear(config.num_heads * self.head_dim, config.hidden_size)
        self.apply_rotary_emb = RotaryEmbedding()
        self.flash_attention = FlashAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q = self.apply_rotary_emb(q, cos, sin)
        k = self.apply_rotary_emb(k, cos, sin)
        out = self.flash_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        fused = config.fused_swiglu
        self.w1 = Linear(config.hidden_size, config.intermediate_size, activation=None if fused else SiLU())
        self.w3 = Linear(config.hidden_size, config.intermediate_size)
        if fused:
            self.swiglu = SwiGLU()
        else:
            self.mul = Mul()
        self.w2 = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "swiglu"):
            return self.w2(self.swiglu(self.w1(x), self.w3(x)))
        return self.w2(self.mul(self.w1(x), self.w3(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = _norm(config)
        self.attention = Attention(config)
        self.ffn_norm = _norm(config)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaModel(nn.Module):
    """Decoder-only language model; ``forward(tokens)`` returns logits."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = _norm(config)
        self.output = Linear(config.hidden_size, config.vocab_size)

    def _rope_tables(self, seq: int, *, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        half = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq}: expected at most max_seq_len={self.config.max_seq_len}")
        h = self.tok_embeddings(tokens)
        with torch.no_grad():
            cos, sin = self._rope_tables(seq, device=h.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
