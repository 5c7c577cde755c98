"""The optimizer step in the profile: measured on scratch parameters, estimated on fake tensors,
added once to every simulated step, and never a step of the user's optimizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import profiler
from adaptive_mem import build_model
from profiler._optimizer_time import SAMPLE_ELEMENTS, _sample, estimate_optimizer_seconds
from search import Action, Decision, Plan, simulate


def test_fake_profile_estimates_the_step_as_memory_bound():
    bundle = build_model("llama-tiny", device="meta")
    prof = profiler.profile_step(bundle, hardware="h100", optimizer="adam")
    numel = sum(p.numel() for p in bundle.model.parameters())
    # fp32 parameters: read p, g, m, v (4 x 4 bytes) and write p, m, v (3 x 4 bytes)
    achieved = prof.hardware.memory_bandwidth * prof.hardware.memory_efficiency  # Note: [op pricing]
    assert prof.optimizer_time == pytest.approx(numel * 28 / achieved, rel=1e-9)
    sgd = profiler.profile_step(bundle, hardware="h100", optimizer="sgd")
    assert sgd.optimizer_time == pytest.approx(numel * 12 / achieved, rel=1e-9)


def test_measured_profile_times_a_scratch_copy_and_leaves_the_user_optimizer_alone():
    bundle = build_model("llama-tiny")
    params = list(bundle.model.parameters())
    opt = torch.optim.Adam(params, lr=0.5)
    before = [p.detach().clone() for p in params]
    prof = profiler.profile_step(bundle, optimizer=opt, warmup=0, repeat=1)
    assert prof.optimizer_time > 0
    assert not opt.state  # never stepped: no state was created
    assert all(torch.equal(a, p) for a, p in zip(before, params))


def test_given_optimizer_time_is_kept_and_negative_is_rejected():
    bundle = build_model("llama-tiny")
    assert profiler.profile_step(bundle, warmup=0, repeat=0, optimizer_time=0.25).optimizer_time == 0.25
    with pytest.raises(ValueError, match="optimizer_time=-1"):
        profiler.profile_step(bundle, warmup=0, repeat=0, optimizer_time=-1.0)


def test_sample_keeps_parameter_shapes_and_stays_under_the_cap():
    small = [torch.nn.Parameter(torch.zeros(3, 5)), torch.nn.Parameter(torch.zeros(7))]
    assert [t.shape for t in _sample(small)] == [torch.Size([3, 5]), torch.Size([7])]
    huge = [torch.nn.Parameter(torch.empty(0).new_empty((SAMPLE_ELEMENTS + 1,), device="meta"))]
    assert sum(t.numel() for t in _sample(huge)) == SAMPLE_ELEMENTS
    many = [torch.nn.Parameter(torch.zeros(SAMPLE_ELEMENTS // 3)) for _ in range(5)]
    assert sum(t.numel() for t in _sample(many)) <= SAMPLE_ELEMENTS


def test_simulator_adds_the_optimizer_step_to_every_plan():
    prof = profiler.profile_step(build_model("llama-tiny", device="meta"), hardware="h100")
    without = dataclasses.replace(prof, optimizer_time=0.0)
    for plan in (Plan(), Plan(decisions={"layers.0": Decision(Action.RECOMPUTE)})):
        delta = simulate(prof, plan).step_time - simulate(without, plan).step_time
        assert delta == pytest.approx(prof.optimizer_time, rel=1e-9, abs=1e-15)


def test_optimizer_time_round_trips_and_a_profile_without_it_loads_as_zero():
    prof = profiler.profile_step(build_model("llama-tiny", device="meta"), hardware="h100")
    data = prof.to_dict()
    assert profiler.Profile.from_dict(data).optimizer_time == prof.optimizer_time
    del data["optimizer_time"]
    assert profiler.Profile.from_dict(data).optimizer_time == 0.0
    assert estimate_optimizer_seconds(torch.nn.Linear(2, 2).requires_grad_(False), "adam", prof.hardware) == 0.0
