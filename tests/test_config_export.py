"""``plan_to_mindformers``: a plan as a swap-mode MindFormers config that reads back to the same plan."""

from __future__ import annotations

import pytest
import yaml

import _config_seeds as seeds
from adaptive_mem import ConfigError, plan_from_config, plan_to_mindformers
from search import Plan

SEED_CONFIGS = {
    "swap1": (seeds.SWAP_CASE_1, 4), "swap2": (seeds.SWAP_CASE_2, 4), "swap3": (seeds.SWAP_CASE_3, 4),
    "swap4": (seeds.SWAP_CASE_4, 4), "layers48": (seeds.LAYERS_48_LAYOUT + seeds.LAYERS_48, 48),
    "deepseek": (seeds.DEEPSEEK_V3_LAYOUT + seeds.DEEPSEEK_V3, 62),
}


def round_trip(plan: Plan, n: int) -> Plan:
    exported = plan_to_mindformers(plan, num_layers=n)
    text = yaml.safe_dump(exported)  # what `search --format mindformers` writes
    return plan_from_config(yaml.safe_load(text), model=None, num_layers=n)


@pytest.mark.parametrize("name", list(SEED_CONFIGS))
def test_seed_plans_round_trip_through_the_mindformers_form(name):
    text, n = SEED_CONFIGS[name]
    plan = plan_from_config(yaml.safe_load(text), model=None)
    again = round_trip(plan, n)
    assert again.decisions == plan.decisions
    exported = plan_to_mindformers(plan, num_layers=n)
    assert exported["swap_config"]["swap"] is True


def test_export_of_a_mixed_plan_uses_layer_index_lists():
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {
        "layers.0": "recompute", "layers.2": {"action": "swap", "backward_prefetch": 0},
        "layers.1.feed_forward.w1.activation.silu": "recompute",
        "layers.3.feed_forward.w1.activation.silu": "recompute",
        "layers.1.attention.flash_attention": {"action": "swap", "backward_prefetch": 2},
        "layers.2.feed_forward.mul": "recompute"}})
    exported = plan_to_mindformers(plan, num_layers=4)
    assert exported == {
        "recompute_config": {"recompute": [0],
                             "select_recompute": {r"feed_forward\.w1\.activation\.silu": [1, 3],
                                                  r"feed_forward\.mul": [2]},
                             "select_comm_recompute": False},
        "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 0, "layers": [2]}],
                        "op_swap": [{"op_name": r"attention\.flash_attention", "backward_prefetch": 2,
                                     "layers": [1]}]},
    }
    assert round_trip(plan, 4).decisions == plan.decisions


def test_explicit_keeps_where_nothing_else_acts_are_dropped():
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {
        "layers.0": "recompute", "layers.1.feed_forward.mul": "keep", "output.matmul": "keep"}})
    assert round_trip(plan, 2).decisions == {"layers.0": plan.decisions["layers.0"]}


def test_an_empty_plan_exports_to_no_swap_and_no_recompute():
    plan = Plan()
    assert round_trip(plan, 3).decisions == {}


@pytest.mark.parametrize("plan,why", [
    (Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers.0": "recompute",
                     "layers.0.attention": "swap"}}), "swap inside a recomputed module"),
    (Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers.0": "recompute",
                     "layers.1": "recompute"}, "groups": [[0, 1]]}), "cannot checkpoint several layers as one unit"),
    (Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {"output.matmul": "swap"}}),
     "not inside a layer"),
    (Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers.9": "swap"}}),
     "layer 9 out of range"),
    (Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers.0": "swap",
                     "layers.0.attention": "keep"}}), "keep inside a recomputed or swapped module"),
    (Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {
        "layers.1": {"action": "recompute", "swap_input": True}}}), "cannot swap a recomputed layer's input"),
])
def test_export_refuses_what_mindformers_cannot_say(plan, why):
    with pytest.raises(ConfigError, match=why):
        plan_to_mindformers(plan, num_layers=4)
