"""``adaptive_mem.search``, the Python front door: the plan and figures ``adaptive-mem search`` prints and
writes, its refusals, the names ``adaptive_mem`` exports, and the README's quickstart as written."""

from __future__ import annotations

import random
import re
import types

import pytest

import adaptive_mem as am
from adaptive_mem.cli._main import main
from search import BudgetError, DeviceMemoryError, InfeasibleBudgetError, fmt_bytes
from search.planning import fmt_seconds
from _profiles import random_profile

QUICKSTART = '''\
import torch, adaptive_mem as am
bundle = am.build_model("llama-tiny", batch_size=2)  # a model and one training step's inputs and loss
model = bundle.model
profile = am.profile_step(bundle)                    # one measured training step
result = am.search(profile, budget="60%")            # or "3MiB"; fastest plan under the budget
print(result.plan, result.peak_bytes, result.step_time)
handle = am.optimize(model, plan=result.plan)        # exact gradients, less memory
loss = bundle.loss(bundle.batch()); loss.backward()  # train as usual
'''


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("prof") / "synthetic.json"
    random_profile(random.Random(5), num_layers=4, units_per_layer=6, bandwidth=2e9).save(path)
    return path


def cli(capsys, tmp_path, *argv) -> tuple[str, str]:
    """The command's stdout and the plan file it wrote."""
    path = tmp_path / "plan.yaml"
    assert main(["search", *[str(a) for a in argv], "-o", str(path)]) == 0
    return capsys.readouterr().out, path.read_text()


@pytest.mark.parametrize("flags, kwargs", [
    (["--budget", "320MiB", "--solver", "greedy"], {"budget": "320MiB", "solver": "greedy"}),
    (["--budget", "320MiB", "--solver", "full"], {"budget": 320 << 20, "solver": "full"}),
    (["--activation-budget", "0.5", "--solver", "greedy"], {"budget": "50%", "solver": "greedy"}),
    (["--activation-budget", "0.7", "--solver", "optuna"], {"activation_budget": 0.7, "solver": "optuna"}),
])
def test_same_plan_and_figures_as_the_command(synthetic, tmp_path, capsys, flags, kwargs):
    out, text = cli(capsys, tmp_path, synthetic, *flags)
    result = am.search(synthetic, **kwargs)
    assert result.plan.dumps(fmt="yaml") == text
    assert f"peak {fmt_bytes(result.peak_bytes)} " in out and f"step {fmt_seconds(result.step_time)}," in out
    assert result.solver == kwargs["solver"] and len(result.stages) == 1 and result.ranks == ()
    assert result.peak_bytes == result.plan.meta["predicted_peak_bytes"] <= result.plan.meta["budget"]
    assert result.minimum_budget <= result.plan.meta["budget"] and result.fits_device


def test_a_profile_object_and_its_file_give_one_plan(synthetic):
    from profiler import Profile

    assert am.search(Profile.load(synthetic), budget="50%", solver="greedy").plan == \
        am.search(str(synthetic), budget="50%", solver="greedy").plan


def test_pipeline_layout_per_stage_and_per_rank(synthetic, tmp_path, capsys):
    flags = ["--activation-budget", "0.7", "--pipeline-stages", "2", "--micro-batches", "4", "--solver", "full"]
    out, text = cli(capsys, tmp_path, synthetic, *flags)
    seen = []
    result = am.search(synthetic, activation_budget="0.7", pipeline_stages=2, micro_batches=4, solver="full",
                       on_stage=seen.append)
    assert result.plan.dumps(fmt="yaml") == text
    assert [st.in_flight for st in result.stages] == [2, 1] and list(result.stages) == seen
    assert [st.where for st in result.stages] == ["stage 0 (2 micro-batches in flight): ",
                                                  "stage 1 (1 micro-batches in flight): "]
    assert [r["stage"] for r in result.ranks] == [0, 1]
    assert result.peak_bytes == max(r["predicted_peak_bytes"] for r in result.ranks)
    assert f"): {fmt_seconds(result.step_time)} predicted" in out
    assert result.step_time == result.plan.meta["pipeline"]["predicted_step_time"] and result.lower_bound is None


@pytest.mark.parametrize("kwargs, flags, error", [
    ({"budget": "1MiB"}, ["--budget", "1MiB"], InfeasibleBudgetError),
    ({"activation_budget": "0.05"}, ["--activation-budget", "0.05"], InfeasibleBudgetError),
    ({"budget": "1000GiB", "hardware": "h100"}, ["--budget", "1000GiB", "--hardware", "h100"], DeviceMemoryError),
    ({"budget": "40Gibibytes"}, ["--budget", "40Gibibytes"], BudgetError),
])
def test_refusals_are_the_commands(synthetic, tmp_path, capsys, kwargs, flags, error):
    with pytest.raises(error) as info:
        am.search(synthetic, solver="greedy", **kwargs)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert main(["search", str(synthetic), *flags, "--solver", "greedy", "-o", str(tmp_path / "p.yaml")]) == 2
    assert capsys.readouterr().err.strip() == f"adaptive-mem search: error: {message}"


@pytest.mark.parametrize("kwargs, needle", [
    ({"budget": "150%"}, "--budget='150%': expected a size like 40GiB or a percentage in (0%, 100%]"),
    ({"budget": "abc%"}, "--budget='abc%'"),
    ({"budget": 0}, "--budget=0: expected a size > 0"),
    ({"budget": "50%", "activation_budget": 0.5}, "not both"),
    ({"budget": "2%"}, "--budget='2%': below the minimum feasible"),
    ({"budget": "1GiB", "solver": "annealing"}, "--solver='annealing': unknown solver"),
    ({"budget": "1GiB", "pipeline_stages": 0}, "--pipeline-stages=0: expected a positive integer"),
    ({"budget": "1GiB", "solver_options": {"trails": 3}}, "solver_options={'trails': 3}: "),
])
def test_bad_python_arguments_raise_one_line_value_errors(synthetic, kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        am.search(synthetic, **{"solver": "greedy", **kwargs})
    assert "\n" not in str(info.value)


def test_solver_options_reach_the_solver(synthetic):
    few = am.search(synthetic, budget="70%", solver="optuna", solver_options={"trials": 5, "seed": 1})
    assert few.plan.meta["solver"] == "optuna" and few.stages[0].solve.stats.iterations == 5


def test_the_command_still_refuses_a_percentage(synthetic, tmp_path, capsys):
    assert main(["search", str(synthetic), "--budget", "60%", "-o", str(tmp_path / "p.yaml")]) == 2
    assert "--budget='60%': expected a positive size such as 40GiB" in capsys.readouterr().err


def test_exports_leave_the_search_package_alone():
    import search

    assert isinstance(search, types.ModuleType) and isinstance(am.search, types.FunctionType)
    assert {"Plan", "Profile", "profile_step", "search", "simulate", "optimize", "SearchResult"} <= set(am.__all__)
    assert am.Plan is search.Plan and am.simulate is search.simulate
    import adaptive_mem.cli._search as command

    assert command.search is am.search


def test_quickstart_runs_as_written(capsys):
    exec(compile(QUICKSTART, "quickstart.py", "exec"), {})
    assert "Plan(" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_batches(tmp_path_factory):
    """llama-tiny profiled on fake tensors at batch sizes 2 and 4."""
    folder = tmp_path_factory.mktemp("tiny")
    for b in (2, 4):
        assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--hardware", "h100", "--batch-size",
                     str(b), "-o", str(folder / f"b{b}.json")]) == 0
    return [folder / "b2.json", folder / "b4.json"]


def test_maximize_throughput_is_the_commands(tiny_batches, tmp_path, capsys):
    capsys.readouterr()
    out, text = cli(capsys, tmp_path, *tiny_batches, "--maximize", "throughput", "--batch-sizes", "1,2,4,8",
                    "--budget", "30MiB", "--solver", "greedy")
    result = am.maximize_throughput(tiny_batches, budget="30MiB", batch_sizes=[1, 2, 4, 8], solver="greedy")
    assert result.plan.dumps(fmt="yaml") == text and result.table.table() in out
    assert f"best: batch size {result.batch_size}, {result.tokens_per_second:,.1f} tokens/s, " \
           f"step {fmt_seconds(result.step_time)}, peak {fmt_bytes(result.peak_bytes)}" in out
    assert result.plan.meta["maximize"] == "throughput" and result.checks == ()


def test_maximize_throughput_refuses_as_the_command(tiny_batches, tmp_path, capsys):
    with pytest.raises(InfeasibleBudgetError) as info:
        am.maximize_throughput(tiny_batches, budget="1MiB", batch_sizes="1,2", solver="greedy")
    assert main(["search", *map(str, tiny_batches), "--maximize", "throughput", "--batch-sizes", "1,2", "--budget",
                 "1MiB", "--solver", "greedy", "-o", str(tmp_path / "p.yaml")]) == 2
    assert capsys.readouterr().err.strip() == f"adaptive-mem search: error: {info.value}"
