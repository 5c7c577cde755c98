"""profiler.naming.ModelStructure: the model's structure is discovered once where a plan meets it and handed down."""

from __future__ import annotations

import pytest
import torch

import profiler
import profiler._structure
import profiler._units
from adaptive_mem import optimize
from adaptive_mem.models import PRESETS, LlamaModel
from profiler.naming import ModelStructure, find_layers, structure_fingerprint
from search import Plan


def _tiny() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(PRESETS["llama-tiny"].config)


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


def test_structure_holds_what_each_discovery_finds():
    model = _tiny()
    structure = ModelStructure.of(model)
    assert "ModelStructure" in profiler.naming.__all__
    assert structure.layers == find_layers(model)
    assert structure.layer_paths == [f"layers.{i}" for i in range(structure.layers.count)]
    assert structure.fingerprint == structure_fingerprint(model)
    assert structure.kinds is not None and len(set(structure.kinds.first)) == 1
    assert structure.namer().layers == structure.layers
    assert structure.wrapper is None and not structure.sharded
    assert structure.of_model(model) is structure
    assert structure.of_model(model.layers[0]) is not structure


def test_compiled_root_is_named_as_its_wrapper():
    model = _tiny()
    assert ModelStructure.of(torch.compile(model)).wrapper == "compiled"


@pytest.mark.parametrize("compile_", [None, "eager"])
def test_optimize_finds_the_layers_once(monkeypatch, compile_):
    """``optimize`` (plan, per-block compile): one ``find_layers`` for check, resolve, executor and compile."""
    calls = []
    real = profiler._units.find_layers

    def counted(root):
        calls.append(type(root).__name__)
        return real(root)

    monkeypatch.setattr(profiler._structure, "find_layers", counted)
    monkeypatch.setattr(profiler._units, "find_layers", counted)
    model = _tiny()
    plan = _plan({"layers.0": "recompute", "layers.1.feed_forward.mul": "recompute",
                  "layers.2": {"action": "swap", "backward_prefetch": 1}})
    with optimize(model, plan=plan, compile=compile_) as handle:
        assert handle.active
    assert calls == ["LlamaModel"]


def test_data_parallel_wrapper_plans_its_module():
    """A plan of the bare model applies inside a DataParallel wrapper (Note: [data-parallel wrapper]): the structure
    handed down is the wrapped module's."""
    model = _tiny()
    wrapped = torch.nn.DataParallel(model)
    assert ModelStructure.of(wrapped).wrapper == "data_parallel"
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    structure = ModelStructure.of(wrapped)
    with optimize(wrapped, plan=_plan({"layers.0": "recompute", "layers.1.feed_forward.mul": "recompute"}),
                  compile=None) as handle:
        assert handle.model is model and handle.resolution.layers == structure.of_model(model).layers
        wrapped(ids).sum().backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
