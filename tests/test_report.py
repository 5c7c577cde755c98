"""The bench report and figures are drawn from results.json only; the comparison logic is checked by hand."""

from __future__ import annotations

import copy
import json

import pytest

from adaptive_mem.bench import ResultsError, compare, compile_landing, load_results, render_report, save_results
from adaptive_mem.bench._plots import build_figures, write_figures
from adaptive_mem.bench._report import TIME_TOLERANCE

MiB = 2**20


def _run(policy, budget, peak_mib, step, *, eager=True, ours=False, **extra):
    return {"policy": policy, "label": f"{policy} label", "budget": budget, "budget_bytes": None,
            "eager": eager, "ours": ours, "status": "ok", "peak_bytes": int(peak_mib * MiB),
            "median_step_time": step, "tokens_per_s": 1000 / step, **extra}


def results(runs):
    return {"format": "adaptive-mem-bench", "version": 1, "created": "2026-01-01T00:00:00+00:00",
            "command": "adaptive-mem bench --model llama-tiny", "figures": {},
            "machine": {"platform": "linux", "cpus": 2, "torch": "2.x", "threads_per_run": 1,
                        "load_average_at_start": [1.0, 1.0, 1.0]},
            "model": {"spec": "llama-tiny", "model_args": None, "batch_size": 2, "seq_len": 32, "dtype": "float32",
                      "num_layers": 2, "tokens_per_step": 64, "static_bytes": 10 * MiB, "base_bytes": 100 * MiB,
                      "predicted_unoptimized_peak_bytes": 300 * MiB},
            "settings": {"budgets": [0.3, 0.5], "policies": [], "steps": 5, "warmup": 1, "repeats": 1, "seed": 0},
            "runs": runs}


LAYERS = [{"layer": 0, "keep": MiB, "recompute": 2 * MiB, "swap": 0},
          {"layer": 1, "keep": 0, "recompute": MiB, "swap": MiB}]
TL = [[0.0, 100 * MiB], [0.5, 250 * MiB], [1.0, 110 * MiB]]


@pytest.fixture
def sample():
    return results([
        _run("none", None, 300, 1.00, predicted_peak_bytes=290 * MiB, predicted_step_time=0.9),
        _run("full", None, 150, 1.40),
        _run("megatron-selective", None, 280, 1.10),
        _run("op-sac", None, 120, 1.30),
        _run("sac-ilp", 0.5, 200, 1.20),
        _run("compile", 0.3, 160, 1.05, eager=False),
        _run("compile", 0.5, 220, 1.02, eager=False),
        _run("ours-milp", 0.3, 140, 1.25, eager=False, ours=True, plan_layers=LAYERS, timeline_measured=TL,
             timeline_predicted=TL, predicted_peak_bytes=138 * MiB, predicted_step_time=1.2),
        _run("ours-milp", 0.5, 200, 1.23, eager=False, ours=True, plan_layers=LAYERS, timeline_measured=TL,
             timeline_predicted=TL),
        {"policy": "hf-gc", "label": "hf", "budget": None, "budget_bytes": None, "eager": True, "ours": False,
         "status": "skipped", "error": "Hugging Face models only (hf:<family>)"},
    ])


def test_compare_picks_our_fastest_run_at_equal_or_lower_memory(sample):
    rows = {(r["competitor"], r["budget"]): r for r in compare(sample)}
    assert set(rows) == {("full", None), ("megatron-selective", None), ("op-sac", None), ("sac-ilp", 0.5)}
    # full: 150 MiB; only ours@0.3 (140 MiB) fits; 1.25 <= 1.40.
    assert rows[("full", None)]["ours_budget"] == 0.3 and rows[("full", None)]["verdict"] == "pass"
    # megatron-selective: 280 MiB; both of ours fit, the faster (1.23 @0.5) is compared; 1.23 > 1.10 * 1.02.
    sel = rows[("megatron-selective", None)]
    assert sel["ours_budget"] == 0.5 and sel["ratio"] == pytest.approx(1.23 / 1.10) and sel["verdict"] == "fail"
    # op-sac uses less memory than any run of ours.
    assert rows[("op-sac", None)]["verdict"] == "no-match"
    # sac-ilp: equal memory (200 MiB) counts as comparable; 1.23 / 1.20 = 1.025 > 1.02.
    assert rows[("sac-ilp", 0.5)]["ours_peak_bytes"] == 200 * MiB
    assert rows[("sac-ilp", 0.5)]["verdict"] == "fail"


def test_compare_tolerance_boundary(sample):
    data = copy.deepcopy(sample)
    for r in data["runs"]:
        if r["policy"] == "sac-ilp":
            r["median_step_time"] = 1.23 / (1 + TIME_TOLERANCE) + 1e-9
    verdict = next(r for r in compare(data) if r["competitor"] == "sac-ilp")["verdict"]
    assert verdict == "pass"


def test_compile_landing_measures_the_share_of_activation_memory(sample):
    rows = compile_landing(sample)
    # (peak - base) / (none peak - base) with base 100 MiB and none 300 MiB.
    assert [round(r["measured_fraction"], 6) for r in rows] == [0.3, 0.6]


def test_report_figures_come_from_the_results(sample):
    text = render_report(sample)
    assert "| ours-milp | 0.3 | ok | 140.0 | -53.3% | 1.2500 | -10.7% | 800 | 138.0 | 1.2000 | -1.4% |" in text
    assert "| hf-gc | - | skipped |" in text and "Hugging Face models only" in text
    assert "**1 pass, 2 fail, 1 without a run of ours at equal or lower memory.**" in text
    assert "| 0.3 | 160.0 | 0.30 | 1.0500 |" in text  # where compile's budget lands
    changed = copy.deepcopy(sample)
    changed["runs"][7]["median_step_time"] = 2.5
    assert render_report(changed) != text and "| 2.5000 |" in render_report(changed)


def test_report_round_trips_through_results_json(sample, tmp_path):
    save_results(sample, tmp_path / "results.json")
    assert render_report(load_results(tmp_path / "results.json")) == render_report(sample)


def test_load_results_rejects_bad_files(tmp_path, sample):
    path = tmp_path / "r.json"
    path.write_text("{")
    with pytest.raises(ResultsError, match="not valid JSON"):
        load_results(path)
    bad = copy.deepcopy(sample)
    bad["runs"][0]["status"] = "great"
    path.write_text(json.dumps(bad))
    with pytest.raises(ResultsError, match=r"runs\[0\].status"):
        load_results(path)
    bad = copy.deepcopy(sample)
    bad["runs"][0]["peak_bytes"] = "big"
    path.write_text(json.dumps(bad))
    with pytest.raises(ResultsError, match=r"runs\[0\].peak_bytes='big'"):
        load_results(path)
    path.write_text(json.dumps({**sample, "format": "other"}))
    with pytest.raises(ResultsError, match="format='other'"):
        load_results(path)


def _legend_labels(ax):
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


def test_figures_have_titles_axis_labels_and_legends(sample, tmp_path):
    import matplotlib.image

    figures = build_figures(sample)
    assert set(figures) == {"pareto", "plan_layers", "timeline"}
    pareto = figures["pareto"].axes[0]
    assert "peak memory" in pareto.get_title()
    assert pareto.get_xlabel() == "measured peak device memory (MiB)" and pareto.get_ylabel() == "median step time (s)"
    assert set(_legend_labels(pareto)) == {"none", "full", "megatron-selective", "op-sac", "sac-ilp", "compile",
                                           "ours-milp"}
    # The ours-milp line goes through the measured points of results.json.
    line = next(ln for ln in pareto.get_lines() if ln.get_label() == "ours-milp")
    assert list(line.get_xdata()) == [140.0, 200.0] and list(line.get_ydata()) == [1.25, 1.23]
    for ax in figures["plan_layers"].axes:
        assert ax.get_title() and ax.get_xlabel() == "layer" and ax.get_ylabel() == "saved bytes (MiB)"
        assert _legend_labels(ax) == ["keep", "recompute", "swap"]
    timeline = figures["timeline"].axes[0]
    assert timeline.get_title() and timeline.get_xlabel() and timeline.get_ylabel() == "device memory (MiB)"
    assert "ours-milp@0.3 measured" in _legend_labels(timeline)
    assert "ours-milp@0.3 predicted" in _legend_labels(timeline)

    written = write_figures(sample, tmp_path)
    assert written == {"pareto": "pareto.png", "plan_layers": "plan_layers.png", "timeline": "timeline.png"}
    for name in written.values():
        image = matplotlib.image.imread(tmp_path / name)
        assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
        assert image[..., :3].std() > 0.05  # not a blank canvas


def test_report_shows_the_throughput_section(sample):
    section = {"memory_bytes": 600 * 2**20, "memory_from": "measured peak of no plan at batch 2", "batch_sizes": [1, 2, 4],
               "seq_len": 512, "rows": [
                   {"policy": "no plan", "largest_batch": 2, "tokens_per_s": 400.0, "peak_bytes": 600 * 2**20},
                   {"policy": "full recompute", "largest_batch": 4, "tokens_per_s": 350.5, "peak_bytes": 590 * 2**20},
                   {"policy": "torch.compile memory budget", "largest_batch": None, "tokens_per_s": None,
                    "peak_bytes": None},
                   {"policy": "ours (batch and plan together)", "largest_batch": 4, "tokens_per_s": 455.25,
                    "peak_bytes": 598 * 2**20, "predicted_tokens_per_s": 460.0}],
               "ours_predicted": [{"batch_size": 4, "source": "scaled from 2", "fits": True, "step_time": 4.5,
                                   "tokens_per_s": 455.1, "peak_bytes": 598 * 2**20, "note": ""}]}
    text = render_report({**sample, "throughput": section})
    assert "## Throughput at a fixed memory" in text and "## Throughput" not in render_report(sample)
    assert "| ours (batch and plan together) | 4 | 455.2 | 598.0 | 460.0 |" in text
    assert "| torch.compile memory budget | - | does not fit | - | - |" in text
    assert "| 4 | scaled from 2 | yes |" in text
