"""Whole-layer recompute with its checkpoint input swapped (Note: [swapped checkpoint input]).

Exact against the same model without a plan (eager: llama-tiny and two Hugging Face families; per-block compiled:
aot_eager), the device bytes left after the forward measured by ``DeviceMemory`` drop by exactly the layer inputs
(counted independently by forward pre-hooks) and by what the simulator predicts, and plans that ask for it where
it cannot apply are refused with one line. The search side (milp against brute force with the option) is in
tests/test_milp_exact.py.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from adaptive_mem import DeviceMemory, build_model, optimize
from profiler import profile_step
from profiler.naming import find_layers
from search import Plan, PlanError, StepModel, simulate
from search.planning import resolve, segments

from _compile_common import compiled_step


def _plan(decisions: dict, **extra) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, **extra})


FULL = {"layers": "recompute"}


def _swap_in(d: int, target: str = "layers") -> dict:
    return {target: {"action": "recompute", "swap_input": True, "backward_prefetch": d}}


def _step(bundle, model, plan):
    """Loss, gradients, device bytes left after the forward and the layer inputs' bytes (pre-hooks)."""
    model.zero_grad(set_to_none=True)
    handle = optimize(model, plan=plan) if plan is not None else None
    inputs: list[int] = []  # one entry per layer call (a storage key could be reused once the input is freed)

    def pre(module, args, kwargs=None):
        x = args[0] if args else next(iter(kwargs.values()))
        inputs.append(x.untyped_storage().nbytes())

    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)][0]
    hooks = [layer.register_forward_pre_hook(pre) for layer in layers]
    run = copy.copy(bundle)
    run.model = model
    try:
        gc.collect()
        mem = DeviceMemory(track_existing=False)
        with mem:
            loss = run.loss(bundle.batch(seed=0))
            engine = handle._executor.engine if handle is not None else None
            if engine is not None:  # every offload landed, its source released (both copiers)
                engine.drain()
            held = mem.live
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
        if handle is not None:
            handle.remove()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, held, sum(inputs)


@pytest.mark.parametrize("spec", ["llama-tiny", "hf:qwen2", "hf:gpt2"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_exact_and_frees_the_layer_inputs(spec, prefetch):
    bundle = build_model(spec, batch_size=2, seq_len=32, seed=0)
    container = find_layers(bundle.model).containers[0]
    loss0, grads0, _, _ = _step(bundle, copy.deepcopy(bundle.model), None)
    _, _, full_held, _ = _step(bundle, copy.deepcopy(bundle.model), _plan({container: "recompute"}))
    loss, grads, held, inputs = _step(bundle, copy.deepcopy(bundle.model), _plan(_swap_in(prefetch, container)))
    assert torch.equal(loss, loss0)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads0))
    assert inputs > 0 and full_held - held == inputs, (full_held, held, inputs)


def test_mixed_with_op_swap_and_keep_is_exact():
    bundle = build_model("llama-tiny", batch_size=2, seq_len=32, seed=0)
    loss0, grads0, _, _ = _step(bundle, copy.deepcopy(bundle.model), None)
    plan = _plan({**_swap_in(2, "layers.1"), "layers.2.attention": {"action": "swap", "backward_prefetch": 1},
                  "layers.3": "recompute"})
    loss, grads, _, _ = _step(bundle, copy.deepcopy(bundle.model), plan)
    assert torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))


def test_simulator_predicts_the_freed_inputs():
    bundle = build_model("llama-tiny", batch_size=2, seq_len=32, seed=0)
    profile = profile_step(bundle, repeat=1, record=1)
    model = StepModel.build(profile)
    asg = resolve(model, _plan(_swap_in(1)))
    assert asg.inputs == tuple((p, 1) for p in model.layer_positions)
    assert [s.in_swap for s in segments(model, asg)][1:-1] == model.input_swap[1:-1]
    full = simulate(profile, _plan(FULL), record=True)
    swapped = simulate(profile, _plan(_swap_in(1)), record=True)
    end = model.forward_time

    def at_forward_end(sim):
        return max(v for t, v in sim.timeline.memory if t <= end)

    assert swapped.swapped_bytes == sum(model.input_swap)
    assert at_forward_end(full) - at_forward_end(swapped) == sum(model.input_swap[2:]), model.input_swap
    _, _, full_held, _ = _step(bundle, copy.deepcopy(bundle.model), _plan(FULL))
    _, _, held, inputs = _step(bundle, copy.deepcopy(bundle.model), _plan(_swap_in(1)))
    assert sum(model.input_swap) == inputs == full_held - held


def test_per_block_compiled_is_exact_and_offloads_the_inputs():
    def fresh():
        torch._dynamo.reset()
        counters.clear()
        b = build_model("llama-tiny", model_args={"num_layers": 2}, batch_size=2, seq_len=32, seed=0)
        for layer in b.model.layers:
            layer.compile(backend="aot_eager")
        return b.model, b.batch(seed=0)

    model, batch = fresh()
    ref = compiled_step(model, model, batch)
    model, batch = fresh()
    with optimize(model, plan=_plan(_swap_in(1))) as handle:
        got = compiled_step(model, model, batch)
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        stats = handle.swap_stats
        assert stats.offloaded_bytes >= 2 * 2 * 32 * 64 * 4 and stats.reloaded_bytes == stats.offloaded_bytes
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("decisions, extra, message", [
    ({"layers.0.attention": {"action": "recompute", "swap_input": True}}, {}, "swap_input covers part of a layer"),
    ({"layers": {"action": "swap", "swap_input": True}}, {}, "swap_input=true with action swap"),
    ({"layers": {"action": "recompute", "swap_input": "yes"}}, {}, "swap_input='yes': expected true or false"),
    ({"layers": {"action": "recompute", "swap_input": True}}, {"groups": [[0, 1]]}, "of a checkpoint group"),
])
def test_refused_where_it_cannot_apply(decisions, extra, message):
    bundle = build_model("llama-tiny", batch_size=2, seq_len=32, seed=0)
    with pytest.raises(PlanError, match=message) as err:
        plan = _plan(decisions, **extra)
        optimize(bundle.model, plan=plan)
    assert "\n" not in str(err.value)
    assert not any(k.startswith("_adaptive") for k in vars(bundle.model))
