"""Ours' top three batches ranked by paired rounds in one process (Note: [paired rounds])."""

from __future__ import annotations

import random
import statistics
from math import comb

import pytest

from adaptive_mem.bench._paired import median_interval, paired_ranking
from adaptive_mem.cli._main import main

from test_throughput import _Worker, tiny_profiles  # noqa: F401 - the fixture is used by name


# ---------------------------------------------------------------- the interval of a median
@pytest.mark.parametrize("n, ranks", [(5, None), (6, (1, 6)), (8, (1, 8)), (9, (2, 8)), (10, (2, 9)), (12, (3, 10)),
                                      (15, (4, 12)), (20, (6, 15)), (30, (10, 21))])
def test_median_interval_ranks_are_the_textbook_ones(n, ranks):
    """The 95 % distribution-free interval of a median (order statistics; tables of the sign test)."""
    got = median_interval([float(v) for v in range(1, n + 1)])
    assert got == (None if ranks is None else (float(ranks[0]), float(ranks[1])))


@pytest.mark.parametrize("n", [6, 9, 15, 31])
def test_median_interval_ranks_are_the_narrowest_that_cover(n):
    """Brute force over k: the coverage 1 - 2 P(Bin(n, 1/2) <= k - 1) of ranks (k, n + 1 - k)."""
    def coverage(k):
        return 1 - 2 * sum(comb(n, j) for j in range(k)) / 2 ** n

    lo, hi = median_interval(list(range(1, n + 1)))
    assert hi == n + 1 - lo and coverage(lo) >= 0.95 and coverage(lo + 1) < 0.95


def test_median_interval_covers_the_median_of_a_skewed_distribution():
    rng = random.Random(7)
    true_median = 1.0  # of exp(N(0, 1)): a skewed distribution, median e^0
    hits = sum(lo <= true_median <= hi for _ in range(2000)
               for lo, hi in [median_interval([rng.lognormvariate(0, 1) for _ in range(15)])])
    assert 0.94 <= hits / 2000 <= 0.99  # nominal 96.5 % at n = 15


# ---------------------------------------------------------------- the ranking
def _rounds(per_token: list[float], tokens: list[int], rounds: int, *, load: float, noise: float, seed: int = 0):
    """Step times: each round's load multiplies every candidate's step alike (+- ``load``), each step its own
    noise (+- ``noise``)."""
    rng = random.Random(seed)
    times = [[] for _ in per_token]
    for _ in range(rounds):
        drift = 1 + rng.uniform(-load, load)
        for c, (s, t) in enumerate(zip(per_token, tokens)):
            times[c].append(s * t * drift * (1 + rng.uniform(-noise, noise)))
    return times


def test_paired_rounds_rank_through_load_that_hides_a_one_percent_gap():
    """Note: [paired rounds] the round's load hits every candidate alike: a 1 % gap under +-20 % load is resolved
    by 15 paired rounds, while the medians of the same steps taken apart cannot see it."""
    tokens = [2048, 3072, 3584]
    times = _rounds([1.0, 0.99, 1.03], tokens, 15, load=0.2, noise=0.003)
    ranked = paired_ranking(times, tokens)
    assert ranked["rounds"] == 15 and ranked["measured_best"] == 1 and ranked["second"] == 0
    assert ranked["ranking"] == "resolved" and ranked["gap"] == pytest.approx(1 / 0.99 - 1, abs=0.004)
    assert ranked["ratio"][0] == 1.0 and ranked["ratio_interval"][0] is None
    lo, hi = ranked["ratio_interval"][1]
    assert 1.0 < lo <= ranked["ratio"][1] <= hi
    assert ranked["ratio_interval"][2][1] < 1.0
    # the same steps taken apart: the per-candidate medians' spreads dwarf the gap
    spreads = [(max(t) - min(t)) / statistics.median(t) for t in times]
    assert min(spreads) > 0.2
    assert ranked["tokens_per_s"] == pytest.approx([statistics.median([k / s for s in t]) for k, t in
                                                    zip(tokens, times)])


def test_paired_rounds_predicted_best_resolved():
    tokens = [4, 6, 7]
    ranked = paired_ranking(_rounds([1.0, 1.02, 1.03], tokens, 12, load=0.1, noise=0.002), tokens)
    assert ranked["measured_best"] == 0 and ranked["second"] == 1 and ranked["ranking"] == "resolved"


def test_paired_rounds_tie_is_within_noise():
    tokens = [4, 6]
    ranked = paired_ranking(_rounds([1.0, 1.0], tokens, 15, load=0.1, noise=0.01, seed=3), tokens)
    assert ranked["ranking"] == "within noise"
    lo, hi = ranked["lead_interval"]
    assert lo <= 1.0 <= hi


def test_paired_rounds_too_few_rounds_claim_nothing():
    tokens = [4, 6]
    ranked = paired_ranking(_rounds([1.0, 1.1], tokens, 5, load=0.0, noise=0.0), tokens)
    assert ranked["measured_best"] == 0 and ranked["lead_interval"] is None
    assert ranked["ranking"] == "noise not measured (fewer than 6 rounds at 95%)"


# ---------------------------------------------------------------- in the throughput section
class _PairedWorker(_Worker):
    """The stand-in worker of test_throughput, and paired jobs: per-token step ``per_token[k]`` for the k-th
    candidate; ``fail``: the paired job fails."""

    def __init__(self, base, ours, per_token, fail=False):
        super().__init__(base, ours)
        self.per_token, self.fail, self.paired = per_token, fail, []

    def __call__(self, j):
        if j.get("kind") != "paired":
            return super().__call__(j)
        self.paired.append(j)
        if self.fail:
            return {"status": "failed", "error": "worker died: paired"}
        tokens = [c["batch_size"] * 32 for c in j["candidates"]]
        return {"status": "ok", "tokens_per_step": tokens,
                "step_times": _rounds(self.per_token, tokens, j["rounds"], load=0.2, noise=0.002)}


def _section(profile, tmp_path, per_token, *, fail=False, rounds=9):
    from adaptive_mem.bench._throughput import throughput_section

    worker = _PairedWorker(profile.peak_memory, [[100.0, 101.0, 99.0], [99.0, 101.0, 100.0], [80.0] * 3], per_token,
                           fail=fail)
    section = throughput_section(profile=profile, batch_sizes=[1, 2, 4, 8], job=worker.job, spawn=worker,
                                 out=tmp_path, seq_len=32, repeats=3, rounds=rounds)
    return section, worker


def test_section_paired_rounds_decide_the_verdict(tiny_profiles, tmp_path):
    from adaptive_mem.bench._throughput import format_throughput

    section, worker = _section(tiny_profiles[2], tmp_path, [1.0, 0.98, 1.05])
    top = section["ours_top_predicted"]
    (job,) = worker.paired
    assert job["rounds"] == 9 and job["policy"] == "ours-milp"
    assert [c["batch_size"] for c in job["candidates"]] == [c["batch_size"] for c in top]
    assert job["candidates"][0]["plan"] == str(tmp_path / "plans" / "throughput-ours.yaml")
    assert all((tmp_path / "plans").joinpath(c["plan"].rsplit("/", 1)[-1]).exists() for c in job["candidates"])
    # the processes cannot tell the first two apart; the paired rounds find the second 2 % faster
    assert section["process_ranking"] == "within noise" and section["process_best"] == top[0]["batch_size"]
    assert section["ranking_from"] == "paired rounds" and section["ours_paired"]["measured_best"] == top[1]["batch_size"]
    assert not section["predicted_best_is_measured_best"] and section["ours_ranking"] == "resolved"
    assert section["ours_measured_gap"] == pytest.approx(1 / 0.98 - 1, abs=0.004)
    assert top[0]["paired_ratio"] == 1.0 and top[1]["paired_ratio"] > 1.0 > top[2]["paired_ratio"]
    text = format_throughput(section)
    assert "  by process medians: the predicted best is the measured best; gap best to second 0.0 %: within noise" in text
    assert f"timed in one process, 9 paired rounds (tokens/s relative to batch {top[0]['batch_size']}" in text
    gap = 100 * section["ours_measured_gap"]
    assert text.endswith(f"  by paired rounds: the predicted best is NOT the measured best; gap best to second {gap:.1f} "
                         "%: resolved")


def test_section_paired_rounds_failed_keeps_the_process_verdict(tiny_profiles, tmp_path):
    from adaptive_mem.bench._throughput import format_throughput

    section, _ = _section(tiny_profiles[2], tmp_path, [1.0, 1.0, 1.0], fail=True)
    assert section["ranking_from"] == "processes" and section["ours_paired"]["error"] == "worker died: paired"
    assert section["ours_ranking"] == "within noise"
    assert format_throughput(section).endswith("  paired rounds in one process: failed: worker died: paired")


def test_section_without_rounds_runs_no_paired_job(tiny_profiles, tmp_path):
    section, worker = _section(tiny_profiles[2], tmp_path, [1.0, 1.0, 1.0], rounds=0)
    assert worker.paired == [] and "ours_paired" not in section and section["ranking_from"] == "processes"


@pytest.mark.parametrize("rounds", [-1, 1.5, True])
def test_section_bad_rounds(tiny_profiles, tmp_path, rounds):
    from adaptive_mem.bench._throughput import throughput_section

    with pytest.raises(ValueError, match=rf"^rounds={rounds!r}: expected a non-negative integer$"):
        throughput_section(profile=tiny_profiles[2], batch_sizes=[1], job=dict, spawn=dict, out=tmp_path, seq_len=32,
                           rounds=rounds)


def test_cli_bad_paired_rounds_one_line(tmp_path, capsys):
    code = main(["bench", "--model", "llama-tiny", "--policies", "", "--throughput", "1-2", "--paired-rounds", "-1",
                 "--out", str(tmp_path / "b")])
    out, err = capsys.readouterr()
    assert code == 2 and err.strip() == "adaptive-mem bench: error: --paired-rounds=-1: expected an integer >= 0"
    assert not (tmp_path / "b").exists()
    code = main(["bench", "--model", "llama-tiny", "--policies", "none", "--paired-rounds", "6",
                 "--out", str(tmp_path / "b")])
    out, err = capsys.readouterr()
    assert code == 2 and err.strip() == ("adaptive-mem bench: error: --paired-rounds=6 without --throughput: expected "
                                         "both (the rounds rank the throughput table's top three)")
    assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------- the worker
def test_worker_runs_the_candidates_in_one_process(tmp_path):
    """Each candidate its own model, optimizer and plan (a plan is applied per candidate: its decisions count)."""
    from adaptive_mem.bench._worker import run_paired
    from search import Plan

    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1,
                           "decisions": {"layers.0": "recompute", "layers.1": "swap"}})
    path = tmp_path / "plan.yaml"
    plan.save(path)
    job = {"spec": "llama-tiny", "seq_len": 16, "seed": 0, "policy": "ours-milp", "warmup": 1, "rounds": 3,
           "candidates": [{"batch_size": 1, "plan": str(path)}, {"batch_size": 2, "plan": str(path)}]}
    result = run_paired(job)
    assert result["status"] == "ok" and [len(t) for t in result["step_times"]] == [3, 3]
    assert all(t > 0 for times in result["step_times"] for t in times)
    assert result["tokens_per_step"] == [16, 32] and [i["decisions"] for i in result["info"]] == [2, 2]


def test_worker_times_each_step_after_one_of_its_own(monkeypatch):
    """Note: [paired rounds] a timed step follows an untimed step of the same candidate (what a training step
    follows), never another candidate's; the order is reversed every other round."""
    import time

    from adaptive_mem.bench import _worker

    events, real_step, real_clock = [], _worker._step, time.perf_counter

    def step(bundle, optimizer, seed):
        events.append(("step", bundle.batch_size))
        return real_step(bundle, optimizer, seed)

    def clock():
        events.append(("clock", None))
        return real_clock()

    monkeypatch.setattr(_worker, "_step", step)
    monkeypatch.setattr(_worker.time, "perf_counter", clock)
    job = {"spec": "llama-tiny", "seq_len": 8, "seed": 0, "policy": "none", "warmup": 1, "rounds": 3,
           "candidates": [{"batch_size": 1}, {"batch_size": 3}, {"batch_size": 2}]}
    assert _worker.run_paired(job)["status"] == "ok"
    starts = [k for k, e in enumerate(events) if e[0] == "clock"][::2]  # start, stop, start, ...
    timed = [(k + 1, events[k + 1][1]) for k in starts]
    assert [b for _, b in timed] == [1, 3, 2, 2, 3, 1, 1, 3, 2]
    for k, b in timed:
        assert events[k - 2] == ("step", b)  # the untimed step just before the clock started
