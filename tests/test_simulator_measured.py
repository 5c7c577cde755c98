"""Acceptance: the simulator agrees with measurement on CPU for recompute plans on llama-small.

The profile is measured here (``adaptive-mem profile``), each plan is executed by
``adaptive-mem run`` (the executor, with the independent device-memory tracker), and the
simulator's prediction from the profile is compared: peak within 5 %, step time within 15 %.
Step times are wall-clock: a machine busy with other work makes them noisy.
"""

from __future__ import annotations

import re

import pytest

from adaptive_mem._cli import main
from search import Action, Decision, Plan, simulate
from profiler import Profile

pytestmark = pytest.mark.slow

LAYERS = 8  # llama-small


def _run(capsys, plan_path) -> tuple[int, float]:
    assert main(["run", "--model", "llama-small", "--plan", str(plan_path), "--steps", "3",
                 "--log-level", "WARNING"]) == 0
    out = capsys.readouterr().out
    peak = int(re.search(r"peak device memory: (\d+) bytes", out).group(1))
    step = float(re.search(r"median step time: ([0-9.]+) s", out).group(1))
    return peak, step


@pytest.mark.parametrize("name, decisions", [
    ("full", {f"layers.{i}": Decision(Action.RECOMPUTE) for i in range(LAYERS)}),
    ("half", {f"layers.{i}": Decision(Action.RECOMPUTE) for i in range(0, LAYERS, 2)}),
])
def test_recompute_plan_prediction_matches_measurement(tmp_path_factory, capsys, name, decisions):
    directory = tmp_path_factory.getbasetemp()
    profile_path = directory / "llama-small.json"
    if not profile_path.exists():
        assert main(["profile", "--model", "llama-small", "-o", str(profile_path), "--log-level", "WARNING"]) == 0
        capsys.readouterr()
    profile = Profile.load(profile_path)
    plan = Plan(decisions=decisions)
    plan_path = tmp_path_factory.mktemp(name) / "plan.yaml"
    plan.save(plan_path)
    predicted = simulate(profile, plan)
    peak, step = _run(capsys, plan_path)
    assert predicted.peak_bytes == pytest.approx(peak, rel=0.05), (predicted.peak_bytes, peak)
    assert predicted.step_time == pytest.approx(step, rel=0.15), (predicted.step_time, step)
