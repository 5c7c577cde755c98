"""The profile of a model compiled per block: what each compiled block saves (pack hook around the compiled
call) and its times, for keep and full recompute, and the per-op figures rewritten to the compiled model."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import profiler
from adaptive_mem import build_model
from adaptive_mem.cli._main import main
from profiler import Profile, ProfileError


@pytest.fixture(scope="module")
def profiles():
    torch.set_num_threads(1)
    bundle = build_model("llama-tiny")
    eager = profiler.profile_step(bundle, optimizer="adam", repeat=1, record=1)
    compiled = profiler.profile_compiled(bundle, eager, backend="aot_eager", repeat=1)
    return bundle, eager, compiled


def test_compiled_blocks_save_less_under_full_recompute_than_keep(profiles):
    _, eager, compiled = profiles
    layers = compiled.compiled["layers"]
    assert compiled.compiled["backend"] == "aot_eager" and len(layers) == eager.num_layers == 4
    for row in layers:
        keep, full, plain = row["keep"]["saved_bytes"], row["full"]["saved_bytes"], row["eager"]["saved_bytes"]
        assert 0 < full < keep <= plain, row
        # full recompute keeps the block's input (batch 2 x seq 32 x hidden 64 fp32) and the rotary tables
        assert full >= 2 * 32 * 64 * 4
        assert row["keep"]["fwd_time"] > 0 and row["keep"]["bwd_time"] > 0 and row["full"]["bwd_time"] > 0


def test_ops_are_rewritten_to_the_compiled_blocks(profiles):
    """Note: [compiled profile]: saved bytes move by compiled keep - eager per block, times sum to the compiled."""
    _, eager, compiled = profiles
    delta = sum(r["keep"]["saved_bytes"] - r["eager"]["saved_bytes"] for r in compiled.compiled["layers"])
    assert compiled.saved_bytes == eager.saved_bytes + delta and delta < 0
    assert compiled.peak_memory == eager.peak_memory + delta
    for row in compiled.compiled["layers"]:
        units = compiled.layer_units(row["layer"])
        assert sum(u.fwd_time for u in units) == pytest.approx(row["keep"]["fwd_time"])
        assert sum(u.bwd_time for u in units) == pytest.approx(row["keep"]["bwd_time"])
        assert all(u.saved_bytes == sum(compiled.ops[i].saved_bytes for i in u.ops) for u in units)
    outside = [u for u in eager.units if u.layer is None]
    assert outside == [u for u in compiled.units if u.layer is None]  # not compiled: unchanged
    assert compiled.step_time == compiled.compiled["step_time"]
    assert compiled.compiled["eager_step_time"] == eager.step_time


def test_units_are_what_each_block_graph_saves(profiles):
    """Note: [compiled profile] with the rows' ``units`` (Note: [graph unit names]): a unit the block's forward graph
    saves nothing of gets no bytes (the residual add: the next norm saves its own; silu: recomputed from w1's output),
    the others their share of the measured total in the graph's proportions; an older profile without ``units``
    keeps the proportional spread."""
    _, eager, compiled = profiles
    for row in compiled.compiled["layers"]:
        path = compiled.layer_path(row["layer"])
        table = row["units"]
        inner = {u.name[len(path) + 1:]: u for u in compiled.layer_units(row["layer"])
                 if all(c.startswith(path + ".") for c in u.consumers)}
        assert table and set(table) <= set(inner), (set(table) - set(inner))
        assert inner["add"].saved_bytes == 0 and inner["feed_forward.w1.activation.silu"].saved_bytes == 0
        assert eager.unit(f"{path}.add").saved_bytes > 0
        for rel, u in inner.items():
            assert (u.saved_bytes > 0) == (table.get(rel, 0) > 0), rel
        total, graph = sum(u.saved_bytes for u in inner.values()), sum(table.values())
        for rel, n in table.items():  # the graph's proportions, up to rounding
            assert inner[rel].saved_bytes == pytest.approx(n * total / graph, rel=1e-3), rel
    data = copy.deepcopy(compiled.to_dict())
    for row in data["compiled"]["layers"]:
        del row["units"]
    older = Profile.from_dict(json.loads(json.dumps(data)))
    assert all("units" not in row for row in older.compiled["layers"])
    bare = copy.deepcopy(eager)
    from profiler._compiled import apply_compiled
    spread = apply_compiled(bare, older.compiled)
    assert spread.saved_bytes == compiled.saved_bytes and spread.unit("layers.0.add").saved_bytes > 0


def test_profiling_compiled_leaves_the_model_as_it_was(profiles):
    bundle, _, _ = profiles
    for layer in bundle.model.layers:
        assert "forward" not in layer.__dict__ and layer._compiled_call_impl is None
    assert all(p.grad is None for p in bundle.model.parameters())


def test_compiled_profile_round_trips_and_eager_profiles_stay_version_1(tmp_path, profiles):
    _, eager, compiled = profiles
    compiled.save(tmp_path / "c.json")
    assert Profile.load(tmp_path / "c.json") == compiled
    assert "compiled" not in eager.to_dict()  # older readers read eager profiles unchanged


@pytest.mark.parametrize("path, value, message", [
    (("layers", 0, "keep", "saved_bytes"), -1, "profile.compiled.layers[0].keep.saved_bytes=-1: expected a number"),
    (("layers", 1, "full", "bwd_time"), float("nan"), "profile.compiled.layers[1].full.bwd_time=nan: expected"),
    (("step_time",), "fast", "profile.compiled.step_time='fast': expected"),
    (("layers", 0, "keep"), {"saved_bytes": 1}, "profile.compiled.layers[0].keep="),
    (("layers", 0, "units"), {"feed_forward.mul": -1}, "profile.compiled.layers[0].units.feed_forward.mul=-1: expected"),
    (("layers", 2, "units"), {"feed_forward.mul": 1.5}, "profile.compiled.layers[2].units.feed_forward.mul=1.5: expected int"),
    (("layers", 1, "units"), ["mul"], "profile.compiled.layers[1].units=['mul']: expected an object of unit names"),
])
def test_bad_compiled_figures_are_rejected_naming_the_key(profiles, path, value, message):
    data = copy.deepcopy(profiles[2].to_dict())
    target = data["compiled"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ProfileError) as info:
        Profile.from_dict(json.loads(json.dumps(data)))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_bad_backend_and_fake_tensors_are_refused(profiles, tmp_path, capsys):
    bundle, eager, compiled = profiles
    with pytest.raises(ValueError, match=r"^compile='tpu': not a torch.compile backend; expected one of .*inductor"):
        profiler.profile_step(bundle, compile="tpu")
    with pytest.raises(ValueError, match="already a compiled profile"):
        profiler.profile_compiled(bundle, compiled, backend="aot_eager")
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--compile", "aot_eager"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--compile='aot_eager' with --device meta: expected inductor" in err and len(err.splitlines()) == 1


def test_meta_profile_with_inductor_is_the_compile_model(tmp_path):
    """Note: [compile model] on fake tensors ``--compile inductor`` is ``profiler.compiled_estimate`` of the eager
    fake profile, written as a compiled profile (``compiled.modelled``)."""
    out, eager_out = tmp_path / "c.json", tmp_path / "e.json"
    base = ["profile", "--model", "llama-tiny", "--device", "meta", "--hardware", "h100"]
    assert main([*base, "--compile", "inductor", "-o", str(out)]) == 0
    assert main([*base, "-o", str(eager_out)]) == 0
    written, eager = profiler.Profile.load(out), profiler.Profile.load(eager_out)
    assert written.compiled and written.compiled.get("modelled") is True
    assert written.to_dict() == profiler.compiled_estimate(eager).to_dict()


def test_profile_command_writes_the_compiled_profile(tmp_path):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "llama-tiny", "--compile", "aot_eager", "-o", str(out)]) == 0
    loaded = Profile.load(out)
    assert loaded.compiled["backend"] == "aot_eager" and len(loaded.compiled["layers"]) == 4
