"""A planned Hugging Face model still works with the Hugging Face and PyTorch tools around it.

For every plan kind (full recompute, selective recompute of the MLP, layer swap, op swap of attention):
state_dict keys, ``save_pretrained``/``from_pretrained``, ``eval()`` logits, greedy ``generate()``, three
``transformers.Trainer`` steps, and ``copy.deepcopy``/``pickle``/``torch.save`` (Note: [copy drops the
plan] in adaptive_mem/runtime/_copy_guard.py: the copy is a plain model, one warning says so).
"""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
from torch import nn

import transformers

import adaptive_mem
from search import PlanError

PLANS = {
    "full-recompute": {"config": {"recompute_config": {"recompute": True}}},
    "select-recompute-mlp": {"config": {"recompute_config": {"select_recompute": {"mlp": True}}}},
    "layer-swap": {"plan": {"format": "adaptive-mem-plan", "version": 1, "decisions": {"model.layers.0": "swap"}}},
    "op-swap-attention": {"config": {"swap_config": {"swap": True, "op_swap": [
        {"op_name": "self_attn", "backward_prefetch": 1, "layers": [0, 1]}]}}},
}
SWAPS = {"layer-swap", "op-swap-attention"}
NOT_COPIED = "the plan was not copied; apply it to the copy with adaptive_mem.optimize"
GUARDS = ("forward", "__deepcopy__", "__reduce_ex__")


def tiny(*, use_cache: bool = False) -> nn.Module:
    """The kv cache is off as in training with gradient checkpointing (see test_select_recompute_with_the_kv_cache)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0,
                                   pad_token_id=0, use_cache=use_cache)
    return transformers.LlamaForCausalLM(cfg)


def ids() -> torch.Tensor:
    return torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = ids()
    model(input_ids=x, labels=x).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_plain(model: nn.Module) -> None:
    for path, module in model.named_modules():
        assert not any(name in module.__dict__ for name in GUARDS), path
        assert not module._forward_hooks and not module._forward_pre_hooks, path
        assert not module._forward_hooks_with_kwargs and not module._forward_pre_hooks_with_kwargs, path
        assert not module._forward_hooks_always_called, path


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture(scope="module")
def reference() -> dict:
    model = tiny().eval()
    with torch.no_grad():
        tokens = model.generate(ids(), max_new_tokens=6, do_sample=False, use_cache=True)
    return {"keys": list(model.state_dict()), "logits": model(input_ids=ids()).logits.detach(),
            "tokens": tokens, "grads": grads(model.train())}


@pytest.mark.parametrize("kind", list(PLANS))
def test_state_dict_save_load_eval_and_generate(kind, reference, tmp_path):
    model = tiny()
    with adaptive_mem.optimize(model, **PLANS[kind]):
        assert list(model.state_dict()) == reference["keys"]
        model.save_pretrained(tmp_path)
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
        assert_same_weights(loaded, tiny())
        assert_plain(loaded)
        model.eval()
        assert torch.equal(model(input_ids=ids()).logits, reference["logits"])  # grad on: the plan's path runs
        tokens = model.generate(ids(), max_new_tokens=6, do_sample=False, use_cache=True)
        assert torch.equal(tokens, reference["tokens"])


def train(model: nn.Module, out: str) -> nn.Module:
    rows = ids().repeat(3, 1)
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = transformers.TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=2,
                                          learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    return model


@pytest.fixture(scope="module")
def trained_reference(tmp_path_factory) -> nn.Module:
    return train(tiny(), str(tmp_path_factory.mktemp("reference")))


@pytest.mark.parametrize("kind", list(PLANS))
def test_three_trainer_steps_give_the_unplanned_weights(kind, trained_reference, tmp_path):
    model = tiny()
    with adaptive_mem.optimize(model, **PLANS[kind]) as handle:
        train(model, str(tmp_path))
        if kind in SWAPS:
            assert handle.swap_stats.offloaded_bytes > 0
    assert_same_weights(model, trained_reference)
    assert not torch.equal(model.lm_head.weight, tiny().lm_head.weight)  # the steps did train


def count_warnings(caplog) -> int:
    n = sum(NOT_COPIED in r.getMessage() for r in caplog.records)
    caplog.clear()
    return n


@pytest.mark.parametrize("kind", list(PLANS))
def test_copies_are_plain_models_and_the_original_keeps_its_plan(kind, reference, caplog):
    model = tiny()
    with adaptive_mem.optimize(model, **PLANS[kind]) as handle:
        assert torch.equal(grads(model)["lm_head.weight"], reference["grads"]["lm_head.weight"])
        with caplog.at_level(logging.WARNING, logger="adaptive_mem"):
            copies = [copy.deepcopy(model)]
            assert count_warnings(caplog) == 1
            copies.append(pickle.loads(pickle.dumps(model)))
            assert count_warnings(caplog) == 1
            buffer = io.BytesIO()
            torch.save(model, buffer)
            assert count_warnings(caplog) == 1
            copies.append(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(2)  # a copy computing with the original's weights shows
        for c in copies:
            assert type(c) is type(model)
            assert_plain(c)
            assert torch.equal(c.eval()(input_ids=ids()).logits, reference["logits"])
            got = grads(c.train())
            for name, g in reference["grads"].items():
                assert torch.equal(got[name], g), name
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.div_(2)
        offloaded = handle.swap_stats.offloaded_bytes if kind in SWAPS else 0
        got = grads(model)  # the original still trains with its plan
        for name, g in reference["grads"].items():
            assert torch.equal(got[name], g), name
        if kind in SWAPS:
            assert handle.swap_stats.offloaded_bytes > offloaded
        with adaptive_mem.optimize(copies[0], **PLANS[kind]):  # the plan applies to a copy
            got = grads(copies[0])
            for name, g in reference["grads"].items():
                assert torch.equal(got[name], g), name
        assert_plain(copies[0])
    assert_plain(model)


def test_a_layer_copied_alone_is_plain_and_has_its_own_weights(caplog):
    model = tiny()
    x = torch.randn(2, 12, 64)
    with adaptive_mem.optimize(model, **PLANS["full-recompute"]):
        layer = model.model.layers[1]
        pos = model.model.rotary_emb(x, torch.arange(12)[None])
        with caplog.at_level(logging.WARNING, logger="adaptive_mem"):
            twin = copy.deepcopy(layer)
        assert count_warnings(caplog) == 1
        assert_plain(twin)
        expected = layer(x, position_embeddings=pos)
        with torch.no_grad():
            layer.mlp.up_proj.weight.zero_()
        assert torch.equal(twin(x, position_embeddings=pos), expected)


def test_a_copy_made_before_the_first_forward_does_not_carry_the_input_check():
    model = tiny()
    plan = {"format": "adaptive-mem-plan", "version": 1, "decisions": {"model.layers.0": "recompute"},
            "model": {"batch_size": 2, "seq_len": 12}}
    other = torch.randint(3, 128, (1, 5))
    with adaptive_mem.optimize(model, plan=plan) as handle:
        twin = copy.deepcopy(model)
        assert_plain(twin)
        twin(input_ids=other).logits.sum().backward()  # the original's check neither runs nor removes its plan
        assert handle.active
        with pytest.raises(PlanError, match="input shape mismatch"):
            model(input_ids=other)


def test_the_swap_engine_refuses_to_be_copied():
    model = tiny()
    with adaptive_mem.optimize(model, **PLANS["layer-swap"]) as handle:
        with pytest.raises(TypeError, match="SwapEngine cannot be copied or pickled"):
            copy.deepcopy(handle._executor.engine)


def test_select_recompute_with_the_kv_cache():
    model = tiny(use_cache=True).eval()
    expected = model(input_ids=ids()).logits
    with adaptive_mem.optimize(model, **PLANS["select-recompute-mlp"]):
        got = model(input_ids=ids()).logits
        assert type(got) is torch.Tensor and torch.equal(got, expected)
