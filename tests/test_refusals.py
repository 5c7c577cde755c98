"""Requests that a looser parser would accept silently (or end in a traceback) are refused with one line."""

from __future__ import annotations

import json
import logging
import random

import pytest

from adaptive_mem import ConfigError, ModelSpecError, build_model, plan_from_config
from adaptive_mem.cli._main import main
from profiler import Profile, ProfileError
from search import Plan, PlanError
from _profiles import random_profile


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith(f"adaptive-mem {command}: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """llama-tiny profiled (fake tensors) at batch 2 and 4, and a plan searched for batch 2."""
    root = tmp_path_factory.mktemp("refusals")
    out = {}
    for batch in (2, 4):
        out[batch] = root / f"p{batch}.json"
        assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--hardware", "h100",
                     "--batch-size", str(batch), "--seq-len", "32", "-o", str(out[batch])]) == 0
    out["plan"] = root / "plan.yaml"
    assert main(["search", str(out[2]), "--activation-budget", "0.5", "--solver", "full", "-o", str(out["plan"])]) == 0
    assert Plan.load(out["plan"]).decisions
    return out


def test_simulate_refuses_a_plan_of_another_batch_size(profiles, capsys):
    assert run(capsys, "simulate", profiles[2], profiles["plan"])[0] == 0
    code, out, err = run(capsys, "simulate", profiles[4], profiles["plan"])
    assert code == 2 and out == ""
    assert "plan.model.batch_size=2, but the profile is of batch_size=4" in one_line_error(err, "simulate")


def test_run_refuses_a_plan_of_another_batch_size_before_logging_it_applied(profiles, capsys, caplog):
    caplog.set_level(logging.INFO)
    code, _, err = run(capsys, "run", "--model", "llama-tiny", "--batch-size", "4", "--seq-len", "32",
                       "--plan", profiles["plan"], "--steps", "1")
    assert code == 2
    assert "the plan was made for batch_size=2" in one_line_error(err, "run")
    assert not [r for r in caplog.records if r.getMessage().startswith("Set ")]


def test_plan_file_given_as_config_is_refused(profiles, capsys):
    code, _, err = run(capsys, "run", "--model", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
                       "--config", profiles["plan"], "--steps", "1")
    assert code == 2
    assert "an adaptive-mem plan file" in one_line_error(err, "run") and "--plan" in err


@pytest.mark.parametrize("text", ["", "# nothing\n", "parallel_config:\n  pipeline_stage: 1\n"])
def test_config_without_recompute_or_swap_is_refused(tmp_path, capsys, text):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    code, _, err = run(capsys, "run", "--model", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
                       "--config", path, "--steps", "1")
    assert code == 2
    assert "recompute_config" in one_line_error(err, "run")


def test_empty_config_dict_is_refused():
    with pytest.raises(ConfigError, match="neither recompute_config nor swap_config"):
        plan_from_config({}, model=None, num_layers=2)


def test_duplicate_yaml_key_is_refused_in_a_config(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("recompute_config:\n  recompute: True\n  recompute: False\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'recompute' at line 3 \(first at line 2\)"):
        plan_from_config(str(path), model=None, num_layers=2)


def test_duplicate_yaml_key_is_refused_in_a_plan(profiles, tmp_path):
    text = profiles["plan"].read_text()
    target = next(iter(Plan.load(profiles["plan"]).decisions))
    doubled = text.replace("decisions:\n", f"decisions:\n  {target}: keep\n", 1)
    assert doubled != text
    with pytest.raises(PlanError, match=f"duplicate key '{target}'"):
        Plan.loads(doubled)


def test_duplicate_json_key_is_refused_in_a_profile(profiles, tmp_path):
    text = profiles[2].read_text()
    path = tmp_path / "dup.json"
    path.write_text(text.replace('"device":', '"device": "cpu", "device":', 1))
    with pytest.raises(ProfileError, match="duplicate key 'device'"):
        Profile.load(path)


@pytest.mark.parametrize(("where", "value", "message"), [
    (("static", "parameters"), -5, "profile.static.parameters=-5: expected a number, finite and >= 0"),
    (("ops", 0, "fwd_time"), -1.0, r"profile.ops\[0\].fwd_time=-1.0"),
    (("ops", 0, "fwd_time"), float("inf"), r"profile.ops\[0\].fwd_time=inf"),
    (("units", 0, "saved_bytes"), -1, r"profile.units\[0\].saved_bytes=-1"),
    (("ops", 0, "consumers"), [-1], r"profile.ops\[0\].consumers\[0\]=-1"),
    (("model", "batch_size"), 0, "profile.model.batch_size=0: expected a positive integer"),
])
def test_profile_numbers_must_be_finite_and_not_negative(profiles, tmp_path, capsys, where, value, message):
    data = json.loads(profiles[2].read_text())
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)
    out_plan = tmp_path / "plan.yaml"
    code, _, err = run(capsys, "search", path, "--activation-budget", "0.5", "-o", out_plan)
    assert code == 2 and not out_plan.exists()
    one_line_error(err, "search")


def test_search_output_that_is_a_directory_is_refused_before_solving(tmp_path, capsys):
    prof = tmp_path / "p.json"
    random_profile(random.Random(1), num_layers=2, units_per_layer=3, bandwidth=1e9).save(prof)
    code, out, err = run(capsys, "search", prof, "--activation-budget", "0.5", "-o", tmp_path)
    assert code == 2 and out == ""
    assert "is a directory; expected a file path" in one_line_error(err, "search")
    code, out, err = run(capsys, "search", prof, "--activation-budget", "0.5", "-o", tmp_path / "no" / "p.yaml")
    assert code == 2 and "does not exist" in one_line_error(err, "search")


@pytest.mark.parametrize(("args", "message"), [
    ("hidden_size=65", "--model-args hidden_size=65: LlamaConfig rejected it (The hidden size (65) is not a multiple"),
    ("hidden_size=abc", "--model-args hidden_size=abc: LlamaConfig rejected it"),
])
def test_model_config_validation_is_one_line(capsys, args, message):
    with pytest.raises(ModelSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_model("hf:llama", model_args=args)
    code, _, err = run(capsys, "run", "--model", "hf:llama", "--model-args", args, "--steps", "1")
    assert code == 2 and message in one_line_error(err, "run")


def test_debug_shows_the_traceback_of_a_refused_input(tmp_path):
    with pytest.raises(ModelSpecError):
        main(["run", "--model", "hf:llama", "--model-args", "hidden_size=65", "--steps", "1", "--debug"])
