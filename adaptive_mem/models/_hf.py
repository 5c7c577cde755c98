"""Hugging Face models built from their config classes with random weights (``hf:<family>`` specs), for training:
``use_cache`` off unless ``--model-args use_cache=true`` asks for it (as Hugging Face's own training with
gradient checkpointing does); planned layers that do get a ``Cache`` handle it (Note: [cache in recompute])."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from typing import Any, Sequence

import torch
from torch import nn

from ._errors import ModelSpecError

__all__ = ["HF_FAMILIES", "HF_HEADS", "build_hf", "class_defaults", "hf_packed", "hf_unpacked_sequences",
           "shape_args"]

_log = logging.getLogger(__name__)


# Tiny defaults: 3 layers of width 64, enough to exercise every op of the family in well under a second.
_IDS = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_TINY = dict(_IDS, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=128)
_GQA = dict(_TINY, num_key_value_heads=2)
HF_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(_GQA, intermediate_size=176, num_hidden_layers=2, max_position_embeddings=512)),
    "mistral": ("MistralConfig", dict(_GQA, head_dim=16)),
    "qwen2": ("Qwen2Config", _GQA),
    "qwen3": ("Qwen3Config", dict(_GQA, head_dim=16)),
    "gemma": ("GemmaConfig", dict(_GQA, head_dim=16)),
    "gemma2": ("Gemma2Config", dict(_GQA, head_dim=16, sliding_window=64)),
    "phi3": ("Phi3Config", dict(_GQA, original_max_position_embeddings=128)),
    "olmo2": ("Olmo2Config", _GQA),
    "starcoder2": ("Starcoder2Config", _GQA),
    "mixtral": ("MixtralConfig", dict(_GQA, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=128)),
    "deepseek_v3": ("DeepseekV3Config", dict(_TINY, num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1,
                                             n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    "phimoe": ("PhimoeConfig", dict(_GQA, num_local_experts=4, num_experts_per_tok=2)),
    "gpt2": ("GPT2Config", dict(_IDS, n_embd=64, n_layer=3, n_head=4, n_inner=128, n_positions=128,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neox": ("GPTNeoXConfig", dict(_TINY, hidden_dropout=0.0, attention_dropout=0.0)),
    "opt": ("OPTConfig", dict(_IDS, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
                              word_embed_proj_dim=64, max_position_embeddings=128, dropout=0.0)),
    "bloom": ("BloomConfig", dict(_IDS, hidden_size=64, n_layer=3, n_head=4)),
    "falcon": ("FalconConfig", dict(_IDS, hidden_size=64, ffn_hidden_size=128, num_hidden_layers=3,
                                    num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                    max_position_embeddings=128)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(_IDS, n_embd=64, n_layer=3, n_head=4, n_inner=128, n_positions=128,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "bert": ("BertConfig", dict(_TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "t5": ("T5Config", dict(_IDS, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3, num_heads=4,
                            dropout_rate=0.0, decoder_start_token_id=0)),
    # Hybrid stacks: layers of two kinds in one ModuleList (docs/plan-format.md, "Layers of several kinds").
    "qwen3_next": ("Qwen3NextConfig", dict(_GQA, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
                                           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=64)),
    "lfm2": ("Lfm2Config", dict(_GQA, full_attn_idxs=[1, 3], block_auto_adjust_ff_dim=False)),
}
HF_HEADS: dict[str, str] = {"bert": "BertForMaskedLM", "t5": "T5ForConditionalGeneration"}
"""Model class of the families that are not causal LMs (the rest: ``AutoModelForCausalLM``)."""
_POSITIONS = {"gpt2": "n_positions", "gpt_bigcode": "n_positions", "bloom": None, "t5": None}
"""Config attribute bounding the sequence length, where it is not ``max_position_embeddings``."""
_EAGER = ("gemma2", "bloom")
"""Families without an SDPA attention in transformers (gemma2: logit soft-capping)."""


_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")
"""The config keys naming a family's width, the first its tiny shape has."""


def class_defaults(config_cls: type, keys: Any) -> dict[str, Any]:
    """The defaults ``config_cls`` declares for ``keys``: its ``__init__``'s, so a key it derives from others
    when not given (``n_inner``, ``head_dim``...) is None; keys its signature lacks take a default instance's."""
    params = inspect.signature(config_cls.__init__).parameters
    out = {k: params[k].default for k in keys if k in params and params[k].default is not inspect.Parameter.empty}
    rest = [k for k in keys if k not in out]
    if rest:
        default = config_cls()
        out.update({k: getattr(default, k) for k in rest if hasattr(default, k)})
    return out


def shape_args(spec: str, family: str, config_cls: type, args: dict[str, Any]) -> dict[str, Any]:
    """The config keywords of ``hf:<family>`` with ``args``: the family's tiny shape under ``args``.

    Note: [tiny shape under a new width] the tiny shape's keys are sized for its width; when ``args`` change the
    width, the tiny keys the config class derives when not given (declared default None: gpt2's ``n_inner``,
    mistral's ``head_dim``, falcon's ``ffn_hidden_size``, the key-value heads) are dropped so the class derives
    them from the given shape, and the tiny shape sizes kept (layers, vocabulary...) are named in one warning.
    Token ids stay: they index the vocabulary."""
    tiny = HF_FAMILIES[family][1]
    alias = getattr(config_cls, "attribute_map", {})  # gpt2: hidden_size -> n_embd
    given = {alias.get(k, k): v for k, v in args.items()}
    width = next((k for k in _WIDTH_KEYS if k in tiny), None)
    if width is None or given.get(width, tiny[width]) == tiny[width]:
        return {**tiny, **args}
    shape = {k: v for k, v in tiny.items() if k not in given and not k.endswith("token_id")}
    derived = {k for k, v in class_defaults(config_cls, shape).items() if v is None}
    positions = _POSITIONS.get(family, "max_position_embeddings")  # grown to the sequence length anyway
    kept = sorted(k for k, v in shape.items()
                  if k not in derived and k != positions and isinstance(v, int) and not isinstance(v, bool))
    if kept:
        _log.warning("model spec %r: %s=%s with the tiny test shape's %s; give them in --model-args for the "
                     "model you mean", spec, width, given[width], ", ".join(f"{k}={tiny[k]}" for k in kept))
    return {**{k: v for k, v in tiny.items() if k not in derived}, **args}


def build_hf(spec: str, family: str, args: dict[str, Any], seq: int) -> tuple[nn.Module, int]:
    if family not in HF_FAMILIES:
        raise ModelSpecError(f"model spec {spec!r}: unknown family {family!r}; expected hf:<{'|'.join(HF_FAMILIES)}>")
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(f"model spec {spec!r}: needs transformers (pip install 'adaptive-mem[hf]')") from None
    class_name, tiny = HF_FAMILIES[family]
    config_cls = getattr(transformers, class_name)
    default = config_cls(**tiny)
    unknown = sorted(k for k in args if not hasattr(default, k))
    if unknown:
        raise ModelSpecError(f"model spec {spec!r}: model_args key {unknown[0]!r}: not an attribute of {class_name}")
    try:
        config = config_cls(**shape_args(spec, family, config_cls, args))
    except Exception as exc:  # noqa: BLE001 - the config class's own validation (HF strict dataclasses)
        raise ModelSpecError(rejected(spec, class_name, args, exc)) from None
    positions = _POSITIONS.get(family, "max_position_embeddings")
    if positions is not None and getattr(config, positions) < seq:
        if positions in args:
            raise ModelSpecError(f"model spec {spec!r}: seq_len={seq}: expected at most {positions}={args[positions]}")
        setattr(config, positions, seq)
    if "use_cache" not in args:
        config.use_cache = False
    head = HF_HEADS.get(family)
    try:
        if head is None:
            attention = "eager" if family in _EAGER else "sdpa"
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        else:
            model = getattr(transformers, head)(config)
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

    Note: [packed on fake tensors] transformers reads ``position_ids`` to detect packed sequences; fake
    tensors have no values, so it would assume packing and build an explicit mask, a different attention path
    from the real run. :meth:`ModelBundle.batch` makes one whole sequence per row, so "not packed" is the true
    answer; a :func:`hf_packed` step of several sequences is packed, and runs without this patch.
    """
    import sys
    from unittest import mock

    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        return None
    return mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None)


def hf_packed(bundle: Any, lengths: Sequence[int]) -> Any:
    """``bundle`` (an ``hf:`` causal LM's :class:`ModelBundle`) stepping on padding-free packed batches.

    Its batch is what transformers' ``DataCollatorWithFlattening`` makes of ``len(lengths)`` sequences:
    ``(input_ids, position_ids, labels)``, each ``[1, sum(lengths)]``; ``position_ids`` restart at 0 at each
    sequence, ``labels`` are the ids with -100 at each sequence's first token (no token predicts across a
    boundary); the loss is the model's own on ``labels``. transformers reads the packing from ``position_ids``
    and attends within each sequence only. ``seq_len`` is the total of ``lengths``, ``batch_size`` 1; ``bundle``
    may be packed already (its model, other lengths)."""
    repacked = hasattr(bundle.loss_fn, "packed")  # a packed bundle packs other lengths
    if not bundle.spec.startswith("hf:") or bundle.spec[3:] in HF_HEADS or (bundle.batch_fn and not repacked):
        raise ModelSpecError(f"model spec {bundle.spec!r}: packed batches: expected an hf:<family> causal LM")
    lengths = tuple(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in lengths):
        raise ModelSpecError(f"packed lengths={lengths!r}: expected one or more positive integers")
    fake_mode, device, vocab = bundle.fake_mode, bundle.device, bundle.vocab_size

    def batch_fn(seed: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, vocab, (1, sum(lengths)), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        labels = ids.clone()
        labels[0, torch.tensor([0, *lengths[:-1]]).cumsum(0)] = -100
        if fake_mode is not None:
            return tuple(fake_mode.from_tensor(t) for t in (ids, positions, labels))
        return ids.to(device), positions.to(device), labels.to(device)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ids, positions, labels = batch
        return model(input_ids=ids, position_ids=positions, labels=labels).loss

    loss_fn.packed = len(lengths) > 1  # Note: [packed on fake tensors]
    return dataclasses.replace(bundle, batch_size=1, seq_len=sum(lengths), batch_fn=batch_fn, loss_fn=loss_fn)
