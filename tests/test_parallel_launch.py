"""Launching parallel runs end to end (subprocesses with a timeout, 2 gloo ranks on CPU): ``adaptive-mem run --nproc 2
--parallel ddp|pp`` spawns its own ranks, ``torchrun --nproc-per-node 2 examples/train.py --parallel fsdp`` with a plan
and with the adaptive loop. A plan of recompute changes no loss: each planned run prints the plain run's losses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_mem.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds per launch; each rank's collectives have their own
TINY = ["--model", "llama-tiny", "--batch-size", "4", "--seq-len", "32", "--log-level", "WARNING"]


def _plan(tmp_path: Path) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "adaptive-mem-plan", "version": 1, "decisions": {
        "layers.0": "recompute", "layers.1.feed_forward.w1.activation.silu": "recompute"}}))
    return str(path)


def _launch(cmd: list[str], tmp_path: Path) -> str:
    env = {**os.environ, "ADAPTIVE_MEM_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env)
    assert done.returncode == 0, f"{cmd}: rc {done.returncode}\n{done.stdout}\n{done.stderr[-6000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout


def _run(tmp_path: Path, *flags: str) -> str:
    cli = Path(sys.executable).with_name("adaptive-mem")
    return _launch([str(cli), "run", "--nproc", "2", *TINY, "--steps", "2", *flags], tmp_path)


def _losses(out: str) -> str:
    return re.search(r"^steps: 2  loss: (\S+ -> \S+)$", out, re.M).group(1)


@pytest.mark.parametrize("layout", ["ddp", "pp"])
def test_run_spawns_the_ranks_and_prints_rank_0s_figures(tmp_path, layout):
    plain = _run(tmp_path, "--parallel", layout)
    planned = _run(tmp_path, "--parallel", layout, "--plan", _plan(tmp_path))
    for out in (plain, planned):
        assert f"parallel: {layout} over 2 ranks (gloo)" in out, out
        assert out.count("steps: 2  loss:") == 1, f"only rank 0 prints: {out}"
        peaks = re.search(r"^peak device memory: rank 0 (\d+) bytes .*; per rank \[(\d+), (\d+)\]$", out, re.M)
        assert peaks is not None and int(peaks.group(1)) == int(peaks.group(2)) > 0, out
    assert _losses(planned) == _losses(plain)
    assert "plan: " + _plan(tmp_path) in planned
    assert re.search(r"^rank 0: optimize: 1 layers recomputed, ", planned, re.M), planned


def test_run_adaptive_on_two_ddp_ranks(tmp_path):
    out = _run(tmp_path, "--parallel", "ddp", "--adaptive-memory-optimization", "--memory-budget", "6MB")
    assert re.search(r"^rank 0: adaptive memory: .*1 profiles", out, re.M), out


def test_run_adaptive_under_tensor_parallel_plans_with_the_ranks_local_shards(tmp_path):
    """A DTensor rank's profile counts its local shards (``profiler._recorder.local_shard``): a budget under the plain
    TP run's own peak is planned and met; with global sizes the loop refused it as below the minimum feasible."""
    plain = _run(tmp_path, "--parallel", "tp")
    peak = int(re.search(r"^peak device memory: rank 0 (\d+) bytes", plain, re.M).group(1))
    budget = int(peak * 0.95)
    out = _run(tmp_path, "--parallel", "tp", "--adaptive-memory-optimization", "--memory-budget", f"{budget}B")
    assert re.search(r"^rank 0: adaptive memory: converged", out, re.M), out
    ranks = re.search(r"^peak device memory: rank 0 \d+ bytes .*; per rank \[(\d+), (\d+)\]$", out, re.M)
    assert ranks is not None and max(int(ranks.group(1)), int(ranks.group(2))) <= budget, (out, budget)
    assert _losses(out) == _losses(plain)


@pytest.mark.parametrize("argv, message", [
    (["--parallel", "pp", "--nproc", "1"], "--parallel=pp with --nproc=1: expected --nproc >= 2 (one rank per "
                                           "pipeline stage)"),
    (["--nproc", "2"], "--nproc=2 without --parallel: expected --parallel ddp, fsdp, tp or pp"),
    (["--nproc", "2", "--parallel", "pp", "--model-args", "num_layers=3"],
     "--parallel=pp with --nproc=2: expected a divisor of the model's 3 layers"),
    (["--nproc", "2", "--parallel", "ddp", "--micro-batches", "2"], "--micro-batches=2 with --parallel=ddp"),
])
def test_run_refuses_nproc_and_parallel_that_disagree_in_one_line(capsys, argv, message):
    rc = cli_main(["run", "--steps", "1", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"adaptive-mem run: error: {message}"), err


def _torchrun(tmp_path: Path, *flags: str) -> str:
    torchrun = Path(sys.executable).with_name("torchrun")
    return _launch([str(torchrun), "--nproc-per-node", "2", "examples/train.py", "--parallel", "fsdp",
                    "--batch-size", "4", "--seq-len", "32", "--steps", "2", *flags], tmp_path)


def test_torchrun_example_fsdp_with_a_plan_and_with_the_adaptive_loop(tmp_path):
    plain = _torchrun(tmp_path)
    planned = _torchrun(tmp_path, "--memory-plan", _plan(tmp_path))
    adaptive = _torchrun(tmp_path, "--adaptive-memory-optimization", "--memory-budget", "6MB")
    losses = [re.findall(r"^step \d: loss (\S+),", out, re.M) for out in (plain, planned, adaptive)]
    assert len(losses[0]) == 2, f"rank 0 prints each step once: {plain}"
    assert losses[1] == losses[0] and losses[2] == losses[0], losses
    assert "layers recomputed" in planned
    assert re.search(r"^adaptive memory: .*1 profiles", adaptive, re.M), adaptive
