"""The communication stream of a simulated step: collectives run one at a time beside compute, each issued when
the compute that produces its data ends (Note: [comm stream]).

Data-parallel gradient reduction is one bucket per backward segment (layer or checkpoint group), issued when
that segment's backward ends, so it overlaps the backward of the layers still to run; what runs past the end of
compute is exposed. Tensor-parallel collectives are units on the compute stream (``profiler._shard``): they
are on the critical path and never appear here. ``search._collectives`` takes its exposed times from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ._timeline import Interval, Timeline

__all__ = ["CommSchedule", "add_gradient_reduce", "schedule_collectives"]


@dataclass(frozen=True)
class CommSchedule:
    intervals: tuple[Interval, ...]
    """The collectives on the ``comm`` stream."""
    end: float
    """When the last one ends (0 without any)."""
    exposed: float
    """Seconds past ``compute_end`` that compute waits for them."""


def schedule_collectives(ready: Sequence[tuple[str, float]], seconds: Sequence[float], *, compute_end: float,
                         kind: str = "all_reduce") -> CommSchedule:
    """Note: [comm stream] collective ``k`` (label, ready time) starts when it is ready and the stream is free,
    and runs ``seconds[k]``; in issue order."""
    if len(ready) != len(seconds):
        raise ValueError(f"ready={len(ready)} collectives, seconds={len(seconds)}: expected one duration each")
    free, out = 0.0, []
    for (label, at), length in zip(ready, seconds):
        start = max(free, at)
        free = start + length
        out.append(Interval("comm", kind, start, free, label))
    end = free if out else 0.0
    return CommSchedule(tuple(out), end, max(0.0, end - compute_end) if out else 0.0)


def add_gradient_reduce(timeline: Timeline, seconds: float, *, kind: str = "all_reduce") -> CommSchedule:
    """Put a data-parallel gradient reduction of ``seconds`` in all on ``timeline``'s comm stream: equal buckets,
    one per backward interval, each issued when that interval ends (tests/test_comm_stream.py)."""
    backward = [iv for iv in timeline.intervals if iv.stream == "compute" and iv.kind == "backward"]
    compute_end = max((iv.end for iv in timeline.intervals if iv.stream == "compute"), default=0.0)
    if not backward or seconds <= 0:
        return CommSchedule((), 0.0, 0.0)
    share = seconds / len(backward)
    schedule = schedule_collectives([(iv.label, iv.end) for iv in backward], [share] * len(backward),
                                    compute_end=compute_end, kind=kind)
    timeline.intervals.extend(schedule.intervals)
    return schedule
