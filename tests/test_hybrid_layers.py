"""Layers of several kinds in one stack (Qwen3-Next: ``linear_attn`` or ``self_attn``; LFM2: ``conv`` or ``self_attn``).

Note: [layer kinds] (profiler/_kinds.py) and Note: [keys per layer] (adaptive_mem/config/_names.py,
docs/plan-format.md "Layers of several kinds"): a config key applies in the layers it names that have what it
selects and says so once at INFO; it is refused only when none of them has it; a plan target naming a module its
layer lacks is refused naming the layer's kind. Exactness of these plans on a training step: tests/test_hf_zoo.py.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers", reason="Hugging Face models need transformers (the [test] extra installs it)")

import profiler  # noqa: E402
from adaptive_mem import ConfigError, build_model, optimize, plan_from_config  # noqa: E402
from adaptive_mem.adaptive._calibrate import _plans  # noqa: E402
from adaptive_mem.cli._main import main  # noqa: E402
from profiler.naming import find_layers
from profiler.naming import layer_kinds
from search import Plan, PlanError  # noqa: E402
from search import Action

OTHER = {"qwen3_next": "linear_attn", "lfm2": "conv"}
"""The module of layers 0 and 2 (layer 1 has ``self_attn``), in the tiny configs of ``HF_FAMILIES``."""
MLP = {"qwen3_next": "mlp", "lfm2": "feed_forward"}
FAMILIES = list(OTHER)
NAMES = "adaptive_mem.config._names"
SWAP_MODE = {"swap": True, "layer_swap": []}
"""Swap mode (layer-index lists) without the default swap strategy."""


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request):
    return request.param, build_model(f"hf:{request.param}", device="meta").model


def _infos(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == NAMES and r.levelno == logging.INFO]


def _op_swap(op: str, layers) -> dict:
    return {"swap": True, "op_swap": [{"op_name": op, "backward_prefetch": 1, "layers": layers}]}


def test_the_layers_are_of_two_kinds(hybrid):
    family, model = hybrid
    kinds = layer_kinds(model, find_layers(model))
    assert kinds.first == (0, 1, 0) and kinds.layers(2) == [0, 2]
    assert kinds.describe(1) == "with self_attn" and kinds.describe(0) == f"with {OTHER[family]}"


def _forms(other: str) -> dict[str, tuple[dict, dict[str, Action], str]]:
    """form -> (config, decisions, the INFO line naming the layers that lack the key)."""
    attn = {"model.layers.1.self_attn": Action.SWAP}
    lacks_attn = ("applies in layer 1 (with self_attn); not in layers 0, 2 (with {o}), which have no "
                  "self_attn").format(o=other)
    return {
        "op_swap": ({"swap_config": _op_swap("self_attn", True)}, attn,
                    f"swap_config.op_swap[0].op_name='self_attn': {lacks_attn}"),
        "op_swap-list": ({"swap_config": _op_swap("self_attn", [1, 2])}, attn,
                         "swap_config.op_swap[0].op_name='self_attn': applies in layer 1 (with self_attn); not in "
                         f"layer 2 (with {other}), which has no self_attn"),
        "select_recompute": ({"recompute_config": {"select_recompute": {other: True}}},
                             {f"model.layers.{i}.{other}": Action.RECOMPUTE for i in (0, 2)},
                             f"recompute_config.select_recompute.{other}='{other}': applies in layers 0, 2 (with "
                             f"{other}); not in layer 1 (with self_attn), which has no {other}"),
        "select_recompute-swap-mode": (
            {"recompute_config": {"select_recompute": {"self_attn": [0, 1]}}, "swap_config": SWAP_MODE},
            {"model.layers.1.self_attn": Action.RECOMPUTE},
            "recompute_config.select_recompute.self_attn='self_attn': applies in layer 1 (with self_attn); not in "
            f"layer 0 (with {other}), which has no self_attn"),
        "select_comm_recompute": ({"recompute_config": {"select_comm_recompute": ["self_attn"]}},
                                  {"model.layers.1.self_attn": Action.RECOMPUTE},
                                  f"recompute_config.select_comm_recompute.self_attn='self_attn': {lacks_attn}"),
        "default-swap": ({"swap_config": {"swap": True}}, {"model.layers.1.self_attn.flash_attention": Action.SWAP},
                         "swap_config.swap=True: applies in layer 1 (with self_attn); not in layers 0, 2 (with "
                         f"{other}), which have no self_attn.flash_attention"),
        "megatron-selective": (["--recompute-granularity", "selective"],
                               {"model.layers.1.self_attn.flash_attention": Action.RECOMPUTE},
                               "--recompute-granularity='selective': applies in layer 1 (with self_attn); not in "
                               f"layers 0, 2 (with {other}), which have no self_attn.flash_attention"),
    }


@pytest.mark.parametrize("form", list(_forms("conv")))
def test_a_key_applies_where_it_matches_and_says_once_where_not(hybrid, form, caplog):
    family, model = hybrid
    config, decisions, line = _forms(OTHER[family])[form]
    caplog.set_level(logging.INFO)
    plan = plan_from_config(config, model=model)
    assert {t: d.action for t, d in plan.decisions.items()} == decisions
    assert _infos(caplog) == [line]
    lacking = [i for i in range(3) if not any(t.startswith(f"model.layers.{i}.") for t in decisions)]
    set_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Set ")]
    assert not [m for m in set_lines for i in lacking if m.startswith(f"Set op_swap at layer {i}:")
                or m.startswith(f"Set select recompute at layer {i}:")], set_lines


def test_a_key_every_layer_has_logs_nothing(hybrid, caplog):
    family, model = hybrid
    mlp = MLP[family]
    caplog.set_level(logging.INFO)
    both = f"(self_attn|{OTHER[family]})"
    plan = plan_from_config({"recompute_config": {"select_recompute": [mlp]}, "swap_config": _op_swap(both, True)},
                            model=model)
    assert plan.decisions.keys() == {f"model.layers.{i}.{mlp}" for i in range(3)} | {
        "model.layers.1.self_attn", "model.layers.0." + OTHER[family], "model.layers.2." + OTHER[family]}
    assert _infos(caplog) == []


def _select(key: str, layers: list[int]) -> dict:
    return {"recompute_config": {"select_recompute": {key: layers}}, "swap_config": SWAP_MODE}


REFUSED = {  # form -> the config and the start of its error, given the module of layers 0 and 2
    "op_swap": lambda o: ({"swap_config": _op_swap("self_attn", [0, 2])},
                          f"swap_config.op_swap[0].op_name='self_attn': matches no op of a layer of layers 0, 2 "
                          f"(with {o}); nearest local names: "),
    "select-attention": lambda o: (_select("self_attn", [2]), "recompute_config.select_recompute.self_attn="
                                   f"'self_attn': matches no op of a layer of layer 2 (with {o}); "),
    "select-other": lambda o: (_select(o, [1]), f"recompute_config.select_recompute.{o}='{o}': matches no op of a "
                               "layer of layer 1 (with self_attn); "),
}


@pytest.mark.parametrize("form", list(REFUSED))
def test_a_key_matching_in_none_of_its_layers_is_refused(hybrid, form):
    family, model = hybrid
    config, message = REFUSED[form](OTHER[family])
    with pytest.raises(ConfigError) as info:
        plan_from_config(config, model=model)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.fixture(scope="module", params=FAMILIES)
def real(request):
    return request.param, build_model(f"hf:{request.param}", batch_size=2, seq_len=16, seed=0).model


def _untouched(model) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in model.modules())


def test_refusals_leave_the_model_untouched(real):
    family, model = real
    with pytest.raises(ConfigError, match="matches no op of a layer of layers 0, 2"):
        optimize(model, config={"swap_config": _op_swap("self_attn", [0, 2])})
    assert _untouched(model)
    other = OTHER[family]
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1,
                           "decisions": {f"model.layers.0.{MLP[family]}": "recompute",
                                         f"model.layers.1.{other}": "recompute"}})
    with pytest.raises(PlanError) as info:
        optimize(model, plan=plan)
    assert str(info.value).startswith(
        f"plan.decisions.'model.layers.1.{other}': layer 1 (model.layers.1) is a layer with self_attn and has no "
        f"{other} (layers 0, 2 have it); expected a module or unit of layer 1: self_attn, ")
    assert _untouched(model)


def test_plan_targets_that_exist_apply_per_layer(real):
    family, model = real
    other = OTHER[family]
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {
        f"model.layers.0.{other}": "recompute", "model.layers.1.self_attn": {"action": "swap", "backward_prefetch": 1},
        "model.layers.2": "recompute"}})
    with optimize(model, plan=plan) as handle:
        summary = handle.summary()
        assert (summary.layers_recomputed, summary.layers_selective, summary.layers_swapping) == (1, 1, 1)
    assert _untouched(model)


def test_units_prints_one_tree_per_kind(hybrid, capsys):
    family, _ = hybrid
    other = OTHER[family]
    assert main(["units", "--model", f"hf:{family}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    second = next(k for k, line in enumerate(lines) if line.startswith("layer 1 "))
    assert lines[0].startswith("layer 0 of model.layers (3 layers)")
    assert lines[0].endswith(f"its kind: layers 0, 2 (with {other})")
    assert lines[second] == "layer 1 (model.layers.1), another kind: layer 1 (with self_attn)"
    first_tree, second_tree = {line.strip() for line in lines[1:second]}, {line.strip() for line in lines[second:]}
    assert other in first_tree and "self_attn" not in first_tree
    assert "self_attn" in second_tree and other not in second_tree


def test_calibration_plans_name_each_layers_own_units(hybrid):
    """The selective-recompute plan of ``calibrate`` picks a unit in each layer from that layer's own units."""
    family, _ = hybrid
    profile = profiler.profile_step(build_model(f"hf:{family}", device="meta"))
    targets = list(_plans(profile)["sac"].decisions)
    assert len(targets) == 3
    for i, target in enumerate(targets):
        assert target in {u.name for u in profile.layer_units(i)}
