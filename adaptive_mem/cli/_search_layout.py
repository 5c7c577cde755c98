"""``adaptive-mem search`` under a parallel layout: per-chunk budgets and the per-rank, per-step report."""

from __future__ import annotations

from profiler import Layout
from search import Budget, Plan, Stage, fmt_bytes, fmt_seconds, pipeline_step_time
from search._budget import DeviceMemoryError, activation_peak, keep_all
from search._collectives import data_parallel_comm

__all__ = ["chunk_budgets", "report_pipeline"]


def _static(stage: Stage) -> int:
    return stage.model.static_bytes


def chunk_budgets(stages: list[Stage], budget: Budget, layout: Layout) -> list[Budget]:
    """One budget per stage model. ``--budget`` is a rank's: with ``V`` chunks per rank, the room left by the
    rank's static memory is split over its chunks in proportion to their keep-all activation peaks
    (micro-batches in flight included); fractions apply to each chunk as they are."""
    if budget.total is None or layout.virtual_pipeline_stages == 1:
        return [budget] * len(stages)
    out: list[Budget] = []
    for s in range(layout.pipeline_stages):
        mine = [st for st in stages if st.index == s]
        shared = mine[0].model.profile.static.buffers  # whole in every chunk's model, held once by the rank
        static = sum(_static(st) for st in mine) - (len(mine) - 1) * shared
        room = budget.total - static
        if room <= 0:
            raise DeviceMemoryError(f"stage {s}: static memory {fmt_bytes(static)} (parameters, gradients, optimizer "
                                    f"state of its {len(mine)} chunks) exceeds the budget {fmt_bytes(budget.total)}; "
                                    "expected a larger --budget or more sharding (--zero, --tensor-parallel)")
        keep = [max(1, activation_peak(st.model, keep_all(st.model), in_flight=st.in_flight)) for st in mine]
        out += [Budget(total=_static(st) + int(room * k / sum(keep))) for st, k in zip(mine, keep)]
    return out


def report_pipeline(plan: Plan, stages: list[Stage], results: list, layout: Layout) -> None:
    """Per rank: predicted peak (its chunks together) and seconds per micro-batch; the pipelined step time."""
    ranks = []
    for s in range(layout.pipeline_stages):
        mine = [(st, r) for st, r in zip(stages, results) if st.index == s]
        shared = mine[0][0].model.profile.static.buffers
        peak = sum(r.plan.meta.get("predicted_peak_bytes", r.cost.peak_bytes) for _, r in mine) - (len(mine) - 1) * shared
        busy = sum(r.cost.step_time - st.model.other_time for st, r in mine)
        share = sum(len(st.layers) for st, _ in mine) / max(stages[0].model.profile.num_layers, 1)
        models = [st.model for st, _ in mine]
        d, z = layout.data_parallel, layout.zero
        comm = data_parallel_comm(
            layout, gradient_bytes=sum(m.profile.static.gradients for m in models) * (d if z >= 2 else 1),
            parameter_bytes=sum(m.profile.static.parameters for m in models) * (d if z >= 3 else 1),
            layers=sum(len(st.layers) for st, _ in mine), forward_time=sum(m.forward_time for m in models),
            backward_time=sum(m.backward_time for m in models),
            bandwidth=float(models[0].profile.model.get("interconnect_bandwidth") or 0.0))
        ranks.append({"stage": s, "predicted_peak_bytes": int(peak), "micro_batch_time": busy,
                      "optimizer_time": mine[0][0].model.profile.optimizer_time * share,
                      "comm_time": comm.total, "exposed_comm_time": comm.exposed})
    step = pipeline_step_time([r["micro_batch_time"] for r in ranks], layout,
                              other=max(r["optimizer_time"] for r in ranks),
                              exposed_comm=max(r["exposed_comm_time"] for r in ranks))
    meta = plan.meta.setdefault("pipeline", {"stages": layout.pipeline_stages, "micro_batches": layout.micro_batches})
    meta.update(stages=layout.pipeline_stages, schedule=layout.schedule, virtual_stages=layout.virtual_pipeline_stages, per_rank=ranks,
                predicted_step_time=step)
    for r in ranks:
        print(f"rank of stage {r['stage']}: peak {fmt_bytes(r['predicted_peak_bytes'])} (upper bound over its chunks), "
              f"{fmt_seconds(r['micro_batch_time'])} per micro-batch")
    print(f"pipelined step ({layout.schedule}, {layout.micro_batches} micro-batches, {layout.pipeline_stages} stages"
          f"{f' x {layout.virtual_pipeline_stages} chunks' if layout.virtual_pipeline_stages > 1 else ''}): "
          f"{fmt_seconds(step)} predicted")
