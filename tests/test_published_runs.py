"""benchmarks/published_runs.py: its table of published runs is well-formed and one shrunken row runs through
``adaptive_mem.estimate``. The full table runs in the benchmark, not here."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import adaptive_mem
from adaptive_mem._estimate import ESTIMATE_AC_MODES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "published_runs.py"
FIGURES = {"peak_gib", "tokens_per_s_per_gpu", "mfu", "step_time_s", "oom"}


def _load():
    spec = importlib.util.spec_from_file_location("published_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("published_runs", module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules["published_runs"])
    return sys.modules["published_runs"]


def test_rows_are_well_formed():
    pr = _load()
    names = [r.name for r in pr.ROWS]
    assert len(set(names)) == len(names) and pr.SEED_NAME not in names
    keys = set(inspect.signature(adaptive_mem.estimate).parameters)
    for run in pr.ROWS:
        assert run.source and run.run and run.arms, run.name
        assert set(run.kwargs) <= keys - {"model", "ac", "solver", "model_args"}, run.name
        assert {"hardware", "gpus", "precision", "batch_size", "seq_len"} <= set(run.kwargs), run.name
        assert run.arms[0].published, f"{run.name}: the published AC mode comes first, with its figures"
        for arm in run.arms:
            assert arm.ac in ESTIMATE_AC_MODES and set(arm.published) <= FIGURES, (run.name, arm.label)
            assert 0 < arm.published.get("mfu", 0.5) < 1
    assert len(pr.bench_parallel_sim.SEED) == 3


def test_unknown_row_is_refused():
    pr = _load()
    with pytest.raises(SystemExit, match="--rows='nope': unknown row 'nope'"):
        pr.main(["--rows", "nope"])


# In its own process: evaluating registers the benchmark's solvers, which the solver tests must not see.
_CHEAP = """
import dataclasses, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("published_runs", sys.argv[1])
pr = sys.modules["published_runs"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(pr)
run = next(r for r in pr.ROWS if r.name == "deepspeed-qwen3-14b-3328")
tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=256)
run = dataclasses.replace(run, model_args=tiny, kwargs=dict(run.kwargs, batch_size=2, seq_len=64),
                          memory_gib=1.0)
print(json.dumps(pr.evaluate(run), default=str))
"""


def test_a_shrunken_row_runs_through_estimate():
    out = subprocess.run([sys.executable, "-c", _CHEAP, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.splitlines()[-1])
    labels = [a["label"] for a in res["arms"]]
    assert labels == ["baseline (no offload)", "offload-all", "planned = ours"]
    for arm in res["arms"]:
        p = arm["predicted"]
        assert p["fits"] and p["step_time_s"] > 0 and p["peak_gib"] >= p["peak_allocated_gib"] > 0
    swap, ours = res["arms"][1]["predicted"], res["arms"][2]["predicted"]
    assert ours["step_time_s"] <= swap["step_time_s"]
    assert {c["target"] for c in res["checks"]} >= {"step time (s) within 15%", "faster than offload-all"}
    assert all(isinstance(c["ok"], bool) for c in res["checks"])


def test_breakdown_of_a_shrunken_mpt_row_meets_the_hand_count(capsys):
    """benchmarks/published_breakdown.py on the MPT row cut to a tiny GELU block: its saved bytes per layer print
    beside the hand count ``s b (16 h + 4 f) + 4 b a s`` and agree with it."""
    import dataclasses
    import re

    _load()
    spec = importlib.util.spec_from_file_location("published_breakdown", ROOT / "benchmarks" / "published_breakdown.py")
    bd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bd)
    run = next(r for r in bd.published_runs.ROWS if r.name == "mpt-7b-4096")
    tiny = dict(run.model_args, n_embd=256, n_layer=2, n_head=4, n_inner=1024, vocab_size=256, n_positions=128)
    bd.breakdown(dataclasses.replace(run, model_args=tiny, kwargs=dict(run.kwargs, batch_size=2, seq_len=128)))
    out = capsys.readouterr().out
    saved = re.search(r"saved per layer \(layer 0\): ([\d.]+) MiB; hand count .* = ([\d.]+) MiB", out)
    assert saved and saved.group(1) == saved.group(2), out
    assert "full AC: allocated" in out and "boundary" in out
