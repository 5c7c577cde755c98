"""Ours' throughput row is measured to fit like the others' (Note: [ours measured to fit]): a predicted best that
measures over the memory is listed, not counted, ranked or paired."""

from __future__ import annotations

import pytest

from test_paired_rounds import _PairedWorker
from test_throughput import _Worker, tiny_profiles  # noqa: F401 - the fixture is used by name


class _OverWorker(_Worker):
    """Ours' run of the first predicted batch measures ``over`` bytes above the memory; the others fit."""

    def __init__(self, base, ours, over):
        super().__init__(base, ours)
        self.over = over

    def __call__(self, j):
        result = super().__call__(j)
        if j["policy"] == "ours-milp" and self.order and j["batch_size"] == self.order[0]:
            result = {**result, "peak_bytes": self.base + self.over}
        return result


def test_bench_throughput_ours_row_is_its_best_that_measured_to_fit(tiny_profiles, tmp_path):
    """Note: [ours measured to fit] the predicted best measures a few KB over: the row is the next that fits."""
    from adaptive_mem.bench._report import _throughput as throughput_lines
    from adaptive_mem.bench._throughput import format_throughput, throughput_section

    profile = tiny_profiles[2]
    worker = _OverWorker(profile.peak_memory, [[120.0] * 3, [100.0, 101.0, 99.0], [90.0] * 3], over=4096)
    section = throughput_section(profile=profile, batch_sizes=[1, 2, 4, 8], job=worker.job, spawn=worker,
                                 out=tmp_path, seq_len=32, repeats=3)
    b1, b2, b3 = (c["batch_size"] for c in section["ours_top_predicted"])
    assert [c["fits"] for c in section["ours_top_predicted"]] == [False, True, True]
    ours = {r["name"]: r for r in section["rows"]}["ours-milp"]
    assert ours["largest_batch"] == b2 and ours["fits"] and ours["tokens_per_s"] == 100.0
    assert ours["peak_bytes"] <= section["memory_bytes"]
    assert ours["over_memory"] == [{"batch_size": b1, "peak_bytes": profile.peak_memory + 4096}]
    assert ours["plan"].endswith(f"throughput-ours-batch{b2}.yaml")
    # the faster run over the memory is no measured best: batch b2 is, 10 tokens/s ahead of b3
    assert not section["predicted_best_is_measured_best"] and section["ours_measured_gap"] == pytest.approx(10 / 90)
    text = format_throughput(section)
    assert f"(batch {b1}, predicted better, measured " in text and "MiB: over the memory)" in text
    assert "median 120.0 measured, spread 0.0 %, over the memory (runs" in text
    report = "\n".join(throughput_lines({"throughput": section}))
    assert f"| {b1} | " in report and "| 120.0 (over the memory) |" in report and "whose measured peak fits" in report


def test_section_paired_rounds_leave_out_a_batch_over_the_memory(tiny_profiles, tmp_path):
    """Note: [ours measured to fit] the predicted best measured over the memory: the other two are paired."""
    from adaptive_mem.bench._throughput import format_throughput, throughput_section

    class Over(_PairedWorker):
        def __call__(self, j):
            result = super().__call__(j)
            if j.get("kind") != "paired" and j["policy"] == "ours-milp" and j["batch_size"] == self.order[0]:
                result = {**result, "peak_bytes": self.base + 1}
            return result

    worker = Over(tiny_profiles[2].peak_memory, [[100.0] * 3, [99.0] * 3, [80.0] * 3], [1.0, 1.05])
    section = throughput_section(profile=tiny_profiles[2], batch_sizes=[1, 2, 4, 8], job=worker.job, spawn=worker,
                                 out=tmp_path, seq_len=32, repeats=3, rounds=9)
    b1, b2, b3 = (c["batch_size"] for c in section["ours_top_predicted"])
    (job,) = worker.paired
    assert [c["batch_size"] for c in job["candidates"]] == [b2, b3] and job["batch_size"] == b2
    assert section["ranking_from"] == "paired rounds" and not section["predicted_best_is_measured_best"]
    assert "paired_ratio" not in section["ours_top_predicted"][0]
    assert f"paired rounds (tokens/s relative to batch {b2}," in format_throughput(section)
