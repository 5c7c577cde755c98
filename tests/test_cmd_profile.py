"""``adaptive-mem profile`` and ``adaptive-mem demo``: output, files, and bad input (exit 2, one line)."""

from __future__ import annotations

import json

import pytest

from adaptive_mem.cli import _demo as _cmd_demo
from adaptive_mem.cli._main import main
from profiler import Profile


def test_profile_prints_the_summary_and_writes_the_profile(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "llama-tiny", "-o", str(out), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "saved MiB" in text and "fwd ms" in text and "bwd ms" in text
    assert "top units by saved bytes" in text
    profile = Profile.load(out)
    assert profile.device == "cpu" and profile.measured and profile.model["spec"] == "llama-tiny"
    rows = [line.split() for line in text.splitlines()]
    layer_rows = [r for r in rows if len(r) == 4 and r[0].isdigit()]
    assert [int(r[0]) for r in layer_rows] == [0, 1, 2, 3]
    for row in layer_rows:  # the table shows what the file holds
        saved = sum(u.saved_bytes for u in profile.layer_units(int(row[0])))
        assert float(row[1]) == pytest.approx(saved / 2**20, abs=0.006)
    top = text.split("top units by saved bytes")[1].splitlines()[2:5]
    assert len(top) == 3 and top[0].split()[0] == "feed_forward.w1.matmul"


def test_profile_on_fake_tensors_for_named_hardware(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["profile", "--model", "hf:qwen2", "--model-args", "num_hidden_layers=3", "--batch-size", "1",
            "--seq-len", "16", "--dtype", "bf16", "--device", "meta", "--hardware", "a100", "--optimizer", "sgd",
            "-o", str(out)]
    assert main(args) == 0
    profile = Profile.load(out)
    assert (profile.device, profile.measured, profile.hardware.name, profile.num_layers) == ("meta", False, "a100", 3)
    assert profile.static.optimizer == "sgd" and profile.static.optimizer_state == 0
    assert (profile.model["batch_size"], profile.model["seq_len"], profile.model["dtype"]) == (1, 16, "bfloat16")
    assert "estimated for a100" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["--model", "llama-huge"], "model spec 'llama-huge': unknown; expected a preset"),
    (["--model", "hf:roberta"], "unknown family 'roberta'"),
    (["--model", "test_model_spec:raising_factory"], "factory raised RuntimeError: weights not found"),
    (["--model", "test_model_spec:frozen_lm"], "output has no grad"),
    (["--model", "llama-tiny", "--batch-size", "0"], "--batch-size='0': expected a positive integer"),
    (["--model", "llama-tiny", "--seq-len", "ten"], "--seq-len='ten': expected a positive integer"),
    (["--model", "hf:llama", "--model-args", "num_hidden_layers=-1"], "num_hidden_layers=-1: expected a positive"),
    (["--model", "llama-tiny", "--device", "meta", "--hardware", "tpu-v9"], "--hardware='tpu-v9': unknown; expected"),
    (["--model", "llama-tiny", "--hardware", "h100"], "a --device cpu profile is measured"),
    (["--model", "llama-tiny", "--dtype", "float8"], "dtype='float8': expected one of"),
    (["--model", "llama-tiny", "--optimizer", "lion"], "--optimizer='lion': expected one of adam"),
    (["--model", "llama-tiny", "-o", "/no/such/dir/p.json"], "directory '/no/such/dir' does not exist"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys, tmp_path):
    assert main(["profile", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("adaptive-mem profile: error: ") and needle in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="unknown; expected a preset"):
        main(["profile", "--model", "llama-huge", "--debug"])


def test_demo_profiles_the_default_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(_cmd_demo, "DEFAULT_MODEL", "llama-tiny")  # the wiring; llama-small is the benchmark's
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 0  # no throughput table unless asked
    assert "saved MiB" in capsys.readouterr().out
    assert Profile.load(tmp_path / "demo" / "profile.json").model["spec"] == "llama-tiny"
    assert "throughput" not in json.loads((tmp_path / "demo" / "results.json").read_text())
    (tmp_path / "file").write_text("x")
    assert main(["demo", "--out", str(tmp_path / "file")]) == 2
