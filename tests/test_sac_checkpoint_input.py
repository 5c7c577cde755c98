"""Acceptance: a layer under a selective checkpoint holds its inputs, and the simulator counts them.

Note: [selective checkpoint input] in ``search/_simulator.py``. Each plan kind (torchtitan's per-op SAC ``op``,
``full``, and a MILP plan with op-level recompute decisions) is profiled on real CPU tensors, simulated, and run by
the executor under the counting CPU allocator (``DeviceMemory``). Two models: llama-small in bf16, whose RMSNorm
upcasts the block input before saving it (autograd saves no bf16 block input: only the checkpoint holds it), and
hf:qwen2 in fp32 (the norm saves the block input itself: held once, by the previous layer).

Compared per plan: the bytes the forward leaves alive for backward against the segments' held bytes, equal up to
the CPU RNG state each checkpoint saves (``preserve_rng_state``: host memory on an accelerator, a few KiB per
layer); and, on llama-small, the step's peak within 5 % (the model's own: what else the process holds on the
counted device is taken out). On hf:qwen2's few-KiB layers the simulated peak is under the measured one by at
most 20 %: there the activation gradients inside a recomputed layer's backward, which the simulator does not
model, are 10-15 % of it.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import adaptive_mem as am
import profiler
from adaptive_mem import DeviceMemory
from search import Action, Plan, StepModel, simulate
from search.planning import resolve, segments

pytestmark = pytest.mark.slow

RNG_STATE = 8 << 10
"""Bytes per checkpointed layer of the CPU RNG state it saves (5056 B on this torch) and the like."""

MODELS = {"llama-small-bf16": ("llama-small", "bfloat16", 512, 2), "qwen2-fp32": ("hf:qwen2", "float32", 256, 4)}


def _build(name: str):
    spec, dtype, seq_len, batch_size = MODELS[name]
    return am.build_model(spec, seed=0, batch_size=batch_size, seq_len=seq_len, dtype=dtype)


def _milp_plan(profile) -> Plan:
    """The MILP's plan where copies to the host crawl: recompute decisions only, op-level ones among them."""
    slow_link = dataclasses.replace(profile.hardware, h2d_bandwidth=1e5, d2h_bandwidth=1e5)
    plan = am.search(profile, budget="35%", hardware=slow_link).plan
    assert {d.action for d in plan.decisions.values()} == {Action.RECOMPUTE}, plan.to_dict()["decisions"]
    return plan


def _measure(name: str, plan: Plan) -> tuple[int, int]:
    """(bytes alive at the loss beyond those before the forward, peak device bytes) of the second step: the peak
    of this model's tensors, without what else the test process holds on the counted device (the live bytes before
    the forward beyond the model's parameters and its batch)."""
    bundle = _build(name)
    handle = am.optimize(bundle.model, plan=plan)
    gc.collect()
    mem = DeviceMemory(device=bundle.device)
    try:
        with mem:
            for step in range(2):  # the first step also runs the plan's discovery pass
                bundle.model.zero_grad(set_to_none=True)
                batch = bundle.batch(seed=step)  # the inputs: before the count starts, as the simulator's base has them
                before = mem.live
                mem.reset_peak()
                loss = bundle.loss(batch)
                held = mem.live - before
                loss.backward()
                del loss
    finally:
        handle.remove()
    own = sum(p.numel() * p.element_size() for p in bundle.model.parameters()) + sum(t.nbytes for t in batch)
    return held, mem.peak - (before - own)


@pytest.fixture(scope="module", params=list(MODELS))
def measured(request):
    """name -> (plan kind -> (plan, simulated held, simulated peak, checkpointed layers, measured held, peak))."""
    name = request.param
    bundle = _build(name)
    profile = profiler.profile_step(bundle, optimizer="sgd", warmup=0, repeat=0, record=1)
    del bundle
    model = StepModel.build(profile)
    out = {}
    for kind in ("op", "full", "milp"):
        plan = _milp_plan(profile) if kind == "milp" else am.ac_plan(kind, profile)
        segs = segments(model, resolve(model, plan))
        checkpointed = sum(len(s.positions) for s in segs if s.mode != "plain")
        modes = {s.mode for s in segs}
        out[kind] = (modes, sum(s.held for s in segs), simulate(model, plan).peak_bytes, checkpointed,
                     *_measure(name, plan))
    return name, model, out


@pytest.mark.parametrize("kind", ["op", "full", "milp"])
def test_simulated_held_bytes_are_the_measured_ones(measured, kind):
    name, model, out = measured
    modes, held, _, checkpointed, measured_held, _ = out[kind]
    assert checkpointed and ("sac" in modes) == (kind != "full"), (name, kind, modes)
    assert 0 <= measured_held - held <= RNG_STATE * checkpointed, (name, kind, held, measured_held)


def test_a_bf16_block_input_is_held_only_by_the_checkpoint(measured):
    name, model, out = measured
    layer_input = model.input_extra[2]
    if name.endswith("bf16"):
        assert layer_input > 0  # not saved by autograd: the selective checkpoint's own
    else:
        assert layer_input == 0  # saved by the norm: held by the previous layer, counted once


@pytest.mark.parametrize("kind", ["op", "full", "milp"])
def test_simulated_peak_is_within_five_percent(measured, kind):
    name, _, out = measured
    _, _, peak, _, _, measured_peak = out[kind]
    if not name.startswith("llama-small"):
        # hf:qwen2's few-KiB layers: the activation gradients inside a recomputed layer's backward, not simulated
        # (module docstring), are 10-15 % of the peak: the simulated peak is under the measured one by at most that
        assert 0.8 * measured_peak <= peak <= measured_peak, (name, kind, peak, measured_peak)
        return
    assert peak == pytest.approx(measured_peak, rel=0.05), (name, kind, peak, measured_peak)
