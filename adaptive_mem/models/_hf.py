"""Hugging Face causal LMs built from their config classes with random weights (``hf:<family>`` specs)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ._errors import ModelSpecError

__all__ = ["HF_FAMILIES", "build_hf", "hf_unpacked_sequences"]


# Tiny defaults: a few layers of width 64, enough to exercise every op of the family in well under a second.
_TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
HF_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", _TINY_LLAMA),
    "qwen2": ("Qwen2Config", _TINY_LLAMA),
    "mistral": ("MistralConfig", _TINY_LLAMA),
    "mixtral": ("MixtralConfig", {**_TINY_LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt2": ("GPT2Config", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
}


def build_hf(spec: str, family: str, args: dict[str, Any], seq: int) -> tuple[nn.Module, int]:
    if family not in HF_FAMILIES:
        raise ModelSpecError(f"model spec {spec!r}: unknown family {family!r}; expected hf:<{'|'.join(HF_FAMILIES)}>")
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(f"model spec {spec!r}: needs transformers (pip install 'adaptive-mem[hf]')") from None
    class_name, tiny = HF_FAMILIES[family]
    config_cls = getattr(transformers, class_name)
    default = config_cls()
    unknown = sorted(k for k in args if not hasattr(default, k))
    if unknown:
        raise ModelSpecError(f"model spec {spec!r}: model_args key {unknown[0]!r}: not an attribute of {class_name}")
    try:
        config = config_cls(**{**tiny, **args})
    except Exception as exc:  # noqa: BLE001 - the config class's own validation (HF strict dataclasses)
        raise ModelSpecError(rejected(spec, class_name, args, exc)) from None
    positions = "n_positions" if family == "gpt2" else "max_position_embeddings"
    if getattr(config, positions) < seq:
        if positions in args:
            raise ModelSpecError(f"model spec {spec!r}: seq_len={seq}: expected at most {positions}={args[positions]}")
        setattr(config, positions, seq)
    config.use_cache = False
    try:
        extra = {}
        if family == "mixtral":
            # grouped_mm's meta kernel takes bf16 only; batched_mm runs everywhere (same choice real and fake).
            bf16 = torch.get_default_dtype() == torch.bfloat16
            extra["experts_implementation"] = "grouped_mm" if bf16 else "batched_mm"
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **extra)
    except (ValueError, TypeError, AssertionError) as exc:
        raise ModelSpecError(f"model spec {spec!r}: {class_name} rejected model_args: {exc}") from None
    return model, config.vocab_size


def rejected(spec: str, class_name: str, args: dict[str, Any], exc: BaseException) -> str:
    """One line naming the ``--model-args`` keys a config class refused, and its reason."""
    cause = exc.__cause__ or exc
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    text = f"{exc} {reason}".lower()
    named = [k for k in args if k.lower() in text or k.replace("_", " ").lower() in text] or list(args)
    given = ",".join(f"{k}={args[k]}" for k in named) or "(defaults)"
    return f"model spec {spec!r}: --model-args {given}: {class_name} rejected it ({reason})"


def hf_unpacked_sequences() -> contextlib.AbstractContextManager | None:
    """On fake tensors, tell transformers' mask builder that the batch holds no packed sequences.

    transformers reads ``position_ids`` to detect packed sequences; fake tensors have no values, so it
    would assume packing and build an explicit mask, a different attention path from the real run.
    :meth:`ModelBundle.batch` makes one whole sequence per row, so "not packed" is the true answer.
    """
    import sys
    from unittest import mock

    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        return None
    return mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None)
