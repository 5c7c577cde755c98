"""The simulator's comm stream (Note: [comm stream], search/_comm_stream.py): collectives one at a time beside
compute, each issued when its data is ready; hand-computed timelines."""

from __future__ import annotations

import pytest

from profiler import Layout
from search.planning import data_parallel_comm
from search._comm_stream import add_gradient_reduce, schedule_collectives
from search.planning import Interval, Timeline


def _spans(schedule) -> list[tuple[str, float, float]]:
    return [(iv.label, round(iv.start, 9), round(iv.end, 9)) for iv in schedule.intervals]


def test_short_buckets_hide_behind_compute_but_the_last():
    # compute ends at 4; buckets of 0.5 s ready at 1, 2, 3, 4: each runs at once, the last ends at 4.5
    s = schedule_collectives([("a", 1), ("b", 2), ("c", 3), ("d", 4)], [0.5] * 4, compute_end=4)
    assert _spans(s) == [("a", 1, 1.5), ("b", 2, 2.5), ("c", 3, 3.5), ("d", 4, 4.5)]
    assert s.exposed == pytest.approx(0.5) and all(iv.stream == "comm" for iv in s.intervals)


def test_long_buckets_queue_on_the_stream():
    # buckets of 2 s ready at 1, 2, 3: the stream is busy, each waits for the previous: 1-3, 3-5, 5-7
    s = schedule_collectives([("a", 1), ("b", 2), ("c", 3)], [2, 2, 2], compute_end=3)
    assert _spans(s) == [("a", 1, 3), ("b", 3, 5), ("c", 5, 7)]
    assert s.end == 7 and s.exposed == pytest.approx(4)


def test_gradient_reduce_overlaps_the_backward_of_earlier_layers():
    # forward 0-3, backward of layers 2, 1, 0: 3-5, 5-7, 7-9; 3 s of reduction = 1 s per layer bucket
    t = Timeline([Interval("compute", "forward", 0, 3, "layers.0-2"), Interval("compute", "backward", 3, 5, "layers.2"),
                  Interval("compute", "backward", 5, 7, "layers.1"), Interval("compute", "backward", 7, 9, "layers.0")])
    s = add_gradient_reduce(t, 3.0)
    assert _spans(s) == [("layers.2", 5, 6), ("layers.1", 7, 8), ("layers.0", 9, 10)]
    assert s.exposed == pytest.approx(1.0)
    assert [iv.stream for iv in t.intervals].count("comm") == 3


def test_data_parallel_cost_is_the_comm_stream_exposure():
    # 4 equal layers, backward 4 s: gradient all-reduce 8 s -> buckets of 2 s ready at 1, 2, 3, 4 -> ends 9 -> 5 exposed
    link = 1e9
    grads = int(8 * link / (2 * (2 - 1) / 2))  # ring all-reduce over 2 ranks moves 2 (d - 1) / d of the bytes
    cost = data_parallel_comm(Layout(data_parallel=2), gradient_bytes=grads, parameter_bytes=0, layers=4,
                              forward_time=2, backward_time=4, bandwidth=link)
    assert cost.total == pytest.approx(8) and cost.exposed == pytest.approx(5)
    short = data_parallel_comm(Layout(data_parallel=2), gradient_bytes=grads // 8, parameter_bytes=0, layers=4,
                               forward_time=2, backward_time=4, bandwidth=link)
    assert short.exposed == pytest.approx(0.25)  # 4 buckets of 0.25 s each hide behind a 1 s layer but the last


def test_mismatched_durations_are_refused():
    with pytest.raises(ValueError, match="expected one duration each"):
        schedule_collectives([("a", 0)], [], compute_end=1)


def test_pipeline_stage_gradients_are_resident_over_several_micro_batches():
    # Note: [accumulated gradients]: gradients from the first micro-batch's backward stay for the others
    from adaptive_mem import build_model
    from profiler import profile_step
    from search.planning import split_layout

    prof = profile_step(build_model("llama-tiny", seed=0, model_args={"num_layers": 2}), warmup=0, repeat=0, record=1)
    one = split_layout(prof, layout=Layout(pipeline_stages=2, micro_batches=1))
    four = split_layout(prof, layout=Layout(pipeline_stages=2, micro_batches=4))
    for a, b in zip(one, four):
        assert sum(b.model.grads) == 0 and sum(a.model.grads) > 0
        assert (b.model.base - b.runtime) - (a.model.base - a.runtime) == sum(a.model.grads)
