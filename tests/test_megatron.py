"""Megatron recompute flags: the documented layer sets, add_arguments, and the exporter back to flags."""

from __future__ import annotations

import argparse
import logging

import pytest

from adaptive_mem import add_arguments, plan_from_config, plan_to_megatron
from search import Action, Decision, Plan

R = Action.RECOMPUTE


def plan_for(flags: list[str], n: int = 8):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    return plan_from_config(parser.parse_args(flags), model=None, num_layers=n)


def full(plan) -> list[int]:
    return sorted(int(t.split(".")[1]) for t, d in plan.decisions.items() if d.action is R and t.count(".") == 1)


def test_add_arguments_adds_megatrons_flags_with_its_defaults():
    parser = add_arguments(argparse.ArgumentParser())
    ns = parser.parse_args([])
    assert (ns.recompute_activations, ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers,
            ns.distribute_saved_activations) == (False, None, None, 1, False)
    assert plan_from_config(ns, model=None, num_layers=4).decisions == {}


def test_add_arguments_skips_flags_the_parser_already_has():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recompute-num-layers", type=int, default=7)
    add_arguments(parser)
    assert parser.parse_args(["--recompute-method", "block"]).recompute_num_layers == 7


def test_recompute_activations_is_selective_attention_core_of_every_layer():
    plan = plan_for(["--recompute-activations"], 4)
    assert plan.decisions == {f"layers.{i}.attention.flash_attention": Decision(R) for i in range(4)}
    assert plan_for(["--recompute-granularity", "selective"], 4).decisions == plan.decisions
    # --recompute-activations overrides an explicit full granularity
    assert plan_for(["--recompute-activations", "--recompute-granularity", "full"], 4).decisions == plan.decisions


def test_selective_on_an_hf_model_uses_its_attention_core():
    from adaptive_mem import build_model

    model = build_model("hf:llama").model
    plan = plan_from_config(["--recompute-activations"], model=model)
    layers = range(len(model.model.layers))
    assert set(plan.decisions) == {f"model.layers.{i}.self_attn.flash_attention" for i in layers}


@pytest.mark.parametrize("n,k,groups", [(8, 1, []), (8, 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
                                        (8, 3, [[0, 1, 2], [3, 4, 5], [6, 7]]), (8, 8, [list(range(8))]),
                                        (8, 20, [list(range(8))])])
def test_uniform_checkpoints_chunks_of_n_layers_as_one_unit(n, k, groups):
    plan = plan_for(["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                     str(k)], n)
    assert full(plan) == list(range(n))
    assert plan.groups == groups


def test_uniform_chunks_restart_at_each_pipeline_stage():
    plan = plan_for(["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3",
                     "--pipeline-model-parallel-size", "2"], 8)
    assert plan.groups == [[0, 1, 2], [4, 5, 6]]
    assert full(plan) == list(range(8))


@pytest.mark.parametrize("k,pp,expected", [(1, 1, [0]), (5, 1, [0, 1, 2, 3, 4]), (2, 2, [0, 1, 4, 5]),
                                           (9, 2, list(range(8))), (1, 4, [0, 2, 4, 6])])
def test_block_recomputes_the_first_n_layers_of_each_stage(k, pp, expected):
    plan = plan_for(["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(k),
                     "--pipeline-model-parallel-size", str(pp)], 8)
    assert full(plan) == expected
    assert plan.groups == []
    assert plan.meta["layer_stage"] == [i // (8 // pp) for i in range(8)]


def test_distribute_saved_activations_sets_the_plan_flag_and_logs(caplog):
    with caplog.at_level(logging.INFO, logger="adaptive_mem.config"):
        plan = plan_for(["--recompute-granularity", "full", "--recompute-method", "block",
                         "--recompute-num-layers", "2", "--distribute-saved-activations"], 4)
    assert plan.distribute_saved_activations is True
    lines = [r.getMessage() for r in caplog.records]
    assert "Set full recompute at layer 1" in lines and "Set no recompute at layer 2" in lines


def test_flags_as_a_list_of_strings():
    assert full(plan_from_config(["--recompute-granularity", "full", "--recompute-method", "block"], model=None,
                                 num_layers=3)) == [0]


@pytest.mark.parametrize("flags", [
    [], ["--recompute-granularity", "selective"],
    ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"],
    ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "5"],
    ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2",
     "--distribute-saved-activations"],
])
def test_megatron_export_round_trip(flags):
    plan = plan_for(flags, 8)
    exported = plan_to_megatron(plan, num_layers=8)
    again = plan_for(exported, 8)
    assert again.decisions == plan.decisions and again.groups == plan.groups
    assert again.distribute_saved_activations == plan.distribute_saved_activations


@pytest.mark.parametrize("decisions,why", [
    ({"layers.1": "recompute"}, r"Megatron recomputes every layer \(uniform\) or the first N"),
    ({"layers.0.attention.flash_attention": {"action": "swap"}}, "Megatron flags only recompute"),
    ({"layers.0.feed_forward.mul": "recompute"}, "other than the attention core of every layer"),
    ({"output.matmul": "recompute"}, "not inside a layer"),
])
def test_megatron_export_refuses_what_flags_cannot_say(decisions, why):
    from adaptive_mem import ConfigError

    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})
    with pytest.raises(ConfigError, match=why):
        plan_to_megatron(plan, num_layers=4)
