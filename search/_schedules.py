"""Pipeline schedules: micro-batches whose activations a pipeline rank holds at its peak.

One function per schedule, each ``(layout) -> counts`` with ``counts[stage][chunk]`` = the
micro-batches of that model chunk whose forward has run and whose backward has not, at the rank's
peak (right before its first backward: from then on every forward is paired with a backward).
Model chunk ``c`` of rank ``s`` is pipeline chunk ``c * P + s`` (Megatron's virtual pipeline order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from profiler import Layout

__all__ = ["SCHEDULE_COUNTS", "RuntimeBuffers", "in_flight", "in_flight_1f1b", "in_flight_gpipe",
           "in_flight_interleaved", "chunk_layers", "pipeline_step_time", "runtime_buffers"]


def in_flight_gpipe(layout: Layout) -> list[list[int]]:
    """GPipe: every forward before any backward, so each stage holds all ``M`` micro-batches."""
    return [[layout.micro_batches] for _ in range(layout.pipeline_stages)]


def in_flight_1f1b(layout: Layout) -> list[list[int]]:
    """1F1B (PipeDream-flush): stage ``s`` runs ``P - s - 1`` warm-up forwards, then one more before its
    first backward: ``min(P - s, M)`` micro-batches in flight."""
    p, m = layout.pipeline_stages, layout.micro_batches
    return [[min(p - s, m)] for s in range(p)]


def in_flight_interleaved(layout: Layout) -> list[list[int]]:
    """Interleaved 1F1B with ``V`` chunks per rank (Narayanan et al., SC'21, section 2.2.2).

    Megatron-LM ``megatron/core/pipeline_parallel/schedules.py``,
    ``forward_backward_pipelining_with_interleaving``: rank ``s`` runs
    ``warmup = min((P - s - 1) * 2 + (V - 1) * P, M * V)`` forwards, then (if any are left) one more
    before its first backward; forward ``k`` is of chunk ``(k // P) % V`` (micro-batches go in groups
    of ``P`` per chunk). So rank ``s`` holds ``min(warmup + 1, M * V)`` chunk-micro-batches, the first
    rank the most: ``P * V + P - 1`` when ``M >= P``, i.e. ``1 + (P - 1) / (P * V)`` times 1F1B's ``P``
    micro-batches of its layers (Korthikanti et al. 2022, section 4.2.3).
    """
    p, v, m = layout.pipeline_stages, layout.virtual_pipeline_stages, layout.micro_batches
    out = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * p, m * v)
        forwards = min(warmup + 1, m * v)
        counts = [0] * v
        for k in range(forwards):
            counts[(k // p) % v] += 1
        out.append(counts)
    return out


SCHEDULE_COUNTS: dict[str, Callable[[Layout], list[list[int]]]] = {
    "gpipe": in_flight_gpipe, "1f1b": in_flight_1f1b, "interleaved-1f1b": in_flight_interleaved,
}


def in_flight(layout: Layout) -> list[list[int]]:
    """``counts[stage][chunk]`` for the layout's schedule."""
    return SCHEDULE_COUNTS[layout.schedule](layout)


@dataclass(frozen=True)
class RuntimeBuffers:
    """Tensors ``torch.distributed.pipelining`` holds for one model chunk at the rank's peak, beyond the saved
    activations the simulator counts, as counts of boundary tensors (one per micro-batch)."""

    recv: int = 0
    """Activation receive buffers: one per micro-batch, allocated at the first step and kept (chunk's input)."""
    grad_recv: int = 0
    """Gradient receive buffers: one per micro-batch, kept (chunk's output)."""
    sent_outputs: int = 0
    """Outputs whose backward has run, still held by a send not yet waited on (chunk's output)."""
    sent_grads: int = 0
    """Input gradients held by a send not yet waited on (chunk's input)."""
    cached_outputs: int = 0
    """Last chunk: model outputs (the loss inputs) cached for backward beyond the one in the profile's
    loss workspace (its ``boundary``)."""


def runtime_buffers(layout: Layout) -> list[list[RuntimeBuffers]]:
    """``buffers[stage][chunk]`` at the peak ``in_flight`` counts (Note: [pipelining buffers]).

    Read from ``torch.distributed.pipelining`` (``stage.py``: ``args_recv_info`` / ``grad_recv_info`` hold
    one buffer per micro-batch; ``schedules.py``): 1F1B keeps the last warm-up send's work (micro-batch
    ``w - 2`` of ``w`` warm-up forwards) until the cool-down, and the previous backward's input-gradient
    send (``bwd_sends``) until the next backward has run; GPipe waits every forward send before its first
    backward and its peak is that backward, with all ``M`` model outputs cached on the last stage;
    interleaved 1F1B waits its sends only at the step's end, so at its counted peak (the first backward)
    every pending send is of an output still in flight.
    """
    p, v, m = layout.pipeline_stages, layout.virtual_pipeline_stages, layout.micro_batches
    counts = in_flight(layout)
    out: list[list[RuntimeBuffers]] = []
    for s in range(p):
        row = []
        for c in range(v):
            k = c * p + s
            first, last, w = k == 0, k == p * v - 1, counts[s][c]
            sent_out = sent_grad = 0
            if layout.schedule == "1f1b":
                sent_out = int(not last and w >= 2 and m >= 2 * w - 1)
                sent_grad = int(not first and m > w)
            row.append(RuntimeBuffers(recv=0 if first else m, grad_recv=0 if last else m, sent_outputs=sent_out,
                                      sent_grads=sent_grad, cached_outputs=max(w - 1, 0) if last else 0))
        out.append(row)
    return out


def chunk_layers(num_layers: int, layout: Layout) -> list[list[range]]:
    """``ranges[stage][chunk]``: global layer indices of each model chunk; layers split evenly over the
    ``P * V`` pipeline chunks in order, earlier chunks taking the remainder."""
    chunks = layout.chunks
    bounds, start = [], 0
    for c in range(chunks):
        size = num_layers // chunks + (1 if c < num_layers % chunks else 0)
        bounds.append(range(start, start + size))
        start += size
    p = layout.pipeline_stages
    return [[bounds[c * p + s] for c in range(layout.virtual_pipeline_stages)] for s in range(p)]


def pipeline_step_time(stage_times: list[float], layout: Layout, *, other: float = 0.0,
                       exposed_comm: float = 0.0) -> float:
    """Seconds of one step of ``M`` micro-batches, ``stage_times[s]`` = forward + recompute + backward of
    one micro-batch through rank ``s`` (all its chunks). The slowest rank sets the steady state; the
    fill and drain bubble is the sum over ranks, ``V`` times shorter under interleaving (Narayanan et
    al. SC'21, eq. for the bubble ``(P - 1) / (V * M)``); GPipe and 1F1B share the bubble.
    ``other``: optimizer step; ``exposed_comm``: collective time not hidden behind compute."""
    m, v = layout.micro_batches, layout.virtual_pipeline_stages
    slowest = max(stage_times)
    bubble = (sum(stage_times) - slowest) / v
    return m * slowest + bubble + other + exposed_comm
