"""The AC modes users compare against (torchtitan full / selective op / selective layer N, Megatron selective and
full, Hugging Face gradient checkpointing) as plans: hand-checked decisions on llama-tiny and hf:qwen2, each plan
simulated on the model's profile and executed with gradients equal to the model's without a plan."""

from __future__ import annotations

import functools

import pytest
import torch

import profiler
from adaptive_mem import AC_MODES, ConfigError, ac_plan, build_model, optimize, plan_from_config
from adaptive_mem.config._ac_modes import titan_layer_policy, titan_op_policy
from search import Action, simulate

from _profiles import synthetic_profile
from _deterministic import deterministic  # noqa: F401 - the fixture is used by name

BATCH, SEQ = 2, 32
MODELS = {"llama-tiny": {}, "hf:qwen2": {"num_hidden_layers": 3}}
MODES = ["none", "full", "op", "layer:1", "layer:2", "layer:3", "megatron-selective", "megatron-full", "hf"]

# Local names of the units each layer recomputes under torchtitan's op SAC, by hand from the ops in order (units
# that save no bytes take no decision). llama-tiny: matmuls wq, wk, wv, wo, w1, w3, w2 are the 1st..7th mm, so
# wk, wo, w3 (2nd, 4th, 6th) are recomputed (wk and wo save nothing); the attention kernel is kept. Qwen2: q, k,
# v are addmm (bias), saved and not counted; o_proj, gate, up, down are the 1st..4th mm: gate_proj and down_proj
# are recomputed (down_proj saves nothing).
OP_RECOMPUTED = {
    "llama-tiny": {"attention_norm.norm", "attention.apply_rotary_emb.rope", "add", "ffn_norm.norm",
                   "feed_forward.w1.activation.silu", "feed_forward.w3.matmul", "feed_forward.mul", "add_1"},
    "hf:qwen2": {"input_layernorm.norm", "self_attn.add", "self_attn.add_1", "add", "post_attention_layernorm.norm",
                 "mlp.gate_proj.matmul", "mlp.act_fn.silu", "mlp.mul", "add_1"},
}
CORE = {"llama-tiny": "attention.flash_attention", "hf:qwen2": "self_attn.flash_attention"}


pytestmark = pytest.mark.usefixtures("deterministic")


def _build(spec: str):
    return build_model(spec, model_args=MODELS.get(spec, {}), batch_size=BATCH, seq_len=SEQ, seed=0)


@functools.lru_cache(maxsize=None)
def _profile(spec: str):
    return profiler.profile_step(_build(spec), warmup=0, repeat=0, record=1, optimizer_time=0.0)


def _step(bundle, batch):
    bundle.model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = bundle.loss(batch)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in bundle.model.named_parameters() if p.grad is not None}


@functools.lru_cache(maxsize=None)
def _reference(spec: str):
    bundle = _build(spec)
    batch = bundle.batch(seed=0)
    return bundle, batch, _step(bundle, batch)


def _decided(plan) -> dict[str, str]:
    return {target: d.action.value for target, d in plan.decisions.items()}


def _layers(spec: str, indices) -> dict[str, str]:
    profile = _profile(spec)
    return {profile.layer_path(i): "recompute" for i in indices}


def test_titan_op_policy_recomputes_every_second_matmul_and_what_it_does_not_save():
    mm, add, sdpa = "aten.mm.default", "aten.add.Tensor", "aten._scaled_dot_product_flash_attention.default"
    assert [titan_op_policy(mm, k) for k in range(1, 5)] == [Action.KEEP, Action.RECOMPUTE] * 2
    assert titan_op_policy("aten.addmm.default", 2) is Action.KEEP  # not counted, always saved
    assert titan_op_policy(sdpa, 0) is Action.KEEP
    assert titan_op_policy(add, 1) is Action.RECOMPUTE
    assert titan_op_policy("_c10d_functional.all_reduce.default", 1) is Action.RECOMPUTE  # issued again
    assert titan_op_policy("_c10d_functional.reduce_scatter_tensor.default", 1) is Action.KEEP


def test_titan_layer_policy_counts_layers_from_one():
    assert [titan_layer_policy(i, 2) for i in range(4)] == [Action.KEEP, Action.RECOMPUTE] * 2
    assert [titan_layer_policy(i, 3) for i in range(4)] == [Action.KEEP, Action.KEEP, Action.RECOMPUTE, Action.KEEP]
    assert all(titan_layer_policy(i, 1) is Action.RECOMPUTE for i in range(4))


@pytest.mark.parametrize("spec", list(MODELS))
def test_whole_layer_modes(spec):
    profile = _profile(spec)
    every = range(profile.num_layers)
    for mode in ("full", "megatron-full", "hf", "layer:1"):
        assert _decided(ac_plan(mode, profile)) == _layers(spec, every), mode
    assert _decided(ac_plan("layer:2", profile)) == _layers(spec, [i for i in every if i % 2 == 1])
    assert _decided(ac_plan("layer:3", profile)) == _layers(spec, [2])
    assert _decided(ac_plan(f"layer:{profile.num_layers + 1}", profile)) == {}
    assert _decided(ac_plan("none", profile)) == {}


@pytest.mark.parametrize("spec", list(MODELS))
def test_op_mode_is_torchtitans_save_list(spec):
    profile = _profile(spec)
    plan = ac_plan("op", profile)
    want = {f"{profile.layer_path(i)}.{name}": "recompute" for i in range(profile.num_layers)
            for name in OP_RECOMPUTED[spec]}
    assert _decided(plan) == want
    assert plan.meta["ac_mode"] == "op" and "torchtitan" in plan.meta["ac_source"]
    assert plan.fingerprint == profile.model["fingerprint"]


@pytest.mark.parametrize("spec", list(MODELS))
def test_megatron_modes_are_the_megatron_flags(spec):
    """From the profile, the Megatron flag front-end decides what it decides on the model itself."""
    profile, model = _profile(spec), _reference(spec)[0].model
    selective = ac_plan("megatron-selective", profile)
    assert _decided(selective) == {f"{profile.layer_path(i)}.{CORE[spec]}": "recompute"
                                   for i in range(profile.num_layers)}
    assert selective.decisions == plan_from_config(["--recompute-granularity", "selective"], model=model).decisions
    full = plan_from_config(["--recompute-granularity", "full", "--recompute-method", "uniform"], model=model)
    assert ac_plan("megatron-full", profile).decisions == full.decisions


def test_hf_mode_recomputes_the_gradient_checkpointing_layers():
    """Hugging Face checkpoints every GradientCheckpointingLayer: the layers the plan recomputes."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = _reference("hf:qwen2")[0].model
    checkpointed = {name for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)}
    assert set(ac_plan("hf", _profile("hf:qwen2")).decisions) == checkpointed


@pytest.mark.parametrize("spec", list(MODELS))
def test_every_mode_simulates(spec):
    profile = _profile(spec)
    plain = simulate(profile, ac_plan("none", profile))
    for mode in MODES[1:]:
        sim = simulate(profile, ac_plan(mode, profile))
        assert sim.peak_bytes <= plain.peak_bytes and sim.step_time >= plain.step_time, mode
    full, op = simulate(profile, ac_plan("full", profile)), simulate(profile, ac_plan("op", profile))
    assert full.step_time > op.step_time  # op SAC replays less than the whole layer


def _run_exact(spec: str, mode: str) -> None:
    bundle, batch, (loss, grads) = _reference(spec)
    with optimize(bundle.model, plan=ac_plan(mode, _profile(spec)), profile=_profile(spec)) as handle:
        assert handle.summary().takes_effect == (mode != "none"), handle.summary()
        got_loss, got = _step(bundle, batch)
    assert torch.equal(got_loss, loss)
    assert got.keys() == grads.keys()
    for key, grad in grads.items():
        assert torch.equal(got[key], grad), f"{spec} {mode}: grad of {key} differs"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", list(MODELS))
def test_every_mode_runs_exact(spec, mode):
    _run_exact(spec, mode)


def test_layers_of_two_kinds():
    """LFM2 mixes conv layers (0, 2) and an attention layer (1): from the profile the Megatron core attention is
    that of layer 1 alone, as the flags decide on the model, and the per-op modes run exact."""
    spec = "hf:lfm2"
    model = _reference(spec)[0].model
    selective = ac_plan("megatron-selective", _profile(spec))
    assert _decided(selective) == {"model.layers.1.self_attn.flash_attention": "recompute"}
    assert selective.decisions == plan_from_config(["--recompute-granularity", "selective"], model=model).decisions
    for mode in ("megatron-selective", "op"):
        _run_exact(spec, mode)


@pytest.mark.parametrize("mode", ["layer:0", "layer:N", "layer:-1", "layer:two", "layer", "Full", "selective", "",
                                  None, 2])
def test_bad_modes_are_refused(mode):
    with pytest.raises(ConfigError) as err:
        ac_plan(mode, _profile("llama-tiny"))
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message
    assert repr(mode) in message and "none, full, op, layer:N" in message and "N an integer >= 1" in message


def test_a_profile_without_layers_is_refused():
    with pytest.raises(ConfigError, match="no repeated layers"):
        ac_plan("full", synthetic_profile(layers=[]))
    assert AC_MODES == ("none", "full", "op", "layer:N", "megatron-selective", "megatron-full", "hf")
