"""Pipeline parallelism: one stage model, budget and plan per stage.

Under 1F1B, stage ``s`` of ``P`` holds the activations of ``min(P - s, M)`` micro-batches at
its peak (``M`` micro-batches per step), so early stages need more aggressive plans (the
seed's DeepSeek-V3 recompute list ``[3, 4, 4, ..., 3, 2, 0]``). Layers are split evenly
(earlier stages take the remainder); units before the layers live on stage 0, units after
them on the last stage. Static memory is split in proportion to each stage's layer count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from profiler._layout import Layout
from profiler._profile import HardwareSpec, Profile

from ._model import StepModel
from ._plan import Plan, PlanError

__all__ = ["Stage", "split_layout", "split_stages", "merge_plans"]


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
    from ._schedules import chunk_layers, in_flight

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
    return [Stage(s, ranges[s][c], counts[s][c],
                  _cut(profile, whole, ranges[s][c], first=s == 0 and c == 0, last=s == p - 1 and c == v - 1,
                       hardware=hardware, gradients=gradients), chunk=c)
            for s in range(p) for c in range(v)]


def _cut(profile: Profile, whole: StepModel, layers: range, *, first: bool, last: bool,
         hardware: HardwareSpec | None, gradients: str = "per-step") -> StepModel:
    """The step model of ``layers`` (units before the layers on the ``first`` stage, after them on the ``last``)."""
    n = profile.num_layers
    first_layer = next((i for i, u in enumerate(profile.units) if u.layer is not None), len(profile.units))
    def mine(i: int, layer: int | None) -> bool:
        if layer is not None:
            return layer in layers
        return first if i < first_layer else last
    keep = [u for i, u in enumerate(profile.units) if mine(i, u.layer)]
    names = {u.name for u in keep}
    outside = frozenset(u.name for u in profile.units if u.name not in names)
    share = len(layers) / max(n, 1)
    st = profile.static
    static = replace(st, parameters=int(st.parameters * share), gradients=int(st.gradients * share),
                     optimizer_state=int(st.optimizer_state * share))
    saved = sum(u.saved_bytes for u in keep) + (profile.saved_input_bytes if first else 0)
    boundary = whole.boundary if last else 0
    resident = static.total - static.gradients  # per-step gradients, StepModel.build's default
    sub = replace(profile, units=keep, static=static, saved_input_bytes=profile.saved_input_bytes if first else 0,
                  peak_memory=resident + saved + boundary,
                  step_time=sum(u.fwd_time + u.bwd_time for u in keep))
    return StepModel.build(sub, hardware=hardware, outside=outside, gradients=gradients)


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
