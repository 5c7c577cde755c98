"""Every MindFormers config form gives the plan its description says, per layer and per op."""

from __future__ import annotations

import logging

import pytest

from adaptive_mem import ConfigError, plan_from_config
from adaptive_mem.config._layers import StageLayout
from search import Action, Decision

R, S, K = Action.RECOMPUTE, Action.SWAP, Action.KEEP
DEFAULT_OPS = ("feed_forward.mul", "feed_forward.w1.activation.silu")
NORMS = ("attention_norm.norm", "ffn_norm.norm")


def cfg(n: int, *, pp: int = 1, vv: int = 1, offset=0, recompute=None, swap=None) -> dict:
    out = {"model": {"model_config": {"num_layers": n, "pp_interleave_num": vv, "offset": offset}},
           "parallel_config": {"pipeline_stage": pp}}
    if recompute is not None:
        out["recompute_config"] = recompute
    if swap is not None:
        out["swap_config"] = swap
    return out


def plan_of(config, **kwargs):
    return plan_from_config(config, model=None, **kwargs)


def full_layers(plan) -> set[int]:
    return {int(t.split(".")[1]) for t, d in plan.decisions.items() if d.action is R and t.count(".") == 1}


def op_layers(plan, local: str, action=R) -> set[int]:
    return {int(t.split(".")[1]) for t, d in plan.decisions.items() if d.action is action and t.endswith("." + local)
            and t.split(".", 2)[2] == local}


# ---------------------------------------------------------------- layout
def test_layout_of_the_48_layer_example():
    layout = StageLayout.build(num_layers=48, pipeline_stage=5, interleave=2, offset=[[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert layout.counts == ((4, 5, 5, 5, 5), (5, 5, 5, 5, 4))
    assert layout.starts() == [[0, 4, 9, 14, 19], [24, 29, 34, 39, 44]]
    assert layout.chunk_of(29) == (1, 1, 0)
    assert layout.stage_layers()[0] == [0, 1, 2, 3, 24, 25, 26, 27, 28]


@pytest.mark.parametrize("offset,counts", [(0, ((2, 2),)), ([1, -1], ((3, 1),)), ([[1, -1]], ((3, 1),))])
def test_offset_forms(offset, counts):
    assert StageLayout.build(num_layers=4, pipeline_stage=2, offset=offset).counts == counts


def test_int_offset_broadcasts_to_every_chunk():
    assert StageLayout.build(num_layers=12, pipeline_stage=2, interleave=2, offset=0).counts == ((3, 3), (3, 3))
    with pytest.raises(ConfigError, match=r"offsets sum to 4; expected them to sum to 0"):
        StageLayout.build(num_layers=12, pipeline_stage=2, interleave=2, offset=1)


# ---------------------------------------------------------------- recompute (normal mode)
def test_recompute_true_is_every_layer_and_false_none():
    assert full_layers(plan_of(cfg(4, recompute={"recompute": True}))) == {0, 1, 2, 3}
    assert plan_of(cfg(4, recompute={"recompute": False})).decisions == {}


def test_recompute_per_stage_counts_take_the_first_layers_of_each_stage():
    plan = plan_of(cfg(8, pp=2, recompute={"recompute": [1, 3]}))
    assert full_layers(plan) == {0, 4, 5, 6}


def test_true_false_in_place_of_counts():
    assert full_layers(plan_of(cfg(8, pp=2, recompute={"recompute": [True, False]}))) == {0, 1, 2, 3}
    assert full_layers(plan_of(cfg(8, pp=2, recompute={"recompute": [False, 2]}))) == {4, 5}


def test_per_stage_counts_spread_over_interleaved_chunks_round_robin():
    # 8 layers, pp 2, interleave 2: chunks [0,1] [2,3] / [4,5] [6,7]; stage 0 holds [0,1,4,5]
    plan = plan_of(cfg(8, pp=2, vv=2, recompute={"recompute": [3, 1]}))
    assert full_layers(plan) == {0, 1, 4, 2}


def test_two_d_counts_with_bool_rows_and_items_clip_to_chunk_size():
    plan = plan_of(cfg(8, pp=2, vv=2, recompute={"recompute": [[9, False], True]}))
    assert full_layers(plan) == {0, 1, 4, 5, 6, 7}
    plan = plan_of(cfg(8, pp=2, vv=2, recompute={"recompute": [[1, True], [0, 1]]}))
    assert full_layers(plan) == {0, 2, 3, 6}


def test_select_recompute_true_means_the_default_ops_of_every_layer():
    plan = plan_of(cfg(2, recompute={"select_recompute": True}))
    assert set(plan.decisions) == {f"layers.{i}.{op}" for i in range(2) for op in DEFAULT_OPS}


def test_select_recompute_counts_apply_to_the_default_ops():
    plan = plan_of(cfg(4, pp=2, recompute={"select_recompute": [1, 0]}))
    assert set(plan.decisions) == {f"layers.0.{op}" for op in DEFAULT_OPS}


def test_select_recompute_list_of_regexes_is_every_layer():
    plan = plan_of(cfg(3, recompute={"select_recompute": [r"attention\.w[qk]\.matmul"]}))
    assert set(plan.decisions) == {f"layers.{i}.attention.{w}.matmul" for i in range(3) for w in ("wq", "wk")}


def test_select_recompute_dict_of_bool_list_and_2d():
    plan = plan_of(cfg(8, pp=2, vv=2, recompute={"select_recompute": {
        r"feed_forward\.mul": True, r"ffn_norm\.norm": [1, 0], r"attention": [[0, 1], [1, 0]]}}))
    assert op_layers(plan, "feed_forward.mul") == set(range(8))
    assert op_layers(plan, "ffn_norm.norm") == {0}
    assert op_layers(plan, "attention") == {2, 4}
    assert plan.decision_for("layers.2.attention.wq.matmul").action is R


def test_select_comm_recompute_forms_and_default_norm_ops():
    plan = plan_of(cfg(2, recompute={"select_comm_recompute": True}))
    assert set(plan.decisions) == {f"layers.{i}.{op}" for i in range(2) for op in NORMS}
    plan = plan_of(cfg(2, recompute={"select_comm_recompute": [r"ffn_norm\.norm"]}))
    assert set(plan.decisions) == {"layers.0.ffn_norm.norm", "layers.1.ffn_norm.norm"}
    plan = plan_of(cfg(2, recompute={"select_comm_recompute": {r".*_norm\.norm": [1]}}))
    assert set(plan.decisions) == {"layers.0.ffn_norm.norm", "layers.0.attention_norm.norm"}


def test_without_swap_every_layer_logs_one_line_with_its_final_setting(caplog):
    # Note: [per-layer recompute line]
    with caplog.at_level(logging.INFO, logger="adaptive_mem.config"):
        plan_of(cfg(3, recompute={"recompute": [1], "select_recompute": {r"feed_forward\.mul": [2]},
                                  "select_comm_recompute": {r"ffn_norm\.norm": True}}))
    lines = [r.getMessage() for r in caplog.records if " at layer " in r.getMessage()]
    assert lines == ["Set full recompute at layer 0",
                     "Set select recompute at layer 1: feed_forward.mul; select comm recompute: ffn_norm.norm",
                     "Set select comm recompute at layer 2: ffn_norm.norm"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="adaptive_mem.config"):
        plan_of(cfg(2, recompute={"recompute": [1]}))
    assert [r.getMessage() for r in caplog.records if " at layer " in r.getMessage()] == [
        "Set full recompute at layer 0", "Set no recompute at layer 1"]


def test_full_recompute_wins_over_selective_on_the_same_layer():
    plan = plan_of(cfg(2, recompute={"recompute": [1], "select_recompute": True, "select_comm_recompute": True}))
    assert plan.decisions["layers.0"] == Decision(R)
    assert not [t for t in plan.decisions if t.startswith("layers.0.")]
    assert {f"layers.1.{op}" for op in DEFAULT_OPS + NORMS} <= set(plan.decisions)


def test_a_regex_covering_a_module_keeps_only_the_module():
    plan = plan_of(cfg(1, recompute={"select_recompute": [r"feed_forward(\..*)?"]}))
    assert set(plan.decisions) == {"layers.0.feed_forward"}


def test_inactive_parallel_keys_are_accepted_and_reported(caplog):
    with caplog.at_level(logging.INFO, logger="adaptive_mem.config"):
        plan = plan_of(cfg(2, recompute={"mp_comm_recompute": True, "parallel_optimizer_comm_recompute": False,
                                         "recompute_slice_activation": True}))
    assert plan.decisions == {}
    assert plan.meta["inactive"] == ["mp_comm_recompute", "recompute_slice_activation"]
    assert any("mp_comm_recompute=True: accepted; inactive here" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- swap mode
def test_swap_mode_recompute_keys_take_layer_indices_regardless_of_pipeline():
    plan = plan_of(cfg(8, pp=2, recompute={"recompute": [1, 6], "select_recompute": {"feed_forward": [0, 6]},
                                           "select_comm_recompute": [2]},
                       swap={"swap": True, "layer_swap": []}))
    assert full_layers(plan) == {1, 6}
    assert op_layers(plan, "feed_forward") == {0}  # layer 6 is fully recomputed
    assert op_layers(plan, "attention_norm.norm") == op_layers(plan, "ffn_norm.norm") == {2}
    assert not plan.targets(S)


def test_swap_mode_bools():
    plan = plan_of(cfg(3, recompute={"recompute": True}, swap={"swap": True, "op_swap": []}))
    assert full_layers(plan) == {0, 1, 2}
    plan = plan_of(cfg(3, recompute={"select_recompute": True}, swap={"swap": True, "op_swap": []}))
    assert set(plan.decisions) == {f"layers.{i}.{op}" for i in range(3) for op in DEFAULT_OPS}


def test_default_prefetch_defaults_to_one_and_layer_swap_true_means_all_layers():
    plan = plan_of(cfg(2, swap={"swap": True}))
    assert plan.decisions == {f"layers.{i}.attention.flash_attention": Decision(S, 1) for i in range(2)}
    plan = plan_of(cfg(3, swap={"swap": True, "layer_swap": [{"backward_prefetch": 0, "layers": True}]}))
    assert plan.decisions == {f"layers.{i}": Decision(S, 0) for i in range(3)}


def test_swap_false_disables_every_swap_key(caplog):
    with caplog.at_level(logging.INFO, logger="adaptive_mem.config"):
        plan = plan_of(cfg(2, swap={"swap": False, "op_swap": [{"op_name": "attention", "backward_prefetch": 1,
                                                                "layers": [0]}]}))
    assert plan.decisions == {}
    assert any("swap_config.swap is False" in r.getMessage() for r in caplog.records)


def test_recompute_wins_over_swap_on_the_same_op_and_inside_a_recomputed_layer(caplog):
    with caplog.at_level(logging.INFO, logger="adaptive_mem.config"):
        plan = plan_of(cfg(3, recompute={"recompute": [0], "select_recompute": {"feed_forward": [1]}},
                           swap={"swap": True,
                                 "layer_swap": [{"backward_prefetch": 2, "layers": [0]}],
                                 "op_swap": [{"op_name": "feed_forward", "backward_prefetch": 1, "layers": [0, 1, 2]},
                                             {"op_name": r"feed_forward\.w3", "backward_prefetch": 3,
                                              "layers": [1]}]}))
    assert plan.decisions == {"layers.0": Decision(R), "layers.1.feed_forward": Decision(R),
                              "layers.2.feed_forward": Decision(S, 1)}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "All operator in layer 0 that is enabled swap do not work! Because it is enabled recompute." in warnings
    assert ("feed_forward operator in layer 1 that is enabled swap do not work! Because it is enabled recompute."
            in warnings)
    assert ("feed_forward.w3 operator in layer 1 that is enabled swap do not work! Because it is enabled recompute."
            in warnings)


def test_op_recompute_inside_a_swapped_module_stays_recomputed():
    plan = plan_of(cfg(1, recompute={"select_recompute": {r"feed_forward\.mul": [0]}},
                       swap={"swap": True, "op_swap": [{"op_name": "feed_forward", "backward_prefetch": 2,
                                                        "layers": [0]}]}))
    assert plan.decision_for("layers.0.feed_forward.mul").action is R
    assert plan.decision_for("layers.0.feed_forward.w2.matmul") == Decision(S, 2)


# ---------------------------------------------------------------- input shapes
def test_config_as_a_yaml_path_and_as_bare_sections(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("recompute_config:\n  recompute: [1]\n")
    plan = plan_of(str(path), num_layers=3)
    assert full_layers(plan) == {0} and plan.meta["config"] == str(path)
    assert plan_of({"recompute_config": {"recompute": [2]}}, num_layers=3).decisions.keys() == {"layers.0", "layers.1"}


def test_layer_count_comes_from_the_model():
    from adaptive_mem.models import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2))
    plan = plan_from_config({"recompute_config": {"recompute": True}}, model=model)
    assert full_layers(plan) == {0, 1, 2}
    with pytest.raises(ConfigError, match=r"model.model_config.num_layers=4: the model has 3 layers"):
        plan_from_config(cfg(4), model=model)


def test_hf_model_default_swap_uses_its_attention_core():
    from adaptive_mem import build_model

    bundle = build_model("hf:llama")
    n = len(bundle.model.model.layers)
    plan = plan_from_config({"swap_config": {"swap": True, "default_prefetch": 2}}, model=bundle.model)
    assert plan.decisions == {f"model.layers.{i}.self_attn.flash_attention": Decision(S, 2) for i in range(n)}
    plan = plan_from_config({"recompute_config": {"select_recompute": [r"mlp\.act_fn\.silu"]}}, model=bundle.model)
    assert set(plan.decisions) == {f"model.layers.{i}.mlp.act_fn.silu" for i in range(n)}
