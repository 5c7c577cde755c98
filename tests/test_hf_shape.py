"""``hf:<family>`` under ``model_args`` that change the width: the keys the config class derives follow the new
width, the tiny test shape's other sizes are named in a warning (Note: [tiny shape under a new width]); a local
config.json's missing keys are the config class's own defaults, derived ones included."""

from __future__ import annotations

import json
import logging

import pytest

import adaptive_mem as am
from adaptive_mem import _estimate as est

pytest.importorskip("transformers", reason="Hugging Face models need transformers (the [test] extra installs it)")


def _config(spec: str, **model_args):
    return am.build_model(spec, model_args=model_args, batch_size=1, seq_len=16, device="meta").model.config


def test_gpt2_mlp_follows_the_width(caplog):
    with caplog.at_level(logging.WARNING, logger="adaptive_mem.models._hf"):
        model = am.build_model("hf:gpt2", model_args=dict(n_embd=256, n_head=4), batch_size=1, seq_len=16,
                               device="meta").model
    assert model.config.n_inner is None  # GPT-2's MLP: 4 x n_embd
    assert tuple(model.transformer.h[0].mlp.c_fc.weight.shape) == (256, 1024)
    [record] = [r for r in caplog.records if "tiny test shape" in r.getMessage()]
    assert "n_layer=3" in record.getMessage() and "vocab_size=256" in record.getMessage()
    assert "n_inner" not in record.getMessage() and "n_positions" not in record.getMessage()


def test_a_width_given_by_its_alias_counts(caplog):
    with caplog.at_level(logging.WARNING, logger="adaptive_mem.models._hf"):
        config = _config("hf:gpt2", hidden_size=256, num_hidden_layers=1, num_attention_heads=4)
    assert config.n_embd == 256 and config.n_inner is None and config.n_layer == 1
    [record] = [r for r in caplog.records if "tiny test shape" in r.getMessage()]
    assert "n_layer" not in record.getMessage() and "n_head" not in record.getMessage()


def test_the_tiny_shape_stays_whole_at_its_width(caplog):
    with caplog.at_level(logging.WARNING, logger="adaptive_mem.models._hf"):
        assert _config("hf:gpt2", n_layer=2).n_inner == 128
        assert _config("hf:gpt2", n_embd=64, n_layer=2).n_inner == 128
    assert not [r for r in caplog.records if "tiny test shape" in r.getMessage()]


def test_every_key_given_names_nothing(caplog):
    args = dict(n_embd=256, n_layer=2, n_head=4, n_inner=512, vocab_size=512)
    with caplog.at_level(logging.WARNING, logger="adaptive_mem.models._hf"):
        assert _config("hf:gpt2", **args).n_inner == 512
    assert not [r for r in caplog.records if "tiny test shape" in r.getMessage()]


def test_llama_heads_follow_the_width_and_kept_sizes_are_named(caplog):
    with caplog.at_level(logging.WARNING, logger="adaptive_mem.models._hf"):
        config = _config("hf:llama", hidden_size=256, num_attention_heads=8)
    assert config.head_dim == 32 and config.num_key_value_heads == 8  # derived, not the tiny shape's 2
    [record] = [r for r in caplog.records if "tiny test shape" in r.getMessage()]
    assert "intermediate_size=176" in record.getMessage() and "num_hidden_layers=2" in record.getMessage()
    assert _config("hf:llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=4).num_key_value_heads == 4


def test_mistral_head_dim_follows_the_width():
    assert _config("hf:mistral", hidden_size=256, num_attention_heads=4).head_dim == 64  # not the tiny 16
    assert _config("hf:mistral", num_hidden_layers=2).head_dim == 16


@pytest.mark.parametrize("family, text, key, value", [
    ("mistral", dict(hidden_size=320, num_attention_heads=4, num_hidden_layers=1, intermediate_size=640), "head_dim", 80),
    ("llama", dict(hidden_size=320, num_attention_heads=4, num_hidden_layers=1, intermediate_size=640), "head_dim", 80),
    ("gpt2", dict(n_embd=320, n_head=4, n_layer=1), "n_inner", None),
])
def test_local_config_derives_what_it_does_not_give(tmp_path, family, text, key, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": family, **text}))
    spec, args = est._hf_config(f"hf:{path}", None)
    config = am.build_model(spec, model_args=args, batch_size=1, seq_len=16, device="meta").model.config
    assert getattr(config, key) == value
