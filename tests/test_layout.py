"""Parallel layouts planned without the ranks: flags, schedules, sharding, ZeRO, CLI."""

from __future__ import annotations

import re

import pytest
import yaml

import profiler
from adaptive_mem._model_spec import build_model
from adaptive_mem.cli._main import main
from profiler import Layout, LayoutError, StaticMemory, shard_profile
from profiler.tracing import ParameterSplit, rank_static, tp_roles
from search.planning import chunk_layers, in_flight, pipeline_step_time
from search.planning import data_parallel_comm
from profiler.tracing import parameter_split


@pytest.mark.parametrize("flags, message", [
    ({"tensor_parallel": "0"}, "--tensor-parallel=0: expected a positive integer"),
    ({"tensor_parallel": "two"}, "--tensor-parallel='two': expected a positive integer"),
    ({"zero": "4", "data_parallel": "2"}, "--zero=4: expected one of 0, 1, 2, 3"),
    ({"zero": "x"}, "--zero='x': expected one of 0, 1, 2, 3"),
    ({"schedule": "zb"}, "--schedule='zb': expected one of gpipe, 1f1b, interleaved-1f1b"),
    ({"sequence_parallel": True}, "--sequence-parallel with --tensor-parallel=1: expected --tensor-parallel >= 2"),
    ({"zero": "1"}, "--zero=1 with --data-parallel=1: expected --data-parallel >= 2"),
    ({"pipeline_stages": "4", "virtual_pipeline_stages": "2"}, "--virtual-pipeline-stages=2 with --schedule=1f1b"),
    ({"pipeline_stages": "4", "virtual_pipeline_stages": "2", "micro_batches": "6", "schedule": "interleaved-1f1b"},
     "--micro-batches=6: expected a multiple of --pipeline-stages=4"),
])
def test_bad_flags_name_flag_value_and_form(flags, message):
    with pytest.raises(LayoutError, match="^" + re.escape(message)):
        Layout.from_flags(**flags)


def test_flags_parse_and_round_trip():
    layout = Layout.from_flags(tensor_parallel="8", pipeline_stages="4", virtual_pipeline_stages="2",
                               data_parallel="2", sequence_parallel=True, zero="1", micro_batches="8",
                               schedule="interleaved-1f1b")
    assert (layout.tensor_parallel, layout.chunks, layout.zero, layout.sequence_parallel) == (8, 8, 1, True)
    assert Layout.from_dict(layout.to_dict()) == layout
    with pytest.raises(LayoutError, match=r"^layout\.tp: unknown key"):
        Layout.from_dict({"tp": 2})


def test_in_flight_gpipe_and_1f1b_hand_counts():
    assert in_flight(Layout(pipeline_stages=4, micro_batches=8, schedule="gpipe")) == [[8], [8], [8], [8]]
    assert in_flight(Layout(pipeline_stages=4, micro_batches=8)) == [[4], [3], [2], [1]]
    assert in_flight(Layout(pipeline_stages=4, micro_batches=2)) == [[2], [2], [2], [1]]


def test_in_flight_interleaved_hand_counts():
    # P=4, V=2, M=8: rank s runs (4-s-1)*2 + 4 warm-up forwards and one more before its first backward;
    # forward k is of chunk (k // 4) % 2: rank 0 runs 11 (chunks 0000 1111 000), rank 3 runs 5 (0000 1).
    layout = Layout(pipeline_stages=4, virtual_pipeline_stages=2, micro_batches=8, schedule="interleaved-1f1b")
    assert in_flight(layout) == [[7, 4], [5, 4], [4, 3], [4, 1]]
    # rank 0 holds 11 chunk-micro-batches of half its layers: 5.5 of 1F1B's 4, = 4 * (1 + 3 / 8) (Megatron).
    assert sum(in_flight(layout)[0]) / 2 == 4 * (1 + 3 / 8)
    # M * V = 8 forwards cap the warm-up: every forward runs before the first backward on rank 0.
    small = Layout(pipeline_stages=4, virtual_pipeline_stages=2, micro_batches=4, schedule="interleaved-1f1b")
    assert in_flight(small) == [[4, 4], [4, 4], [4, 3], [4, 1]]
    assert chunk_layers(8, layout) == [[range(0, 1), range(4, 5)], [range(1, 2), range(5, 6)],
                                       [range(2, 3), range(6, 7)], [range(3, 4), range(7, 8)]]


def test_pipeline_step_time_bubble():
    one = Layout(pipeline_stages=4, micro_batches=8)
    assert pipeline_step_time([1.0] * 4, one) == 8 + 3  # (M + P - 1) stage times
    two = Layout(pipeline_stages=4, virtual_pipeline_stages=2, micro_batches=8, schedule="interleaved-1f1b")
    assert pipeline_step_time([1.0] * 4, two) == 8 + 1.5  # bubble / V


def test_rank_static_zero_hand_figures():
    static = StaticMemory(parameters=1000, gradients=1000, optimizer_state=4000)
    split = ParameterSplit(linears=frozenset(), shardable=800, total=1000, layer=100)
    tp = rank_static(static, layout=Layout(tensor_parallel=2), split=split)  # 800 / 2 + 200 = 600 of 1000
    assert (tp.parameters, tp.gradients, tp.optimizer_state, tp.buffers) == (600, 600, 2400, 0)
    figures = {}
    for zero in (1, 2, 3):
        st = rank_static(static, layout=Layout(tensor_parallel=2, data_parallel=4, zero=zero), split=split)
        figures[zero] = (st.parameters, st.gradients, st.optimizer_state, st.buffers)
    # Note: [gathered copy] 325 = two gathered layers of 100, one layer's reduce-scatter input 100 and its output 25
    assert figures == {1: (600, 600, 600, 0), 2: (600, 150, 600, 0), 3: (150, 150, 600, 325)}


def test_data_parallel_comm_overlap_hand_figures():
    """Note: [comm overlap] gradients overlap backward but for the last bucket; ZeRO-3 gathers overlap compute."""
    kw = dict(gradient_bytes=1000, parameter_bytes=1000, layers=4, forward_time=1.0, backward_time=2.0, bandwidth=1000.0)
    z0 = data_parallel_comm(Layout(data_parallel=4), **kw)
    assert (z0.total, z0.exposed) == (1.5, 0.375)  # all-reduce 2*3/4 s; 1.5 - 2*3/4 < 1.5/4
    z2 = data_parallel_comm(Layout(data_parallel=4, zero=2), **kw)
    assert (z2.total, z2.exposed) == (0.75 + 0.75, 0.1875 + 0.75)  # reduce-scatter, then an exposed all-gather
    z3 = data_parallel_comm(Layout(data_parallel=4, zero=3, micro_batches=2), **kw)
    assert z3.total == 0.75 + 2 * 2 * 0.75
    assert z3.exposed == 0.1875 + 2 * (0.1875 + 0.1875)
    assert data_parallel_comm(Layout(), **kw).total == 0.0


@pytest.fixture(scope="module")
def tiny():
    bundle = build_model("llama-tiny", seq_len=16, device="meta")
    whole = profiler.profile_step(bundle, hardware="h100")
    return bundle, whole


def _shard(bundle, whole, layout):
    split = parameter_split(bundle.model, whole.layer_info(), tensor_parallel=layout.tensor_parallel)
    return shard_profile(whole, layout=layout, split=split, interconnect=450e9), split


def test_tp_and_sp_shard_activations(tiny):
    """Note: [TP roles] column/row linears by their inputs; split units / TP, the rest / TP under SP only."""
    bundle, whole = tiny
    roles = tp_roles(whole, parameter_split(bundle.model, whole.layer_info(), tensor_parallel=2).linears)
    assert roles["layers.0.attention.wq.matmul"] == "column" and roles["layers.0.attention.wo.matmul"] == "row"
    assert roles["layers.0.feed_forward.mul"] == "sharded" and roles["layers.0.add"] == "replicated"
    tp, split = _shard(bundle, whole, Layout(tensor_parallel=2))
    sp, _ = _shard(bundle, whole, Layout(tensor_parallel=2, sequence_parallel=True))
    for unit in whole.units:
        if unit.layer is None:
            continue
        sharded = roles[unit.name] != "replicated"
        assert tp.unit(unit.name).saved_bytes == (unit.saved_bytes // 2 if sharded else unit.saved_bytes), unit.name
        assert sp.unit(unit.name).saved_bytes == unit.saved_bytes // 2, unit.name
    colls = [u for u in tp.units if u.name.endswith("wo.all_reduce") or u.name.endswith("w2.all_reduce")]
    assert len(colls) == 2 * whole.num_layers  # after wo and w2 of every layer
    wo = whole.unit("layers.0.attention.wo.matmul")
    assert colls[0].fwd_time == colls[0].bwd_time == 2 * (1 / 2) * wo.output_bytes / 450e9
    assert tp.unit("layers.0.attention.wo.matmul").consumers == ["layers.0.attention.wo.all_reduce"]
    assert tp.static.parameters == int(whole.static.parameters * (split.shardable / 2 + split.total - split.shardable)
                                       / split.total)
    assert tp.model["layout"]["tensor_parallel"] == 2
    assert whole.model.get("layout") is None  # the input profile is untouched, and so is the model:
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in bundle.model.modules())
    profiler.Profile.from_dict(tp.to_dict())  # a valid profile of the documented form


def test_cli_profile_then_search_per_stage(tmp_path, capsys):
    prof = tmp_path / "rank.json"
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--seq-len", "16", "--tensor-parallel", "2",
                 "--pipeline-stages", "2", "--micro-batches", "2", "--sequence-parallel", "-o", str(prof)]) == 0
    assert profiler.Profile.load(prof).model["layout"]["pipeline_stages"] == 2
    plan_path = tmp_path / "plan.yaml"
    assert main(["search", str(prof), "--activation-budget", "0.6", "-o", str(plan_path)]) == 0
    meta = yaml.safe_load(plan_path.read_text())["meta"]
    assert [s["in_flight"] for s in meta["pipeline"]["per_stage"]] == [2, 1]
    assert [s["layers"] for s in meta["pipeline"]["per_stage"]] == [[0, 1], [2, 3]]
    assert meta["layout"]["tensor_parallel"] == 2 and meta["pipeline"]["predicted_step_time"] > 0
    out = capsys.readouterr().out
    assert "stage 0 (2 micro-batches in flight)" in out and "pipelined step (1f1b" in out
    for fmt, path in (("plan", tmp_path / "block.yaml"), ("mindformers", tmp_path / "mf.yaml")):
        assert main(["search", str(prof), "--activation-budget", "0.6", "--solver", "block", "--format", fmt,
                     "-o", str(path)]) == 0
    config = yaml.safe_load((tmp_path / "mf.yaml").read_text())
    assert config["parallel_config"] == {"pipeline_stage": 2}
    assert isinstance(config["recompute_config"]["recompute"], list) and "swap_config" not in config
    from adaptive_mem.config import plan_from_config
    from search import Action, Plan

    back = plan_from_config(config, model=None, num_layers=4)
    planned = Plan.load(tmp_path / "block.yaml")
    assert {t for t, d in back.decisions.items() if d.action is Action.RECOMPUTE} == \
        {t for t, d in planned.decisions.items() if d.action is Action.RECOMPUTE}
    mg = tmp_path / "mg.txt"
    assert main(["search", str(prof), "--activation-budget", "0.6", "--solver", "full", "--format", "megatron",
                 "-o", str(mg)]) == 0
    assert mg.read_text().split() == ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                      "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method",
                                      "block", "--recompute-num-layers", "2"]


def test_cli_layout_errors_exit_2(tmp_path, capsys):
    prof = tmp_path / "rank.json"
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--zero", "5", "--data-parallel", "2",
                 "-o", str(prof)]) == 2
    assert "--zero=5: expected one of 0, 1, 2, 3" in capsys.readouterr().err
    assert main(["profile", "--model", "llama-tiny", "--tensor-parallel", "2", "-o", str(prof)]) == 2
    assert "--tensor-parallel=2 with --device cpu" in capsys.readouterr().err
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--seq-len", "16", "--tensor-parallel", "2",
                 "-o", str(prof)]) == 0
    assert main(["search", str(prof), "--activation-budget", "0.5", "--tensor-parallel", "4",
                 "-o", str(tmp_path / "p.yaml")]) == 2
    assert "--tensor-parallel='4': the profile was cut to one rank with tensor_parallel=2" in capsys.readouterr().err


def test_export_per_chunk_counts_and_megatron_refusal():
    from adaptive_mem.config import ConfigError, plan_from_config, plan_to_megatron_stages, plan_to_mindformers_stages
    from search import Action, Decision, Plan

    # 8 layers, P=2, V=2: chunks [interleave][stage] = layers 0-1, 2-3 | 4-5, 6-7.
    plan = Plan(decisions={f"layers.{i}": Decision(Action.RECOMPUTE) for i in (0, 1, 2, 4, 6)})
    config = plan_to_mindformers_stages(plan, num_layers=8, pipeline_stages=2, interleave=2)
    assert config["recompute_config"]["recompute"] == [[2, 1], [1, 1]]
    back = plan_from_config(config, model=None, num_layers=8)
    assert sorted(back.decisions) == sorted(plan.decisions)
    with pytest.raises(ConfigError, match=r"recomputes \[\[2, 1\], \[1, 1\]\] layers per stage: Megatron's "):
        plan_to_megatron_stages(plan, num_layers=8, pipeline_stages=2, interleave=2)
    gap = Plan(decisions={"layers.1": Decision(Action.RECOMPUTE)})
    with pytest.raises(ConfigError, match=r"layers \[1\] of stage 0, chunk 0 \(layers 0\.\.1\): per-stage counts"):
        plan_to_mindformers_stages(gap, num_layers=8, pipeline_stages=2, interleave=2)
    even = Plan(decisions={f"layers.{i}": Decision(Action.RECOMPUTE) for i in (0, 2, 4, 6)})
    assert plan_to_megatron_stages(even, num_layers=8, pipeline_stages=2, interleave=2, tensor_parallel=2) == [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "2", "--recompute-granularity", "full", "--recompute-method",
        "block", "--recompute-num-layers", "1"]


def test_interleaved_rank_budget_split_over_chunks(tmp_path, capsys):
    prof = tmp_path / "rank.json"
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--seq-len", "16", "--tensor-parallel", "2",
                 "--pipeline-stages", "2", "--micro-batches", "4", "-o", str(prof)]) == 0
    plan_path = tmp_path / "plan.yaml"
    budget = int(1.4 * 2**20)  # below keep-all: 1.55 MiB (rank 0), 1.45 MiB (rank 1), pipelining buffers included
    assert main(["search", str(prof), "--budget", f"{budget}B", "--virtual-pipeline-stages", "2",
                 "-o", str(plan_path)]) == 0
    meta = yaml.safe_load(plan_path.read_text())["meta"]
    assert meta["layout"]["schedule"] == "interleaved-1f1b"
    assert [(s["stage"], s.get("chunk", 0), s["in_flight"]) for s in meta["pipeline"]["per_stage"]] == [
        (0, 0, 3), (0, 1, 2), (1, 0, 2), (1, 1, 1)]
    ranks = meta["pipeline"]["per_rank"]
    assert len(ranks) == 2 and all(r["predicted_peak_bytes"] <= budget for r in ranks)
