"""The target device's attention kernel on fake tensors: what flash attention saves, against its formula."""

from __future__ import annotations

import pytest
import torch

import profiler
from adaptive_mem import build_model

_LSE = 4  # the logsumexp is fp32 whatever the inputs' dtype


def _attention_units(profile: profiler.Profile) -> list[profiler.UnitRecord]:
    return [u for u in profile.units if u.local_name.endswith("flash_attention")]


def _flash_bytes(batch: int, seq: int, heads: int, head_dim: int, itemsize: int, rng: int = 0) -> int:
    """Output ``[B, S, H, D]`` in the inputs' dtype, logsumexp ``[B, H, S]`` fp32, the RNG state with dropout."""
    return batch * seq * heads * head_dim * itemsize + batch * heads * seq * _LSE + rng


def _check(bundle, heads: int, head_dim: int, hardware: str, rng: int = 0) -> profiler.Profile:
    profile = profiler.profile_step(bundle, hardware=hardware)
    units = _attention_units(profile)
    assert len(units) == profile.num_layers
    itemsize = torch.empty((), dtype=bundle.dtype).element_size()
    expected = _flash_bytes(bundle.batch_size, bundle.seq_len, heads, head_dim, itemsize, rng)
    assert {u.saved_bytes for u in units} == {expected}
    return profile


@pytest.mark.parametrize("hardware", ["h100", "a100"])
def test_llama_tiny_attention_saves_output_and_logsumexp(hardware):
    bundle = build_model("llama-tiny", device="meta", dtype="bfloat16")
    cfg = bundle.model.config
    _check(bundle, cfg.num_heads, cfg.head_dim, hardware)


def test_hf_llama_attention_saves_output_and_logsumexp():
    bundle = build_model("hf:llama", device="meta", dtype="bfloat16")
    cfg = bundle.model.config
    _check(bundle, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads, "h100")


@pytest.mark.parametrize("spec, dropout", [("hf:gpt2", "attn_pdrop=0.1"), ("hf:llama", "attention_dropout=0.1")])
def test_dropout_on_a_cuda_target_saves_the_rng_state_not_the_attention_matrix(spec, dropout):
    bundle = build_model(spec, device="meta", dtype="bfloat16", model_args=dropout)  # hf:llama: grouped-query
    cfg = bundle.model.config
    rng = 2 * 8 + 8  # rng_state (two uint64) and the kernel's unused uint64
    heads = cfg.num_attention_heads
    profile = _check(bundle, heads, cfg.hidden_size // heads, "h100", rng=rng)
    assert any(o.op == "aten._scaled_dot_product_flash_attention.default" for o in profile.ops)
    assert all(o.flops > 0 for o in profile.ops if "flash_attention" in o.op)


def test_dropout_off_a_cuda_target_keeps_the_cpu_dispatch():
    bundle = build_model("hf:gpt2", device="meta", dtype="bfloat16", model_args="attn_pdrop=0.1")
    cuda = profiler.profile_step(bundle, hardware="h100")
    ascend = profiler.profile_step(bundle, hardware="ascend-910b")
    assert not any("flash_attention" in o.op for o in ascend.ops)  # the math decomposition
    assert sum(o.saved_bytes for o in ascend.ops) > sum(o.saved_bytes for o in cuda.ops)


def test_fp32_dropout_on_a_cuda_target_runs_memory_efficient_attention():
    bundle = build_model("hf:gpt2", device="meta", dtype="float32", model_args="attn_pdrop=0.1")
    cfg = bundle.model.config
    heads, padded = cfg.n_head, -(-bundle.seq_len // 32) * 32  # its logsumexp is padded to a multiple of 32
    profile = profiler.profile_step(bundle, hardware="h100")
    out = bundle.batch_size * bundle.seq_len * cfg.n_embd * 4
    expected = out + bundle.batch_size * heads * padded * _LSE + 2 * 8  # RNG seed and offset (int64)
    assert {u.saved_bytes for u in _attention_units(profile)} == {expected}
    assert any(o.op == "aten._scaled_dot_product_efficient_attention.default" for o in profile.ops)


def test_dropout_under_autocast_runs_the_flash_kernel_in_bf16():
    bundle = build_model("hf:gpt2", device="meta", dtype="float32", model_args="attn_pdrop=0.1")
    profile = profiler.profile_step(bundle, hardware="h100", precision="amp-bf16")
    assert any(o.op == "aten._scaled_dot_product_flash_attention.default" for o in profile.ops)
