"""One rank's share of a profiled step under a parallel layout (:class:`profiler.Layout`), without the ranks.

A whole-model profile (fake tensors are enough) is cut to what one tensor-parallel rank runs, the
way Megatron shards a transformer (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4). Note: [TP roles]: each unit gets a role from the unit graph
in forward order: a linear (``nn.Linear`` / HF ``Conv1D``) whose inputs are all replicated is
*column*-parallel (its output is split over the TP ranks); a linear fed by a split tensor is
*row*-parallel (its output is whole again after an all-reduce); any other unit is *sharded* when one
of its inputs is split, else *replicated*. Split units keep 1/TP of their bytes, FLOPs and time;
replicated ones keep all of them, or 1/TP under sequence parallel when they carry the sequence
(inside the layers, after them, and the embedding). Each row-parallel linear is followed by a
collective unit named as a real tensor-parallel rank names it (``<linear>.all_reduce``, or
``<linear>.reduce_scatter`` under SP, which here also carries the time of the SP all-gather: the same bytes)
timed on the interconnect at ``2 (t - 1) / t * bytes / bandwidth`` in forward and again in backward
(the all-reduce of the column-parallel input gradient). The logits' column-parallel backward
all-reduce is not modelled (one per step).

Static memory per rank (``rank_static``): the bytes of TP-shardable modules (linears, embeddings)
divided by TP; under ZeRO-1/2/3 over DP the optimizer state and master weights, then the gradients, then the
parameters divided by DP (``profiler._precision.SHARDED_FROM``; a precision recipe may raise the stage:
``megatron-bf16``'s distributed optimizer is ZeRO-1, ``fsdp2-bf16`` ZeRO-3); under ZeRO-3 FSDP2's unsharded
layers and reduce-scatter buffers (Note: [gathered copy]) are held beside them, recorded in ``buffers``, which
pipeline stage splits do not scale; under DDP (ZeRO 0 over several DP ranks) its gradient buckets (Note: [DDP
gradient buckets]), recorded in ``other``, which a pipeline stage holds for its own gradients
(``search._pipeline.stage_static``).

Note: [row-parallel output] a row-parallel linear's matmul writes a whole partial sum on every rank (the
all-reduce, or under SP the reduce-scatter, makes it whole or splits it afterwards): its output bytes are not
divided by TP; its saved bytes, times and FLOPs are. Under SP the saved bytes of every unit of a layer are
divided by TP (Korthikanti et al. 2022, section 4.2.2); without it the norms' and the residual stream's stay whole.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ._layout import Layout
from ._paths import named_modules
from ._precision import PRECISIONS, SHARDED_FROM, Precision, precision_layout
from ._profile import OpRecord, Profile, StaticMemory, UnitRecord
from ._units import LayerInfo

__all__ = ["ParameterSplit", "collective_time", "ddp_bucket_bytes", "fsdp_buffer_bytes", "group_bandwidth", "rank_share",
           "parameter_split", "rank_static", "shard_profile", "tp_roles"]

_LINEARS = ("Linear", "Conv1D", "NonDynamicallyQuantizableLinear")
_SHARDABLE = (*_LINEARS, "Embedding")


@dataclass(frozen=True)
class ParameterSplit:
    linears: frozenset[str]
    """Module paths of the linears (their matmul units get TP roles)."""
    shardable: int
    """Parameter bytes of modules TP splits (linears, embeddings)."""
    total: int
    """All parameter bytes."""
    layer: int
    """Parameter bytes of the largest layer on one TP rank (what ZeRO-3 gathers for the layer in flight)."""
    outer: int = 0
    """Parameter bytes on one TP rank of the largest module outside the layers (the output head or the embedding:
    an FSDP2 unit of its own, gathered for the first backward; Note: [gathered copy])."""


def parameter_split(model: nn.Module, layers: LayerInfo | None, *, tensor_parallel: int) -> ParameterSplit:
    """What of ``model``'s parameters tensor parallelism splits (read from its module types)."""
    linears, shardable, seen = set(), 0, set()
    per_layer: dict[int, float] = defaultdict(float)
    outer: dict[str, float] = defaultdict(float)
    for name, module in named_modules(model):  # Note: [compile wrapper names]
        kind = type(module).__name__
        if kind in _LINEARS:
            linears.add(name)
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            nbytes = p.numel() * p.element_size()
            split = kind in _SHARDABLE
            shardable += nbytes if split else 0
            index = layers.split(name)[0] if layers is not None else None
            share = nbytes / tensor_parallel if split else nbytes
            if index is not None:
                per_layer[index] += share
            else:  # outside the layers: one unit per module holding parameters (embedding, head, final norm)
                outer[name] += share
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    return ParameterSplit(frozenset(linears), shardable, total, int(max(per_layer.values(), default=0)),
                          int(max(outer.values(), default=0)))


def collective_time(nbytes: int, *, ranks: int, bandwidth: float, kind: str = "all_reduce") -> float:
    """Ring time of a collective over ``ranks`` on ``bandwidth`` bytes/s (bus bandwidth, per direction):
    all-reduce moves ``2 (r - 1) / r`` of the bytes, all-gather and reduce-scatter ``(r - 1) / r``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if bandwidth <= 0:
        raise ValueError(f"interconnect bandwidth={bandwidth!r}: expected > 0 bytes/s for a {ranks}-rank {kind}")
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * (ranks - 1) / ranks * nbytes / bandwidth


def tp_roles(profile: Profile, linears: frozenset[str]) -> dict[str, str]:
    """Unit name -> ``column``, ``row``, ``sharded`` or ``replicated`` (Note: [TP roles])."""
    producers: dict[str, list[str]] = defaultdict(list)
    for unit in profile.units:
        for consumer in unit.consumers:
            producers[consumer].append(unit.name)
    roles: dict[str, str] = {}
    for unit in profile.units:
        split = any(roles.get(p) in ("column", "sharded") for p in producers[unit.name])
        modules = {profile.ops[i].module for i in unit.ops}
        if len(modules) == 1 and next(iter(modules)) in linears:
            roles[unit.name] = "row" if split else "column"
        else:
            roles[unit.name] = "sharded" if split else "replicated"
    return roles


def rank_static(static: StaticMemory, *, layout: Layout, split: ParameterSplit,
                precision: Precision | None = None) -> StaticMemory:
    """One rank's parameters, gradients, master weights and optimizer state (before the pipeline split by stage):
    each figure divided by DP from its ZeRO stage on (``SHARDED_FROM``); FSDP2's gathered layers and
    reduce-scatter buffers added to ``buffers`` (``fsdp_buffer_bytes``), DDP's gradient buckets to ``other``
    (``ddp_bucket_bytes``)."""
    t, d, z = layout.tensor_parallel, layout.data_parallel, layout.zero
    scale = (split.shardable / t + split.total - split.shardable) / split.total if split.total else 1.0
    figures = {key: int(getattr(static, key) * scale / (d if z >= stage else 1)) for key, stage in SHARDED_FROM.items()}
    gathered = fsdp_buffer_bytes(split.layer, layout=layout, precision=precision, outer=split.outer)
    return replace(static, **figures, buffers=static.buffers + gathered,
                   other=static.other + ddp_bucket_bytes(figures["gradients"], layout))


def fsdp_buffer_bytes(layer: int, *, layout: Layout, precision: Precision | None, outer: int = 0) -> int:
    """Note: [gathered copy] what FSDP2 (ZeRO-3) holds beside a rank's shards at the activation peak, the start
    of backward, for layers of ``layer`` unsharded bytes in the dtype the forward reads them in
    (``ParameterSplit.layer``, on a model built in ``Precision.model_dtype``). Read from
    ``torch/distributed/fsdp/_fully_shard``: ``_fsdp_collectives.foreach_all_gather`` gathers a layer into a new
    flat buffer of the whole layer in the parameter dtype (the rank's own shard copied in, the sharded parameters
    kept), copied out into the unsharded parameters; ``_fsdp_param_group`` gathers the next layer while the
    current one computes (implicit forward prefetch, and backward prefetch), so at the start of backward the last
    layer's parameters (gathered for its backward) and the previous layer's (prefetched) are unsharded: two
    layers. ``foreach_reduce`` packs each layer's unsharded gradients into a reduce-scatter input of the whole
    layer in the reduce dtype (the recipe's gradient bytes: fp32 for ``fsdp2-bf16``) and a ``1 / d`` output shard,
    held until the reduce-scatter is waited on, while the previous layer's backward runs: one layer's. The first
    unit of backward is the output head (``outer``: the largest module outside the layers, an FSDP2 unit of its
    own as torchtitan and HF Accelerate wrap it) where it outweighs a layer: it is gathered beside the prefetched
    last layer, and its gradients are the reduce-scatter in flight."""
    d = layout.data_parallel
    if layout.zero < 3 or d == 1 or layer <= 0:
        return 0
    first = max(layer, outer)
    reduce = first if precision is None else first * precision.gradients // precision.model_dtype.itemsize
    return first + layer + reduce + reduce // d


def ddp_bucket_bytes(gradient_bytes: int, layout: Layout) -> int:
    """The runtime's rule (Note: [DDP gradient buckets] in ``adaptive_mem/adaptive/_wrappers.py``) on a rank's
    figures: DDP without ZeRO on several data-parallel ranks holds flat buckets beside ``.grad`` for the whole
    step, as many bytes as the gradients in their dtype, under its default ``gradient_as_bucket_view=False``
    (the only form modelled)."""
    return gradient_bytes if layout.zero == 0 and layout.data_parallel > 1 else 0


def group_bandwidth(sheet: Any, ranks_span: int) -> float:
    """Note: [group links] the bytes/s a collective over a group of ranks gets on the datasheet ``sheet`` (a
    ``profiler.HARDWARE`` entry): ``interconnect_bandwidth`` (the link inside a node) while the group's ranks lie
    within ``gpus_per_node`` consecutive GPUs (8 where the sheet does not say), else ``internode_bandwidth``
    (``interconnect_bandwidth`` where the sheet does not say). Ranks are laid out as Megatron-LM's default order
    and torchtitan's device mesh lay them: tensor parallel innermost, then data parallel, pipeline stages
    outermost: a TP group spans ``t`` GPUs, a DP group ``t x d``. Each link is taken at the bus bandwidth
    collectives reach on it (``effective_interconnect`` / ``effective_internode``: the line rate times the sheet's
    collective efficiency, from published nccl-tests figures) where the sheet has them."""
    inside = float(getattr(sheet, "effective_interconnect", sheet.interconnect_bandwidth))
    if ranks_span <= int(getattr(sheet, "gpus_per_node", 8) or 8):
        return inside
    across = getattr(sheet, "effective_internode", None) or getattr(sheet, "internode_bandwidth", None)
    return float(across or inside)


def rank_share(profile: Profile, model: nn.Module, layout: Layout) -> Profile:
    """One rank's share of ``profile`` (of ``model``) under ``layout``: the parameter split read from the model and
    each group's link on the profile's named hardware (Note: [group links]; a TP group spans ``t`` GPUs, a DP group
    ``t x d``; no links for hardware without a datasheet), cut by :func:`shard_profile`."""
    from ._hardware import HARDWARE

    split = parameter_split(model, profile.layer_info(), tensor_parallel=layout.tensor_parallel)
    sheet = HARDWARE.get(profile.hardware.name)
    if sheet is None:
        return shard_profile(profile, layout=layout, split=split, interconnect=0.0)
    return shard_profile(profile, layout=layout, split=split,
                         interconnect=group_bandwidth(sheet, layout.tensor_parallel),
                         data_parallel_bandwidth=group_bandwidth(sheet, layout.tensor_parallel * layout.data_parallel))


def shard_profile(profile: Profile, *, layout: Layout, split: ParameterSplit, interconnect: float,
                  data_parallel_bandwidth: float | None = None) -> Profile:
    """The profile of one rank under ``layout`` (its pipeline stage is cut later, by the search), with the
    layout recorded in ``model.layout``: at least the ZeRO stage of the profile's precision recipe.
    ``interconnect``: the tensor-parallel group's link, recorded as ``model.interconnect_bandwidth``;
    ``data_parallel_bandwidth``: the data-parallel group's (``group_bandwidth``), recorded as
    ``model.data_parallel_bandwidth`` when given (the search times DP/ZeRO collectives on it, else on the
    interconnect)."""
    layout = precision_layout(layout, PRECISIONS.get(profile.model.get("precision", "")))
    t = layout.tensor_parallel
    roles = tp_roles(profile, split.linears) if t > 1 else {}
    factors = _shard_factors(profile, layout, roles)
    ops: list[OpRecord] = []
    units: list[UnitRecord] = []
    remap: dict[int, int] = {}
    after: dict[str, str] = {}  # row-parallel unit -> its collective unit
    pending: list[tuple[int, list[int]]] = []  # new op index -> old consumer indices
    name = "reduce_scatter" if layout.sequence_parallel else "all_reduce"  # the names a real TP rank gives them
    for unit, f in zip(profile.units, factors):
        new_ids = []
        for i in unit.ops:
            op = profile.ops[i]
            remap[i] = len(ops)
            new_ids.append(len(ops))
            pending.append((len(ops), op.consumers))
            out = 1.0 if roles.get(unit.name) == "row" else f  # Note: [row-parallel output]
            ops.append(replace(op, index=len(ops), output_bytes=int(op.output_bytes * out),
                               saved_bytes=int(op.saved_bytes * f), fwd_time=op.fwd_time * f,
                               bwd_time=op.bwd_time * f, flops=int(op.flops * f)))
        units.append(_sum_unit(unit, [ops[k] for k in new_ids], new_ids))
        if roles.get(unit.name) == "row":
            seconds = collective_time(unit.output_bytes, ranks=t, bandwidth=interconnect)
            pending.append((len(ops), profile.ops[unit.ops[-1]].consumers))
            op, collective = _collective(profile, unit, name, len(ops), seconds)
            ops.append(op)
            units.append(collective)
            after[unit.name] = collective.name
    for k, old in pending:
        ops[k] = replace(ops[k], consumers=sorted({remap[c] for c in old if c in remap and remap[c] > k}))
    units = [replace(u, consumers=[after[u.name]]) if u.name in after else u for u in units]
    sharded = _rank_profile(profile, ops, units, layout=layout, split=split, interconnect=interconnect)
    if data_parallel_bandwidth is None:
        return sharded
    return replace(sharded, model={**sharded.model, "data_parallel_bandwidth": float(data_parallel_bandwidth)})


def _shard_factors(profile: Profile, layout: Layout, roles: dict[str, str]) -> list[float]:
    """Per unit, the share of its bytes, times and flops one tensor-parallel rank holds: ``1 / t`` for a sharded
    linear, and under sequence parallelism for a replicated unit that carries the sequence (from the first layer
    on, or an embedding)."""
    t = layout.tensor_parallel
    seq_from = next((i for i, u in enumerate(profile.units) if u.layer is not None), len(profile.units))
    factors = []
    for index, unit in enumerate(profile.units):
        if roles.get(unit.name, "replicated") != "replicated":
            factors.append(1.0 / t)
            continue
        carries_sequence = index >= seq_from or any(
            profile.ops[i].op.startswith("aten.embedding") for i in unit.ops)
        factors.append(1.0 / t if layout.sequence_parallel and carries_sequence else 1.0)
    return factors


def _collective(profile: Profile, unit: UnitRecord, name: str, index: int,
                seconds: float) -> tuple[OpRecord, UnitRecord]:
    """The op and unit of the collective (``name``) after the row-parallel ``unit``, as op ``index``."""
    last = profile.ops[unit.ops[-1]]
    coll_name = f"{last.module}.{name}" if last.module else name
    local = unit.local_name.rsplit(".", 1)[0] + f".{name}" if "." in unit.local_name else name
    op = OpRecord(index=index, op=f"c10d.{name}", unit=coll_name, module=last.module, layer=unit.layer,
                  output_bytes=0, saved_bytes=0, fwd_time=seconds, bwd_time=seconds, flops=0)
    collective = UnitRecord(name=coll_name, local_name=local, layer=unit.layer, ops=[index], output_bytes=0,
                            saved_bytes=0, fwd_time=seconds, bwd_time=seconds, consumers=list(unit.consumers))
    return op, collective


def _rank_profile(profile: Profile, ops: list[OpRecord], units: list[UnitRecord], *, layout: Layout,
                  split: ParameterSplit, interconnect: float) -> Profile:
    """``profile`` with one rank's ``ops`` and ``units``, and its static memory, peak, step and optimizer time."""
    t = layout.tensor_parallel
    static = rank_static(profile.static, layout=layout, split=split,
                         precision=PRECISIONS.get(profile.model.get("precision", "")))
    act_old = sum(u.saved_bytes for u in profile.units)
    boundary = max(0, profile.peak_memory - (profile.static.total - profile.static.gradients)
                   - profile.saved_input_bytes - act_old)
    act_new = sum(u.saved_bytes for u in units)
    peak = (static.total - static.gradients) + profile.saved_input_bytes + act_new + boundary // t
    model = {**profile.model, "layout": layout.to_dict(),
             "interconnect_bandwidth": interconnect}
    step = profile.step_time + sum(o.fwd_time + o.bwd_time for o in ops) \
        - sum(o.fwd_time + o.bwd_time for o in profile.ops)
    touched = profile.static.total - profile.static.buffers  # the optimizer step reads and writes these
    buckets = ddp_bucket_bytes(static.gradients, layout)  # the optimizer step does not touch them
    ratio = (static.total - static.buffers - buckets) / touched if touched else 1.0
    return replace(profile, model=model, ops=ops, units=units, static=static, peak_memory=int(peak),
                   step_time=max(0.0, step), optimizer_time=profile.optimizer_time * ratio,
                   layer_forward=[])  # measured unsharded


def _sum_unit(unit: UnitRecord, ops: list[OpRecord], ids: list[int]) -> UnitRecord:
    return replace(unit, ops=ids, output_bytes=sum(o.output_bytes for o in ops),
                   saved_bytes=sum(o.saved_bytes for o in ops), fwd_time=sum(o.fwd_time for o in ops),
                   bwd_time=sum(o.bwd_time for o in ops))
