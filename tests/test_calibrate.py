"""``calibrate``: the compute costs of swaps and op-level recompute, measured from real steps, stored in the profile."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import profiler
from adaptive_mem import build_model, calibrate


def test_measures_on_a_real_device_and_changes_nothing_else():
    bundle = build_model("llama-tiny", seed=0, batch_size=4, seq_len=128)
    prof = profiler.profile_step(bundle, warmup=0, repeat=1)
    grads = [p.grad for p in bundle.model.parameters()]
    before = [p.detach().clone() for p in bundle.model.parameters()]
    out = calibrate(bundle, prof, pairs=2)
    bandwidth, overhead = out.hardware.swap_compute_bandwidth, out.hardware.sac_op_overhead
    assert 0 <= bandwidth < float("inf") and 0 <= overhead < 1e-2
    assert out.hardware.disk_bandwidth > 0  # the disk tier of the swap store, measured too
    # the machinery's per-call costs (Note: [machinery calls]): measured, finite (their size is the benchmark's)
    assert 0 <= out.hardware.dispatch_call_time < 1 and 0 <= out.hardware.hook_call_time < 1
    # only those fields changed; the model, its gradients and the input profile are untouched
    assert dataclasses.replace(out.hardware, swap_compute_bandwidth=0.0, sac_op_overhead=0.0,
                               disk_bandwidth=prof.hardware.disk_bandwidth, dispatch_call_time=0.0,
                               hook_call_time=0.0) == prof.hardware
    assert prof.hardware.swap_compute_bandwidth == 0.0 and prof.hardware.sac_op_overhead == 0.0
    assert dataclasses.replace(out, hardware=prof.hardware) == prof
    assert [p.grad for p in bundle.model.parameters()] == grads
    assert all(torch.equal(a, p) for a, p in zip(before, bundle.model.parameters()))
    assert not bundle.model._forward_pre_hooks and not bundle.model._forward_hooks
    # the profile round-trips with the measured field
    assert profiler.Profile.from_dict(out.to_dict()).hardware == out.hardware


def test_fake_profiles_and_bad_pairs():
    fake = build_model("llama-tiny", device="meta")
    prof = profiler.profile_step(fake, hardware="h100")
    assert calibrate(fake, prof) is prof  # estimated times: nothing to measure
    with pytest.raises(ValueError, match="pairs=0"):
        calibrate(fake, prof, pairs=0)
