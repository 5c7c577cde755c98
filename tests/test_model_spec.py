"""Model specs: presets, hf:<family>, package.module:factory, fake tensors, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from adaptive_mem import ModelBundle, ModelSpecError, build_model
from adaptive_mem._model_spec import parse_model_args

# ---------------------------------------------------------------- factories used by the specs below
# (importable as ``test_model_spec:<name>``: pytest puts tests/ on sys.path)


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int = 50, width: int = 16) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return (self.head(h),)


def tiny_lm(width: int = 16):
    return TinyLM(width=width)


def raising_factory():
    raise RuntimeError("weights not found")


def not_a_module():
    return 42


def frozen_lm():
    model = TinyLM()
    model.requires_grad_(False)
    return model


def regression_bundle():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return ModelBundle(
        model=model, spec="test_model_spec:regression_bundle", batch_size=5, seq_len=1, dtype=torch.float32,
        device=torch.device("cpu"),
        batch_fn=lambda seed: (torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)),),
        loss_fn=lambda m, batch: m(batch[0]).square().mean(),
    )


# ---------------------------------------------------------------- tests


def test_preset_defaults_and_overrides():
    bundle = build_model("llama-tiny")
    assert (bundle.batch_size, bundle.seq_len, bundle.dtype, bundle.device.type) == (2, 32, torch.float32, "cpu")
    ids, labels = bundle.batch(seed=0)
    assert ids.shape == labels.shape == (2, 32) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1])  # next-token labels
    other = build_model("llama-tiny", model_args="num_layers=2,hidden_size=32", batch_size=3, seq_len=8, dtype="bf16")
    assert len(other.model.layers) == 2 and other.model.config.hidden_size == 32
    assert other.batch(seed=0)[0].shape == (3, 8)
    assert all(p.dtype == torch.bfloat16 for p in other.model.parameters())
    long = build_model("llama-tiny", seq_len=512)  # longer than the preset's rotary table: the table grows
    assert long.model.config.max_seq_len == 512


def test_weights_and_batches_are_deterministic_per_seed():
    a, b, c = build_model("llama-tiny"), build_model("llama-tiny"), build_model("llama-tiny", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert not torch.equal(a.model.output.weight, c.model.output.weight)
    assert torch.equal(a.batch(seed=3)[0], b.batch(seed=3)[0])
    assert not torch.equal(a.batch(seed=3)[0], a.batch(seed=4)[0])
    state = torch.get_rng_state()
    build_model("llama-tiny")
    assert torch.equal(torch.get_rng_state(), state)  # building does not move the global RNG


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "mixtral"])
def test_hf_families_build_tiny_and_train(family):
    bundle = build_model(f"hf:{family}")
    params = sum(p.numel() for p in bundle.model.parameters())
    assert params < 2_000_000  # tiny defaults
    loss = bundle.loss(bundle.batch())
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert any(p.grad is not None for p in bundle.model.parameters())


def test_hf_model_args_override_the_config():
    bundle = build_model("hf:llama", model_args="num_hidden_layers=3,hidden_size=128,rms_norm_eps=1e-6,"
                                                "tie_word_embeddings=true")
    cfg = bundle.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (3, 128, 1e-6, True)
    assert len(bundle.model.model.layers) == 3
    gpt2 = build_model("hf:gpt2", model_args={"hidden_size": 32, "num_hidden_layers": 1})
    assert gpt2.model.config.n_embd == 32 and len(gpt2.model.transformer.h) == 1


def test_parse_model_args_types():
    assert parse_model_args("a=1,b=2.5,c=true,d=False,e=silu,f=none") == {
        "a": 1, "b": 2.5, "c": True, "d": False, "e": "silu", "f": None}
    assert parse_model_args(None) == {} and parse_model_args("") == {}


def test_meta_builds_fake_tensors_without_allocating():
    bundle = build_model("llama2-70b", device="meta", dtype="bfloat16")
    params = list(bundle.model.parameters())
    assert all(isinstance(p, FakeTensor) and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) > 68e9
    ids, labels = bundle.batch()
    assert isinstance(ids, FakeTensor) and ids.shape == (1, 4096)
    hf = build_model("hf:mixtral", device="meta")
    loss = hf.loss(hf.batch())
    assert isinstance(loss, FakeTensor) and loss.requires_grad


def test_factory_returning_a_module():
    bundle = build_model("test_model_spec:tiny_lm", model_args="width=8", batch_size=4, seq_len=6)
    assert isinstance(bundle.model, TinyLM) and bundle.model.embed.embedding_dim == 8
    assert bundle.vocab_size == 50
    ids, _ = bundle.batch()
    assert ids.shape == (4, 6) and int(ids.max()) < 50
    bundle.loss((ids, _)).backward()
    fake = build_model("test_model_spec:tiny_lm", device="meta")
    assert isinstance(next(fake.model.parameters()), FakeTensor)


def test_factory_returning_a_bundle_is_used_as_is():
    bundle = build_model("test_model_spec:regression_bundle")
    assert bundle.batch_size == 5
    loss = bundle.loss(bundle.batch(seed=1))
    assert loss.ndim == 0 and loss.requires_grad


@pytest.mark.parametrize("kwargs,match", [
    ({"spec": "gpt-5"}, r"model spec 'gpt-5': unknown; expected a preset .*hf:<family>.*package.module:factory"),
    ({"spec": "hf:roberta"}, r"'hf:roberta': unknown family 'roberta'; expected hf:<llama\|"),
    ({"spec": "test_model_spec:raising_factory"}, r"factory raised RuntimeError: weights not found"),
    ({"spec": "test_model_spec:not_a_module"}, r"factory returned int; expected an nn.Module or a ModelBundle"),
    ({"spec": "test_model_spec:missing"}, r"has no callable 'missing'"),
    ({"spec": "no_such_package.models:make"}, r"cannot import 'no_such_package.models'"),
    ({"spec": "llama-tiny", "batch_size": 0}, r"batch_size=0: expected a positive integer"),
    ({"spec": "llama-tiny", "seq_len": -4}, r"seq_len=-4: expected a positive integer"),
    ({"spec": "hf:llama", "model_args": "hidden_size=-8"}, r"hidden_size=-8: expected a positive integer"),
    ({"spec": "llama-tiny", "model_args": "num_layers=0"}, r"num_layers=0: expected a positive integer"),
    ({"spec": "llama-tiny", "model_args": "hidden=4"}, r"model_args key 'hidden': expected one of"),
    ({"spec": "hf:gpt2", "model_args": "colour=red"}, r"model_args key 'colour': not an attribute of GPT2Config"),
    ({"spec": "llama-tiny", "model_args": "num_layers"}, r"model_args item 'num_layers': expected key=value"),
    ({"spec": "llama-tiny", "dtype": "int8"}, r"dtype='int8': expected one of .*bfloat16"),
    ({"spec": "llama-tiny", "device": "warp-drive"}, r"device='warp-drive': expected cpu, meta"),
])
def test_bad_specs_raise_one_line_errors(kwargs, match):
    with pytest.raises(ModelSpecError, match=match) as info:
        build_model(**kwargs)
    assert "\n" not in str(info.value)


def test_model_without_grad_is_rejected_at_the_loss():
    bundle = build_model("test_model_spec:frozen_lm")
    with pytest.raises(ModelSpecError, match="output has no grad"):
        bundle.loss(bundle.batch())
