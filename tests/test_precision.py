"""Precision recipes as data: static bytes per recipe and layout counted by hand on llama-tiny, a fake profile's
activation bytes under the recipe's autocast, the command's flag, and every plan kind exact under CPU autocast."""

from __future__ import annotations

import json

import pytest
import torch

import adaptive_mem as am
import profiler
from adaptive_mem.cli._main import main
from profiler import PRECISIONS, Layout, PrecisionError, Profile
from profiler.tracing import parameter_split, rank_static, static_memory
from search import Plan

# llama-tiny: vocab 256, dim 64, 4 layers, 4 heads of 16, 2 kv heads, feed-forward 176, output not tied
V, D, L, KV, F = 256, 64, 4, 32, 176
LAYER = D * D + 2 * D * KV + D * D + 3 * D * F + 2 * D  # wq, wk, wv, wo, w1 w2 w3, two norms
N = V * D + L * LAYER + D + V * D  # embedding, layers, final norm, output
B, S = 2, 32  # the preset's batch and sequence

# bytes per parameter element: parameters, gradients, master weights, one Adam moment
BYTES = {"fp32": (4, 4, 0, 4), "bf16": (2, 2, 0, 2), "amp-bf16": (4, 4, 0, 4), "fsdp2-bf16": (4, 4, 0, 4),
         "megatron-bf16": (2, 4, 4, 4)}


def _fake(precision: str | None = None):
    dtype = PRECISIONS[precision].model_dtype if precision else torch.float32
    return am.build_model("llama-tiny", device="meta", dtype=dtype)


def test_llama_tiny_has_the_hand_counted_parameters():
    bundle = _fake()
    assert sum(p.numel() for p in bundle.model.parameters()) == N


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_static_bytes_per_recipe(name):
    recipe = PRECISIONS[name]
    p, g, m, s = BYTES[name]
    static = static_memory(_fake(name).model, optimizer="adam", precision=recipe)
    assert (static.parameters, static.gradients, static.master, static.optimizer_state) == (p * N, g * N, m * N,
                                                                                          2 * s * N)
    assert static.total == {"fp32": 16, "bf16": 8, "amp-bf16": 16, "fsdp2-bf16": 16, "megatron-bf16": 18}[name] * N
    assert static_memory(_fake(name).model, optimizer="sgd-momentum", precision=recipe).optimizer_state == s * N


def test_no_recipe_counts_the_tensors_as_before():
    static = static_memory(_fake("bf16").model, optimizer="adam")
    assert (static.parameters, static.gradients, static.master, static.optimizer_state) == (2 * N, 2 * N, 0, 8 * N)


def _rank(name: str, zero: int):
    """One of 8 data-parallel ranks: the recipe's static bytes through the profile's layout sharding."""
    bundle = _fake(name)
    whole = profiler.profile_step(bundle, hardware="h100", precision=name)
    split = parameter_split(bundle.model, whole.layer_info(), tensor_parallel=1)
    return profiler.shard_profile(whole, layout=Layout(data_parallel=8, zero=zero), split=split, interconnect=450e9)


@pytest.mark.parametrize("name", ["fp32", "bf16", "amp-bf16", "megatron-bf16"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_stages_over_eight_ranks(name, zero):
    p, g, m, s = BYTES[name]
    static = _rank(name, zero).static
    assert static.master == m * N // 8
    assert static.optimizer_state == 2 * s * N // 8
    assert static.gradients == (g * N // 8 if zero >= 2 else g * N)
    assert static.parameters == (p * N // 8 if zero >= 3 else p * N)
    layer_bytes = LAYER * PRECISIONS[name].model_dtype.itemsize
    # Note: [gathered copy] two unsharded layers, one layer's reduce-scatter input in the gradient dtype and its shard
    assert static.buffers == (2 * layer_bytes + g * LAYER + g * LAYER // 8 if zero >= 3 else 0)


def test_megatron_distributed_optimizer_without_zero_is_six_plus_twelve_over_d():
    rank = _rank("megatron-bf16", 0)
    assert rank.model["layout"]["zero"] == 1
    assert rank.static.total - rank.static.buffers == 6 * N + 12 * N // 8


def test_fsdp2_shards_everything_beside_its_gathered_layers_and_reduce_scatter():
    rank = _rank("fsdp2-bf16", 0)
    assert rank.model["layout"]["zero"] == 3
    st = rank.static
    assert (st.parameters, st.gradients, st.master, st.optimizer_state) == (4 * N // 8, 4 * N // 8, 0, 8 * N // 8)
    assert st.buffers == 2 * (2 * LAYER) + 4 * LAYER + 4 * LAYER // 8  # two bf16 layers, fp32 reduce-scatter


def test_rank_static_without_a_recipe_is_unchanged():
    split = parameter_split(_fake().model, None, tensor_parallel=1)
    static = profiler.StaticMemory(parameters=4 * N, gradients=4 * N, optimizer_state=8 * N)
    st = rank_static(static, layout=Layout(data_parallel=8, zero=1), split=split)
    assert (st.parameters, st.gradients, st.optimizer_state, st.master) == (4 * N, 4 * N, N, 0)


def _unit_saved(profile: Profile, name: str) -> int:
    return profile.unit(name).saved_bytes


def test_amp_fake_profile_saves_bf16_matmuls_and_fp32_norms():
    plain = profiler.profile_step(_fake(), hardware="h100")
    amp = profiler.profile_step(_fake("amp-bf16"), hardware="h100", precision="amp-bf16")
    assert amp.model["precision"] == "amp-bf16" and "precision" not in plain.model
    ops = {o.unit: o for o in amp.ops if o.op == "aten.mm.default"}
    assert ops["layers.0.feed_forward.w1.matmul"].output_bytes == B * S * F * 2  # bf16
    assert _unit_saved(plain, "layers.0.feed_forward.w1.matmul") == B * S * F * 4
    assert _unit_saved(amp, "layers.0.feed_forward.w1.activation.silu") == B * S * F * 2
    # the norm: its rsqrt and normalized input in fp32 (the matmuls after it save their own bf16 casts)
    assert _unit_saved(amp, "layers.0.attention_norm.norm") == B * S * 4 + B * S * D * 4
    # wq saves the bf16 casts of its input and its weight
    assert _unit_saved(amp, "layers.0.attention.wq.matmul") == B * S * D * 2 + D * D * 2
    # the logits: bf16 out of the matmul, upcast to fp32 for cross-entropy, log_softmax saved in fp32
    logits = next(o for o in amp.ops if o.unit == "output.matmul" and o.op == "aten.mm.default")
    assert logits.output_bytes == B * S * V * 2
    upcast = [o for o in amp.ops if o.op == "aten._to_copy.default" and o.layer is None and o.consumers
              and amp.ops[o.consumers[0]].op == "aten._log_softmax.default"]
    assert [o.output_bytes for o in upcast] == [B * S * V * 4]
    assert _unit_saved(amp, "log_softmax") == B * S * V * 4
    assert amp.static == plain.static  # amp's static bytes are fp32's


@pytest.mark.parametrize("dtype, nbytes", [("bf16", 4), (None, 4)])
def test_the_loss_reads_fp32_logits(dtype, nbytes):
    """Note: [loss in fp32] a bf16 model's logits are upcast once before cross-entropy, whose log-softmax is saved in
    fp32; an fp32 model's logits are not copied."""
    fake = profiler.profile_step(_fake(dtype), hardware="h100")
    assert _unit_saved(fake, "log_softmax") == B * S * V * nbytes
    copies = [o for o in fake.ops
              if o.layer is None and o.op == "aten._to_copy.default" and o.output_bytes == B * S * V * 4]
    assert len(copies) == (1 if dtype else 0)


def test_recipe_peak_holds_what_the_model_does_not():
    bf16 = profiler.profile_step(_fake("bf16"), hardware="h100")
    megatron = profiler.profile_step(_fake("megatron-bf16"), hardware="h100", precision="megatron-bf16")
    # Note: [precision peak]: fp32 master weights and fp32 moments instead of bf16 ones; the wider main grads are
    # made by backward, as the gradients of every profile are, so they are not in the peak before it
    assert megatron.peak_memory - bf16.peak_memory == 4 * N + (8 - 8) * N
    assert megatron.static.total == 18 * N


@pytest.mark.parametrize("name", ["fsdp2-bf16", "megatron-bf16"])
def test_wide_gradients_are_not_in_the_loss_workspace(name):
    """Note: [precision peak] a recipe's gradients wider than the model's (fp32 main or reduced gradients) are
    counted once, by the simulator as backward makes them: the loss workspace the step model derives from the
    peak is the same as under pure bf16, and the simulated keep-all peak grows by the static bytes held all step
    plus at most the wider gradients (those live at the peak)."""
    from search import StepModel, simulate

    bf16 = profiler.profile_step(_fake("bf16"), hardware="h100", precision="bf16")
    wide = profiler.profile_step(_fake(name), hardware="h100", precision=name)
    assert StepModel.build(wide).boundary == StepModel.build(bf16).boundary
    grown = simulate(wide, am.ac_plan("none", wide)).peak_bytes - simulate(bf16, am.ac_plan("none", bf16)).peak_bytes
    extra_gradients = wide.static.gradients - bf16.static.gradients
    assert wide.static.total - bf16.static.total - extra_gradients <= grown <= wide.static.total - bf16.static.total


def test_old_profiles_load_and_no_master_is_not_written(tmp_path):
    plain = profiler.profile_step(_fake(), hardware="h100")
    data = plain.to_dict()
    assert "master" not in data["static"]
    assert Profile.from_dict(json.loads(json.dumps(data))).static.master == 0
    megatron = profiler.profile_step(_fake("megatron-bf16"), hardware="h100", precision="megatron-bf16")
    path = tmp_path / "p.json"
    megatron.save(path)
    assert Profile.load(path).static == megatron.static
    bad = {**data, "model": {**data["model"], "precision": "fp8"}}
    with pytest.raises(profiler.ProfileError, match="profile.model.precision='fp8': expected one of fp32"):
        Profile.from_dict(bad)


def test_bad_recipes_and_dtypes_raise_one_line_errors(capsys):
    with pytest.raises(PrecisionError, match="precision='fp8': expected one of fp32, bf16, amp-bf16"):
        profiler.profile_step(_fake(), hardware="h100", precision="fp8")
    with pytest.raises(PrecisionError, match="parameters are float32; expected bfloat16"):
        profiler.profile_step(_fake(), hardware="h100", precision="megatron-bf16")
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--precision", "amp-bf16",
                 "--dtype", "float16"]) != 0
    assert "error: --dtype='float16' with --precision=amp-bf16: expected --dtype float32 or no --dtype" \
        in capsys.readouterr().err
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--precision", "fp8"]) != 0
    assert "error: --precision='fp8': expected one of fp32, bf16, amp-bf16" in capsys.readouterr().err


def test_the_command_profiles_under_the_recipe(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--hardware", "h100", "--precision",
                 "megatron-bf16", "--data-parallel", "8", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "master weights" in printed and "(megatron-bf16)" in printed
    profile = Profile.load(out)
    assert profile.model["precision"] == "megatron-bf16" and profile.model["dtype"] == "bfloat16"
    assert profile.model["layout"]["zero"] == 1
    assert profile.static.total - profile.static.buffers == 6 * N + 12 * N // 8


# ---------------------------------------------------------------- every plan kind exact under CPU autocast


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, "groups": []})


PLANS = {
    "full-layer-recompute": {"layers": "recompute"},
    "op-select-recompute": {f"layers.{i}.{u}": "recompute" for i in range(4)
                            for u in ("feed_forward.w1.activation.silu", "attention_norm.norm")},
    "layer-swap": {"layers.1": {"action": "swap", "backward_prefetch": 1}},
    "op-swap": {f"layers.{i}.attention.flash_attention": {"action": "swap", "backward_prefetch": 1}
                for i in range(4)},
}


def _autocast_step(bundle, batch):
    bundle.model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = bundle.loss(batch)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in bundle.model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    bundle = am.build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    return bundle, batch, _autocast_step(bundle, batch)


def _milp_plan(bundle) -> Plan:
    profile = profiler.profile_step(bundle, precision="amp-bf16", warmup=0, repeat=0, record=1)
    plan = am.search(profile, budget="60%").plan
    assert plan.decisions  # something recomputed or swapped
    return plan


@pytest.mark.parametrize("kind", [*PLANS, "milp"])
def test_every_plan_kind_is_exact_under_cpu_autocast(reference, kind):
    bundle, batch, (ref_loss, ref_grads) = reference
    assert ref_loss.dtype == torch.float32 and ref_grads["layers.0.attention.wq.weight"].dtype == torch.float32
    plan = _milp_plan(bundle) if kind == "milp" else _plan(PLANS[kind])
    with am.optimize(bundle.model, plan=plan):
        for _ in range(2):  # the first step also runs the plan's discovery pass
            loss, grads = _autocast_step(bundle, batch)
            assert torch.equal(loss, ref_loss), kind
            for key, grad in ref_grads.items():
                assert torch.equal(grads[key], grad), f"{kind}: grad of {key} differs"
