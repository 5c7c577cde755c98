"""The single flag from the command line and from examples/train.py (reference model and an ``hf:`` model).

Both run under ``DeviceMemory`` with a gc scan of existing tensors, as a user's run does: each in its own process,
so tensors another test left alive are no device memory of theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env)


def test_cli_run_with_the_flag(tmp_path):
    done = _run(["-m", "adaptive_mem.cli._main", "run", "--model", "llama-tiny", "--batch-size", "4", "--seq-len",
                 "128", "--optimizer", "sgd", "--adaptive-memory-optimization", "--memory-budget", "8MB", "--steps",
                 "4", "--memory-plan-cache", str(tmp_path)])
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    peak = int(done.stdout.split("peak device memory: ")[1].split(" ")[0])
    assert peak <= 8_000_000
    refused = _run(["-m", "adaptive_mem.cli._main", "run", "--adaptive-memory-optimization", "--plan", "x.yaml",
                    "--steps", "1"])
    assert refused.returncode == 2, refused.stderr


def test_example_trains_an_hf_model_with_the_flag(tmp_path):
    pytest.importorskip("transformers", reason="Hugging Face models need transformers (the [test] extra installs it)")
    done = _run(["examples/train.py", "--model", "hf:llama", "--adaptive-memory-optimization", "--memory-budget",
                 "6MB", "--steps", "4", "--memory-plan-cache", str(tmp_path)])
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    peaks = [int(line.split("peak ")[1].split(" ")[0]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(peaks) == 4 and max(peaks) <= 6_000_000
