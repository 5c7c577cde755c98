"""Collectives that overlap compute slow it: the overlapped seconds of each data-parallel collective add the
datasheet's ``comm_compute_slowdown`` of themselves to the step (Note: [comm contention])."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

import adaptive_mem as am
import profiler
from profiler import HARDWARE, HardwareSpec, Layout, Profile, ProfileError
from search.planning import data_parallel_comm

LINK = 1e9
# a 2-rank ring all-reduce moves 2 (d - 1) / d of the bytes: these take 1 s at LINK
ONE_SECOND = int(LINK / (2 * (2 - 1) / 2))


def _grads(seconds: float, slowdown: float, *, layout: Layout = Layout(data_parallel=2)):
    return data_parallel_comm(layout, gradient_bytes=int(ONE_SECOND * seconds), parameter_bytes=0, layers=4,
                              forward_time=2, backward_time=4, bandwidth=LINK, slowdown=slowdown)


def test_overlapped_seconds_add_the_slowdown_of_themselves():
    # 4 buckets of 0.25 s ready at 1, 2, 3, 4 s of a 4 s backward: 0.75 s overlap it, the last 0.25 s is exposed
    base, slowed = _grads(1, 0.0), _grads(1, 0.2)
    assert (base.total, base.exposed, base.contention) == pytest.approx((1, 0.25, 0))
    assert slowed.total == pytest.approx(1)
    assert slowed.contention == pytest.approx(0.2 * 0.75)
    assert slowed.exposed == pytest.approx(0.25 + 0.2 * 0.75)


def test_a_collective_past_the_compute_is_not_slowing_it():
    # 8 s of buckets beside a 4 s backward: the stream runs 1..9 s, 3 s beside compute, 5 s after it
    slowed = _grads(8, 0.5)
    assert slowed.contention == pytest.approx(0.5 * 3)
    assert slowed.exposed == pytest.approx(5 + 0.5 * 3)


def test_one_data_parallel_rank_has_no_collective_to_slow_compute():
    assert _grads(1, 0.2, layout=Layout(data_parallel=1)) == _grads(1, 0.0, layout=Layout(data_parallel=1))
    assert _grads(1, 0.2, layout=Layout(data_parallel=1)).exposed == 0.0


def test_the_datasheets_give_the_sms_nccl_takes():
    assert HARDWARE["h100"].comm_compute_slowdown == pytest.approx(24 / 132)
    assert HARDWARE["h200"].comm_compute_slowdown == pytest.approx(24 / 132)
    assert HARDWARE["a100"].comm_compute_slowdown == pytest.approx(24 / 108)
    assert HARDWARE["ascend-910b"].comm_compute_slowdown == 0.0  # no public figure
    assert profiler.hardware_spec("h100").comm_compute_slowdown == pytest.approx(24 / 132)
    assert profiler.hardware_spec("cpu").comm_compute_slowdown == 0.0


def test_an_fsdp_step_grows_by_the_slowdown_of_its_overlapped_collectives(monkeypatch):
    kwargs = dict(precision="bf16", ac="full", gpus=2, zero=3, batch_size=1, seq_len=256)
    slowed = am.estimate("llama-tiny", **kwargs)
    monkeypatch.setitem(HARDWARE, "h100", replace(HARDWARE["h100"], comm_compute_slowdown=0.0))
    plain = am.estimate("llama-tiny", **kwargs)
    rank = plain.plan.meta["pipeline"]["per_rank"][0]
    overlapped = rank["comm_time"] - rank["exposed_comm_time"]
    assert overlapped > 0
    grown = slowed.step_time_s - plain.step_time_s
    assert grown == pytest.approx(24 / 132 * overlapped, rel=1e-9)


def test_a_profile_without_the_field_loads_with_no_slowdown(tmp_path):
    data = profiler.profile_step(am.build_model("llama-tiny", device="meta"), hardware="h100").to_dict()
    assert data["hardware"]["comm_compute_slowdown"] == pytest.approx(24 / 132)
    del data["hardware"]["comm_compute_slowdown"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert Profile.load(path).hardware.comm_compute_slowdown == 0.0


@pytest.mark.parametrize("value", [-0.1, 1.0, True, "0.2"])
def test_a_slowdown_that_is_not_a_fraction_is_refused(value):
    data = asdict(profiler.hardware_spec("h100"))
    with pytest.raises(ProfileError, match=r"hardware\.comm_compute_slowdown=.*expected a fraction in \[0, 1\)"):
        HardwareSpec(**{**data, "comm_compute_slowdown": value})
