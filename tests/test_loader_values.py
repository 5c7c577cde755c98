"""Profile and plan loading reject negative, NaN and infinite sizes and times, naming the key (one line)."""

from __future__ import annotations

import copy
import json
import re

import pytest

import profiler
from adaptive_mem import build_model
from adaptive_mem.cli._main import main
from profiler import Profile, ProfileError
from search import Plan, PlanError

BAD = [-1, -0.5, float("nan"), float("inf"), float("-inf")]

# every size, time, bandwidth and count a profile stores
PROFILE_KEYS = [
    ("ops", 0, "saved_bytes"), ("ops", 0, "output_bytes"), ("ops", 0, "fwd_time"), ("ops", 0, "bwd_time"),
    ("ops", 0, "flops"), ("ops", 0, "saved_tensors"), ("ops", 0, "view_ops"), ("units", 0, "saved_bytes"), ("units", 0, "output_bytes"), ("units", 0, "fwd_time"),
    ("units", 0, "bwd_time"), ("static", "parameters"), ("static", "buffers"), ("static", "gradients"),
    ("static", "other"), ("static", "optimizer_state"), ("hardware", "peak_flops"), ("hardware", "memory_bandwidth"),
    ("hardware", "h2d_bandwidth"), ("hardware", "d2h_bandwidth"), ("hardware", "device_memory"),
    ("hardware", "swap_compute_bandwidth"), ("hardware", "sac_op_overhead"), ("hardware", "disk_bandwidth"),
    ("hardware", "fp32_flops"), ("hardware", "half_flops"), ("hardware", "matmul_efficiency"),
    ("hardware", "attention_efficiency"), ("hardware", "memory_efficiency"), ("hardware", "kernel_latency"),
    ("hardware", "comm_compute_slowdown"), ("hardware", "dispatch_call_time"), ("hardware", "hook_call_time"),
    ("saved_input_bytes",),
    ("peak_memory",), ("step_time",), ("unattributed_time",), ("optimizer_time",), ("num_layers",),
    ("model", "batch_size"), ("model", "seq_len"),
]


@pytest.fixture(scope="module")
def profile_dict():
    return profiler.profile_step(build_model("llama-tiny", device="meta")).to_dict()


def _where(path: tuple) -> str:
    return "profile" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


def _edited(data: dict, path: tuple, value) -> dict:
    data = copy.deepcopy(data)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize("path", PROFILE_KEYS, ids=_where)
@pytest.mark.parametrize("value", BAD, ids=repr)
def test_profile_rejects_bad_numbers_naming_the_key(tmp_path, profile_dict, path, value):
    file = tmp_path / "p.json"
    file.write_text(json.dumps(_edited(profile_dict, path, value)))  # NaN / Infinity tokens, as json writes them
    with pytest.raises(ProfileError) as info:
        Profile.load(file)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(_where(path) + "="), message


def test_profile_keys_listed_here_are_all_its_numbers(profile_dict):
    """Guards PROFILE_KEYS: a numeric field added to the format must be added to this test."""
    found = set()

    def walk(value, path):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, path + (k,))
        elif isinstance(value, list):
            if value and not isinstance(value[0], (int, float)):
                walk(value[0], path + (0,))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found.add(path)

    walk(profile_dict, ())
    assert found - {("version",), ("model", "parameters"), ("ops", 0, "index")} == set(PROFILE_KEYS)


@pytest.mark.parametrize("value", [-1, float("nan")], ids=repr)
def test_profile_model_parameters_is_checked(profile_dict, value):
    with pytest.raises(ProfileError, match=r"profile\.model\.parameters="):
        Profile.from_dict(_edited(profile_dict, ("model", "parameters"), value))


def test_search_on_a_profile_with_negative_bytes_names_the_key(tmp_path, profile_dict, capsys):
    """Edited byte counts are refused at load, naming the key, instead of ending in "no plan fits"."""
    data = copy.deepcopy(profile_dict)
    for unit in data["units"]:
        unit["saved_bytes"] = -unit["saved_bytes"] - 1
    file = tmp_path / "p.json"
    file.write_text(json.dumps(data))
    assert main(["search", str(file), "--activation-budget", "0.5", "-o", str(tmp_path / "plan.yaml")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and not (tmp_path / "plan.yaml").exists()
    assert re.search(r"profile\.units\[0\]\.saved_bytes=-\d+: expected a number, finite and >= 0", err), err


PLAN = "format: adaptive-mem-plan\nversion: 1\n"


@pytest.mark.parametrize("text,key", [
    (PLAN + "decisions: {layers.0: {action: swap, backward_prefetch: -1}}", "plan.decisions.layers.0.backward_prefetch=-1"),
    (PLAN + "decisions: {layers.0: {action: swap, backward_prefetch: .nan}}", "plan.decisions.layers.0.backward_prefetch=nan"),
    (PLAN + "decisions: {layers.0: {action: swap, backward_prefetch: .inf}}", "plan.decisions.layers.0.backward_prefetch=inf"),
    (PLAN + "decisions: {layers.0: {action: swap, backward_prefetch: 1.5}}", "plan.decisions.layers.0.backward_prefetch=1.5"),
    ('{"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers.0": {"action": "swap", '
     '"backward_prefetch": Infinity}}}', "plan.decisions.layers.0.backward_prefetch='Infinity'"),
    (PLAN + "model: {batch_size: -2}\ndecisions: {}", "plan.model.batch_size=-2"),
    (PLAN + "model: {seq_len: .nan}\ndecisions: {}", "plan.model.seq_len=nan"),
    (PLAN + "model: {num_layers: .inf}\ndecisions: {}", "plan.model.num_layers=inf"),
    (PLAN + "model: {num_layers: 0}\ndecisions: {}", "plan.model.num_layers=0"),
    (PLAN + "groups: [[-1, 0]]\ndecisions: {}", "plan.groups=[[-1, 0]]"),
])
def test_plan_rejects_bad_numbers_naming_the_key(text, key):
    with pytest.raises(PlanError) as info:
        Plan.loads(text)
    message = str(info.value)
    assert "\n" not in message and message.startswith(key), message
