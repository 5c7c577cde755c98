"""``adaptive-mem explain``: the per-layer table of a config, without training."""

from __future__ import annotations

import _config_seeds as seeds
from adaptive_mem.cli._main import main


def test_explain_prints_one_row_per_layer(tmp_path, capsys):
    path = tmp_path / "train.yaml"
    path.write_text(seeds.SWAP_CASE_4)
    assert main(["explain", "--model", "llama-tiny", "--config", str(path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["layer", "stage", "recompute", "swap"]
    assert rows[1] == ["0", "0", "feed_forward", "attention", "(prefetch", "20)"]
    assert rows[2] == ["1", "0", "-", "attention", "(prefetch", "20),", "feed_forward", "(prefetch", "15)"]
    assert rows[4] == ["3", "0", "feed_forward", "attention", "(prefetch", "10)"]
    assert len(rows) == 5


def test_explain_shows_pipeline_stages_and_inactive_keys(tmp_path, capsys):
    path = tmp_path / "train.yaml"
    path.write_text(seeds.DEEPSEEK_V3_LAYOUT + seeds.DEEPSEEK_V3)
    assert main(["explain", "--model", "llama-tiny", "--model-args", "num_layers=62", "--config", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["0", "0", "whole", "layer", "-"]
    assert out[3].split() == ["2", "0", "whole", "layer", "-"]
    assert out[4].split() == ["3", "0", "-", "-"]
    assert out[62].split() == ["61", "15", "-", "-"]
    assert out[-1] == ("accepted but inactive here: parallel_optimizer_comm_recompute, mp_comm_recompute, "
                       "recompute_slice_activation")


def test_explain_with_megatron_flags(capsys):
    assert main(["explain", "--model", "llama-tiny", "--recompute-granularity", "full", "--recompute-method",
                 "uniform", "--recompute-num-layers", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["0", "0", "whole", "layer", "(with", "layers", "0-1)", "-"]


def test_explain_bad_config_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "train.yaml"
    path.write_text("recompute_config:\n  recompute: [9]\nswap_config:\n  swap: True\n")
    assert main(["explain", "--model", "llama-tiny", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "recompute_config.recompute[0]=9: layer index out of range; expected 0..3" in err
    assert "Traceback" not in err
    assert main(["explain", "--model", "llama-tiny"]) == 2
    assert "expected either a MindFormers YAML" in capsys.readouterr().err
