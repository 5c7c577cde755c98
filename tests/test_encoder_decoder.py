"""Encoder-decoder models (T5): both stacks are layers, plans on them apply on both and run exactly.

Note: [several layer stacks] (``profiler/_units.py``, docs/plan-format.md "Several layer stacks"): the
encoder's and the decoder's blocks are one global layer list (encoder first); unit names stay full module
paths, local names are relative to the block. Note: [cache in recompute] (``runtime/_layer_cache.py``):
the decoder's ``EncoderDecoderCache`` written in forward made full recompute raise ``CheckpointError``.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="Hugging Face models need transformers (the [test] extra installs it)")

import adaptive_mem  # noqa: E402
import profiler  # noqa: E402
from adaptive_mem._model_spec import ModelBundle  # noqa: E402
from adaptive_mem.config import plan_from_config  # noqa: E402
from profiler import Profile, ProfileError
from profiler.naming import LayerInfo, find_layers
from search import Budget, Plan, PlanError, StepModel, get_solver, simulate  # noqa: E402
from search.planning import activation_peak, keep_all

BATCH, SEQ = 4, 32


def _t5(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, attn_implementation=attn)
    return transformers.T5ForConditionalGeneration(config)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(1, 128, (BATCH, SEQ), generator=gen), torch.randint(1, 128, (BATCH, SEQ), generator=gen)


def _step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, labels = _batch()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_exact(reference: nn.Module, planned: nn.Module) -> None:
    loss0, grads0 = _step(reference)
    loss1, grads1 = _step(planned)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name, grad in grads0.items():
        assert grad is not None and torch.equal(grad, grads1[name]), name


@pytest.fixture(scope="module")
def t5() -> nn.Module:
    return _t5()


@pytest.fixture(scope="module")
def t5_profile(t5) -> Profile:
    model = copy.deepcopy(t5)
    ids, labels = _batch()
    bundle = ModelBundle(model=model, spec="t5-tiny", batch_size=BATCH, seq_len=SEQ, dtype=torch.float32,
                         device=torch.device("cpu"), vocab_size=128, batch_fn=lambda seed: (ids, labels),
                         loss_fn=lambda m, b: m(input_ids=b[0], labels=b[1]).loss)
    return profiler.profile_step(bundle, warmup=0, repeat=0, record=1)


def test_both_stacks_are_found_as_one_global_layer_list(t5):
    info = find_layers(t5)
    assert info.stacks == (("encoder.block", 2), ("decoder.block", 2))
    assert info.container == "encoder.block" and info.count == 4
    assert [info.layer_path(i) for i in range(4)] == ["encoder.block.0", "encoder.block.1", "decoder.block.0",
                                                      "decoder.block.1"]
    assert info.split("decoder.block.1.layer.0.SelfAttention.q.matmul") == (3, "layer.0.SelfAttention.q.matmul")
    assert info.split("encoder.block.0.layer.1.DenseReluDense") == (0, "layer.1.DenseReluDense")
    assert info.split("encoder.final_layer_norm.norm") == (None, "encoder.final_layer_norm.norm")
    assert [info.stack_of(i) for i in range(4)] == [0, 0, 1, 1]


def test_a_decoder_only_model_keeps_one_stack():
    from adaptive_mem.models import LlamaConfig, LlamaModel

    llama = LlamaModel(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2,
                                   max_seq_len=8))
    assert find_layers(llama) == LayerInfo(container="layers", count=3)
    assert find_layers(llama).stacks == (("layers", 3),)

    class WithAdapters(nn.Module):  # a small homogeneous list of blocks beside the layers is no stack
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
                                        for _ in range(3))
            self.adapters = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2))

    assert find_layers(WithAdapters()) == LayerInfo(container="layers", count=3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4))
    assert find_layers(hf).stacks == (("model.layers", 2),)


def test_the_profile_has_units_of_both_stacks(t5_profile):
    prof = t5_profile
    assert prof.layer_stacks == [{"container": "encoder.block", "count": 2}, {"container": "decoder.block", "count": 2}]
    assert prof.layer_container == "encoder.block" and prof.num_layers == 4
    assert [prof.layer_path(i) for i in range(4)] == ["encoder.block.0", "encoder.block.1", "decoder.block.0",
                                                      "decoder.block.1"]
    for layer in range(4):
        units = prof.layer_units(layer)
        assert units and all(u.name == f"{prof.layer_path(layer)}.{u.local_name}" for u in units)
        assert "layer.0.SelfAttention.q.matmul" in {u.local_name for u in units}
    assert "layer.2.DenseReluDense.wi.matmul" in {u.local_name for u in prof.layer_units(2)}
    assert prof.unit("encoder.final_layer_norm.norm").layer is None
    again = Profile.from_dict(prof.to_dict())
    assert again.layer_stacks == prof.layer_stacks and again.layer_info() == prof.layer_info()


def test_one_stack_profiles_keep_the_version_1_form(t5_profile):
    data = t5_profile.to_dict()
    single = {**data, "layer_stacks": []}
    assert "layer_stacks" not in Profile.from_dict(single).to_dict()  # not written for one stack
    del single["layer_stacks"]
    assert Profile.from_dict(single).layer_info() == LayerInfo(container="encoder.block", count=4)
    with pytest.raises(ProfileError, match=r"profile.layer_stacks\[1\]=.*expected an object"):
        Profile.from_dict({**data, "layer_stacks": [data["layer_stacks"][0], {"container": "decoder.block"}]})
    with pytest.raises(ProfileError, match="profile.layer_stacks=.*counts summing to num_layers"):
        Profile.from_dict({**data, "layer_stacks": [{"container": "encoder.block", "count": 2}]})


@pytest.mark.parametrize("form, config, covered", [
    ("full recompute", {"recompute_config": {"recompute": True}}, ""),
    ("select recompute", {"recompute_config": {"select_recompute": [r".*DenseReluDense"]}}, "DenseReluDense"),
    ("op swap", {"swap_config": {"swap": True, "op_swap": [{"op_name": r".*SelfAttention", "backward_prefetch": 1,
                                                           "layers": [0, 1, 2, 3]}]}}, "SelfAttention"),
])
def test_config_forms_apply_on_both_stacks_exactly(t5, form, config, covered):
    planned = copy.deepcopy(t5)
    handle = adaptive_mem.optimize(planned, config=config)
    targets = sorted(handle.plan.decisions)
    stacks = {t.split(".block.")[0] for t in targets}
    assert stacks == {"encoder", "decoder"} and len(targets) == 4, targets
    assert all(t.endswith(covered) for t in targets)
    _assert_exact(copy.deepcopy(t5), planned)


def test_full_recompute_is_exact_with_eager_attention_too():
    model = _t5("eager")
    planned = copy.deepcopy(model)
    adaptive_mem.optimize(planned, config={"recompute_config": {"recompute": True}})
    _assert_exact(model, planned)


def test_a_local_name_of_one_stack_applies_to_that_stack_only(t5):
    plan = plan_from_config({"recompute_config": {"select_recompute": [r"layer\.2\.DenseReluDense"]}}, model=t5)
    assert sorted(plan.decisions) == [f"decoder.block.{i}.layer.2.DenseReluDense" for i in range(2)]
    plan = plan_from_config({"recompute_config": {"select_recompute": [r"layer\.1\.EncDecAttention"]}}, model=t5)
    assert all(t.startswith("decoder.block.") for t in plan.decisions) and len(plan.decisions) == 2


@pytest.mark.parametrize("link", ["measured", "slow"])
def test_milp_plan_at_half_the_activations_is_exact(t5, t5_profile, link):
    prof = t5_profile
    if link == "slow":  # swaps cost: the plan recomputes
        prof = copy.copy(prof)
        prof.hardware = replace(prof.hardware, h2d_bandwidth=1e6, d2h_bandwidth=1e6)
    model = StepModel.build(prof)
    result = get_solver("milp").solve(Budget(activation_fraction=0.5).problem(model))
    assert activation_peak(model, result.assignment) <= 0.5 * activation_peak(model, keep_all(model))
    stacks = {prof.unit(u.name).layer // 2 for u, a in zip(model.units, result.assignment.actions)
              if a.value != "keep" and prof.unit(u.name).layer is not None}
    assert stacks == {0, 1}  # decisions in the encoder and in the decoder
    if link == "slow":
        assert any(a.value == "recompute" for a in result.assignment.actions)
    plan = Plan.from_dict(result.plan.to_dict())
    simulate(prof, plan)
    planned = copy.deepcopy(t5)
    adaptive_mem.optimize(planned, plan=plan, profile=prof)
    _assert_exact(copy.deepcopy(t5), planned)


def test_checkpoint_groups_stay_inside_one_stack(t5, t5_profile):
    whole = {f"{p}": "recompute" for p in ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1")}
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": whole, "groups": [[1, 2]]})
    with pytest.raises(PlanError, match=r"plan.groups\[0\]=\[1, 2\]: spans encoder.block and decoder.block"):
        adaptive_mem.optimize(copy.deepcopy(t5), plan=plan)
    with pytest.raises(PlanError, match="spans two stacks"):
        simulate(t5_profile, plan)
    model = StepModel.build(t5_profile)
    assert model.stack_ranges() == [(1, 2), (3, 4)]
    uniform = get_solver("uniform")._groups(model, 3)
    assert uniform.groups == ((1, 2), (3, 4))


@pytest.mark.parametrize("use_cache", [False, True])
def test_checkpoint_groups_inside_a_t5_stack_are_exact(t5, use_cache, caplog):
    """Note: [group inputs]: T5's first block computes the position bias the next blocks take, so a group
    over blocks 0-1 splits into per-layer recompute (one warning naming the input); with the decoder's
    cache the first call runs per layer, checking the inputs, and the cache is written once."""
    model = copy.deepcopy(t5)
    model.config.use_cache = use_cache
    whole = {p: "recompute" for p in ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1")}
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": whole, "groups": [[0, 1], [2, 3]]})
    planned = copy.deepcopy(model)
    with caplog.at_level("WARNING"), adaptive_mem.optimize(planned, plan=plan):
        for _ in range(3):
            reference = copy.deepcopy(model)
            _assert_exact(reference, planned)
            planned.zero_grad(set_to_none=True)
    warnings = [r.getMessage() for r in caplog.records if "checkpoint group" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "layers 0-1 runs as per-layer recompute: layer 1 takes position_bias" in warnings[0]
    assert "layers 2-3 runs as per-layer recompute: layer 3 takes position_bias" in warnings[1]


def test_checkpoint_group_with_a_cache_runs_as_one_group_after_its_checking_call(caplog):
    """Note: [group inputs]: a stack whose layers take only the hidden states from each other (Llama, with its
    KV cache) is checked on the first call and grouped from then on, exactly and without a warning."""
    from adaptive_mem import build_model

    bundle = build_model("hf:llama", model_args={"use_cache": True, "num_hidden_layers": 3}, batch_size=2,
                         seq_len=16, seed=0)
    batch = bundle.batch(seed=0)

    def step():
        bundle.model.zero_grad(set_to_none=True)
        loss = bundle.loss(batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in bundle.model.named_parameters()}

    want = step()
    whole = {f"model.layers.{i}": "recompute" for i in range(3)}
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": whole, "groups": [[0, 1, 2]]})
    with caplog.at_level("WARNING"), adaptive_mem.optimize(bundle.model, plan=plan) as handle:
        for _ in range(3):
            got = step()
            assert torch.equal(got[0], want[0])
            assert all(torch.equal(got[1][k], v) for k, v in want[1].items())
        assert handle._executor.groups.checked == {0} and not handle._executor.groups.split
    assert not [r for r in caplog.records if "checkpoint group" in r.getMessage()]
