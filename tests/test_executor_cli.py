"""``adaptive-mem run``: trains with a plan, reports measured memory; bad input exits 2 with one line."""

from __future__ import annotations

import re

import pytest

from adaptive_mem.cli._main import main
from search import parse_bytes
from search import Plan


def _peak(out: str) -> int:
    return int(re.search(r"peak device memory: (\d+) bytes", out).group(1))


def test_run_with_plan_reports_lower_peak_than_plain(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers": "recompute"}}).save(plan)
    assert main(["run", "--model", "llama-tiny", "--seq-len", "128", "--steps", "2", "--optimizer", "sgd"]) == 0
    plain = capsys.readouterr().out
    assert main(["run", "--model", "llama-tiny", "--seq-len", "128", "--steps", "2", "--optimizer", "sgd",
                 "--plan", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "steps: 2" in out and re.search(r"median step time: [\d.]+ s", out)
    assert _peak(out) < _peak(plain)


def test_run_cap_raises_out_of_memory(capsys):
    assert main(["run", "--steps", "1", "--device-memory-cap", "1MiB"]) == 1
    assert "out of device memory at step 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--plan", "missing.yaml"], "plan file 'missing.yaml': cannot read"),
    (["--steps", "0"], "--steps=0: expected a positive integer"),
    (["--device-memory-cap", "lots"], "--device-memory-cap='lots': expected a positive size"),
    (["--plan", "a.yaml", "--config", "b.yaml"], "--plan and --config both given"),
])
def test_run_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]


def test_parse_bytes():
    assert parse_bytes("2GiB", key="x", plain=True) == 2 * 2**30
    assert parse_bytes("1500", key="x", plain=True) == 1500
    assert parse_bytes("1.5 MB", key="x", plain=True) == 1_500_000
