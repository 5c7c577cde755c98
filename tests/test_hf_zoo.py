"""The Hugging Face zoo: every plan kind exact on 23 families (tiny random-weight models, 3 layers, width 64).

Per family and plan: one training step of the planned model against the same model without a plan (same
weights, same batch, same seed); loss and every gradient ``torch.equal``. Models keep Hugging Face's
defaults and ``use_cache=True`` (the layers get a ``Cache`` object, Note: [cache in recompute]). Full
recompute must also hold no more activation memory at its peak than ``torch.utils.checkpoint``
(non-reentrant) on every layer, both measured by ``MemTracker``. The hybrid families (Qwen3-Next, LFM2) mix
two kinds of layers: their keys apply in the layers that have what they name (Note: [keys per layer]). The MoE
families route each token to its top-k experts (DeepSeek-V3 by its data, PhiMoE also by Gumbel sampling from
the RNG): a replay must route as the forward did.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from adaptive_mem import ConfigError, build_model, optimize
from search import PlanError
from _deterministic import assert_same_step as _assert_same, deterministic, seeded_step as _step  # noqa: F401 - the fixture is used by name

BATCH, SEQ = 2, 32

# family -> (MLP key, attention key): local module names inside a layer, as config regexes.
KEYS: dict[str, tuple[str, str]] = {
    "llama": ("mlp", "self_attn"), "mistral": ("mlp", "self_attn"), "qwen2": ("mlp", "self_attn"),
    "qwen3": ("mlp", "self_attn"), "gemma": ("mlp", "self_attn"), "gemma2": ("mlp", "self_attn"),
    "phi3": ("mlp", "self_attn"), "olmo2": ("mlp", "self_attn"), "starcoder2": ("mlp", "self_attn"),
    "mixtral": ("mlp", "self_attn"), "qwen2_moe": ("mlp", "self_attn"), "deepseek_v3": ("mlp", "self_attn"),
    "phimoe": ("mlp", "self_attn"), "gpt2": ("mlp", "attn"), "gpt_bigcode": ("mlp", "attn"),
    "gpt_neox": ("mlp", "attention"), "opt": ("fc1", "self_attn"), "bloom": ("mlp", "self_attention"),
    "falcon": ("mlp", "self_attention"),
    "bert": ("intermediate", "attention"), "t5": ("DenseReluDense", "SelfAttention"),
    "qwen3_next": ("mlp", "self_attn"), "lfm2": ("feed_forward", "self_attn"),  # self_attn: layer 1 only
}
HYBRID = {"qwen3_next": "linear_attn", "lfm2": "conv"}
"""The module layers 0 and 2 of a hybrid family have where layer 1 has ``self_attn``."""


def _op_swap(attn: str, layers) -> dict:
    return {"swap": True, "op_swap": [{"op_name": attn, "backward_prefetch": 1, "layers": layers}]}


def _configs(family: str) -> dict[str, dict]:
    mlp, attn = KEYS[family]
    return {
        "full-recompute": {"recompute_config": {"recompute": True}},
        "layer-swap": {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]}},
        "select-recompute-mlp": {"recompute_config": {"select_recompute": {mlp: True}}},
        "op-swap-attention": {"swap_config": _op_swap(attn, True)},
        # Case 4 of the MindFormers seed: select recompute of the MLP on even layers, op swap of attention on all.
        "mixed-alternating": {"recompute_config": {"select_recompute": {mlp: [0, 2]}},
                              "swap_config": _op_swap(attn, True)},
    }


PLANS = (*_configs("llama"), "milp-half")
CASES = [pytest.param(f, p, id=f"{f}-{p}") for f in KEYS for p in PLANS]

pytestmark = pytest.mark.usefixtures("deterministic")


def _build(family: str):
    args = {"use_cache": True, **({"num_hidden_layers": 3} if family == "llama" else {})}  # every family: 3 layers
    return build_model(f"hf:{family}", model_args=args, batch_size=BATCH, seq_len=SEQ, seed=0)


@functools.lru_cache(maxsize=None)
def _reference(family: str):
    bundle = _build(family)
    batch = bundle.batch(seed=0)
    return bundle, batch, _step(bundle, batch)


def _milp_plan(family: str, tmp_path) -> str:
    """The milp plan at half the activation peak, searched on the family's own profile (one recorded step)."""
    import profiler
    from adaptive_mem.cli import main

    profile, plan = tmp_path / "p.json", tmp_path / "plan.yaml"
    profiler.profile_step(_build(family), warmup=0, repeat=0, record=1, optimizer_time=0.0).save(profile)
    assert main(["search", str(profile), "--activation-budget", "0.5", "-o", str(plan)]) == 0
    return str(plan)


@pytest.mark.parametrize("family,plan", CASES)
def test_zoo_exact(family: str, plan: str, tmp_path, caplog):
    bundle, batch, ref = _reference(family)
    kwargs = {"plan": _milp_plan(family, tmp_path)} if plan == "milp-half" else {"config": _configs(family)[plan]}
    with caplog.at_level(logging.WARNING), optimize(bundle.model, **kwargs) as handle:
        assert handle.summary().takes_effect, handle.summary()
        for _ in range(2):  # the second step reuses what the first one traced
            _assert_same(_step(bundle, batch), ref, f"{family} {plan}")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "error-level log records"


def _peak(bundle, batch) -> int:
    tracker = MemTracker()
    tracker.track_external(bundle.model)
    bundle.model.zero_grad(set_to_none=True)
    with tracker:
        bundle.loss(batch).backward()
    peak = tracker.get_tracker_snapshot("peak")
    return max(snap["Total"] if "Total" in snap else sum(snap.values()) for snap in peak.values())


def test_phimoe_routing_draws_from_the_rng():
    """The exact PhiMoE cases mean something: its routing follows the RNG state (sparsemixer's Gumbel sampling),
    so a replay that did not restore the forward's RNG state would route other experts."""
    bundle, batch, ref = _reference("phimoe")
    torch.manual_seed(99)
    assert not torch.equal(bundle.loss(batch).detach(), ref[0])


@pytest.mark.parametrize("family", list(KEYS))
def test_full_recompute_peak_at_most_checkpoint(family: str):
    bundle, batch, _ = _reference(family)
    model = bundle.model
    # Both runs without the cache (Hugging Face's checkpointing drops it; Note: [cache in recompute] keeps it).
    use_cache, model.config.use_cache = model.config.use_cache, False
    try:
        with optimize(model, config={"recompute_config": {"recompute": True}}):
            ours = _peak(bundle, batch)
        # torch.utils.checkpoint (non-reentrant) on every layer, as Hugging Face applies it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        theirs = _peak(bundle, batch)
    finally:
        model.activation_checkpointing_disable()
        model.config.use_cache = use_cache
    assert ours <= theirs, f"{family}: full recompute peak {ours} > checkpoint-every-layer peak {theirs}"


MOE_LAYERS = {"mixtral": [0, 1, 2], "qwen2_moe": [0, 1, 2], "phimoe": [0, 1, 2],
              "deepseek_v3": [1, 2]}  # DeepSeek-V3: layer 0 is dense (first_k_dense_replace=1)


def _expert_plans(family: str) -> dict[str, dict]:
    swap, layers = {"action": "swap", "backward_prefetch": 1}, MOE_LAYERS[family]
    units = {f"model.layers.{i}.mlp.experts.act_fn": "recompute" for i in layers}
    units |= {f"model.layers.{i}.mlp.experts.grouped_mm_1": swap for i in layers}
    return {
        "plan": {"plan": {"format": "adaptive-mem-plan", "version": 1, "decisions": units, "groups": []}},
        # every layer: a key applies to the layers whose block has the names (Note: [blocks of two kinds])
        "config": {"config": {"recompute_config": {"select_recompute": {r"mlp\.experts\.act_fn": True}},
                              "swap_config": _op_swap(r"mlp\.experts\.grouped_mm_1", True)}},
    }


@pytest.mark.parametrize("how", ["plan", "config"])
@pytest.mark.parametrize("family", list(MOE_LAYERS))
def test_moe_expert_units_are_targetable(family: str, how: str, caplog):
    """fp32 grouped_mm experts (transformers' default experts implementation) trace on fake tensors
    (Note: [fake op fallbacks]) and their units are named: a plan or a config reaches inside the experts."""
    bundle, batch, ref = _reference(family)
    with caplog.at_level(logging.WARNING), optimize(bundle.model, **_expert_plans(family)[how]) as handle:
        _assert_same(_step(bundle, batch), ref, f"{family} experts")
        assert handle.swap_stats.offloaded_bytes > 0
        # the config's keys select the experts of the MoE layers, as the plan names them
        assert set(handle.plan.decisions) == set(_expert_plans(family)["plan"]["plan"]["decisions"])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "error-level log records"


@pytest.mark.parametrize("family", list(HYBRID))
def test_hybrid_config_keys_apply_where_they_match(family: str, caplog):
    """A key applies in the layers that have what it names, says once at INFO which lack it, and the step is
    exact; a key none of its layers has is refused before anything is applied."""
    bundle, batch, ref = _reference(family)
    other = HYBRID[family]
    config = {"recompute_config": {"select_recompute": {other: True}}, "swap_config": _op_swap("self_attn", True)}
    with caplog.at_level(logging.INFO), optimize(bundle.model, config=config) as handle:
        assert {t: d.action.value for t, d in handle.plan.decisions.items()} == {
            f"model.layers.0.{other}": "recompute", "model.layers.1.self_attn": "swap",
            f"model.layers.2.{other}": "recompute"}
        summary = handle.summary()
        assert (summary.layers_selective, summary.layers_swapping) == (2, 1) and summary.takes_effect, summary
        _assert_same(_step(bundle, batch), ref, f"{family} hybrid config")
    infos = [r.getMessage() for r in caplog.records if r.name == "adaptive_mem.config._names"]
    assert infos == [
        f"recompute_config.select_recompute.{other}='{other}': applies in layers 0, 2 (with {other}); not in "
        f"layer 1 (with self_attn), which has no {other}",
        "swap_config.op_swap[0].op_name='self_attn': applies in layer 1 (with self_attn); not in layers 0, 2 "
        f"(with {other}), which have no self_attn"]
    with pytest.raises(ConfigError, match=rf"op_name='self_attn': matches no op of a layer of layers 0, 2 "
                                          rf"\(with {other}\)"):
        optimize(bundle.model, config={"swap_config": _op_swap("self_attn", [0, 2])})
    _assert_same(_step(bundle, batch), ref, f"{family} after a refused config")


@pytest.mark.parametrize("family", list(HYBRID))
def test_hybrid_plan_targets_apply_in_their_layer(family: str):
    """Plan targets name modules of one layer each: exact where the layer has them, refused naming the layer's
    kind where it does not (the model is left as it was)."""
    bundle, batch, ref = _reference(family)
    other = HYBRID[family]
    swap = {"action": "swap", "backward_prefetch": 1}
    decisions = {f"model.layers.0.{other}": "recompute", "model.layers.1.self_attn": swap,
                 f"model.layers.2.{other}": swap}
    plan = {"format": "adaptive-mem-plan", "version": 1, "decisions": decisions}
    with optimize(bundle.model, plan=plan, example_inputs=(batch[0],)) as handle:
        summary = handle.summary()
        assert summary.takes_effect and not summary.not_applied, summary
        assert (summary.layers_selective, summary.layers_swapping) == (1, 2), summary
        _assert_same(_step(bundle, batch), ref, f"{family} hybrid plan")
    wrong = {**decisions, f"model.layers.1.{other}": "recompute"}
    with pytest.raises(PlanError, match=rf"'model.layers.1.{other}': layer 1 \(model.layers.1\) is a layer with "
                                        rf"self_attn and has no {other} \(layers 0, 2 have it\)"):
        optimize(bundle.model, plan={**plan, "decisions": wrong})
    _assert_same(_step(bundle, batch), ref, f"{family} after a refused plan")



def test_gpt_bigcode_milp_plan_names_the_units_of_eager_attention_and_runs_exactly(tmp_path):
    """GPTBigCode with eager attention runs ``clone`` ops of its own (``transformer.h.0.attn.clone_3``): the milp plan
    searched on its profile names them, and the executor finds the same units and runs the plan exactly."""
    import profiler
    from adaptive_mem.cli import main
    from search import Plan

    bundle = _build("gpt_bigcode")
    bundle.model.set_attn_implementation("eager")
    batch = bundle.batch(seed=0)
    ref = _step(bundle, batch)
    profile, plan = tmp_path / "p.json", tmp_path / "plan.yaml"
    profiler.profile_step(bundle, warmup=0, repeat=0, record=1, optimizer_time=0.0).save(profile)
    assert "transformer.h.0.attn.clone_3" in {u.name for u in profiler.Profile.load(profile).units}
    assert main(["search", str(profile), "--activation-budget", "0.3", "-o", str(plan)]) == 0
    assert any(".attn.clone" in target for target in Plan.load(plan).decisions), "no eager-attention unit decided"
    with optimize(bundle.model, plan=str(plan)) as handle:
        assert handle.summary().takes_effect, handle.summary()
        _assert_same(_step(bundle, batch), ref, "gpt_bigcode eager milp")
