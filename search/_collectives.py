"""Data-parallel and ZeRO collectives of one rank's step: their time on the communication stream, and
how much of it compute does not hide.

Tensor-parallel collectives are units of the profile (``profiler._shard``): they sit on the critical
path, as Megatron runs them. The collectives here run on their own stream beside compute
(Note: [comm overlap]), ring times from ``profiler.tracing.collective_time``, on the DP group's link (the rank's
``model.data_parallel_bandwidth``, Note: [group links]):

* gradients, once per step (the last micro-batch's backward): all-reduce (ZeRO 0/1) or
  reduce-scatter (ZeRO 2/3), in per-layer buckets issued as backward finishes each layer, so they
  overlap the backward of the layers still to run; the last bucket is always exposed;
* ZeRO 1/2: all-gather of the updated parameter shards after the optimizer step: exposed;
* ZeRO 3 (FSDP): all-gather of each layer's parameters (in the dtype the forward reads them in) before its
  forward and again before its backward, every micro-batch, prefetched one layer ahead: hidden behind the
  previous layer's compute except the first layer's gather in each pass.

The collective library's kernels hold SMs while they run, so compute beside them is slower: every overlapped second
of a collective adds ``slowdown`` seconds to the step (``HardwareSpec.comm_compute_slowdown``, Note: [comm
contention] in ``profiler/_hardware.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from profiler import PRECISIONS, Layout
from profiler.tracing import collective_time

from ._comm_stream import schedule_collectives

__all__ = ["CommTime", "data_parallel_comm"]


@dataclass(frozen=True)
class CommTime:
    total: float
    """Seconds on the communication stream per step."""
    exposed: float
    """Seconds added to the step: what compute waits for, plus ``contention``."""
    contention: float = 0.0
    """Of ``exposed``, seconds compute loses to the collectives it overlaps: ``slowdown x`` their overlapped
    seconds (an overlapped second of compute does ``1 - slowdown`` of its work; the rest runs after)."""


def _overlapped(comm: float, compute: float, layers: int) -> float:
    """Exposed seconds of ``comm`` issued in ``layers`` equal buckets beside ``compute`` (equal layers, bucket
    ``k`` ready when layer ``k`` ends) on the comm stream (Note: [comm stream]): one bucket at least."""
    layers = max(layers, 1)
    if comm <= 0:
        return 0.0
    ready = [(f"bucket {k}", compute * (k + 1) / layers) for k in range(layers)]
    return schedule_collectives(ready, [comm / layers] * layers, compute_end=compute).exposed


def data_parallel_comm(layout: Layout, *, gradient_bytes: int, parameter_bytes: int, layers: int,
                       forward_time: float, backward_time: float, bandwidth: float,
                       precision: str | None = None, slowdown: float = 0.0) -> CommTime:
    """Per-rank DP/ZeRO communication for one step. ``gradient_bytes`` / ``parameter_bytes``: the rank's
    unsharded-by-DP gradients and parameters as stored (TP and PP already applied); ``forward_time`` /
    ``backward_time``: one micro-batch on this rank; ``layers``: the rank's layers (bucket count);
    ``precision``: the profile's recipe (``profiler.PRECISIONS``), whose all-gathers move the parameters in the
    dtype the forward reads them in (``fsdp2-bf16``: bf16 copies of fp32 shards, half the stored bytes);
    ``slowdown``: the fraction of compute throughput a collective beside it takes (0: none)."""
    d, z, m = layout.data_parallel, layout.zero, layout.micro_batches
    if d == 1:
        return CommTime(0.0, 0.0)
    recipe = PRECISIONS.get(precision or "")
    if recipe is not None:
        parameter_bytes = parameter_bytes * recipe.model_dtype.itemsize // recipe.parameters
    grads = collective_time(gradient_bytes, ranks=d, bandwidth=bandwidth,
                            kind="reduce_scatter" if z >= 2 else "all_reduce")
    total, exposed = grads, _overlapped(grads, backward_time, layers)
    if z in (1, 2):
        gather = collective_time(parameter_bytes, ranks=d, bandwidth=bandwidth, kind="all_gather")
        total, exposed = total + gather, exposed + gather
    if z == 3:
        gather = collective_time(parameter_bytes, ranks=d, bandwidth=bandwidth, kind="all_gather")
        total += 2 * m * gather
        exposed += m * (_overlapped(gather, forward_time, layers) + _overlapped(gather, backward_time, layers))
    # every collective is ready by the end of its compute, so the stream is busy from then until it drains:
    # its exposed seconds are all past compute, and the rest of ``total`` overlaps compute
    contention = slowdown * (total - exposed)
    return CommTime(total, exposed + contention, contention)
