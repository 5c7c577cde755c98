"""What budgets mean: ``--activation-budget F`` bounds the activation peak, and no plan, budget or
profile exceeds the memory of the named device it is for without saying so.

Note: [activation budget] (``search/_budget.py``): gradients are allocated during backward, so a
peak limit of static memory + F x activations let the not-yet-allocated gradients' room pass as
activations; these tests use profiles whose gradients are as large as their activations.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

import profiler._hardware
from adaptive_mem.cli._main import main
from search import Budget, Plan, StepModel, get_solver
from search.planning import resolve, simulate_assignment
from _profiles import SyntheticUnit, synthetic_profile
from search.planning import activation_peak, keep_all

MiB = 1 << 20


def _profile(*, device_memory: int | None = None):
    """8 layers of 15 MiB saved; static 216 MiB of which gradients 120 MiB; keep-all peak 231 MiB."""
    layer = [SyntheticUnit("a", 8 * MiB, 1e-3, 2e-3), SyntheticUnit("b", 6 * MiB, 1e-3, 2e-3),
             SyntheticUnit("c", 1 * MiB, 1e-3, 2e-3)]
    prof = synthetic_profile(layers=[layer] * 8, static=96 * MiB, gradients=120 * MiB, bandwidth=1e10)
    if device_memory is not None:
        prof.hardware = replace(prof.hardware, device_memory=device_memory)
    return prof


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("fraction", [0.2, 0.5])
@pytest.mark.parametrize("solver", ["milp", "greedy", "optuna"])
def test_solved_plan_holds_at_most_the_fraction_of_the_activation_peak(fraction, solver):
    model = StepModel.build(_profile())
    keep = activation_peak(model, keep_all(model))
    assert keep == 120 * MiB
    result = get_solver(solver).solve(Budget(activation_fraction=fraction).problem(model))
    assert activation_peak(model, result.assignment) <= fraction * keep
    # the plan's real peak (gradients per step) is within the limit the solver was given
    assert simulate_assignment(model, result.assignment).peak_bytes <= result.budget


@pytest.mark.parametrize("fraction", ["0.2", "0.5"])
def test_search_cli_honours_the_activation_budget(fraction, tmp_path, capsys):
    path = tmp_path / "p.json"
    _profile().save(path)
    code, out, _ = run(capsys, "search", path, "--activation-budget", fraction, "-o", tmp_path / "plan.yaml")
    assert code == 0, out
    model = StepModel.build(_profile())
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.decisions  # the old meaning: static + F x activations, met by keeping everything
    assert activation_peak(model, resolve(model, plan)) <= float(fraction) * activation_peak(model, keep_all(model))
    assert "keep-all" in out and "already meets" not in out


@pytest.mark.parametrize("flag, value", [("--activation-budget", "1"), ("--budget", "1GiB")])
def test_search_says_once_when_keep_all_meets_the_budget(flag, value, tmp_path, capsys):
    path = tmp_path / "p.json"
    _profile().save(path)
    code, out, _ = run(capsys, "search", path, flag, value, "-o", tmp_path / "plan.yaml")
    assert code == 0
    lines = [line for line in out.splitlines() if "already meets" in line]
    assert len(lines) == 1 and lines[0].startswith(f"the keep-all plan already meets {flag} {value} (its ")
    assert lines[0].endswith(": no decisions needed")
    assert "wrote" in out and "0 decisions" in out


def test_search_refuses_static_memory_over_the_device(tmp_path, capsys):
    path = tmp_path / "p.json"
    _profile(device_memory=200 * MiB).save(path)  # static 216 MiB
    plan = tmp_path / "plan.yaml"
    code, _, err = run(capsys, "search", path, "--activation-budget", "0.5", "-o", plan)
    assert code == 2 and not plan.exists()
    assert err.strip() == ("adaptive-mem search: error: parameters, gradients and optimizer state (216.00 MiB) exceed "
                           "the synthetic's 200.00 MiB of device memory by 16.00 MiB: shard them (ZeRO/FSDP, tensor "
                           "or pipeline parallel) or use a device with more memory")


def test_search_refuses_a_budget_over_the_device(tmp_path, capsys):
    path = tmp_path / "p.json"
    _profile(device_memory=300 * MiB).save(path)
    code, _, err = run(capsys, "search", path, "--budget", "400MiB", "-o", tmp_path / "plan.yaml")
    assert code == 2
    assert err.strip() == ("adaptive-mem search: error: --budget='400MiB': 400.00 MiB is more than the synthetic's "
                           "300.00 MiB of device memory; expected at most 300MiB, or --hardware naming the device "
                           "the plan is for")


def test_search_and_simulate_warn_once_when_activations_do_not_fit(tmp_path, capsys, caplog):
    path = tmp_path / "p.json"
    _profile(device_memory=220 * MiB).save(path)  # static 216 MiB fits, keep-all peak 231 MiB does not
    plan = tmp_path / "plan.yaml"
    with caplog.at_level(logging.WARNING):
        code, _, _ = run(capsys, "search", path, "--activation-budget", "1", "-o", plan)
    assert code == 0 and plan.exists()
    expected = ("predicted peak 231.00 MiB exceeds the synthetic's 220.00 MiB of device memory by 11.00 MiB: "
                "parameters, gradients and optimizer state (216.00 MiB) fit, activations and workspace (15.00 MiB) "
                "on top do not; search with --budget 220MiB or less")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [expected]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        code, out, _ = run(capsys, "simulate", path, plan)
    assert code == 0 and "231.00 MiB" in out
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [expected]


def test_simulate_names_static_memory_over_the_device(tmp_path, capsys, caplog):
    path = tmp_path / "p.json"
    _profile(device_memory=200 * MiB).save(path)
    plan = tmp_path / "plan.yaml"
    Plan().save(plan)
    with caplog.at_level(logging.WARNING):
        assert run(capsys, "simulate", path, plan)[0] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("predicted peak 231.00 MiB exceeds the synthetic's 200.00 MiB")
    assert "alone need 216.00 MiB (16.00 MiB over)" in warnings[0]


def test_no_device_check_for_cpu(tmp_path, capsys, caplog):
    prof = _profile(device_memory=1 * MiB)
    prof.hardware = replace(prof.hardware, name="cpu")
    path = tmp_path / "p.json"
    prof.save(path)
    with caplog.at_level(logging.WARNING):
        code, _, err = run(capsys, "search", path, "--activation-budget", "0.5", "-o", tmp_path / "plan.yaml")
    assert code == 0, err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_profile_warns_once_when_static_memory_exceeds_the_device(tmp_path, capsys, caplog, monkeypatch):
    sheet = profiler._hardware.HARDWARE["h100"]
    monkeypatch.setitem(profiler._hardware.HARDWARE, "h100", replace(sheet, device_memory=1 * MiB))
    with caplog.at_level(logging.WARNING):
        assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--hardware", "h100"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("parameters, gradients and optimizer state (")
    assert "exceed the h100's 1.00 MiB of device memory by" in warnings[0]
