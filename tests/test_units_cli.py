"""Unit names and keys: `adaptive-mem units`, the key matching rule and the nearest-names error.

Note: [key matching] (adaptive_mem/config/_errors.py, docs/plan-format.md "Unit names and keys").
"""

from __future__ import annotations

import pytest

import profiler
from adaptive_mem import ConfigError, build_model, plan_from_config
from adaptive_mem.cli._main import main
from adaptive_mem.config._names import layer_names
from search import Action
from search.planning import matches
from search import fmt_bytes

TINY = {"hf:gpt2": "n_layer=2,n_embd=32,n_head=2", "hf:qwen2": "num_hidden_layers=2,hidden_size=32,"
        "intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"}
ACT = {"hf:gpt2": ("transformer.h", "mlp.act"), "hf:qwen2": ("model.layers", "mlp.act_fn")}


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def gpt2_profile(tmp_path_factory):
    result = profiler.profile_step(build_model("hf:gpt2", model_args=TINY["hf:gpt2"], device="meta"))
    path = tmp_path_factory.mktemp("units") / "gpt2.json"
    result.save(path)
    return path, result


@pytest.mark.parametrize("spec,args,expected", [
    ("llama-tiny", None, ["attention.wq.matmul *", "feed_forward.w1.activation.silu *", "attention.flash_attention *",
                          "ffn_norm.norm *"]),
    ("hf:gpt2", TINY["hf:gpt2"], ["mlp.act.newgelu *", "attn.c_attn.matmul *", "ln_1.norm *"]),
    ("hf:qwen2", TINY["hf:qwen2"], ["mlp.act_fn.silu *", "self_attn.q_proj.matmul *", "input_layernorm.norm *"]),
])
def test_units_prints_layer_0_tree(capsys, spec, args, expected):
    argv = ["units", "--model", spec] + (["--model-args", args] if args else [])
    code, out, _ = run(capsys, *argv)
    assert code == 0
    lines = out.splitlines()
    names = layer_names(build_model(spec, model_args=args, device="meta").model)
    assert lines[0].startswith(f"layer 0 of {names.container} ({names.count} layers)")
    for name in expected:
        assert any(line.strip() == name for line in lines), name
    # every local name is listed once, a child indented one step below its parent module
    listed = [line.strip().removesuffix(" *") for line in lines[1:-1]]
    assert sorted(listed) == sorted(dict.fromkeys(names.modules + names.units))
    depth = {line.strip().removesuffix(" *"): (len(line) - len(line.lstrip())) // 2 for line in lines[1:-1]}
    assert depth[expected[0].removesuffix(" *")] == expected[0].count(".")


def test_units_with_profile_shows_saved_bytes_and_time(capsys, gpt2_profile):
    path, result = gpt2_profile
    code, out, _ = run(capsys, "units", "--model", "hf:gpt2", "--model-args", TINY["hf:gpt2"], "--profile", path)
    assert code == 0
    unit = result.unit("transformer.h.0.mlp.act.newgelu")
    assert unit.saved_bytes > 0
    line = next(line for line in out.splitlines() if line.strip().startswith("mlp.act.newgelu *"))
    assert f"saved {fmt_bytes(unit.saved_bytes):>10}" in line and "fwd" in line
    assert "saved" not in next(line for line in out.splitlines() if line.strip() == "mlp.act")


def test_units_refuses_a_profile_of_another_model(capsys, gpt2_profile):
    code, out, err = run(capsys, "units", "--model", "hf:qwen2", "--model-args", TINY["hf:qwen2"],
                         "--profile", gpt2_profile[0])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--profile: a profile of 'hf:gpt2', not of --model 'hf:qwen2'" in err


@pytest.mark.parametrize("spec", ["hf:gpt2", "hf:qwen2"])
@pytest.mark.parametrize("form", ["select_recompute", "op_swap"])
def test_mlp_act_key_names_the_activation_on_both_families(spec, form):
    bundle = build_model(spec, model_args=TINY[spec], device="meta")
    if form == "select_recompute":
        config = {"recompute_config": {"select_recompute": {r"mlp\.act": True}}}
        action = Action.RECOMPUTE
    else:
        config = {"swap_config": {"swap": True, "op_swap": [{"op_name": r"mlp\.act", "backward_prefetch": 1,
                                                              "layers": True}]}}
        action = Action.SWAP
    plan = plan_from_config(config, model=bundle.model)
    container, local = ACT[spec]
    assert {t: d.action for t, d in plan.decisions.items()} == {f"{container}.{i}.{local}": action for i in range(2)}
    # the targets cover exactly the activation units of the profiled step
    step = profiler.profile_step(build_model(spec, model_args=TINY[spec], device="meta"))
    covered = {u.local_name for u in step.units if any(matches(t, u.name) for t in plan.decisions)}
    assert covered == {f"{local}.{'newgelu' if spec == 'hf:gpt2' else 'silu'}"}


def test_whole_match_wins_over_prefix():
    plan = plan_from_config({"recompute_config": {"select_recompute": ["attention"]}}, model=None, num_layers=1)
    assert set(plan.decisions) == {"layers.0.attention"}  # not attention_norm: "attention" matches a name whole


def test_prefix_stops_at_a_name_boundary():
    with pytest.raises(ConfigError, match=r"'feed_forward\\\\.w': matches no op of a layer"):
        plan_from_config({"recompute_config": {"select_recompute": [r"feed_forward\.w"]}}, model=None, num_layers=1)
    with pytest.raises(ConfigError, match="'attention_n': matches no op of a layer"):
        plan_from_config({"recompute_config": {"select_recompute": ["attention_n"]}}, model=None, num_layers=1)
    plan = plan_from_config({"recompute_config": {"select_recompute": ["ffn"]}}, model=None, num_layers=1)
    assert set(plan.decisions) == {"layers.0.ffn_norm"}  # a prefix ending at "_"


def test_key_matching_nothing_lists_the_5_nearest_local_names():
    names = layer_names(None)
    with pytest.raises(ConfigError) as info:
        plan_from_config({"swap_config": {"swap": True, "op_swap": [{"op_name": r"feed_forward\.w9",
                                                                      "backward_prefetch": 1, "layers": [0]}]}},
                         model=None, num_layers=2)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(r"swap_config.op_swap[0].op_name='feed_forward\\.w9': matches no op of a layer; ")
    near = message.split("nearest local names: ", 1)[1].split(";", 1)[0].split(", ")
    assert len(near) == 5 and set(near) <= set(names.modules + names.units)
    assert set(near[:3]) == {"feed_forward.w1", "feed_forward.w3", "feed_forward.w2"}  # equally near: any order
    assert "adaptive-mem units --model SPEC" in message


def test_nearest_names_on_a_hugging_face_layer():
    bundle = build_model("hf:qwen2", model_args=TINY["hf:qwen2"], device="meta")
    with pytest.raises(ConfigError) as info:
        plan_from_config({"recompute_config": {"select_recompute": {r"mlp\.gelu": True}}}, model=bundle.model)
    near = str(info.value).split("nearest local names: ", 1)[1].split(";", 1)[0].split(", ")
    assert len(near) == 5 and all(n.startswith("mlp") for n in near)
