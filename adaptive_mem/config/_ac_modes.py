"""The activation-checkpointing (AC) modes users compare against, as plans of a profiled model.

``ac_plan(mode, profile)`` turns a profile (its layers, its units and their ops in order) into the
:class:`search.Plan` one AC mode of torchtitan, Megatron-LM or Hugging Face transformers decides, so the
simulator (``search.simulate``) and the executor (``adaptive_mem.optimize``) run it like any plan and an
estimate sets it beside ours. Their decisions are reproduced, not their code (docs/search.md, "AC modes"):

* ``none``: no checkpointing, every unit kept;
* ``full``: torchtitan ``--activation_checkpoint.mode full``: every layer recomputed as a whole;
* ``op``: torchtitan ``mode selective`` per op (:func:`titan_op_policy`), in every layer;
* ``layer:N``: torchtitan ``selective_ac_option N``: every N-th layer recomputed as a whole
  (:func:`titan_layer_policy`);
* ``megatron-selective`` / ``megatron-full``: Megatron-LM's ``--recompute-granularity selective`` (core
  attention) and ``full --recompute-method uniform --recompute-num-layers 1``, through the Megatron flag
  front-end (``plan_from_megatron``);
* ``hf``: Hugging Face ``gradient_checkpointing_enable()``: every decoder layer
  (``GradientCheckpointingLayer``) recomputed as a whole.

Each policy is a small function returning an :class:`search.Action` for what it is handed.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Callable

from profiler import OpRecord, Profile
from profiler.naming import LayerKinds
from search import Action, Decision, Plan, StepModel

from ._errors import ConfigError, fmt
from ._megatron import plan_from_megatron
from ._names import LayerNames

__all__ = ["AC_MODES", "ac_plan", "parse_ac_mode", "profile_names", "titan_cached_bytes", "titan_layer_policy",
           "titan_op_model", "titan_op_policy", "whole_layer_policy"]

AC_MODES = ("none", "full", "op", "layer:N", "megatron-selective", "megatron-full", "hf")
"""The mode names ``ac_plan`` takes; ``layer:N`` with N an integer >= 1."""

_SOURCES = {
    "none": "no activation checkpointing",
    "full": "torchtitan activation_checkpoint.mode=full (FullAC)",
    "op": "torchtitan activation_checkpoint.mode=selective (SelectiveAC, per-op save list)",
    "layer": "torchtitan activation_checkpoint.mode=selective, selective_ac_option={every}",
    "megatron-selective": "Megatron-LM --recompute-granularity selective (recompute_modules core_attn)",
    "megatron-full": "Megatron-LM --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "hf": "Hugging Face transformers gradient_checkpointing_enable()",
}

# Note: [torchtitan op save list]
# torchtitan's SelectiveAC (torchtitan/distributed/activation_checkpoint.py, _get_default_save_ops) saves the
# outputs of PyTorch's compute-intensive ops (torch._functorch.partitioners.get_default_op_list()), of the SDPA
# and FlexAttention kernels, ``max`` (the amax of low-precision scaling), ``linear``, ``topk`` (MoE routing) and of
# the collectives reduce_scatter and all_to_all; every other op is recomputed. The CPU flash kernel stands for the
# accelerator kernel a GPU run would use (torchtitan lists every CUDA SDPA kernel), so a profile made on CPU plans
# as one made for the GPU. Names are aten overloads as a profile records them (``OpRecord.op``).
_SAVE_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.convolution.default",
    "aten.convolution_backward.default", "aten._scaled_mm.default", "aten.upsample_bilinear2d.default",
    "aten.upsample_bilinear2d.vec", "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default", "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default", "higher_order.flex_attention",
    "aten.max.default", "aten.linear.default", "aten.topk.default",
    "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_to_all_single.default",
})
_MM_OPS = frozenset({"aten.mm.default", "aten.linear.default"})
"""The matmuls torchtitan counts for its "every second matmul is recomputed" rule (``addmm``, ``bmm`` are not)."""


def titan_op_policy(op: str, mm_count: int) -> Action:
    """torchtitan's per-op decision for ``op`` (an aten overload name) inside one layer call: ``mm_count`` is how
    many ``mm``/``linear`` ops the layer has run up to and including this one. Every second of those matmuls is
    recomputed (the 2nd, 4th, ...), the other ops of the save list are kept (Note: [torchtitan op save list]),
    everything else is recomputed."""
    if op in _MM_OPS and mm_count % 2 == 0:
        return Action.RECOMPUTE
    return Action.KEEP if op in _SAVE_OPS else Action.RECOMPUTE


def titan_layer_policy(index: int, every: int) -> Action:
    """torchtitan's ``selective_ac_option=N`` for layer ``index`` (from 0): its counter counts layers from 1 and
    checkpoints those it divides by N, so with N=2 layers 1, 3, 5, ... are recomputed and layer 0 is kept."""
    return Action.RECOMPUTE if (index + 1) % every == 0 else Action.KEEP


def whole_layer_policy(index: int) -> Action:
    """torchtitan ``full`` and Hugging Face's gradient checkpointing: every layer recomputed as a whole."""
    return Action.RECOMPUTE


def parse_ac_mode(mode: object) -> tuple[str, int]:
    """``(name, N)`` of a mode (N only for ``layer:N``, else 0); ConfigError naming the value and the forms."""
    expected = f"expected one of {', '.join(AC_MODES)} (N an integer >= 1)"
    if not isinstance(mode, str):
        raise ConfigError(f"ac mode={fmt(mode)}: {expected}")
    found = re.fullmatch(r"layer:(\d+)", mode)
    if found and int(found.group(1)) >= 1:
        return "layer", int(found.group(1))
    if mode not in AC_MODES or mode == "layer:N":
        raise ConfigError(f"ac mode={mode!r}: {expected}")
    return mode, 0


def _describe(profile: Profile) -> tuple[str | None, dict]:
    """The profile's fingerprint and the plan's ``model`` description (as the solvers write them)."""
    info = {k: profile.model.get(k) for k in ("spec", "batch_size", "seq_len", "dtype")
            if profile.model.get(k) is not None}
    info["num_layers"] = profile.num_layers
    return profile.model.get("fingerprint"), info


def _layer_plan(profile: Profile, policy: Callable[[int], Action]) -> Plan:
    """``layers.i: recompute`` for each layer ``policy(i)`` decides so."""
    return Plan(decisions={profile.layer_path(i): Decision(Action.RECOMPUTE) for i in range(profile.num_layers)
                           if policy(i) is Action.RECOMPUTE})


def _titan_kept(profile: Profile, layer: int) -> tuple[list[OpRecord], set[int]]:
    """The ops of layer ``layer`` in forward order and the indices of those torchtitan's policy keeps."""
    ops = sorted((profile.ops[k] for u in profile.units if u.layer == layer for k in u.ops), key=lambda o: o.index)
    mm_count, kept = 0, set()
    for op in ops:
        mm_count += op.op in _MM_OPS
        if titan_op_policy(op.op, mm_count) is Action.KEEP:
            kept.add(op.index)
    return ops, kept


def _op_plan(profile: Profile) -> Plan:
    """torchtitan's per-op SAC on every layer, unit by unit: a unit is kept when its layer's policy keeps one of its
    ops (a Linear's matmul with the cast before it under autocast), recomputed otherwise; units that save nothing
    for backward take no decision (keep and recompute are the same for them)."""
    decisions: dict[str, Decision] = {}
    for i in range(profile.num_layers):
        ops, kept = _titan_kept(profile, i)
        keep = {op.unit for op in ops if op.index in kept}
        decisions.update({u.name: Decision(Action.RECOMPUTE) for u in profile.units
                          if u.layer == i and u.name not in keep and u.saved_bytes > 0})
    return Plan(decisions=decisions)


# Note: [torchtitan SAC cache]
# PyTorch's selective checkpoint caches the output of every op its policy marks MUST_SAVE until the layer's
# backward, and torchtitan's policy marks its whole save list so, also outputs autograd does not save: on a Llama
# layer the ``wq`` projection's (read only by the rotary embedding, which is recomputed) and ``w2``'s (read only by
# the residual add). Under torch.compile the partitioner saves a MUST_SAVE output only when backward reads it, that
# is when a recomputed op whose output autograd saves is computed from it through recomputed ops of the layer: there
# ``wq``'s is held and ``w2``'s is not. An output read outside the layer is the layer's output, held anyway.
# ``titan_cached_bytes`` returns these bytes per unit. Which figure is which:
# * ``search.simulate(profile, ac_plan("op", profile))`` is what ``adaptive_mem.optimize`` holds running the plan:
#   the executor's policy caches nothing autograd would not save (Note: [SAC policy]), so none of these bytes;
# * ``adaptive_mem.estimate(..., ac="op")`` is torchtitan's run: it simulates the plan on ``titan_op_model``, whose
#   units carry these bytes as ``sac_extra`` (what a SAC policy caches beyond what autograd saves).
# Both measured on llama-tiny and hf:qwen2, eager and aot_eager (tests/test_titan_sac_memory.py), and on
# llama-small (docs/search.md). Not modelled: torchtitan's replay reads a cached output instead of running its op again; the
# model charges that op's replay as the executor's policy runs it.
def titan_cached_bytes(profile: Profile) -> dict[str, int]:
    """Bytes of each unit's outputs torchtitan's ``selective op`` caches beyond what autograd saves, eager or, for a
    compiled profile, as the partitioner saves them (Note: [torchtitan SAC cache]); units without any are left out."""
    cached: dict[str, int] = {}
    for i in range(profile.num_layers):
        ops, kept = _titan_kept(profile, i)
        for op in ops:
            extra = op.output_bytes - op.saved_bytes
            if op.index not in kept or extra <= 0 or not _inside(profile, op, i):
                continue
            if profile.compiled is None or _read_by_backward(profile, op, kept, i):
                cached[op.unit] = cached.get(op.unit, 0) + extra
    return cached


def _inside(profile: Profile, op: OpRecord, layer: int) -> bool:
    """Whether every reader of ``op``'s output is an op of layer ``layer``."""
    return all(profile.ops[c].layer == layer for c in op.consumers)


def _read_by_backward(profile: Profile, op: OpRecord, kept: set[int], layer: int) -> bool:
    """Whether a recomputed op of the layer whose output autograd saves is computed from ``op``'s output through
    recomputed ops of the layer (the compiled backward then reads the cached output)."""
    todo, seen = list(op.consumers), set()
    while todo:
        c = profile.ops[todo.pop()]
        if c.index in seen or c.index in kept or c.layer != layer:
            continue
        seen.add(c.index)
        if c.saved_bytes > 0 and _inside(profile, c, layer):
            return True
        todo.extend(c.consumers)
    return False


def titan_op_model(model: StepModel) -> StepModel:
    """``model`` with torchtitan's cached outputs (:func:`titan_cached_bytes`) as its units' ``sac_extra``: what an
    ``op`` plan holds under torchtitan's policy rather than the executor's (Note: [torchtitan SAC cache])."""
    cached = titan_cached_bytes(model.profile)
    return dataclasses.replace(model, units=[dataclasses.replace(u, sac_extra=cached.get(u.name, 0))
                                             for u in model.units])


def _module_paths(units: tuple[str, ...]) -> tuple[str, ...]:
    """The local module paths above local unit names (``mlp.act_fn.silu`` -> ``mlp``, ``mlp.act_fn``)."""
    return tuple(dict.fromkeys(u.rsplit(".", k)[0] for u in units for k in range(u.count("."), 0, -1)))


def profile_names(profile: Profile) -> LayerNames:
    """The layers' local names as the config front-ends see them, from a profile's units: layers with the same
    local unit names are of one kind (Note: [layer kinds])."""
    info = profile.layer_info()
    per_layer = [tuple(dict.fromkeys(u.local_name for u in profile.units if u.layer == i)) for i in range(info.count)]
    first = tuple(per_layer.index(names) for names in per_layer)
    modules = tuple(_module_paths(per_layer[f]) for f in first)
    stacks = info.stacks if len(info.stacks) > 1 else ()
    by_kind = {f: (modules[f], per_layer[f]) for f in dict.fromkeys(first)}
    if len(by_kind) == 1:
        return LayerNames(info.container, info.count, modules[0], per_layer[0], stacks=stacks)
    return LayerNames(info.container, info.count, tuple(dict.fromkeys(m for ms, _ in by_kind.values() for m in ms)),
                      tuple(dict.fromkeys(u for _, us in by_kind.values() for u in us)), stacks=stacks,
                      kinds=LayerKinds(first=first, modules=modules), by_kind=by_kind)


def _megatron_plan(profile: Profile, granularity: str) -> Plan:
    flags = argparse.Namespace(recompute_granularity=granularity, recompute_num_layers=1,
                               recompute_method="uniform" if granularity == "full" else None)
    return plan_from_megatron(flags, names=profile_names(profile), num_layers=profile.num_layers)


def ac_plan(mode: str, profile: Profile) -> Plan:
    """The plan AC mode ``mode`` (one of :data:`AC_MODES`) decides for the model of ``profile``.

    Whole-layer modes name layers (``layers.3: recompute``); ``op`` and ``megatron-selective`` name units of each
    layer. The plan carries the profile's fingerprint and ``meta.ac_mode`` / ``meta.ac_source``. Raises
    ConfigError for an unknown mode, a profile without layers, or (Megatron selective) a model without an
    attention core unit."""
    name, every = parse_ac_mode(mode)
    if not isinstance(profile, Profile):
        raise ConfigError(f"profile={fmt(profile)}: expected a profiler.Profile")
    if profile.layer_info() is None:
        raise ConfigError(f"profile of {profile.model.get('spec')!r}: no repeated layers; expected a profile of a "
                          "model with layers (an AC mode decides per layer)")
    if name in ("megatron-selective", "megatron-full"):
        plan = _megatron_plan(profile, name.split("-", 1)[1])
    elif name == "op":
        plan = _op_plan(profile)
    elif name == "layer":
        plan = _layer_plan(profile, lambda i: titan_layer_policy(i, every))
    elif name in ("full", "hf"):
        plan = _layer_plan(profile, whole_layer_policy)
    else:
        plan = Plan()
    plan.fingerprint, plan.model = _describe(profile)
    plan.meta.update(ac_mode=mode, ac_source=_SOURCES[name].format(every=every))
    return plan
