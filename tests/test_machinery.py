"""The machinery's calls as the simulator charges them (Note: [machinery calls] in search/_machinery.py): none for
the empty plan or whole-layer recompute, growing with the decided units, priced at the hardware's per-call costs."""

from __future__ import annotations

import dataclasses

import pytest

import profiler
from adaptive_mem import build_model
from search import Action, Decision, MachineryCalls, Plan, machinery_calls, simulate


@pytest.fixture(scope="module")
def prof():
    return profiler.profile_step(build_model("llama-tiny", device="meta"))


def _priced(prof, dispatch: float, hook: float):
    hw = dataclasses.replace(prof.hardware, dispatch_call_time=dispatch, hook_call_time=hook)
    return dataclasses.replace(prof, hardware=hw)


def _swap(*names: str) -> Plan:
    return Plan(decisions={n: Decision(Action.SWAP, backward_prefetch=1) for n in names})


def _saved_tensors(prof, names) -> int:
    return sum(prof.ops[i].saved_tensors for u in prof.units if u.name in names for i in u.ops)


def test_profiles_count_saved_tensors_per_op(prof):
    by_name = {u.name: u for u in prof.units}
    matmul = by_name["layers.0.feed_forward.w1.matmul"]
    assert sum(prof.ops[i].saved_tensors for i in matmul.ops) == 2  # its input and its weight
    old = prof.to_dict()
    for op in old["ops"]:
        del op["saved_tensors"]
    del old["hardware"]["dispatch_call_time"], old["hardware"]["hook_call_time"]
    loaded = profiler.Profile.from_dict(old)  # a profile written before the fields: 0
    assert all(op.saved_tensors == 0 for op in loaded.ops)
    assert loaded.hardware.dispatch_call_time == 0.0 and loaded.hardware.hook_call_time == 0.0


def test_calls_follow_the_decided_units(prof):
    assert machinery_calls(prof, Plan()) == MachineryCalls()
    w1, mul = "layers.0.feed_forward.w1.matmul", "layers.0.feed_forward.mul"
    ops = {u.name: len(u.ops) for u in prof.units}
    assert machinery_calls(prof, _swap(w1)) == MachineryCalls(ops[w1], 2, 2)
    assert machinery_calls(prof, Plan(decisions={mul: Decision(Action.RECOMPUTE)})) == MachineryCalls(2 * ops[mul])
    more = [u.name for u in prof.layer_units(0) if u.saved_bytes > 0][:4]
    counts = [machinery_calls(prof, _swap(*more[:k])).dispatch for k in range(1, 5)]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    layer = machinery_calls(prof, _swap("layers.0"))  # a whole layer: its saved tensors, no dispatch
    assert layer == MachineryCalls(0, _saved_tensors(prof, {u.name for u in prof.layer_units(0)}),
                                   layer.pack) and layer.pack > 0
    assert machinery_calls(prof, Plan(decisions={"layers.0": Decision(Action.RECOMPUTE)})) == MachineryCalls()


def test_the_simulator_charges_the_calls_at_their_cost(prof):
    plans = [Plan(), _swap("layers.0.feed_forward.w1.matmul"), _swap("layers.0", "layers.1"),
             Plan(decisions={"layers.0.feed_forward.mul": Decision(Action.RECOMPUTE)})]
    priced = _priced(prof, 2e-5, 3e-6)
    for plan in plans:
        calls = machinery_calls(prof, plan)
        extra = simulate(priced, plan).step_time - simulate(prof, plan).step_time
        assert extra == pytest.approx(calls.dispatch * 2e-5 + (calls.pack + calls.unpack) * 3e-6, rel=1e-9, abs=1e-12)
    assert simulate(priced, Plan()).step_time == simulate(prof, Plan()).step_time  # the empty plan: nothing
