"""Acceptance: the simulator agrees with measurement on CPU for recompute plans on llama-small.

The profile is measured here (``adaptive-mem profile``), each plan is executed by
``adaptive-mem run`` (the executor, with the independent device-memory tracker), and the
simulator's prediction from the profile is compared: peak within 5 %, step time within 15 %.
Step times are wall-clock: a machine busy with other work makes them noisy. ``run`` times five
untracked steps after two accounted ones (Note: [run timing]); the profile carries the optimizer
step (``Profile.optimizer_time``), which every measured step includes.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from search import Action, Decision, Plan, simulate
from profiler import Profile

pytestmark = pytest.mark.slow

LAYERS = 8  # llama-small


def _run(plan_path) -> tuple[int, float]:
    # Its own process, as a user runs it: the device-memory scan at entry must not find tensors
    # that earlier tests of this pytest process left alive.
    done = subprocess.run([sys.executable, "-m", "adaptive_mem._cli", "run", "--model", "llama-small",
                           "--plan", str(plan_path), "--steps", "7", "--log-level", "WARNING"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    peak = int(re.search(r"peak device memory: (\d+) bytes", out).group(1))
    step = float(re.search(r"median step time: ([0-9.]+) s", out).group(1))
    return peak, step


PLANS = [
    ("full", {f"layers.{i}": Decision(Action.RECOMPUTE) for i in range(LAYERS)}),
    ("half", {f"layers.{i}": Decision(Action.RECOMPUTE) for i in range(0, LAYERS, 2)}),
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Profile once; predict and run (in its own process) every plan: name -> (predicted, peak, step)."""
    directory = tmp_path_factory.mktemp("measured")
    profile_path = directory / "llama-small.json"
    # Its own process too: after hundreds of tests the pytest process is not what a user profiles in.
    done = subprocess.run([sys.executable, "-m", "adaptive_mem._cli", "profile", "--model", "llama-small", "-o",
                           str(profile_path), "--log-level", "WARNING"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    profile = Profile.load(profile_path)
    results = {}
    for name, decisions in PLANS:
        plan = Plan(decisions=decisions)
        plan_path = directory / f"{name}.yaml"
        plan.save(plan_path)
        results[name] = (simulate(profile, plan), *_run(plan_path))
    return results


@pytest.mark.parametrize("name", [name for name, _ in PLANS])
def test_predicted_peak_matches_measurement(measured, name):
    predicted, peak, _ = measured[name]
    assert predicted.peak_bytes == pytest.approx(peak, rel=0.05), (predicted.peak_bytes, peak)


@pytest.mark.parametrize("name", [name for name, _ in PLANS])
def test_predicted_step_time_matches_measurement(measured, name):
    predicted, _, step = measured[name]
    assert predicted.step_time == pytest.approx(step, rel=0.15), f"predicted {predicted.step_time:.3f} s, measured {step:.3f} s"
