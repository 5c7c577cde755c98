"""Note: [whole-model compiled profile] (profiler/_compiled_whole.py) and Note: [graph unit names]: a profile for the
model compiled whole holds what its forward graph saves per unit, checked against a pack hook around the compiled
model; profiling again reads the graphs again (a code object of its own each time); bad layouts are refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import profiler
from adaptive_mem import build_model
from profiler import CompileBackendError, Profile, ProfileError
from search import StepModel
from search._compiled_space import attributed, compiled_blocks


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    bundle = build_model("llama-tiny")
    eager = profiler.profile_step(bundle, optimizer="adam", repeat=1, record=1)
    per_block = profiler.profile_compiled(bundle, eager, backend="inductor", repeat=1)
    whole = profiler.profile_compiled(bundle, eager, backend="inductor", repeat=1, layout="whole-model")
    return bundle, eager, per_block, whole


def _graph_saved(bundle, backend: str) -> int:
    """Bytes of the distinct storages the whole compiled model saves for backward (parameters and the input ids
    aside), seen by a pack hook: independent of the graph reading."""
    ids, labels = bundle.batch(seed=0)
    model = bundle.model
    static = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), ids]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in static:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    compiled = torch.compile(model, backend=backend)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(ids)
    return sum(seen.values())


def test_units_hold_what_the_whole_graph_saves(tiny):
    bundle, eager, per_block, whole = tiny
    table = whole.compiled["whole"]
    assert whole.compiled["layout"] == "whole-model" and per_block.compiled["layout"] == "per-block"
    in_graph = [u for u in whole.units if u.name in table]
    assert all(u.saved_bytes == table[u.name] for u in in_graph)
    assert sum(u.saved_bytes for u in in_graph) == _graph_saved(bundle, "inductor")
    outside = [u.name for u in whole.units if u.name not in table]
    assert outside and all(whole.unit(n).saved_bytes == eager.unit(n).saved_bytes for n in outside)  # the loss
    # the whole graph fuses across blocks: the final norm saves its inverse RMS, not its input and output
    assert whole.unit("norm").saved_bytes < per_block.unit("norm").saved_bytes
    assert whole.saved_bytes < per_block.saved_bytes
    assert whole.peak_memory - per_block.peak_memory == whole.saved_bytes - per_block.saved_bytes
    for row in whole.compiled["layers"]:  # times: the blocks' measured per block
        assert sum(u.fwd_time for u in whole.layer_units(row["layer"])) == pytest.approx(row["keep"]["fwd_time"])
    model = StepModel.build(whole)
    assert compiled_blocks(model) and attributed(model)


def test_profiling_again_reads_the_graphs_again(tiny):
    """The second profile of the same model (dynamo has compiled its blocks and its forward before) reads the same
    per-unit figures, per block and whole."""
    bundle, eager, per_block, whole = tiny
    again = profiler.profile_compiled(bundle, eager, backend="inductor", repeat=1, layout="whole-model")
    assert again.compiled["whole"] == whole.compiled["whole"]
    assert [r["units"] for r in again.compiled["layers"]] == [r["units"] for r in per_block.compiled["layers"]]
    assert "forward" not in bundle.model.__dict__ and all(p.grad is None for p in bundle.model.parameters())


def test_round_trip_and_bad_layouts_are_refused(tiny, tmp_path):
    bundle, eager, per_block, whole = tiny
    whole.save(tmp_path / "w.json")
    assert Profile.load(tmp_path / "w.json") == whole
    with pytest.raises(CompileBackendError, match=r"^layout='blocks': expected one of per-block, whole-model$"):
        profiler.profile_compiled(bundle, eager, backend="inductor", layout="blocks")
    cases = [({"layout": "whole-model", "whole": None}, "profile.compiled.whole=None: expected an object"),
             ({"layout": "per-block"}, "profile.compiled.whole={"),
             ({"layout": "stacked"}, "profile.compiled.layout='stacked': expected one of per-block, whole-model"),
             ({"whole": {"norm": -3}}, "profile.compiled.whole.norm=-3: expected a number")]
    for change, message in cases:
        data = copy.deepcopy(whole.to_dict())
        data["compiled"].update(change)
        with pytest.raises(ProfileError) as info:
            Profile.from_dict(json.loads(json.dumps(data)))
        assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_an_hf_model_names_its_graph_units_as_the_profile():
    """hf:qwen2 under aot_eager: the whole graph's units are the profile's, but for ops the compiler made (folded
    into their module's unit, so no byte is lost)."""
    torch.set_num_threads(1)
    bundle = build_model("hf:qwen2")
    eager = profiler.profile_step(bundle, optimizer="adam", repeat=1, record=1)
    whole = profiler.profile_compiled(bundle, eager, backend="aot_eager", repeat=1, layout="whole-model")
    table = whole.compiled["whole"]
    names = {u.name for u in eager.units}
    matched = [k for k in table if k in names]
    assert len(matched) >= 0.8 * len(table) and any(k.startswith("model.layers.1.") for k in matched)
    in_graph = sum(u.saved_bytes for u in whole.units if u.name in table)
    assert in_graph == sum(table.values())


def test_the_profile_command_takes_the_layout(tmp_path, capsys):
    from adaptive_mem.cli._main import main

    out = tmp_path / "w.json"
    base = ["profile", "--model", "llama-tiny", "--model-args", "num_layers=2"]
    assert main([*base, "--compile", "aot_eager", "--compile-layout", "whole-model", "-o", str(out)]) == 0
    assert "compiled whole: its forward graph saves" in capsys.readouterr().out
    assert Profile.load(out).compiled["layout"] == "whole-model"
    for extra, message in [(["--compile-layout", "whole"], "--compile-layout='whole': expected one of per-block, "
                             "whole-model"),
                           (["--compile-layout", "whole-model"], "--compile-layout='whole-model' without --compile"),
                           (["--device", "meta", "--compile", "inductor", "--compile-layout", "whole-model"],
                            "--compile-layout='whole-model' with --device meta: expected per-block")]:
        assert main([*base, *extra]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and len(captured.err.strip().splitlines()) == 1 and captured.out == ""
