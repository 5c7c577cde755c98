"""Op times recorded with a synchronization per op are fitted to the measured step on an accelerator
(Note: [synchronized op times] in ``profiler/_sync_fit.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from profiler._sync_fit import fit_to_step
from search import Plan, simulate


def _recorder(times: list[tuple[float, float]], unattributed: float = 0.0) -> SimpleNamespace:
    events = [SimpleNamespace(fwd_time=f, bwd_time=b) for f, b in times]
    return SimpleNamespace(events=events, unattributed_bwd_time=unattributed)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_times_over_the_step_are_scaled_to_it_keeping_shares(device):
    rec = _recorder([(0.02, 0.04), (0.06, 0.06)], unattributed=0.02)  # 0.20 s recorded
    factor = fit_to_step(rec, torch.device(device), 0.10)
    assert factor == pytest.approx(0.5)
    assert [(e.fwd_time, e.bwd_time) for e in rec.events] == [pytest.approx((0.01, 0.02)), pytest.approx((0.03, 0.03))]
    assert rec.unattributed_bwd_time == pytest.approx(0.01)
    assert sum(e.fwd_time + e.bwd_time for e in rec.events) + rec.unattributed_bwd_time == pytest.approx(0.10)


@pytest.mark.parametrize("device,step", [("cuda", 0.5), ("cpu", 0.5), ("meta", 0.1), ("cuda", None)])
def test_nothing_changes_under_the_step_on_fake_tensors_or_without_a_timed_step(device, step):
    rec = _recorder([(0.02, 0.04), (0.06, 0.06)])
    assert fit_to_step(rec, torch.device(device), step) == 1.0
    assert [(e.fwd_time, e.bwd_time) for e in rec.events] == [(0.02, 0.04), (0.06, 0.06)]


def test_a_measured_profile_simulates_its_measured_step():
    from adaptive_mem import build_model, profile_step

    bundle = build_model("llama-tiny", seed=0)
    profile = profile_step(bundle, optimizer="sgd", optimizer_time=0.0)
    recorded = sum(o.fwd_time + o.bwd_time for o in profile.ops) + profile.unattributed_time
    assert recorded <= profile.step_time * (1 + 1e-9)
    assert simulate(profile, Plan()).step_time == pytest.approx(profile.step_time, rel=1e-6)
