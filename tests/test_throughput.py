"""Throughput mode: the batch size and plan chosen together, batch scaling, the CLI and the plan's batch size."""

from __future__ import annotations

import dataclasses
import random

import pytest

from adaptive_mem.cli._main import main
from search import (BatchSizesError, Plan, StepModel, get_solver, maximize_throughput, scale_profile,
                    scaling_error)
from _profiles import random_profile
from search.planning import parse_batch_sizes
from search.planning import keep_all
from search.planning import simulate_assignment

from test_milp_exact import PREFETCH, brute_force


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- parsing
@pytest.mark.parametrize("text, sizes", [("1,2,4,8", [1, 2, 4, 8]), ("1-4", [1, 2, 3, 4]), ("8, 1-2,2", [1, 2, 8]),
                                         ("3", [3])])
def test_batch_sizes_parse(text, sizes):
    assert parse_batch_sizes(text) == sizes


@pytest.mark.parametrize("text", ["0", "abc", "", "4-2", "1,,2", "-1", "2.5", "0-3"])
def test_batch_sizes_refused(text):
    with pytest.raises(BatchSizesError, match=r"^--batch-sizes=.*expected positive integers"):
        parse_batch_sizes(text)


# ---------------------------------------------------------------- the search against brute force
def _instance(seed: int):
    rng = random.Random(seed)
    prof = random_profile(rng, num_layers=2, units_per_layer=2, identical=rng.random() < 0.5)
    # a per-step constant (optimizer step) that larger batches amortize, so the best batch is not trivial
    prof = dataclasses.replace(prof, optimizer_time=rng.choice([0.0, 0.005, 0.02, 0.1]))
    keep = simulate_assignment(StepModel.build(prof), keep_all(StepModel.build(prof)))
    act = keep.peak_bytes - StepModel.build(prof).base
    budget = StepModel.build(prof).base + int(rng.uniform(1.0, 5.0) * act)
    return prof, budget


@pytest.mark.parametrize("seed", range(12))
def test_picks_the_brute_force_best_batch(seed):
    prof, budget = _instance(seed)
    sizes = [1, 2, 3, 4, 6]
    result = maximize_throughput(profiles=prof, batch_sizes=sizes, budget=budget,
                                 solver=get_solver("milp", prefetch=PREFETCH))
    expected = {}
    for b in sizes:
        t = brute_force(StepModel.build(scale_profile(prof, b)), budget)
        expected[b] = None if t is None else b / t  # seq_len 1: samples/s
    for row in result.rows:
        assert row.fits == (expected[row.batch_size] is not None), (seed, row.batch_size)
        if row.fits:
            assert row.tokens_per_second == pytest.approx(expected[row.batch_size], rel=1e-6)
            assert row.peak_bytes <= budget
    best = max(v for v in expected.values() if v is not None)
    batch, res = result.best
    assert expected[batch] == pytest.approx(best, rel=1e-6)
    assert res.plan.model["batch_size"] == batch


def test_no_batch_fits_is_one_line():
    prof, _ = _instance(0)
    from search import InfeasibleBudgetError

    with pytest.raises(InfeasibleBudgetError, match=r"^no batch size in 1, 2 fits the budget"):
        maximize_throughput(profiles=prof, batch_sizes="1,2", budget=StepModel.build(prof).base + 1)


def test_activation_fraction_refused():
    from search import Budget, BudgetError

    prof, _ = _instance(0)
    with pytest.raises(BudgetError, match="expected a total"):
        maximize_throughput(profiles=prof, batch_sizes="1", budget=Budget(activation_fraction=0.5))


# ---------------------------------------------------------------- batch scaling
def test_linear_scaling_one_profile():
    prof, _ = _instance(3)
    scaled = scale_profile(prof, 3)
    assert [u.saved_bytes for u in scaled.units] == [3 * u.saved_bytes for u in prof.units]
    assert scaled.static == prof.static and scaled.model["batch_size"] == 3
    assert scaled.model["extrapolated_from"] == [1]
    assert [u.fwd_time for u in scaled.units] == pytest.approx([3 * u.fwd_time for u in prof.units])


@pytest.fixture(scope="module")
def tiny_profiles():
    import profiler
    from adaptive_mem import build_model

    return {b: profiler.profile_step(build_model("llama-tiny", batch_size=b, device="meta"), hardware="h100",
                                     optimizer="adam") for b in (1, 2, 4)}


def test_scaling_checked_against_a_third_size(tiny_profiles):
    """Profiles at batch 1 and 2 predict batch 4's (fake-tensor: exact bytes, estimated times)."""
    (check,) = scaling_error(tiny_profiles)
    assert check.batch_size == 4 and check.scaled_from == (1, 2)
    assert check.activation_error < 0.01 and check.time_error < 0.01 and check.ok
    scaled = scale_profile((tiny_profiles[1], tiny_profiles[2]), 4)
    assert [u.saved_bytes for u in scaled.units] == [u.saved_bytes for u in tiny_profiles[4].units]


def test_scaling_checked_on_measured_cpu_profiles():
    """Measured on this CPU: the saved bytes scale exactly, the keep-all activation peak within 1 % (times are
    not checked here: this machine is shared)."""
    import profiler
    from adaptive_mem import build_model

    profiles = {b: profiler.profile_step(build_model("llama-tiny", batch_size=b), optimizer="adam",
                                         warmup=0, repeat=1, record=1) for b in (1, 2, 4)}
    (check,) = scaling_error(profiles)
    assert check.activation_error < 0.01
    scaled = scale_profile((profiles[1], profiles[2]), 4)
    assert sum(u.saved_bytes for u in scaled.units) == sum(u.saved_bytes for u in profiles[4].units)


@pytest.fixture(scope="module")
def tiny8():
    import profiler
    from adaptive_mem import build_model

    return profiler.profile_step(build_model("llama-tiny", batch_size=8, device="meta"), hardware="h100",
                                 optimizer="adam")


def _slower(profile, factor):
    """``profile`` with every op and unit ``factor`` times slower (a noisy measurement)."""
    return dataclasses.replace(
        profile, ops=[dataclasses.replace(o, fwd_time=o.fwd_time * factor, bwd_time=o.bwd_time * factor)
                      for o in profile.ops],
        units=[dataclasses.replace(u, fwd_time=u.fwd_time * factor, bwd_time=u.bwd_time * factor)
               for u in profile.units])


@pytest.mark.parametrize("batch, pair", [(3, [2, 4]), (5, [4, 8]), (6, [4, 8]), (7, [4, 8]), (12, [4, 8])])
def test_sizes_between_profiles_are_interpolated(tiny_profiles, tiny8, batch, pair):
    """Note: [bracketing profiles] batch 5 comes from 4 and 8 (as near as 2): 5 % noise in the batch-2 profile
    does not reach it; only sizes beyond the profiles are extrapolated, from the two nearest."""
    from search import profile_for_batch

    profiles = {**tiny_profiles, 2: _slower(tiny_profiles[2], 1.05), 8: tiny8}
    got = profile_for_batch(profiles, batch)
    assert got.model["extrapolated_from"] == pair and got.model["batch_size"] == batch
    expected = scale_profile((profiles[pair[0]], profiles[pair[1]]), batch)
    assert [o.fwd_time for o in got.ops] == [o.fwd_time for o in expected.ops]
    if batch < 8:
        for op, lo, hi in zip(got.ops, profiles[pair[0]].ops, profiles[pair[1]].ops):
            assert min(lo.bwd_time, hi.bwd_time) <= op.bwd_time <= max(lo.bwd_time, hi.bwd_time)
    source = {r.batch_size: r.source for r in maximize_throughput(profiles=profiles, batch_sizes=[batch, 8],
                                                                  budget=10**12).rows}
    word = "interpolated between" if batch < 8 else "extrapolated from"
    assert source == {batch: f"{word} batches {pair[0]}, {pair[1]}", 8: "profiled"}


@pytest.mark.parametrize("base, sizes, profiled", [(2, "1-8", [1, 4, 8]), (2, "1-4", [1, 4]), (2, "2", []),
                                                    (1, "1-16", [2, 4, 8, 16]), (4, "1-6", [1, 6]),
                                                    (2, "1-6", [1, 4, 6]), (2, "3,5", [3, 4, 5])])
def test_bench_profiles_the_ends_and_doublings(base, sizes, profiled):
    from adaptive_mem.bench._throughput import profiled_sizes

    assert profiled_sizes(base, parse_batch_sizes(sizes)) == profiled


# ---------------------------------------------------------------- CLI and the plan's batch size
@pytest.fixture(scope="module")
def tiny1(tmp_path_factory):
    path = tmp_path_factory.mktemp("prof") / "tiny1.json"
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--batch-size", "1", "-o", str(path)]) == 0
    return path


@pytest.mark.parametrize("sizes", ["0", "abc", "", "4-2"])
def test_cli_bad_batch_sizes_one_line(tiny1, tmp_path, capsys, sizes):
    code, out, err = run(capsys, "search", tiny1, "--budget", "5MiB", "--maximize", "throughput", "--batch-sizes",
                         sizes, "-o", tmp_path / "p.yaml")
    assert code == 2 and err.count("\n") == 1 and f"--batch-sizes={sizes!r}" in err and "expected" in err
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("argv, what", [
    (["--maximize", "speed", "--batch-sizes", "1"], "--maximize='speed'"),
    (["--maximize", "throughput"], "without --batch-sizes"),
    (["--batch-sizes", "1,2"], "without --maximize"),
    (["--maximize", "throughput", "--batch-sizes", "1", "--pipeline-stages", "2"], "--pipeline-stages='2'"),
])
def test_cli_bad_combinations_one_line(tiny1, tmp_path, capsys, argv, what):
    code, _, err = run(capsys, "search", tiny1, "--budget", "5MiB", *argv, "-o", tmp_path / "p.yaml")
    assert code == 2 and err.count("\n") == 1 and what in err


def test_cli_table_plan_batch_size_and_run(tiny1, tmp_path, capsys):
    plan_path = tmp_path / "plan.yaml"
    code, out, _ = run(capsys, "search", tiny1, "--budget", "4MiB", "--maximize", "throughput", "--batch-sizes",
                       "1,2,4,8", "-o", plan_path)
    assert code == 0, out
    assert "tokens/s" in out and "does not fit" in out and "extrapolated from batch 1" in out
    plan = Plan.load(plan_path)
    best = plan.model["batch_size"]
    assert f"best: batch size {best}," in out and best in (2, 4)
    assert Plan.loads(plan.dumps(fmt="json")).model["batch_size"] == best  # round trip, JSON too
    # run uses the plan's batch size; --batch-size overrides and the shape check refuses the mismatch
    code, out, _ = run(capsys, "run", "--model", "llama-tiny", "--plan", plan_path, "--steps", "1")
    assert code == 0 and f"batch: {best}x32" in out
    code, _, err = run(capsys, "run", "--model", "llama-tiny", "--plan", plan_path, "--steps", "1",
                       "--batch-size", str(best * 2))
    assert code == 2 and "input shape mismatch" in err and err.count("\n") == 1


def test_cli_given_profiles_and_model(tiny1, tmp_path, capsys):
    """--model profiles the other sizes (rows say profiled); with three, the scaling check is printed."""
    code, out, _ = run(capsys, "search", tiny1, "--budget", "5MiB", "--maximize", "throughput", "--batch-sizes",
                       "1,2,4", "--model", "llama-tiny", "-o", tmp_path / "p.yaml")
    assert code == 0 and "scaling check: batch 4" in out
    table = out.split("throughput under")[1]
    assert "extrapolated" not in table and table.count("profiled,") == 3


def test_bench_throughput_section_climbs_until_the_memory(tiny_profiles, tmp_path):
    """The section's logic with a stand-in worker: peaks grow with the batch; each policy stops at the memory."""
    from adaptive_mem.bench._throughput import format_throughput, throughput_section

    profile = tiny_profiles[2]
    per = {"none": 1.0, "full": 0.5, "compile": 0.7, "ours-milp": 0.6}
    base = profile.peak_memory

    def job(policy, batch, **extra):
        return {"policy": policy, "batch_size": batch, **extra}

    def spawn(j):
        peak = base + int(per[j["policy"]] * 400_000 * (j["batch_size"] - 2))
        return {"status": "ok", "peak_bytes": peak, "tokens_per_s": 100.0 * j["batch_size"] / (1 + per[j["policy"]])}

    section = throughput_section(profile=profile, batch_sizes=[1, 2, 4, 8], job=job, spawn=spawn, out=tmp_path,
                                 seq_len=32)
    rows = {r["name"]: r for r in section["rows"]}
    assert section["memory_bytes"] == base
    assert rows["none"]["largest_batch"] == 2 and rows["full"]["largest_batch"] == 2
    assert [t["batch_size"] for t in rows["full"]["tried"]] == [1, 2, 4]  # stops at the first that does not fit
    assert all(0 <= t["budget"] <= 1 for t in rows["compile"]["tried"])
    assert rows["ours-milp"]["largest_batch"] in (1, 2, 4, 8) and (tmp_path / "plans" / "throughput-ours.yaml").exists()
    assert "largest batch" in format_throughput(section)
    # the three batches predicted best are measured: here tokens/s grow with the batch in the stand-in worker
    top = section["ours_top_predicted"]
    assert top[0]["batch_size"] == rows["ours-milp"]["largest_batch"] and 1 <= len(top) <= 3
    assert len({c["batch_size"] for c in top}) == len(top)
    best = max((c for c in top if c["fits"]), key=lambda c: c["tokens_per_s"])["batch_size"]  # over: not ranked
    assert section["predicted_best_is_measured_best"] == (best == top[0]["batch_size"])
    assert "the predicted best" in format_throughput(section)


# ---------------------------------------------------------------- the top three, measured with repeats
class _Worker:
    """A stand-in worker: peaks grow with the batch (plain model at batch 2 = the memory); the other policies'
    tokens/s grow by 1 per call of the same (policy, batch); ours' runs of the k-th predicted batch (by first call)
    return ``ours[k]`` in turn (None: the run fails)."""

    def __init__(self, base: int, ours: list[list[float | None]]):
        self.base, self.ours, self.calls, self.order = base, ours, [], []

    def job(self, policy, batch, **extra):
        return {"policy": policy, "batch_size": batch, **extra}

    def __call__(self, j):
        per = {"none": 1.0, "full": 0.5, "compile": 0.7, "ours-milp": 0.6}[j["policy"]]
        self.calls.append((j["policy"], j["batch_size"]))
        peak = self.base + int(per * 400_000 * (j["batch_size"] - 2))
        if j["policy"] != "ours-milp":
            return {"status": "ok", "peak_bytes": peak, "tokens_per_s": 100.0 * j["batch_size"] + self.calls.count(
                (j["policy"], j["batch_size"]))}
        if j["batch_size"] not in self.order:
            self.order.append(j["batch_size"])
        runs = self.ours[self.order.index(j["batch_size"])]
        tokens = runs[self.calls.count(self.calls[-1]) - 1]
        if tokens is None:
            return {"status": "failed", "error": "worker died: boom"}
        return {"status": "ok", "peak_bytes": min(peak, self.base), "tokens_per_s": tokens}


def _section(profile, tmp_path, ours, repeats):
    from adaptive_mem.bench._throughput import throughput_section

    worker = _Worker(profile.peak_memory, ours)
    section = throughput_section(profile=profile, batch_sizes=[1, 2, 4, 8], job=worker.job, spawn=worker,
                                 out=tmp_path, seq_len=32, repeats=repeats)
    return section, worker


def test_bench_throughput_top_three_interleaved_medians(tiny_profiles, tmp_path):
    from adaptive_mem.bench._throughput import format_throughput

    section, worker = _section(tiny_profiles[2], tmp_path, [[105.0, 95.0, 100.0], [80.0, 90.0, 85.0],
                                                            [71.0, 70.0, 72.0]], repeats=3)
    top = section["ours_top_predicted"]
    assert len(top) == 3 and section["repeats"] == 3
    b1, b2, b3 = (c["batch_size"] for c in top)
    assert [b for p, b in worker.calls if p == "ours-milp"] == [b1, b2, b3] * 3  # round robin, a worker per run
    assert [c["runs_tokens_per_s"] for c in top] == [[105.0, 95.0, 100.0], [80.0, 90.0, 85.0], [71.0, 70.0, 72.0]]
    assert [c["tokens_per_s"] for c in top] == [100.0, 85.0, 71.0]
    assert [c["spread"] for c in top] == pytest.approx([0.1, 10 / 85, 2 / 71])
    assert section["predicted_best_is_measured_best"] and section["ours_ranking"] == "resolved"  # gap 15 > 10
    assert section["ours_measured_gap"] == pytest.approx(15 / 85)
    rows = {r["name"]: r for r in section["rows"]}
    assert rows["ours-milp"]["largest_batch"] == b1 and rows["ours-milp"]["tokens_per_s"] == 100.0
    # the other policies: the median of 3 runs at their largest batch (the plain model's first is the reference)
    assert rows["none"]["largest_batch"] == 2 and rows["none"]["runs_tokens_per_s"] == [201.0, 202.0, 203.0]
    assert rows["none"]["tokens_per_s"] == 202.0 and rows["none"]["spread"] == pytest.approx(2 / 202)
    assert worker.calls.count(("full", rows["full"]["largest_batch"])) == 3
    text = format_throughput(section)
    assert "medians of 3 runs" in text
    assert f"  batch {b1}: " in text and "median 100.0 measured, spread 10.0 % (runs 105.0, 95.0, 100.0)" in text
    assert f"  batch {b3}: " in text and "median 71.0 measured, spread 2.8 % (runs 71.0, 70.0, 72.0)" in text
    assert "the predicted best is the measured best; gap best to second 17.6 %: resolved" in text


@pytest.mark.parametrize("ours, is_best, ranking", [
    ([[100.0, 101.0, 99.0], [90.0, 91.0, 89.0], [80.0] * 3], True, "resolved"),
    ([[100.0, 110.0, 90.0], [95.0, 105.0, 85.0], [80.0] * 3], True, "within noise"),  # gap 5 < spread 20
    ([[90.0, 91.0, 89.0], [100.0, 101.0, 99.0], [80.0] * 3], False, "resolved"),
    ([[95.0, 105.0, 85.0], [80.0] * 3, [100.0, 110.0, 90.0]], False, "within noise"),
    ([[100.0, 100.0, 100.0], [100.0, 100.0, 100.0], [80.0] * 3], True, "within noise"),  # a tie is no ranking
])
def test_bench_throughput_verdict_both_ways(tiny_profiles, tmp_path, ours, is_best, ranking):
    """Note: [ranking resolved]"""
    from adaptive_mem.bench._throughput import format_throughput

    section, _ = _section(tiny_profiles[2], tmp_path, ours, repeats=3)
    assert section["predicted_best_is_measured_best"] is is_best and section["ours_ranking"] == ranking
    verdict = "is" if is_best else "is NOT"
    gap = 100 * section["ours_measured_gap"]
    assert format_throughput(section).endswith(f"the predicted best {verdict} the measured best; "
                                               f"gap best to second {gap:.1f} %: {ranking}")


def test_bench_throughput_one_run_claims_no_resolution(tiny_profiles, tmp_path):
    section, worker = _section(tiny_profiles[2], tmp_path, [[100.0], [90.0], [80.0]], repeats=1)
    assert section["predicted_best_is_measured_best"] and section["ours_ranking"] == "noise not measured (one run each)"
    assert [c["spread"] for c in section["ours_top_predicted"]] == [0.0, 0.0, 0.0]
    assert worker.calls.count(("none", 2)) == 1  # the reference run only: no repeats at repeats=1


def test_bench_throughput_failed_run_is_not_rerun(tiny_profiles, tmp_path):
    from adaptive_mem.bench._throughput import format_throughput

    section, worker = _section(tiny_profiles[2], tmp_path, [[100.0, None, 100.0], [90.0] * 3, [80.0] * 3], repeats=3)
    first, *_ = section["ours_top_predicted"]
    assert worker.calls.count(("ours-milp", first["batch_size"])) == 2
    assert first["tokens_per_s"] is None and first["error"] == "worker died: boom"
    assert not section["predicted_best_is_measured_best"]
    ours = [r for r in section["rows"] if r["name"] == "ours-milp"][0]
    assert ours["tokens_per_s"] is None and ours["error"] == "worker died: boom" and not ours["fits"]
    assert f"  batch {first['batch_size']}: " in format_throughput(section)
    assert "failed: worker died: boom (runs 100.0, failed)" in format_throughput(section)


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True])
def test_bench_throughput_bad_repeats(tiny_profiles, tmp_path, repeats):
    from adaptive_mem.bench._throughput import throughput_section

    with pytest.raises(ValueError, match=rf"^repeats={repeats!r}: expected a positive integer$"):
        throughput_section(profile=tiny_profiles[2], batch_sizes=[1], job=dict, spawn=dict, out=tmp_path, seq_len=32,
                           repeats=repeats)


def test_bench_throughput_section_names_its_profiles_and_checks_the_scaling(tiny_profiles, tmp_path):
    from adaptive_mem.bench._throughput import format_throughput, throughput_section

    worker = _Worker(tiny_profiles[2].peak_memory, [[100.0], [90.0], [80.0]])
    section = throughput_section(profile=tiny_profiles[2], batch_sizes=[1, 2, 3, 4], job=worker.job, spawn=worker,
                                 out=tmp_path, seq_len=32, more_profiles={1: tiny_profiles[1], 4: tiny_profiles[4]})
    assert section["profiled_sizes"] == [1, 2, 4]
    (check,) = section["scaling_checks"]
    assert check.startswith("scaling check: batch 4 measured vs extrapolated from batches 1, 2: activation peak off by")
    sources = {r["batch_size"]: r["source"] for r in section["ours_predicted"]}
    assert sources == {1: "profiled", 2: "profiled", 3: "interpolated between batches 2, 4", 4: "profiled"}
    text = format_throughput(section)
    assert "ours' profiles: batches 1, 2, 4 measured" in text and f"  {check}" in text
