"""``adaptive-mem search`` under a parallel layout: the per-rank, per-step report."""

from __future__ import annotations

from search import fmt_bytes
from search.planning import fmt_seconds

from adaptive_mem._search import SearchResult

__all__ = ["report_pipeline"]


def report_pipeline(result: SearchResult) -> None:
    """Per rank: predicted peak (its chunks together) and seconds per micro-batch; the pipelined step time."""
    layout = result.layout
    for r in result.ranks:
        print(f"rank of stage {r['stage']}: peak {fmt_bytes(r['predicted_peak_bytes'])} (upper bound over its chunks), "
              f"{fmt_seconds(r['micro_batch_time'])} per micro-batch")
    print(f"pipelined step ({layout.schedule}, {layout.micro_batches} micro-batches, {layout.pipeline_stages} stages"
          f"{f' x {layout.virtual_pipeline_stages} chunks' if layout.virtual_pipeline_stages > 1 else ''}): "
          f"{fmt_seconds(result.step_time)} predicted")
