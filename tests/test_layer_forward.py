"""Each block's measured forward (Note: [layer forward time] in ``profiler/_repeats.py``): recorded by the profiler
on a model we did not write, absent where not measured, kept by the profile file, refused when malformed, priced
by the simulator into a whole-layer replay and nowhere else, and leaving no hook on the model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from adaptive_mem import build_model, profile_step
from profiler import Profile, ProfileError
from profiler._repeats import LayerTimer
from search import Action, Decision, Plan, simulate


@pytest.fixture(scope="module")
def hf_profile() -> Profile:
    bundle = build_model("hf:llama", batch_size=2, seq_len=16, seed=0)
    result = profile_step(bundle, warmup=1, repeat=3)
    layers = [bundle.model.get_submodule(result.layer_path(i)) for i in range(result.num_layers)]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in layers)  # planning leaves no state
    return result


def test_the_profiler_times_each_block_of_a_hugging_face_model(hf_profile):
    forward = hf_profile.layer_forward
    assert len(forward) == hf_profile.num_layers == 2
    assert all(0 < t < hf_profile.step_time for t in forward)
    assert sum(forward) < hf_profile.step_time


def test_no_measure_on_fake_tensors_and_the_field_not_written():
    fake = profile_step(build_model("llama-tiny", device="meta"), hardware="h100")
    assert fake.layer_forward == [] and "layer_forward" not in fake.to_dict()


def test_the_profile_file_keeps_it_and_refuses_a_malformed_one(hf_profile):
    data = hf_profile.to_dict()
    assert Profile.from_dict(data).layer_forward == hf_profile.layer_forward
    for bad in ([0.001], [0.001, -1.0], [0.001, "x"], [0.001, math.inf], 3):
        with pytest.raises(ProfileError, match=r"^profile\.layer_forward(\[1\])?=.*: expected "):
            Profile.from_dict({**data, "layer_forward": bad})


def _recompute(profile: Profile, layer: int) -> Plan:
    return Plan(decisions={profile.layer_path(layer): Decision(Action.RECOMPUTE)})


def test_a_whole_layer_replay_costs_the_measured_forward_where_longer(hf_profile):
    units = [sum(u.fwd_time for u in hf_profile.layer_units(i)) for i in range(2)]
    slow = dataclasses.replace(hf_profile, layer_forward=[units[0] + 0.004, units[1] * 0.5])
    bare = dataclasses.replace(hf_profile, layer_forward=[])
    swap = Plan(decisions={hf_profile.layer_path(0): Decision(Action.SWAP)})
    for plan in (Plan(), swap):  # nothing replays: the measure changes nothing
        assert simulate(slow, plan).step_time == simulate(bare, plan).step_time
    # layer 0's Python beyond its ops is replayed with it: 4 ms more; layer 1's ops take longer than its measure
    assert slow.replayed_forward(0) == units[0] + 0.004 and slow.replayed_forward(1) == units[1]
    assert simulate(slow, _recompute(slow, 0)).step_time == pytest.approx(
        simulate(bare, _recompute(bare, 0)).step_time + 0.004, abs=1e-9)
    assert simulate(slow, _recompute(slow, 1)).step_time == simulate(bare, _recompute(bare, 1)).step_time


def test_derived_profiles_drop_the_measure(hf_profile):
    """A profile scaled to another batch size, sequence length or sharding keeps no forward measured on another."""
    other = dataclasses.replace(hf_profile, model={**hf_profile.model, "batch_size": 4})
    from search import profile_for_batch

    assert profile_for_batch({2: hf_profile, 4: other}, 3).layer_forward == []


class _Twice(torch.nn.Module):
    """One block called twice per forward (shared weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](self.layers[0](x)))


def test_a_block_called_twice_in_a_step_is_timed_over_both_calls():
    model = _Twice()
    timer = LayerTimer(model, torch.device("cpu"))
    assert len(timer.blocks) == 2
    with timer:
        model(torch.randn(4, 8)).sum().backward()
    assert all(len(spans) == n for spans, n in zip(timer._spans, (2, 1)))
    assert len(timer.medians()) == 2 and all(t > 0 for t in timer.medians())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.layers)
