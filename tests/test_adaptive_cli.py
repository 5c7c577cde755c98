"""The single flag from the command line and from examples/train.py (reference model and an ``hf:`` model).

Both run under ``DeviceMemory`` with a gc scan of existing tensors: kept in their own module so no
module-scoped fixture of another test holds accounted tensors while they run.
"""

from __future__ import annotations

import gc

import pytest


def test_cli_run_with_the_flag(capsys, tmp_path):
    from adaptive_mem.cli._main import main

    gc.collect()
    code = main(["run", "--model", "llama-tiny", "--batch-size", "4", "--seq-len", "128", "--optimizer", "sgd",
                 "--adaptive-memory-optimization", "--memory-budget", "8MB", "--steps", "4",
                 "--memory-plan-cache", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    peak = int(out.split("peak device memory: ")[1].split(" ")[0])
    assert peak <= 8_000_000
    assert main(["run", "--adaptive-memory-optimization", "--plan", "x.yaml", "--steps", "1"]) == 2


def test_example_trains_an_hf_model_with_the_flag(tmp_path, capsys):
    pytest.importorskip("transformers", reason="Hugging Face models need transformers (the [test] extra installs it)")
    import importlib.util
    from pathlib import Path

    gc.collect()
    path = Path(__file__).resolve().parents[1] / "examples" / "train.py"
    spec = importlib.util.spec_from_file_location("train_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--model", "hf:llama", "--adaptive-memory-optimization", "--memory-budget", "6MB",
                         "--steps", "4", "--memory-plan-cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    peaks = [int(line.split("peak ")[1].split(" ")[0]) for line in out.splitlines() if line.startswith("step ")]
    assert len(peaks) == 4 and max(peaks) <= 6_000_000
