"""``adaptive-mem demo``: the README's main job, end to end (llama-tiny here; llama-small is the benchmark).

One demo run with the throughput table is shared by every check below (module-scoped fixture); each test
guards one property of what the demo writes and prints.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from adaptive_mem.bench import load_results, render_report
from adaptive_mem.cli._main import main


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(["demo", "--model", "llama-tiny", "--out", str(out), "--throughput", "1-4"])
    assert code == 0
    results = load_results(out / "results.json")
    runs = {r["policy"]: r for r in results["runs"] if not r.get("match")}
    matched = {r["match"]: r for r in results["runs"] if r.get("match")}
    return {"out": out, "text": text.getvalue(), "results": results, "runs": runs, "matched": matched}


def test_every_policy_runs(demo):
    runs = demo["runs"]
    assert set(runs) == {"none", "full", "compile", "ours-milp", "ours-milp+compile"}
    assert all(r["status"] == "ok" for r in runs.values())


def test_ours_also_runs_at_full_recompute_and_compile_memory(demo):
    runs, matched = demo["runs"], demo["matched"]
    # ours at full recompute's measured memory (searched at full's predicted peak), and at compile's
    assert set(matched) == {"full", f"compile@{runs['compile']['budget']:g}"}
    at_full = matched["full"]
    assert at_full["status"] == "ok" and at_full["budget_bytes"] == runs["full"]["predicted_peak_bytes"]
    assert f"ours at full recompute's memory: peak {at_full['peak_bytes'] / 2**20:.1f} vs" in demo["text"]
    assert "ours + compile (aot_eager) at compile's memory:" in demo["text"]


def test_compile_rows_use_the_aot_eager_backend(demo):
    runs = demo["runs"]
    assert runs["compile"]["info"]["backend"] == runs["ours-milp+compile"]["info"]["backend"] == "aot_eager"


def test_budget_forces_a_trade_off(demo):
    # below keeping everything, above full recompute (predicted); our plan is predicted within it
    ours, none, full = demo["runs"]["ours-milp"], demo["runs"]["none"], demo["runs"]["full"]
    assert full["predicted_peak_bytes"] < ours["budget_bytes"] < none["predicted_peak_bytes"]
    assert ours["predicted_peak_bytes"] <= ours["budget_bytes"]


def test_summary_lines_print_the_measured_figures(demo):
    ours, none, full, text = demo["runs"]["ours-milp"], demo["runs"]["none"], demo["runs"]["full"], demo["text"]
    saved = 1 - ours["peak_bytes"] / none["peak_bytes"]
    assert f"memory saved: peak {ours['peak_bytes'] / 2**20:.1f} MiB vs {none['peak_bytes'] / 2**20:.1f} MiB" in text
    assert f"({saved:.1%} less)" in text
    assert f"time vs full recompute: {ours['median_step_time']:.3f} s vs {full['median_step_time']:.3f} s" in text
    assert "predicted vs measured: peak" in text


def test_report_and_figures_are_written(demo):
    out = demo["out"]
    assert (out / "report.md").read_text() == render_report(demo["results"])
    assert (out / "pareto.png").exists() and (out / "profile.json").exists()


def test_throughput_table_fits_the_plain_models_peak(demo):
    section = demo["results"]["throughput"]
    assert section["batch_sizes"] == [1, 2, 3, 4] and section["memory_bytes"] > 0
    rows = {r["name"]: r for r in section["rows"]}
    assert set(rows) == {"none", "full", "compile", "ours-milp"}
    assert all(r["largest_batch"] is not None and r["peak_bytes"] <= section["memory_bytes"] for r in rows.values())
    # Note: [ours measured to fit] the first of the predicted best whose measured peak fits
    first_fit = next(c for c in section["ours_top_predicted"] if c["fits"])
    assert rows["ours-milp"]["largest_batch"] == first_fit["batch_size"]


def test_throughput_ranking_comes_from_paired_rounds(demo):
    section, text = demo["results"]["throughput"], demo["text"]
    assert section["ours_paired"]["status"] == "ok" and section["ours_paired"]["rounds"] == 6
    assert section["ranking_from"] == "paired rounds"
    assert "throughput at" in text and "6 paired rounds" in text and "  by paired rounds: the predicted best" in text


def test_profiles_are_aligned_to_paired_plain_steps(demo):
    # Note: [aligned profiles] the profiled sizes' plain steps, timed in the same rounds, align their profiles
    section = demo["results"]["throughput"]
    alignment = section["profile_alignment"]
    assert alignment["status"] == "ok" and alignment["rounds"] == 6
    assert [s["batch_size"] for s in alignment["sizes"]] == section["profiled_sizes"] == [1, 2, 4]
    assert all(0.5 < s["factor"] < 2.0 for s in alignment["sizes"])
    assert "ours' profiles aligned to plain steps timed in one process, 6 paired rounds" in demo["text"]


def test_report_has_the_throughput_section(demo):
    report = (demo["out"] / "report.md").read_text()
    assert "## Throughput at a fixed memory" in report and "Ours' three predicted best batches" in report
    assert "Ours' profiles aligned to plain steps timed in one process" in report


def test_demo_bad_throughput_one_line(tmp_path, capsys):
    assert main(["demo", "--model", "llama-tiny", "--throughput", "0", "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("adaptive-mem demo: error: --throughput='0': batch size 0 is not positive; expected positive "
                   "integers and ranges such as 1,2,4,8 or 1-16")
    assert not (tmp_path / "demo").exists()
