"""The Profile JSON: round trip, and malformed files rejected with one-line errors (never pickle)."""

from __future__ import annotations

import copy
import json

import pytest

import profiler
from adaptive_mem import build_model
from profiler import Profile, ProfileError


@pytest.fixture(scope="module")
def profile_dict():
    return profiler.profile_step(build_model("llama-tiny", device="meta")).to_dict()


def test_round_trip_is_exact(tmp_path, profile_dict):
    original = Profile.from_dict(profile_dict)
    path = tmp_path / "profile.json"
    original.save(path)
    loaded = Profile.load(path)
    assert loaded == original
    assert loaded.to_dict() == profile_dict
    assert json.loads(path.read_text())["format"] == "adaptive-mem-profile"
    assert loaded.saved_bytes == original.saved_bytes and loaded.unit("layers.0.feed_forward.mul").layer == 0


def _set(data, path, value):
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value


@pytest.mark.parametrize("path,value,match", [
    (("format",), "pickle", r"profile.format='pickle': expected 'adaptive-mem-profile'"),
    (("version",), 99, r"profile.version=99: expected 1"),
    (("ops",), {"a": 1}, r"profile.ops=dict: expected a list"),
    (("ops", 0, "saved_bytes"), "12", r"profile.ops\[0\].saved_bytes='12': expected int"),
    (("ops", 0, "saved_bytes"), True, r"profile.ops\[0\].saved_bytes=True: expected int"),
    (("ops", 1, "consumers"), ["x"], r"profile.ops\[1\].consumers\[0\]='x': expected int"),
    (("ops", 1, "layer"), "zero", r"profile.ops\[1\].layer='zero': expected int or None"),
    (("ops", 2, "unit"), KeyError, r"profile.ops\[2\].unit: missing"),
    (("units", 0, "colour"), "red", r"profile.units\[0\].colour: unknown key"),
    (("units", 0, "fwd_time"), float("nan"), r"profile.units\[0\].fwd_time=nan: expected a number"),
    (("hardware",), [], r"profile.hardware: expected an object, got list"),
    (("static", "parameters"), 1.5, r"profile.static.parameters=1.5: expected int"),
    (("model",), "llama", r"profile.model=str: expected an object"),
    (("measured",), "yes", r"profile.measured='yes': expected bool"),
    (("ops", 3, "index"), 4, r"profile.ops\[3\].index=4: expected 3"),
    (("ops", 3, "consumers"), [2], r"profile.ops\[3\].consumers: 2: expected a later op index"),
    (("units", 2, "ops"), [0], r"profile.units\[2\].ops: 0: expected indices of ops of unit"),
    (("units", 2, "consumers"), ["layers.99.mul"], r"profile.units\[2\].consumers: 'layers.99.mul': not a unit"),
])
def test_malformed_profiles_are_rejected(profile_dict, path, value, match):
    data = copy.deepcopy(profile_dict)
    _set(data, path, value)
    with pytest.raises(ProfileError, match=match) as info:
        Profile.from_dict(data)
    assert "\n" not in str(info.value)


def test_files_that_are_not_profiles(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=r"not valid JSON"):
        Profile.load(bad)
    bad.write_bytes(b"\x80\x04\x95 pickle bytes")
    with pytest.raises(ProfileError, match="not UTF-8 text"):
        Profile.load(bad)
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(tmp_path / "missing.json")
    bad.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="expected a JSON object, got list"):
        Profile.load(bad)
