"""What torchtitan's ``selective op`` holds, measured: its policy run by PyTorch's selective checkpoint around every
layer of llama-tiny and hf:qwen2 (eager and compiled with aot_eager), the executor running ``ac_plan("op")``, and the simulator's
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
MODELS = {"llama-tiny": {}, "hf:qwen2": {"num_hidden_layers": 3}}
CLOSE = 0.005
"""Simulated against measured, relative."""
RNG_STATE = torch.get_rng_state().numel()
"""Bytes an eager ``torch.utils.checkpoint`` holds per layer for the CPU generator's state (``preserve_rng_state``):
device memory to ``DeviceMemory`` on CPU, a host tensor on a GPU, and not modelled."""


def _build(spec: str):
    return build_model(spec, model_args=MODELS[spec], batch_size=BATCH, seq_len=SEQ, seed=0)


@functools.lru_cache(maxsize=None)
def _profile(spec: str, compiled: bool):
    profile = profiler.profile_step(_build(spec), warmup=0, repeat=0, record=1, optimizer_time=0.0)
    return profiler.compiled_estimate(profile) if compiled else profile


def _layers(spec: str, bundle) -> torch.nn.ModuleList:
    return bundle.model.get_submodule(_profile(spec, False).layer_info().container)


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

    def forward(self, *args, **kwargs):
        return checkpoint(self.layer, *args, use_reentrant=False, context_fn=_titan_context, **kwargs)


def _held_after_layers(bundle, last: torch.nn.Module) -> int:
    """Device bytes held when the last layer's forward returns, in the second of two steps (the first compiles)."""
    batch, seen = bundle.batch(seed=0), {}
    for _ in range(2):
        bundle.model.zero_grad(set_to_none=True)
        with DeviceMemory(track_existing=False) as mem:
            hook = last.register_forward_hook(lambda *a: seen.__setitem__("held", mem.live))
            loss = bundle.loss(batch)
            hook.remove()
            loss.backward()
    return seen["held"]


def _measured_titan(spec: str, backend: str | None) -> int:
    bundle = _build(spec)
    layers = _layers(spec, bundle)
    for i, layer in enumerate(layers):
        layers[i] = _TitanLayer(layer) if backend is None else torch.compile(_TitanLayer(layer), backend=backend)
    try:
        return _held_after_layers(bundle, layers[-1])
    finally:
        torch._dynamo.reset()


def _measured_executor(spec: str) -> int:
    bundle, profile = _build(spec), _profile(spec, False)
    with optimize(bundle.model, plan=ac_plan("op", profile), profile=profile):
        return _held_after_layers(bundle, _layers(spec, bundle)[-1])


def _simulated(model: StepModel) -> int:
    """Simulated bytes above the static ones when the last layer's forward ends."""
    sim = simulate(model, ac_plan("op", model.profile), record=True)
    end = max(iv.end for iv in sim.timeline.intervals
              if iv.kind == "forward" and iv.label == f"layer {model.num_layers - 1}")
    return [b for t, b in sim.timeline.memory if t <= end][-1] - model.base


# Local names of the units whose outputs torchtitan's policy caches beyond autograd's saves, by hand (eager, then
# compiled). llama-tiny: wq (1st matmul) feeds the recomputed rotary embedding, w2 (7th) the residual add; wo, w3
# are recomputed. Qwen2: the biased q, k projections (addmm, kept) feed the rotary embedding, v is saved by the
# attention, o_proj (1st mm) feeds the residual add that the next norm saves (compiled: kept where the compile
# model keeps that add, layers 1 and 2), up_proj is saved by the gate's mul.
CACHED = {
    "llama-tiny": ({"attention.wq.matmul", "feed_forward.w2.matmul"}, {"attention.wq.matmul"}),
    "hf:qwen2": ({"self_attn.q_proj.matmul", "self_attn.k_proj.matmul", "self_attn.o_proj.matmul"},
                 {"self_attn.q_proj.matmul", "self_attn.k_proj.matmul"}),
}


@pytest.mark.parametrize("spec", list(MODELS))
def test_the_cached_outputs_are_torchtitans_save_list_outside_autograds_saves(spec):
    profile = _profile(spec, False)
    out = {u.name: u.output_bytes for u in profile.units}
    eager, compiled = ({f"{profile.layer_path(i)}.{n}" for i in range(profile.num_layers) for n in names}
                       for names in CACHED[spec])
    assert titan_cached_bytes(profile) == {n: out[n] for n in eager}
    assert compiled <= set(titan_cached_bytes(_profile(spec, True))) <= eager


@pytest.mark.parametrize("spec", list(MODELS))
def test_eager_titan_holds_the_executor_bytes_plus_the_cached_outputs(spec):
    """Measured and simulated alike, torchtitan's run holds the cached outputs more than the executor's (whose figure
    ``search.simulate`` of the plan gives), and the simulated torchtitan figure is the measured one."""
    titan, ours = _measured_titan(spec, None), _measured_executor(spec)
    cached = sum(titan_cached_bytes(_profile(spec, False)).values())
    assert titan - ours == cached > 0
    model = StepModel.build(_profile(spec, False))
    assert _simulated(titan_op_model(model)) - _simulated(model) == cached
    rng = model.num_layers * RNG_STATE
    assert _simulated(titan_op_model(model)) == pytest.approx(titan - rng, rel=CLOSE)
    assert _simulated(model) == pytest.approx(ours - rng, rel=CLOSE)


@pytest.mark.parametrize("spec", list(MODELS))
def test_compiled_titan_holds_the_modelled_bytes(spec):
    """aot_eager runs the partitioner inductor runs; the compile model's saved bytes with the cached outputs."""
    measured = _measured_titan(spec, "aot_eager")
    model = titan_op_model(StepModel.build(_profile(spec, True)))
    assert _simulated(model) == pytest.approx(measured, rel=CLOSE)


def test_estimate_op_counts_the_cached_outputs(monkeypatch):
    """``estimate(ac="op")`` is torchtitan's figure: without the cached outputs it would predict less."""
    args = dict(hardware="h100", gpus=1, precision="bf16", batch_size=BATCH, seq_len=SEQ, ac="op")
    titan = estimate("llama-tiny", **args)
    monkeypatch.setattr(estimate_module, "titan_op_model", lambda model: model)
    ours = estimate("llama-tiny", **args)
    assert titan.peak_allocated_bytes > ours.peak_allocated_bytes
    assert titan.step_time_s == pytest.approx(ours.step_time_s)
