"""Pipeline parallelism: one stage model, budget and plan per stage.

Under 1F1B, stage ``s`` of ``P`` holds the activations of ``min(P - s, M)`` micro-batches at
its peak (``M`` micro-batches per step), so early stages need more aggressive plans (the
seed's DeepSeek-V3 recompute list ``[3, 4, 4, ..., 3, 2, 0]``). Layers are split evenly
(earlier stages take the remainder); units before the layers live on stage 0, units after
them on the last stage. Static memory is split by each stage's share of the parameters (Note: [stage static]).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from profiler import HardwareSpec, Layout, Profile, StaticMemory
from profiler.tracing import ddp_bucket_bytes

from ._model import StepModel
from ._plan import Plan, PlanError

__all__ = ["Stage", "StageStatic", "busiest_stage", "merge_plans", "rank_peak", "split_layout", "split_stages",
           "stage_static",
           "stage_statics"]


@dataclass(frozen=True)
class Stage:
    index: int
    layers: range
    """Global indices of this stage's layers."""
    in_flight: int
    """Micro-batches of activations held at the peak: min(P - s, M)."""
    model: StepModel
    chunk: int = 0
    """Model chunk on this stage's rank (interleaved 1F1B: 0..V-1)."""
    runtime: int = 0
    """Bytes of the pipelining runtime's buffers and the step's batch at the peak, included in ``model.base``
    (Note: [pipelining buffers])."""


def split_stages(profile: Profile, *, stages: int, micro_batches: int,
                 hardware: HardwareSpec | None = None) -> list[Stage]:
    n = profile.num_layers
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise PlanError(f"--pipeline-stages={stages!r}: expected an integer >= 1")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise PlanError(f"--micro-batches={micro_batches!r}: expected an integer >= 1")
    if stages > max(n, 1):
        raise PlanError(f"--pipeline-stages={stages}: expected at most the number of layers ({n})")
    bounds, start = [], 0
    for s in range(stages):
        size = n // stages + (1 if s < n % stages else 0)
        bounds.append(range(start, start + size))
        start += size
    whole = StepModel.build(profile, hardware=hardware)
    return [Stage(s, layers, min(stages - s, micro_batches),
                  _cut(profile, whole, layers, first=s == 0, last=s == stages - 1, hardware=hardware))
            for s, layers in enumerate(bounds)]


def split_layout(profile: Profile, *, layout: Layout, hardware: HardwareSpec | None = None) -> list[Stage]:
    """One :class:`Stage` per pipeline rank and model chunk (``chunk`` 0..V-1), its ``in_flight`` from the
    layout's schedule (``search._schedules``)."""
    from ._schedules import chunk_layers, in_flight, runtime_buffers

    n = profile.num_layers
    if layout.chunks > max(n, 1):
        raise PlanError(f"--pipeline-stages={layout.pipeline_stages} x --virtual-pipeline-stages="
                        f"{layout.virtual_pipeline_stages}: expected at most the number of layers ({n}) chunks")
    whole = StepModel.build(profile, hardware=hardware)
    counts, ranges = in_flight(layout), chunk_layers(n, layout)
    p, v = layout.pipeline_stages, layout.virtual_pipeline_stages
    # Note: [accumulated gradients] a stage's gradients, allocated by its first micro-batch's backward, stay
    # through the backward of the others: resident at the steady-state peak (tests/test_comm_stream.py)
    gradients = "persistent" if layout.micro_batches > 1 else "per-step"
    buffers = runtime_buffers(layout)
    out = []
    for s in range(p):
        for c in range(v):
            first, last = s == 0 and c == 0, s == p - 1 and c == v - 1
            model = _cut(profile, whole, ranges[s][c], first=first, last=last, hardware=hardware, gradients=gradients)
            # Note: [pipelining buffers] torch.distributed.pipelining's own tensors (receive buffers, pending
            # sends, cached model outputs: search._schedules.runtime_buffers) and the step's batch of M
            # micro-batches (views of it go to the first stage's inputs and the last stage's loss) are held
            # whatever the plan: counts x the chunk's boundary tensor bytes, in the stage's base
            # (tests/test_pipeline_buffers.py)
            b = buffers[s][c]
            into, leaving = _boundary_bytes(profile, ranges[s][c], last=last)
            runtime = ((b.recv + b.sent_grads) * into + (b.grad_recv + b.sent_outputs + b.cached_outputs) * leaving
                       + profile.saved_input_bytes * ((layout.micro_batches - 1 if first else 0)
                                                      + (layout.micro_batches if last and not first else 0)))
            model = replace(model, base=model.base + runtime)
            out.append(Stage(s, ranges[s][c], counts[s][c], model, chunk=c, runtime=runtime))
    return out


def _boundary_bytes(profile: Profile, layers: range, *, last: bool) -> tuple[int, int]:
    """Bytes per micro-batch entering ``layers`` from the layer before them and leaving their last layer for
    later units; on the ``last`` chunk the model output (the loss input): the largest output after the layers."""
    def crossing(layer: int) -> int:
        later = {u.name for u in profile.units if u.layer is None or u.layer > layer}
        return sum(u.output_bytes for u in profile.units
                   if u.layer == layer and any(c in later for c in u.consumers))
    first_layer = next((i for i, u in enumerate(profile.units) if u.layer is not None), len(profile.units))
    if last:
        leaving = max((u.output_bytes for u in profile.units[first_layer:] if u.layer is None), default=0)
    else:
        leaving = crossing(layers.stop - 1)
    return (crossing(layers.start - 1) if layers.start > 0 else 0), leaving


def _cut(profile: Profile, whole: StepModel, layers: range, *, first: bool, last: bool,
         hardware: HardwareSpec | None, gradients: str = "per-step") -> StepModel:
    """The step model of ``layers`` (units before the layers on the ``first`` stage, after them on the ``last``)."""
    first_layer = next((i for i, u in enumerate(profile.units) if u.layer is not None), len(profile.units))
    def mine(i: int, layer: int | None) -> bool:
        if layer is not None:
            return layer in layers
        return first if i < first_layer else last
    keep = [u for i, u in enumerate(profile.units) if mine(i, u.layer)]
    names = {u.name for u in keep}
    outside = frozenset(u.name for u in profile.units if u.name not in names)
    static = stage_static(profile, layers, first=first, last=last)
    saved = sum(u.saved_bytes for u in keep) + (profile.saved_input_bytes if first else 0)
    boundary = whole.boundary if last else 0
    # the base StepModel.build derives for ``gradients``: the boundary it takes from peak_memory stays whole.boundary
    resident = static.total - (static.gradients if gradients == "per-step" else 0)
    sub = replace(profile, units=keep, static=static, saved_input_bytes=profile.saved_input_bytes if first else 0,
                  peak_memory=resident + saved + boundary,
                  step_time=sum(u.fwd_time + u.bwd_time for u in keep))
    return StepModel.build(sub, hardware=hardware, outside=outside, gradients=gradients)


def stage_static(profile: Profile, layers: range, *, first: bool, last: bool) -> StaticMemory:
    """Note: [stage static] one rank's static memory on the pipeline chunk of ``layers`` (the embedding on the
    ``first``, the head on the ``last``): parameters, gradients, master weights and optimizer state in proportion
    to the chunk's share of the profile's gradient bytes (``gradient_split``: its layers, plus the positions
    before the layers on the first chunk and after them on the last), by layer count without a split; module
    buffers and ZeRO-3's gathered layers (``buffers``) whole; what the profile holds beside the step
    (``other``) whole, but for data-parallel gradient buckets, which follow the gradients
    (``profiler.tracing.ddp_bucket_bytes``)."""
    n = profile.num_layers
    share = len(layers) / max(n, 1)
    split = profile.gradient_split
    if len(split) == n + 2 and sum(split):  # the stage's own parameters: its layers, the embedding, the head
        share = (sum(split[q + 1] for q in layers) + (split[0] if first else 0) + (split[-1] if last else 0)) / sum(split)
    st = profile.static
    gradients = int(st.gradients * share)
    recorded = _recorded_layout(profile)
    other = st.other - ddp_bucket_bytes(st.gradients, recorded) + ddp_bucket_bytes(gradients, recorded)
    return replace(st, parameters=int(st.parameters * share), gradients=gradients, master=int(st.master * share),
                   optimizer_state=int(st.optimizer_state * share), other=other)


def _recorded_layout(profile: Profile) -> Layout:
    """The layout ``profiler.shard_profile`` cut the profile to (its ZeRO stage that of the run)."""
    return Layout.from_dict(profile.model["layout"]) if profile.model.get("layout") else Layout()


@dataclass(frozen=True)
class StageStatic:
    """One pipeline rank's static memory (its chunks together) and where its layers are."""

    index: int
    layers: tuple[range, ...]
    """Global layer indices of its chunks."""
    first: bool
    """It holds the units before the layers (the embedding)."""
    last: bool
    """It holds the units after the layers (the final norm, the head and the loss)."""
    static: StaticMemory

    def describe(self, stages: int) -> str:
        """``pipeline stage 0 of 16 (layers 0-7 and the embedding)``."""
        spans = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in self.layers if len(r))
        ends = [what for what, here in (("the embedding", self.first), ("the head", self.last)) if here]
        where = " and ".join([f"layers {spans}" if spans else "no layers", *ends])
        return f"pipeline stage {self.index} of {stages} ({where})"


def stage_statics(profile: Profile, layout: Layout) -> list[StageStatic]:
    """Per pipeline rank of ``layout``, its static memory: its chunks' ``stage_static`` (Note: [stage static])
    summed, module buffers, gathered layers and ``other`` once (a rank holds them once)."""
    from ._schedules import chunk_layers

    p, v = layout.pipeline_stages, layout.virtual_pipeline_stages
    ranges = chunk_layers(profile.num_layers, layout)
    out = []
    for s in range(p):
        parts = [stage_static(profile, ranges[s][c], first=s == 0 and c == 0, last=s == p - 1 and c == v - 1)
                 for c in range(v)]
        summed = {k: sum(getattr(part, k) for part in parts) for k in ("parameters", "gradients", "master",
                                                                      "optimizer_state", "other")}
        summed["other"] -= (v - 1) * (profile.static.other - ddp_bucket_bytes(profile.static.gradients,
                                                                              _recorded_layout(profile)))
        out.append(StageStatic(s, tuple(ranges[s]), s == 0, s == p - 1, replace(parts[0], **summed)))
    return out


def rank_peak(chunks: list[Stage], peaks: list[int]) -> int:
    """Note: [rank peak] a pipeline rank's peak from its chunks' ``peaks``: its chunks share one device, so their
    peaks add, but the buffers every chunk's model holds whole (module buffers, ZeRO-3's gathered layers) are held
    once by the rank."""
    return int(sum(peaks)) - (len(chunks) - 1) * chunks[0].model.profile.static.buffers


def busiest_stage(profile: Profile, layout: Layout) -> StageStatic:
    """The pipeline rank with the most static memory (the earliest of equals)."""
    return max(stage_statics(profile, layout), key=lambda st: (st.static.total, -st.index))


def merge_plans(plans: list[Plan], stages: list[Stage], *, micro_batches: int) -> Plan:
    """One plan for the whole model (targets are global names), with per-stage provenance in ``meta``."""
    merged = Plan(fingerprint=plans[0].fingerprint, model=dict(plans[0].model))
    for plan in plans:
        merged.decisions.update(plan.decisions)
        merged.groups.extend(plan.groups)
    merged.meta["pipeline"] = {
        "stages": len(stages), "micro_batches": micro_batches,
        "per_stage": [{"stage": st.index, **({"chunk": st.chunk} if st.chunk else {}), "layers": [st.layers.start, st.layers.stop - 1] if len(st.layers) else [],
                       "in_flight": st.in_flight, **{k: p.meta[k] for k in ("predicted_peak_bytes", "predicted_step_time")
                                                     if k in p.meta}}
                      for st, p in zip(stages, plans)],
    }
    merged.meta["solver"] = plans[0].meta.get("solver")
    return merged
