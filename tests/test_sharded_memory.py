"""Sharded runs as the runtime runs them, counted by hand from the Llama 3 configs: static memory per rank after
the pipeline split, FSDP2's gathered layers and reduce-scatter buffers, DDP's gradient buckets, one rank's saved
activations under tensor and sequence parallelism, and the link each collective group is timed on."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

import adaptive_mem as am
import profiler
from adaptive_mem.cli._main import main
from profiler import Layout
from profiler.tracing import ddp_bucket_bytes, group_bandwidth, parameter_split
from search import Plan
from search.planning import busiest_stage, data_parallel_comm, split_layout, stage_statics


def _layer(h: int, kv: int, f: int) -> int:
    """Elements of one Llama layer: wq, wk, wv, wo, w1 w2 w3, two RMSNorm weights."""
    return h * h + 2 * h * kv + h * h + 3 * h * f + 2 * h


# llama3-405b (Meta's params.json): dim 16384, 126 layers, 8 kv heads of 128, ffn 53248, vocab 128256, untied head
H405, L405, V = 16384, 126, 128256
LAYER405 = _layer(H405, 8 * 128, 53248)
EMBED405 = V * H405
N405 = L405 * LAYER405 + EMBED405 + H405 + EMBED405  # embedding, layers, final norm, output
# llama3-8b: dim 4096, 32 layers, 8 kv heads of 128, ffn 14336, 32 heads
H8, KV8, F8, HEADS8 = 4096, 1024, 14336, 32
LAYER8 = _layer(H8, KV8, F8)
N8 = 32 * LAYER8 + 2 * V * H8 + H8


def _rank(spec: str, precision: str, layout: Layout, *, seq_len: int = 16, model_args: str | None = None):
    """The whole fake profile and one rank's share of it under ``layout``, as ``adaptive-mem profile`` cuts it."""
    recipe = profiler.PRECISIONS[precision]
    bundle = am.build_model(spec, device="meta", dtype=recipe.model_dtype, batch_size=1, seq_len=seq_len,
                            model_args=model_args)
    whole = profiler.profile_step(bundle, hardware="h100", precision=precision)
    split = parameter_split(bundle.model, whole.layer_info(), tensor_parallel=layout.tensor_parallel)
    return whole, profiler.shard_profile(whole, layout=layout, split=split, interconnect=450e9)


@pytest.fixture(scope="module")
def llama405():
    return _rank("llama3-405b", "bf16", Layout(tensor_parallel=8, pipeline_stages=16, data_parallel=8,
                                               micro_batches=16))


def test_the_configs_have_the_published_parameter_counts():
    assert N405 == 405_853_388_800 and N8 == 8_030_261_248


def test_405b_static_per_rank_of_each_pipeline_stage(llama405):
    """126 layers over 16 stages: stages 0-13 take 8, 14-15 take 7; the embedding on stage 0, the final norm and
    the head on stage 15; TP8 splits every linear and embedding, not the norms; bf16 with Adam is 2 + 2 + 2 x 2
    bytes per element, and DDP's buckets one more gradient copy (2 bytes) beside them."""
    whole, rank = llama405
    assert whole.model["parameters"] == N405
    norms = L405 * 2 * H405 + H405
    per_rank = (N405 - norms) // 8 + norms  # elements one TP rank holds before the pipeline split
    stages = stage_statics(rank, Layout.from_dict(rank.model["layout"]))
    share = {0: (8 * LAYER405 + EMBED405) / N405, 7: 8 * LAYER405 / N405, 15: (7 * LAYER405 + H405 + EMBED405) / N405}
    for s, fraction in share.items():
        st = stages[s].static
        assert st.parameters == pytest.approx(2 * per_rank * fraction, abs=1)
        assert st.gradients == pytest.approx(2 * per_rank * fraction, abs=1)
        assert st.optimizer_state == pytest.approx(4 * per_rank * fraction, abs=1)
        assert st.other == st.gradients  # Note: [DDP gradient buckets]
    assert [len(r) for st in stages for r in st.layers] == [8] * 14 + [7] * 2
    busiest = busiest_stage(rank, Layout.from_dict(rank.model["layout"]))
    assert busiest.index == 0
    assert busiest.static.total == pytest.approx(10 * per_rank * share[0], abs=8)  # about 32.1 GiB, not 378
    assert busiest.describe(16) == "pipeline stage 0 of 16 (layers 0-7 and the embedding)"
    assert stages[15].describe(16) == "pipeline stage 15 of 16 (layers 119-125 and the head)"


def test_search_stage_models_hold_the_same_static_memory(llama405):
    """Note: [stage static] the search's stage models and the profile summary use one split."""
    _, rank = llama405
    layout = Layout.from_dict(rank.model["layout"])
    statics = stage_statics(rank, layout)
    for stage in split_layout(rank, layout=layout)[::5]:
        st = statics[stage.index].static
        assert stage.model.profile.static == st
        inputs = rank.saved_input_bytes if stage.index == 0 else 0  # the model inputs, on the first stage
        assert stage.model.static_bytes == st.total + inputs + stage.runtime  # what the device check compares


def test_megatron_distributed_optimizer_per_stage():
    """megatron-bf16 over DP8 is ZeRO-1: bf16 parameters and fp32 main grads whole, fp32 master weights and
    Adam moments over 8 ranks (6 + 12 / 8 bytes per element); no DDP buckets (the main grads are the buffer)."""
    whole, rank = _rank("llama3-405b", "megatron-bf16", Layout(tensor_parallel=8, pipeline_stages=16,
                                                              data_parallel=8, micro_batches=16))
    layout = Layout.from_dict(rank.model["layout"])
    assert layout.zero == 1
    norms = L405 * 2 * H405 + H405
    per_rank = (N405 - norms) // 8 + norms
    st = busiest_stage(rank, layout).static
    fraction = (8 * LAYER405 + EMBED405) / N405
    assert (st.parameters, st.gradients) == (pytest.approx(2 * per_rank * fraction, abs=1),
                                             pytest.approx(4 * per_rank * fraction, abs=1))
    assert st.master == pytest.approx(4 * per_rank * fraction / 8, abs=1)
    assert st.optimizer_state == pytest.approx(8 * per_rank * fraction / 8, abs=1)
    assert st.other == 0


def test_profile_and_simulate_speak_of_the_busiest_stage(tmp_path, capsys, caplog):
    path, plan = tmp_path / "p.json", tmp_path / "plan.yaml"
    args = ["profile", "--model", "llama3-405b", "--device", "meta", "--hardware", "h100", "--precision", "bf16",
            "--pipeline-stages", "16", "--micro-batches", "16", "--seq-len", "16", "--batch-size", "1", "-o", str(path)]
    with caplog.at_level(logging.WARNING):
        assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("one rank of pipeline stage 0 of 16"))
    assert line.startswith("one rank of pipeline stage 0 of 16 (layers 0-7 and the embedding), the busiest: static "
                           "205.66 GiB: parameters 51.41 GiB, gradients 51.41 GiB, optimizer state 102.83 GiB; "
                           "keep-all peak ")
    assert line.endswith(" with 16 micro-batches in flight")  # 1F1B: min(P - 0, M) on stage 0
    # 8 bytes per element of 8 layers and the embedding, whole (no TP): 205.66 GiB, not the 3023.84 GiB of all
    expected = ("one rank of pipeline stage 0 of 16 (layers 0-7 and the embedding), the busiest: parameters, "
                "gradients and optimizer state (205.66 GiB) exceed the h100's 80.00 GiB of device memory by "
                "125.66 GiB: shard them (ZeRO/FSDP, tensor or pipeline parallel) or use a device with more memory")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [expected]
    caplog.clear()
    Plan().save(plan)
    with caplog.at_level(logging.WARNING):
        assert main(["simulate", str(path), str(plan)]) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING][-1] == expected


def test_fsdp2_llama3_8b_on_eight_ranks_holds_the_head_a_layer_and_the_head_reduce_scatter():
    """Note: [gathered copy] fsdp2-bf16 over 8 ranks: fp32 shards (16 / 8 bytes per element); unsharded in bf16 at
    the start of backward: the output head (128256 x 4096, an FSDP2 unit of its own, larger than a layer) for
    its backward and the last layer, prefetched; the head's fp32 reduce-scatter input and its 1 / 8 output
    shard."""
    whole, rank = _rank("llama3-8b", "fsdp2-bf16", Layout(data_parallel=8))
    st = rank.static
    assert rank.model["layout"]["zero"] == 3
    assert (st.parameters, st.gradients, st.optimizer_state, st.master, st.other) == \
        (4 * N8 // 8, 4 * N8 // 8, 8 * N8 // 8, 0, 0)
    head = V * H8  # the output projection, 525,336,576 elements
    gathered = 2 * head + 2 * LAYER8  # 1,050,673,152 + 436,224,000
    reduce_scatter = 4 * head + 4 * head // 8  # 2,101,346,304 + 262,668,288
    assert st.buffers - whole.static.buffers == gathered + reduce_scatter == 3_850_911_744


@pytest.mark.parametrize("precision, nbytes", [("bf16", 2), ("amp-bf16", 4)])
def test_ddp_buckets_are_one_more_gradient_copy(precision, nbytes):
    _, rank = _rank("llama3-8b", precision, Layout(data_parallel=8), model_args="num_layers=2")
    n = 2 * LAYER8 + 2 * V * H8 + H8
    assert rank.static.gradients == rank.static.other == nbytes * n
    _, zero1 = _rank("llama3-8b", precision, Layout(data_parallel=8, zero=1), model_args="num_layers=2")
    assert zero1.static.other == 0


def test_ddp_buckets_follow_the_runtime_rule():
    """Note: [DDP gradient buckets] the runtime's floor for a DDP-wrapped model is the same bytes."""
    from adaptive_mem.adaptive._wrappers import _ddp_buckets

    bundle = am.build_model("llama-tiny", device="meta")
    grads = sum(p.numel() * p.element_size() for p in bundle.model.parameters())
    ddp = SimpleNamespace(module=bundle.model, gradient_as_bucket_view=False, parameters_to_ignore=())
    assert _ddp_buckets(ddp) == ddp_bucket_bytes(grads, Layout(data_parallel=2)) == grads
    assert ddp_bucket_bytes(grads, Layout()) == 0


def _layer_saved(profile) -> int:
    return sum(u.saved_bytes for u in profile.units if u.layer == 0)


def test_one_layer_saved_bytes_under_tp2_with_and_without_sp():
    """A llama3-8b layer at s tokens, bf16 (b = 1): each RMSNorm saves its fp32 input and normalized output and
    the bf16 result (10 s h bytes) and its fp32 rsqrt (4 s); RoPE the rotated q and k (2 s (h + kv)); wv its
    output v (2 s kv); flash attention its output and fp32 logsumexp (2 s h + 4 s heads); the SwiGLU w1 and w3
    outputs, the silu output and the product (4 x 2 s f). Under TP2 the norms stay whole and the rest is halved;
    with SP every activation is halved (Korthikanti et al. 2022, section 4.2.2)."""
    s = 64
    norms = 2 * (10 * s * H8 + 4 * s)
    split = 2 * s * (H8 + KV8) + 2 * s * KV8 + 2 * s * H8 + 4 * s * HEADS8 + 4 * 2 * s * F8
    whole, tp = _rank("llama3-8b", "bf16", Layout(tensor_parallel=2), seq_len=s, model_args="num_layers=2")
    _, sp = _rank("llama3-8b", "bf16", Layout(tensor_parallel=2, sequence_parallel=True), seq_len=s,
                  model_args="num_layers=2")
    assert _layer_saved(whole) == norms + split
    assert _layer_saved(tp) == norms + split // 2
    assert _layer_saved(sp) == (norms + split) // 2


def test_row_parallel_matmul_writes_a_whole_partial_sum():
    """Note: [row-parallel output] wo's output is the whole s x h on each rank; its time is halved."""
    whole, tp = _rank("llama3-8b", "bf16", Layout(tensor_parallel=2), seq_len=64, model_args="num_layers=2")
    wo_whole, wo = whole.unit("layers.0.attention.wo.matmul"), tp.unit("layers.0.attention.wo.matmul")
    assert wo.output_bytes == wo_whole.output_bytes == 2 * 64 * H8
    assert wo.fwd_time == pytest.approx(wo_whole.fwd_time / 2)


def test_group_bandwidth_inside_and_across_nodes():
    """Note: [group links] a group within a node's GPUs gets the interconnect, a wider one the inter-node link."""
    sheet = SimpleNamespace(interconnect_bandwidth=450e9, internode_bandwidth=50e9, gpus_per_node=8)
    assert group_bandwidth(sheet, 8) == 450e9
    assert group_bandwidth(sheet, 16) == 50e9
    bare = SimpleNamespace(interconnect_bandwidth=300e9)  # a sheet without the inter-node figures
    assert group_bandwidth(bare, 64) == group_bandwidth(bare, 2) == 300e9
    h100 = profiler.HARDWARE["h100"]  # a datasheet: the bus bandwidth collectives reach on each link
    assert group_bandwidth(h100, 8) == pytest.approx(h100.interconnect_bandwidth * h100.collective_efficiency)
    assert group_bandwidth(h100, 64) == pytest.approx(h100.internode_bandwidth * h100.collective_efficiency)


def test_data_parallel_link_is_recorded_for_the_search():
    bundle = am.build_model("llama-tiny", device="meta")
    whole = profiler.profile_step(bundle, hardware="h100")
    split = parameter_split(bundle.model, whole.layer_info(), tensor_parallel=1)
    rank = profiler.shard_profile(whole, layout=Layout(data_parallel=4), split=split, interconnect=450e9,
                                  data_parallel_bandwidth=50e9)
    assert (rank.model["interconnect_bandwidth"], rank.model["data_parallel_bandwidth"]) == (450e9, 50e9)
    assert profiler.Profile.from_dict(rank.to_dict()).model["data_parallel_bandwidth"] == 50e9


def test_search_times_data_parallel_collectives_on_the_recorded_link():
    """Note: [group links] the DP gradient all-reduce of a rank takes 450 / 50 = 9 times longer on the slower link."""
    bundle = am.build_model("llama-tiny", device="meta")
    whole = profiler.profile_step(bundle, hardware="h100")
    split = parameter_split(bundle.model, whole.layer_info(), tensor_parallel=1)
    comm = {}
    for link in (None, 50e9):
        rank = profiler.shard_profile(whole, layout=Layout(data_parallel=4), split=split, interconnect=450e9,
                                      data_parallel_bandwidth=link)
        comm[link] = am.search(rank, budget="100%").ranks[0]["comm_time"]
    assert comm[50e9] == pytest.approx(9 * comm[None])


def test_fsdp2_gathers_bf16_copies_of_its_fp32_shards():
    """fsdp2-bf16's all-gathers move the bf16 parameters the forward reads: half the fp32 shards' bytes; its
    reduce-scatter moves the fp32 gradients."""
    kw = dict(gradient_bytes=1000, parameter_bytes=1000, layers=4, forward_time=1.0, backward_time=2.0,
              bandwidth=1000.0)
    layout = Layout(data_parallel=4, zero=3)
    plain, fsdp2 = data_parallel_comm(layout, **kw), data_parallel_comm(layout, precision="fsdp2-bf16", **kw)
    assert plain.total == 0.75 + 2 * 0.75  # reduce-scatter, then forward and backward all-gathers of 3/4 x 1000
    assert fsdp2.total == 0.75 + 2 * 0.375
    assert data_parallel_comm(layout, precision="bf16", **kw) == plain
