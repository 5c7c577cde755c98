"""What torchtitan's ``selective op`` holds, measured: its policy run by PyTorch's selective checkpoint around every
layer of llama-tiny (eager and compiled with aot_eager), the executor running ``ac_plan("op")``, and the simulator's
two figures (Note: [torchtitan SAC cache]): the executor's (``search.simulate`` of the plan) and torchtitan's
(``titan_op_model``, what ``estimate(ac="op")`` simulates). Bytes are the device bytes held once the last layer's
forward has returned (``DeviceMemory``'s exact accounting; parameters existed before and are not counted)."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import adaptive_mem._estimate as estimate_module
import profiler
from adaptive_mem import DeviceMemory, ac_plan, build_model, estimate, optimize
from adaptive_mem.config._ac_modes import titan_cached_bytes, titan_op_model, titan_op_policy
from search import Action, StepModel, simulate

BATCH, SEQ = 2, 32
CLOSE = 0.05
"""Simulated against measured, relative."""


def _build():
    return build_model("llama-tiny", batch_size=BATCH, seq_len=SEQ, seed=0)


@functools.lru_cache(maxsize=None)
def _profile(compiled: bool):
    profile = profiler.profile_step(_build(), warmup=0, repeat=0, record=1, optimizer_time=0.0)
    return profiler.compiled_estimate(profile) if compiled else profile


def _titan_context():
    """torchtitan's ``_custom_policy``: its own matmul count per forward and per recompute of one layer call."""
    counts: dict[str, int] = collections.defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        counts[mode] += str(func) in ("aten.mm.default", "aten.linear.default")
        keep = titan_op_policy(str(func), counts[mode]) is Action.KEEP
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class _TitanLayer(torch.nn.Module):
    """One layer under torchtitan's ``SelectiveAC`` (``ptd_checkpoint_wrapper`` with its ``context_fn``)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return checkpoint(self.layer, *args, use_reentrant=False, context_fn=_titan_context)


def _held_after_layers(bundle) -> int:
    """Device bytes held when the last layer's forward returns, in the second of two steps (the first compiles)."""
    batch, seen = bundle.batch(seed=0), {}
    for _ in range(2):
        bundle.model.zero_grad(set_to_none=True)
        with DeviceMemory(track_existing=False) as mem:
            hook = bundle.model.layers[-1].register_forward_hook(lambda *a: seen.__setitem__("held", mem.live))
            loss = bundle.loss(batch)
            hook.remove()
            loss.backward()
    return seen["held"]


def _measured_titan(backend: str | None) -> int:
    bundle = _build()
    layers = bundle.model.layers
    for i, layer in enumerate(layers):
        layers[i] = _TitanLayer(layer) if backend is None else torch.compile(_TitanLayer(layer), backend=backend)
    try:
        return _held_after_layers(bundle)
    finally:
        torch._dynamo.reset()


def _measured_executor() -> int:
    bundle, profile = _build(), _profile(False)
    with optimize(bundle.model, plan=ac_plan("op", profile), profile=profile):
        return _held_after_layers(bundle)


def _simulated(model: StepModel) -> int:
    """Simulated bytes above the static ones when the last layer's forward ends."""
    sim = simulate(model, ac_plan("op", model.profile), record=True)
    end = max(iv.end for iv in sim.timeline.intervals
              if iv.kind == "forward" and iv.label == f"layer {model.num_layers - 1}")
    return [b for t, b in sim.timeline.memory if t <= end][-1] - model.base


def test_the_cached_outputs_are_torchtitans_save_list_outside_autograds_saves():
    """Eager: ``wq`` (1st matmul) and ``w2`` (7th) outputs, which autograd does not save; compiled: ``wq``'s alone,
    which the recompute of the rotary embedding reads."""
    profile = _profile(False)
    layers = range(profile.num_layers)
    out = {u.name: u.output_bytes for u in profile.units}
    names = [f"{profile.layer_path(i)}.{local}" for i in layers for local in ("attention.wq.matmul",
                                                                           "feed_forward.w2.matmul")]
    assert titan_cached_bytes(profile) == {n: out[n] for n in names}
    assert titan_cached_bytes(_profile(True)) == {n: out[n] for n in names if "wq" in n}


def test_eager_titan_holds_the_executor_bytes_plus_the_cached_outputs():
    """Measured and simulated alike, torchtitan's run holds the cached outputs more than the executor's (whose figure
    ``search.simulate`` of the plan gives), and the simulated torchtitan figure is the measured one."""
    titan, ours = _measured_titan(None), _measured_executor()
    cached = sum(titan_cached_bytes(_profile(False)).values())
    assert titan - ours == cached > 0
    model = StepModel.build(_profile(False))
    assert _simulated(titan_op_model(model)) - _simulated(model) == cached
    assert _simulated(titan_op_model(model)) == pytest.approx(titan, rel=CLOSE)


def test_compiled_titan_holds_the_modelled_bytes():
    """aot_eager runs the partitioner inductor runs; the compile model's saved bytes with the cached outputs."""
    measured = _measured_titan("aot_eager")
    model = titan_op_model(StepModel.build(_profile(True)))
    assert _simulated(model) == pytest.approx(measured, rel=CLOSE)


def test_estimate_op_counts_the_cached_outputs(monkeypatch):
    """``estimate(ac="op")`` is torchtitan's figure: without the cached outputs it would predict less."""
    args = dict(hardware="h100", gpus=1, precision="bf16", batch_size=BATCH, seq_len=SEQ, ac="op")
    titan = estimate("llama-tiny", **args)
    monkeypatch.setattr(estimate_module, "titan_op_model", lambda model: model)
    ours = estimate("llama-tiny", **args)
    assert titan.peak_allocated_bytes > ours.peak_allocated_bytes
    assert titan.step_time_s == pytest.approx(ours.step_time_s)
