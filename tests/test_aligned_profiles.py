"""Profiles of different batch sizes aligned to plain steps timed in paired rounds (Note: [aligned profiles])."""

from __future__ import annotations

import logging
import random

import pytest

from adaptive_mem.bench._align import align_profiles, retime_profile
from search import maximize_throughput
from search.planning import keep_all_step_time

from test_throughput import _Worker, tiny_profiles  # noqa: F401 - the fixture is used by name


def _rows(result):
    return [(r.batch_size, r.fits, r.tokens_per_second, r.peak_bytes) for r in result.rows]


def test_retime_scales_every_time_and_no_byte(tiny_profiles):
    p = tiny_profiles[2]
    q = retime_profile(p, 1.25)
    assert keep_all_step_time(q) == pytest.approx(1.25 * keep_all_step_time(p), rel=1e-12)
    assert [o.fwd_time for o in q.ops] == [1.25 * o.fwd_time for o in p.ops]
    assert [u.bwd_time for u in q.units] == [1.25 * u.bwd_time for u in p.units]
    assert q.optimizer_time == 1.25 * p.optimizer_time and q.step_time == 1.25 * p.step_time
    assert [o.saved_bytes for o in q.ops] == [o.saved_bytes for o in p.ops] and q.peak_memory == p.peak_memory
    assert q.hardware == p.hardware


@pytest.mark.parametrize("noise", [{4: 1.06}, {1: 0.95, 4: 1.04}, {1: 1.03, 4: 0.97}])
def test_alignment_undoes_load_between_profiles(tiny_profiles, noise):
    """Note: [aligned profiles] profiles slowed by the load when each was taken (whole-profile factors), aligned
    to the true plain step ratios, rank batch sizes as the true profiles do: same rows, same best."""
    true = tiny_profiles
    noisy = {b: retime_profile(p, noise[b]) if b in noise else p for b, p in true.items()}
    ratios = {b: keep_all_step_time(true[b]) / keep_all_step_time(true[2]) for b in true}
    aligned = align_profiles(noisy, ratios, reference=2)
    assert aligned[2] is noisy[2]
    for b in true:
        assert keep_all_step_time(aligned[b]) / keep_all_step_time(aligned[2]) == pytest.approx(ratios[b], rel=1e-9)
    for b in true:
        assert [o.fwd_time for o in aligned[b].ops] == pytest.approx([o.fwd_time for o in true[b].ops], rel=1e-9)
        assert [u.bwd_time for u in aligned[b].units] == pytest.approx([u.bwd_time for u in true[b].units], rel=1e-9)
    # the plain steps' table (every size fits): tokens/s of the true profiles, sizes between interpolated alike
    want = maximize_throughput(profiles=true, batch_sizes="1-6", budget=10**12, solver="none")
    got = maximize_throughput(profiles=aligned, batch_sizes="1-6", budget=10**12, solver="none")
    assert [r[2] for r in _rows(got)] == pytest.approx([r[2] for r in _rows(want)], rel=1e-9)
    raw = maximize_throughput(profiles=noisy, batch_sizes="1-6", budget=10**12, solver="none")
    assert [r[2] for r in _rows(raw)] != pytest.approx([r[2] for r in _rows(want)], rel=0.01)


def test_alignment_leaves_sizes_without_a_ratio(tiny_profiles):
    aligned = align_profiles(tiny_profiles, {1: 0.6}, reference=2)
    assert aligned[4] is tiny_profiles[4] and aligned[2] is tiny_profiles[2]
    assert keep_all_step_time(aligned[1]) == pytest.approx(0.6 * keep_all_step_time(tiny_profiles[2]), rel=1e-12)


@pytest.mark.parametrize("ratios, reference, what", [
    ({1: 0.5}, 3, "reference=3: expected one of the profiled batch sizes 1, 2, 4"),
    ({8: 2.0}, 2, "step_ratios[8]: no profile at batch 8; expected one of 1, 2, 4"),
    ({4: 0.0}, 2, "step_ratios[4]=0.0: expected a positive finite step time ratio"),
    ({4: float("nan")}, 2, "step_ratios[4]=nan: expected a positive finite step time ratio"),
])
def test_alignment_bad_input_one_line(tiny_profiles, ratios, reference, what):
    with pytest.raises(ValueError) as err:
        align_profiles(tiny_profiles, ratios, reference=reference)
    assert str(err.value) == what


@pytest.mark.parametrize("factor", [0, -1.0, float("inf"), True])
def test_retime_bad_factor(tiny_profiles, factor):
    with pytest.raises(ValueError, match=r"^factor=.*: expected a positive finite number$"):
        retime_profile(tiny_profiles[2], factor)


# ---------------------------------------------------------------- in the bench's throughput section
class _AligningWorker(_Worker):
    """The stand-in worker of test_throughput; paired jobs of the plain model time each candidate's step as the
    ``true`` profiles predict, times a load common to the round (+-20 %) and 0.2 % noise of its own; paired jobs of
    ours (the top three) time them equal."""

    def __init__(self, base, true, fail=False):
        super().__init__(base, [[100.0] * 3] * 3)
        self.true, self.fail, self.paired = true, fail, []
        self.rng = random.Random(0)

    def __call__(self, j):
        if j.get("kind") != "paired":
            return super().__call__(j)
        self.paired.append(j)
        sizes = [c["batch_size"] for c in j["candidates"]]
        if j["policy"] == "none" and self.fail:
            return {"status": "failed", "error": "worker died: plain steps"}
        step = {b: keep_all_step_time(self.true[b]) if j["policy"] == "none" else float(b) for b in sizes}
        times = [[] for _ in sizes]
        for _ in range(j["rounds"]):
            load = 1 + self.rng.uniform(-0.2, 0.2)
            for k, b in enumerate(sizes):
                times[k].append(step[b] * load * (1 + self.rng.uniform(-0.002, 0.002)))
        return {"status": "ok", "step_times": times, "tokens_per_step": [b * 32 for b in sizes]}


def _section(true, noisy, tmp_path, **kw):
    from adaptive_mem.bench._throughput import throughput_section

    worker = _AligningWorker(true[2].peak_memory, true, **kw)
    section = throughput_section(profile=noisy[2], more_profiles={b: p for b, p in noisy.items() if b != 2},
                                 batch_sizes=[1, 2, 3, 4], job=worker.job, spawn=worker, out=tmp_path, seq_len=32,
                                 repeats=1, rounds=12)
    return section, worker


def _true_row(profiles, batch, budget):
    """Tokens/s of the MILP's plan at ``batch`` on ``profiles``, and at its lower bound: the MILP stops within a
    gap of its bound, and where in it depends on its time limits, so a row is checked between the two."""
    (row,) = maximize_throughput(profiles=profiles, batch_sizes=[batch], budget=budget).rows
    stats = row.result.stats
    return row.tokens_per_second, row.tokens_per_second * row.step_time / stats.lower_bound


def test_section_aligns_the_profiles_to_paired_plain_steps(tiny_profiles, tmp_path):
    from adaptive_mem.bench._throughput import format_throughput

    true = tiny_profiles
    noisy = {**true, 4: retime_profile(true[4], 1.08)}
    section, worker = _section(true, noisy, tmp_path)
    plain = worker.paired[0]
    assert plain["policy"] == "none" and plain["rounds"] == 12
    assert [c["batch_size"] for c in plain["candidates"]] == [1, 2, 4]
    record = section["profile_alignment"]
    assert record["status"] == "ok" and record["reference"] == 2 and record["rounds"] == 12
    sizes = {s["batch_size"]: s for s in record["sizes"]}
    assert sizes[2]["factor"] == 1.0 and sizes[2]["interval"] is None
    # the round's load cancels: the batch-4 profile's 8 % slowdown is measured within the 0.2 % noise
    assert sizes[4]["factor"] == pytest.approx(1 / 1.08, rel=0.004)
    assert sizes[1]["factor"] == pytest.approx(1.0, rel=0.004)
    lo, hi = sizes[4]["interval"]
    true_ratio = keep_all_step_time(true[4]) / keep_all_step_time(true[2])
    assert lo <= sizes[4]["measured_ratio"] <= hi and hi - lo < 0.01 and abs(sizes[4]["measured_ratio"] / true_ratio - 1) < 0.004
    # the predicted table is the true profiles' (within that noise), not the noisy ones' (batch 4 would be 8 %
    # slower): each row between the true profiles' plan and their lower bound, the MILP's own gap allowed for
    for row in section["ours_predicted"]:
        found, best = _true_row(true, row["batch_size"], section["memory_bytes"])
        assert found * (1 - 0.03) <= row["tokens_per_s"] <= best * (1 + 0.005)
    text = format_throughput(section)
    assert ("ours' profiles aligned to plain steps timed in one process, 12 paired rounds (step time relative to "
            "batch 2, median and its 95 % interval):") in text
    assert f"  batch 4: measured {sizes[4]['measured_ratio']:.4f} [{lo:.4f}, {hi:.4f}], profiled " in text


def test_section_alignment_failed_keeps_the_profiles_and_says_so(tiny_profiles, tmp_path, caplog):
    from adaptive_mem.bench._throughput import format_throughput

    noisy = {**tiny_profiles, 4: retime_profile(tiny_profiles[4], 1.08)}
    with caplog.at_level(logging.WARNING, logger="adaptive_mem.bench._align"):
        section, _ = _section(tiny_profiles, noisy, tmp_path, fail=True)
    assert section["profile_alignment"] == {"status": "failed", "error": "worker died: plain steps", "rounds": 12}
    assert [r.getMessage() for r in caplog.records] == [
        "throughput: the profiles are not aligned (the plain steps in paired rounds failed: worker died: plain steps)"]
    assert [r["batch_size"] for r in section["ours_predicted"]] == [1, 2, 3, 4]
    for row in section["ours_predicted"]:  # the noisy profiles as they came (batch 4's 8 % slower)
        found, best = _true_row(noisy, row["batch_size"], section["memory_bytes"])
        assert found * (1 - 0.03) <= row["tokens_per_s"] <= best * (1 + 0.005)
    assert ("ours' profiles not aligned: the plain steps in paired rounds failed: worker died: plain steps"
            in format_throughput(section))


def test_section_without_rounds_does_not_align(tiny_profiles, tmp_path):
    from adaptive_mem.bench._throughput import throughput_section

    worker = _AligningWorker(tiny_profiles[2].peak_memory, tiny_profiles)
    section = throughput_section(profile=tiny_profiles[2], more_profiles={1: tiny_profiles[1], 4: tiny_profiles[4]},
                                 batch_sizes=[1, 2, 3, 4], job=worker.job, spawn=worker, out=tmp_path, seq_len=32)
    assert worker.paired == [] and section["profile_alignment"] is None
