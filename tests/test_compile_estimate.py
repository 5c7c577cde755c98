"""``profiler.compiled_estimate``: inductor per block modelled on a profile (Note: [compile model]), checked against
the inductor-compiled CPU profile and on fake tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import profiler
from adaptive_mem import build_model
from profiler import CompileBackendError, Profile
from profiler._fusion import _Block, _fusion_factors, _kind


@pytest.fixture(scope="module")
def fake() -> tuple[Profile, Profile]:
    bundle = build_model("llama-tiny", device="meta")
    eager = profiler.profile_step(bundle, hardware="h100", optimizer="adam")
    return eager, profiler.compiled_estimate(eager)


def _block_saved(profile: Profile, layer: int) -> int:
    return sum(u.saved_bytes for u in profile.layer_units(layer))


def test_saved_bytes_match_the_inductor_compiled_cpu_profile(fake):
    """The model, on the eager CPU profile and on the fake one, against what the compiled blocks really save (pack
    hook around each inductor-compiled block)."""
    torch.set_num_threads(1)
    bundle = build_model("llama-tiny")
    eager = profiler.profile_step(bundle, optimizer="adam", repeat=1, record=1)
    real = profiler.profile_compiled(bundle, eager, backend="inductor", repeat=1)
    modelled = profiler.compiled_estimate(eager)
    for layer in range(eager.num_layers):
        for model in (modelled, fake[1]):
            assert _block_saved(model, layer) == pytest.approx(_block_saved(real, layer), rel=0.10)
        assert _block_saved(modelled, layer) < _block_saved(eager, layer)
        # per unit, the modelled partitioner saves the values the real graph saves (Note: [graph unit names]), up to
        # which of two same-sized values a min-cut tie picks (the residual add's output or wo's input)
        graph = real.compiled["layers"][layer]["units"]
        for table in (modelled.compiled["layers"][layer]["units"], fake[1].compiled["layers"][layer]["units"]):
            assert sorted(table.values()) == sorted(graph.values())
            assert len(set(table.items()) - set(graph.items())) <= 1
    assert modelled.saved_bytes == pytest.approx(real.saved_bytes, rel=0.10)


def test_pointwise_outputs_are_recomputed_and_matmul_outputs_saved(fake):
    eager, compiled = fake
    units = {u.local_name: u for u in compiled.layer_units(1)}
    before = {u.local_name: u for u in eager.layer_units(1)}
    assert before["feed_forward.w1.activation.silu"].saved_bytes > 0
    assert units["feed_forward.w1.activation.silu"].saved_bytes == 0  # rebuilt from w1's output in backward
    for name in ("feed_forward.w1.matmul", "feed_forward.w3.matmul", "feed_forward.mul", "attention.flash_attention",
                 "attention.wv.matmul"):  # compute intensive, or read by a matmul's backward
        assert units[name].saved_bytes == before[name].saved_bytes, name
    norm = units["ffn_norm.norm"]  # keeps its 1/rms and its output (a matmul input); the normalised input goes
    assert 0 < norm.saved_bytes < before["ffn_norm.norm"].saved_bytes
    assert [u for u in compiled.units if u.layer is None] == [u for u in eager.units if u.layer is None]


def test_fused_chains_cost_less_and_matmuls_the_same(fake):
    eager, compiled = fake
    for old, new in zip(eager.ops, compiled.ops):
        if old.op == "aten.mm.default" or old.layer is None:
            assert (new.fwd_time, new.bwd_time) == (old.fwd_time, old.bwd_time)
        assert new.fwd_time <= old.fwd_time and new.bwd_time <= old.bwd_time
    norm = [(o, n) for o, n in zip(eager.ops, compiled.ops) if n.unit == "layers.0.ffn_norm.norm"]
    assert sum(n.fwd_time for _, n in norm) < 0.8 * sum(o.fwd_time for o, _ in norm)
    assert compiled.step_time < eager.step_time
    assert compiled.peak_memory == eager.peak_memory + compiled.saved_bytes - eager.saved_bytes


def test_the_compiled_figures_are_marked_modelled_and_round_trip(fake, tmp_path):
    eager, compiled = fake
    figures = compiled.compiled
    assert figures["modelled"] is True and figures["layout"] == "per-block" and figures["backend"] == "inductor"
    assert figures["eager_step_time"] == eager.step_time and len(figures["layers"]) == eager.num_layers
    row = figures["layers"][2]
    assert row["keep"]["saved_bytes"] < row["eager"]["saved_bytes"] and row["full"]["saved_bytes"] > 0
    compiled.save(tmp_path / "c.json")
    assert Profile.load(tmp_path / "c.json") == compiled


def test_random_and_compute_intensive_ops_are_never_recomputed():
    assert _kind("aten.native_dropout.default") == "random"
    assert _kind("aten.mm.default") == _kind("aten._scaled_dot_product_flash_attention.default") == "fixed"
    assert _kind("aten.cat.default") == _kind("aten.embedding.default") == "fixed"
    assert _kind("aten.silu.default") == _kind("aten.mul.Tensor") == _kind("aten._to_copy.default") == "recomputable"


def test_bad_input_is_refused_naming_the_key(fake):
    eager, compiled = fake
    with pytest.raises(CompileBackendError, match=r"^backend='aot_eager': .*expected 'inductor'$"):
        profiler.compiled_estimate(eager, backend="aot_eager")
    with pytest.raises(CompileBackendError, match=r"^profile.compiled.backend='inductor': already a compiled"):
        profiler.compiled_estimate(compiled)


def test_a_fused_chain_keeps_one_kernel_latency_per_direction():
    """Note: [compile model] (b): each fused chain is one kernel forward and one backward; of its ops' per-kernel
    latencies (Note: [op pricing]) it keeps one per direction, its roofline seconds scaled as without latency."""
    bundle = build_model("llama-tiny", device="meta")
    spec = profiler.hardware_spec("h100")
    latency = spec.kernel_latency
    assert latency > 0
    eager = {lat: profiler.profile_step(bundle, hardware=dataclasses.replace(spec, kernel_latency=lat))
             for lat in (0.0, latency)}
    compiled = {lat: profiler.compiled_estimate(p) for lat, p in eager.items()}
    fused = 0
    for layer in range(eager[latency].num_layers):
        fused += sum(len(chain) - 1 for chain, _ in _fusion_factors(_Block(eager[latency], layer), {}))

    def forward(p: Profile) -> float:
        return sum(o.fwd_time for o in p.ops)
    # every op's forward is one kernel in eager: the latency profile's surplus is one latency per op, less one per
    # op fused into another's kernel once compiled
    surplus = forward(compiled[latency]) - forward(compiled[0.0])
    assert forward(eager[latency]) - forward(eager[0.0]) == pytest.approx(latency * len(eager[latency].ops))
    assert surplus == pytest.approx(latency * (len(eager[latency].ops) - fused))
    assert fused > 0
