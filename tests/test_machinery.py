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


def _dispatches(prof, scope: str) -> int:
    return sum(1 + op.view_ops for op in prof.ops if op.module == scope or op.module.startswith(scope + "."))


def test_calls_follow_the_decided_units(prof):
    assert machinery_calls(prof, Plan()) == MachineryCalls()
    assert machinery_calls(prof, Plan(decisions={"layers.0": Decision(Action.RECOMPUTE)})) == MachineryCalls()
    w1, mul = "layers.0.feed_forward.w1.matmul", "layers.0.feed_forward.mul"
    # its tensor enters its module's activation before anything saves it: no dispatch, the activation's save
    # (Note: [scopes by their boundaries]); attention's core saves its own tensor: the ops of its module dispatched
    assert machinery_calls(prof, _swap(w1)) == MachineryCalls(0, 1, 1)
    core = "layers.0.attention.flash_attention"
    one = machinery_calls(prof, _swap(core))
    assert one.dispatch == _dispatches(prof, core) > 0 and 2 <= one.pack == one.unpack <= 8
    # a module unit read by a module: recomputed at pack, a hook call per tensor its reader (w2) saves
    assert machinery_calls(prof, Plan(decisions={mul: Decision(Action.RECOMPUTE)})) == MachineryCalls(0, 2, 2)
    # else the policy over the ops of the module holding the unit and its reader (rope and flash attention)
    rope = "layers.0.attention.apply_rotary_emb.rope"
    sac = machinery_calls(prof, Plan(decisions={rope: Decision(Action.RECOMPUTE)}))
    assert sac == MachineryCalls(_dispatches(prof, "layers.0.attention"))
    spread = Plan(decisions={u: Decision(Action.RECOMPUTE) for u in (mul, "layers.0.attention_norm.norm")})
    assert machinery_calls(prof, spread).dispatch == _dispatches(prof, "layers.0") > sac.dispatch
    more = [u.name for u in prof.layer_units(0) if u.saved_bytes > 0]
    counts = [machinery_calls(prof, _swap(*more[:k])) for k in range(1, len(more))]
    assert all(a.dispatch <= b.dispatch and a.pack <= b.pack for a, b in zip(counts, counts[1:]))
    assert counts[0].dispatch < counts[-1].dispatch
    layer = machinery_calls(prof, _swap("layers.0"))  # a whole layer: its saved tensors and its readers', no dispatch
    assert layer.dispatch == 0 and layer.pack >= _saved_tensors(prof, {u.name for u in prof.layer_units(0)}) > 0


def test_the_simulator_charges_the_calls_at_their_cost(prof):
    plans = [Plan(), _swap("layers.0.feed_forward.w1.matmul"), _swap("layers.0", "layers.1"),
             Plan(decisions={"layers.0.feed_forward.mul": Decision(Action.RECOMPUTE)})]
    priced = _priced(prof, 2e-5, 3e-6)
    for plan in plans:
        calls = machinery_calls(prof, plan)
        extra = simulate(priced, plan).step_time - simulate(prof, plan).step_time
        assert extra == pytest.approx(calls.dispatch * 2e-5 + (calls.pack + calls.unpack) * 3e-6, rel=1e-9, abs=1e-12)
    assert simulate(priced, Plan()).step_time == simulate(prof, Plan()).step_time  # the empty plan: nothing


def test_counted_calls_of_one_unit_plans_follow_the_model():
    """The runtime's counted calls (``FOOTPRINT``) of one-unit plans on llama-tiny against the model's count (Note:
    [machinery calls]): within a factor 2 (plus 2 calls), so the per-call prices apply to the calls that happen."""
    from adaptive_mem import optimize
    from adaptive_mem.runtime._footprint import FOOTPRINT

    bundle = build_model("llama-tiny", seed=0, batch_size=2, seq_len=32)
    real = profiler.profile_step(bundle, warmup=0, repeat=1)
    batch = bundle.batch(seed=0)
    plans = [_swap("layers.0.feed_forward.w1.matmul"), _swap("layers.1"),
             Plan(decisions={"layers.0.feed_forward.mul": Decision(Action.RECOMPUTE)}),
             Plan(decisions={"layers.0.attention.apply_rotary_emb.rope": Decision(Action.RECOMPUTE)})]
    for plan in plans:
        with optimize(bundle.model, plan=plan):
            for _ in range(2):  # the second step counted: the first learns the layers' traces
                FOOTPRINT.reset()
                bundle.loss(batch).backward()
            counted = FOOTPRINT.snapshot()
        bundle.model.zero_grad(set_to_none=True)
        model = machinery_calls(real, plan)
        for key in ("dispatch", "pack", "unpack"):
            want = getattr(model, key)
            assert counted[key] <= 2 * want + 2 and want <= 2 * counted[key] + 2, (plan.decisions, key, counted, model)
