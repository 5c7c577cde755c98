"""The target-hardware report: fake-tensor profiles, per-stage plans, throughput in the seeds' table form."""

from __future__ import annotations

import pytest

from adaptive_mem.bench import SimConfig, render_report, simulate_targets
from adaptive_mem.bench._plots import build_figures
from adaptive_mem.bench._simulated import model_flops

CONFIGS = (SimConfig("llama-tiny", micro_batch=2, stages=1, micro_batches=1, dp=1),
           SimConfig("llama-tiny", micro_batch=2, stages=2, micro_batches=4, dp=2))


@pytest.fixture(scope="module")
def tight():
    # A device barely above what full recompute needs: keeping everything does not fit.
    loose = simulate_targets(hardware="h100", configs=CONFIGS[:1], pareto_model=None)
    full = next(r for r in loose["rows"] if r["policy"] == "full recompute")
    capacity = int(full["peak_bytes"] * 1.05)
    return simulate_targets(hardware="h100", configs=CONFIGS, pareto_model="llama-tiny", capacity=capacity)


def test_rows_in_the_seeds_table_form(tight):
    rows = tight["rows"]
    assert {(r["policy"], r["devices"]) for r in rows} == {
        (p, d) for p in ("adaptive-mem (milp)", "Megatron selective", "full recompute") for d in (1, 4)}
    for r in rows:
        assert "seq-length=32, micro-batch-size=2" in r["configuration"] and "PP=" in r["configuration"]
    single = {r["policy"]: r for r in rows if r["devices"] == 1}
    ours, full = single["adaptive-mem (milp)"], single["full recompute"]
    assert ours["peak_bytes"] <= tight["device_memory"] and full["peak_bytes"] <= tight["device_memory"]
    # milp's space contains full recompute: never slower, and the gain is the TFLOPs ratio
    assert ours["step_time"] <= full["step_time"] * (1 + 1e-9)
    assert ours["gain"] == pytest.approx(ours["tflops"] / full["tflops"] - 1)
    assert full["gain"] is None


def test_pipeline_step_is_1f1b_of_the_slowest_stage(tight):
    pipe = next(r for r in tight["rows"] if r["devices"] == 4 and r["policy"] == "full recompute")
    # TFLOPs per device = M x model FLOPs / step / P
    from adaptive_mem import build_model
    import profiler
    from dataclasses import replace

    bundle = build_model("llama-tiny", device="meta", dtype="bfloat16", batch_size=2)
    prof = profiler.profile_step(bundle, hardware="h100", optimizer="adam")
    prof = replace(prof, model={**prof.model, "hidden_size": bundle.model.config.hidden_size})
    assert pipe["tflops"] == pytest.approx(4 * model_flops(prof) / pipe["step_time"] / 2 / 1e12)


def test_simulated_section_in_report_and_pareto_figure(tight):
    results = {"format": "adaptive-mem-bench", "version": 1, "runs": [], "model": {}, "machine": {},
               "settings": {}, "simulated": tight, "figures": {"simulated_pareto": "simulated_pareto.png"}}
    text = render_report(results)
    assert "## Simulated on h100 (fake-tensor profiles)" in text
    assert "| model | policy | configuration | devices | TFLOPs per device | gain over full recompute |" in text
    ours = next(r for r in tight["rows"] if r["policy"] == "adaptive-mem (milp)" and r["devices"] == 1)
    assert f"| {ours['tflops']:.1f} | {ours['gain']:.2%} |" in text
    fig = build_figures(results)["simulated_pareto"]
    ax = fig.axes[0]
    assert ax.get_title() and ax.get_xlabel() == "predicted peak device memory (GiB)"
    assert ax.get_legend() is not None and "milp" in [t.get_text() for t in ax.get_legend().get_texts()]
