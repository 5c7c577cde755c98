"""Compile in the bench: ``compile`` runs inductor by default (``--compile-backend``), ``ours-milp+compile`` (planned on
the profile of the model compiled per block, applied, the whole model compiled) and its rows matched to compile's
peaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_mem.bench import compare, get_policy, load_results, render_report
from adaptive_mem.bench._runner import BenchConfig, _fit_matched, _job
from adaptive_mem.cli._main import main


def test_labels_name_the_backend_and_inductor_is_the_default():
    assert "inductor backend" in get_policy("compile").label_for("inductor")
    assert "aot_eager backend" in get_policy("compile").label_for("aot_eager")
    assert "(aot_eager)" in get_policy("ours-milp+compile").label_for("aot_eager")
    config = BenchConfig(spec="llama-tiny", budgets=(1.0,), policies=("compile",), out=Path("unused"))
    assert _job(config, "compile", 1.0, {})["compile_backend"] == "inductor"
    assert get_policy("ours-milp+compile").compiled_profile and not get_policy("compile").compiled_profile


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-compile")
    code = main(["bench", "--model", "llama-tiny", "--budgets", "1.0", "--policies", "compile,ours-milp+compile",
                 "--compile-backend", "aot_eager", "--out", str(out), "--steps", "5"])
    assert code == 0
    return out


def test_ours_with_compile_runs_at_compiles_measured_peak(bench_dir):
    results = load_results(bench_dir / "results.json")
    assert results["settings"]["compile_backend"] == "aot_eager"
    runs = {(r["policy"], r.get("match")): r for r in results["runs"]}
    compile_run = runs[("compile", None)]
    ours = runs[("ours-milp+compile", None)]
    matched = runs[("ours-milp+compile", "compile@1")]
    assert all(r["status"] == "ok" for r in (compile_run, ours, matched)), [r.get("error") for r in runs.values()]
    assert compile_run["info"]["backend"] == ours["info"]["backend"] == matched["info"]["backend"] == "aot_eager"
    assert "aot_eager" in compile_run["label"] and "aot_eager" in matched["label"]
    # Note: [whole-model offset]: searched at compile's measured peak + (the per-block keep-all prediction -
    # compile@1.0's measured peak); the plan runs whole-model and is predicted in those terms
    assert matched["match_peak_bytes"] == compile_run["repeats"][0]["peak_bytes"]
    offset = matched["whole_model_offset_bytes"]
    assert matched["planned_for"] == "whole-model" and offset > 0
    assert matched["info"]["compile"] == ours["info"]["compile"] == "whole-model"
    assert matched["budget_bytes"] <= matched["match_peak_bytes"] + offset
    assert matched["predicted_peak_bytes"] == matched["predicted_peak_bytes_simulated"] - offset
    assert matched["predicted_peak_bytes"] <= matched["match_peak_bytes"]
    # Note: [matched at no more memory]: searched again at a lower budget while over compile's peak
    assert all(r["peak_bytes"] <= matched["match_peak_bytes"] for r in matched["repeats"])
    # the plans are searched on the compiled profile, written next to the eager one
    assert (bench_dir / "profile-compiled.json").exists()
    assert (bench_dir / "plans" / "ours-milp+compile-match-compile-1.yaml").exists()
    # same model, weights and first batch: the losses of the compiled runs agree
    assert matched["repeats"][0]["first_loss"] == pytest.approx(compile_run["repeats"][0]["first_loss"], rel=1e-5)
    rows = compare(results, ours="ours-milp+compile", against="compile")
    assert [r["competitor"] for r in rows] == ["compile"]
    text = (bench_dir / "report.md").read_text()
    assert text == render_report(results) and "## Ours + compile against compile alone" in text


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_bad_compile_backend_is_one_line_and_exit_2(tmp_path, capsys, command):
    assert main([command, "--model", "llama-tiny", "--out", str(tmp_path / "o"), "--compile-backend", "tvm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--compile-backend='tvm': expected one of inductor, aot_eager" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def _fit(peaks: list[int], *, infeasible: bool = False) -> tuple[list, list, list, object]:
    """``_fit_matched`` on one row matched to a 100-byte peak (budget 102), with a fake worker measuring ``peaks``
    in turn and a fake search answering ``limit - 5`` (or finding nothing): rows, measured, limits asked, bar."""
    from search import InfeasibleBudgetError

    config = BenchConfig(spec="llama-tiny", budgets=(1.0,), policies=("ours-milp",), out=Path("unused"))
    runs, asked = iter(peaks), []

    class Ctx:
        def predict(self, solver, name, *, budget, limit, tag):
            if infeasible:
                raise InfeasibleBudgetError("milp: no plan in its space fits")
            asked.append(limit)
            return {"predicted_peak_bytes": limit - 5, "plan": f"plans/{tag}.yaml"}

    class Bar:
        total = 4

        def refresh(self):
            pass

    row = {"policy": "ours-milp", "match": "full", "match_peak_bytes": 100, "budget_bytes": 102}
    rows, measured, bar = [(row, {"policy": "ours-milp"})], [[]], Bar()

    def execute(todo):
        for k in todo:
            measured[k].append({"status": "ok", "peak_bytes": next(runs)})

    _fit_matched(0, rows, measured, execute, config, Ctx(), bar)
    return rows, measured, asked, bar


def test_a_matched_row_over_its_competitors_peak_is_searched_again_lower():
    """Note: [matched at no more memory], with a fake worker: 110 over a 100 target, then 98."""
    rows, measured, asked, bar = _fit([110, 98])
    assert asked == [int(102 * 100 / 110) - 1]
    assert rows[0][0]["budget_bytes"] == asked[0] and rows[0][0]["predicted_peak_bytes"] == asked[0] - 5
    assert measured == [[{"status": "ok", "peak_bytes": 98}]] and bar.total == 5


def test_a_matched_row_no_plan_can_bring_lower_says_so():
    """Note: [matched at no more memory]: below full recompute's prediction milp finds nothing; the row keeps its
    run and says why it is over (the demo prints it)."""
    rows, measured, _, _ = _fit([104], infeasible=True)
    assert rows[0][0]["over_match"] == "no plan of ours fits lower" and rows[0][1] == {"policy": "ours-milp"}
    assert measured == [[{"status": "ok", "peak_bytes": 104}]]


def test_a_matched_row_over_after_every_try_keeps_its_closest_run():
    """Note: [matched at no more memory]: three runs all over the peak (104, 103, 110 B over 100): the second, the
    closest, is kept with its own plan and results."""
    rows, measured, _, _ = _fit([104, 103, 110])
    assert measured == [[{"status": "ok", "peak_bytes": 103}]]
    assert rows[0][1]["plan"] == "plans/ours-milp-match-0-fit1.yaml"
