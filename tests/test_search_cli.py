"""``adaptive-mem search`` / ``simulate`` / ``pareto`` end to end, and their one-line errors."""

from __future__ import annotations

import json
import random

import pytest
import yaml

from adaptive_mem.cli._main import main
from search import Plan, StepModel
from search.planning import resolve
from _profiles import random_profile


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("prof") / "synthetic.json"
    random_profile(random.Random(5), num_layers=4, units_per_layer=6, bandwidth=2e9).save(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A fake-tensor profile of llama-tiny (real unit names, for the config round trip)."""
    path = tmp_path_factory.mktemp("prof") / "tiny.json"
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--hardware", "h100", "-o", str(path)]) == 0
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_search_then_simulate_agree(synthetic, tmp_path, capsys):
    plan_path = tmp_path / "plan.yaml"
    code, out, _ = run(capsys, "search", synthetic, "--activation-budget", "0.5", "-o", plan_path)
    assert code == 0 and "gap" in out and plan_path.exists()
    plan = Plan.load(plan_path)
    code, out, _ = run(capsys, "simulate", synthetic, plan_path)
    assert code == 0
    peak = int(out.split("(")[1].split(" bytes")[0])
    assert peak == plan.meta["predicted_peak_bytes"] <= plan.meta["budget"]
    step = float(out.split("step time")[1].split()[0])
    assert step == pytest.approx(plan.meta["predicted_step_time"], abs=2e-6)


def test_simulate_draws_a_timeline(synthetic, tmp_path, capsys):
    plan_path = tmp_path / "plan.yaml"
    assert run(capsys, "search", synthetic, "--activation-budget", "0.6", "--solver", "milp", "-o",
               plan_path)[0] == 0
    png = tmp_path / "timeline.png"
    code, out, _ = run(capsys, "simulate", synthetic, plan_path, "--timeline", png)
    assert code == 0 and png.stat().st_size > 1000


@pytest.mark.parametrize("solver", ["full", "greedy", "optuna"])
def test_search_with_other_solvers(synthetic, tmp_path, capsys, solver):
    path = tmp_path / "plan.json"
    code, out, _ = run(capsys, "search", synthetic, "--activation-budget", "0.7", "--solver", solver, "-o", path)
    assert code == 0, out
    assert json.loads(path.read_text())["meta"]["solver"] == solver


def test_pipeline_stages_get_their_own_plans(synthetic, tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    code, out, _ = run(capsys, "search", synthetic, "--activation-budget", "0.5", "--pipeline-stages", "2",
                       "--micro-batches", "4", "-o", path)
    assert code == 0
    assert "stage 0 (2 micro-batches in flight)" in out and "stage 1 (1 micro-batches in flight)" in out
    meta = Plan.load(path).meta["pipeline"]
    assert [s["in_flight"] for s in meta["per_stage"]] == [2, 1]
    assert [s["layers"] for s in meta["per_stage"]] == [[0, 1], [2, 3]]


def test_mindformers_format_round_trips_through_the_config_front_end(tiny, tmp_path, capsys):
    from profiler import Profile

    from adaptive_mem import plan_from_config
    plan_path, mf_path = tmp_path / "plan.yaml", tmp_path / "mf.yaml"
    # (milp under a time limit on a loaded machine may differ between the two runs)
    args = ["search", tiny, "--activation-budget", "0.3", "--solver", "optuna"]  # seeded: same plan twice
    assert run(capsys, *args, "-o", plan_path)[0] == 0
    assert run(capsys, *args, "-o", mf_path, "--format", "mindformers")[0] == 0
    actions = {d.action.value for d in Plan.load(plan_path).decisions.values()}
    assert actions == {"recompute", "swap"}, actions
    config = yaml.safe_load(mf_path.read_text())
    assert set(config) == {"recompute_config", "swap_config"}
    model = StepModel.build(Profile.load(tiny))
    back = plan_from_config(config, model=None, num_layers=model.num_layers)
    assert resolve(model, back) == resolve(model, Plan.load(plan_path))


def test_megatron_format(synthetic, tmp_path, capsys):
    path = tmp_path / "flags.txt"
    assert run(capsys, "search", synthetic, "--activation-budget", "0.8", "--solver", "full", "-o", path,
               "--format", "megatron")[0] == 0
    assert "--recompute-granularity full" in path.read_text()


def test_pareto_figure(synthetic, tmp_path, capsys):
    png = tmp_path / "pareto.png"
    code, out, _ = run(capsys, "pareto", synthetic, "--solvers", "milp,full,greedy", "--points", "4", "-o", png)
    assert code == 0 and png.stat().st_size > 1000
    assert "milp" in out and "full" in out


@pytest.mark.parametrize("argv, needle", [
    (["search", "{p}", "--budget", "40Gibibytes", "-o", "x.yaml"], "--budget='40Gibibytes'"),
    (["search", "{p}", "--budget", "40", "-o", "x.yaml"], "--budget='40'"),
    (["search", "{p}", "--activation-budget", "2", "-o", "x.yaml"], "--activation-budget"),
    (["search", "{p}", "--budget", "1GiB", "--solver", "annealing", "-o", "x.yaml"], "unknown solver"),
    (["search", "{p}", "--budget", "1GiB", "--hardware", "tpu9", "-o", "x.yaml"], "tpu9"),
    (["search", "{p}", "--budget", "1GiB", "--format", "deepspeed", "-o", "x.yaml"], "--format"),
    (["search", "{p}", "--budget", "1MiB", "-o", "x.yaml"], "minimum feasible"),
    (["search", "{p}", "--budget", "1GiB", "--pipeline-stages", "0", "-o", "x.yaml"], "--pipeline-stages"),
    (["search", "{bad}", "--budget", "1GiB", "-o", "x.yaml"], "profile"),
    (["search", "{missing}", "--budget", "1GiB", "-o", "x.yaml"], "cannot read"),
    (["simulate", "{p}", "{bad}"], "plan"),
    (["pareto", "{p}", "--solvers", "milp,bogus", "-o", "x.png"], "bogus"),
])
def test_bad_input_is_one_line_exit_2(synthetic, tmp_path, capsys, argv, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "adaptive-mem-profile", "version": 1, "units": "nope"}))
    fill = {"{p}": str(synthetic), "{bad}": str(bad), "{missing}": str(tmp_path / "none.json")}
    code, out, err = run(capsys, *[fill.get(a, a) for a in argv])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
