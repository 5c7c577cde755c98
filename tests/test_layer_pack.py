"""Note: [whole-layer pack in C++] (adaptive_mem/runtime/_layer_pack.h): a layer swapped as a whole packs its saves
in C++ where the engine has a native store. Against the same plan with the Python hooks: every step bit for bit
the step with no plan, the same bytes offloaded, the same pack and unpack calls counted, the same saves handed to
hooks entered before the plan's (Note: [scope hooks chain outward]), the same accounted peak."""

from __future__ import annotations

import contextlib

import pytest
import torch

from adaptive_mem import DeviceMemory, build_model, optimize
from adaptive_mem.runtime._footprint import FOOTPRINT
from adaptive_mem.runtime._layer_pack import LayerHooks
from search import Plan
from _deterministic import assert_same_step, deterministic, seeded_step  # noqa: F401 - fixture used by name

pytestmark = pytest.mark.usefixtures("deterministic")


class _Outer:
    """Saved-tensor hooks entered around the planned step: count what reaches them and hand it back."""

    def __init__(self) -> None:
        self.packed = self.unpacked = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        self.unpacked += 1
        return t


def _run(spec: str, layers: list[str], *, native: bool, outer: bool, monkeypatch) -> dict:
    monkeypatch.setattr(LayerHooks, "available", staticmethod(lambda engine, opaque: native and engine.store
                                                              is not None and not opaque))
    bundle = build_model(spec, seed=0)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1,
                           "decisions": {p: {"action": "swap", "backward_prefetch": 1} for p in layers}})
    hooks = _Outer()
    with optimize(bundle.model, plan=plan) as handle:
        for step in range(2):
            FOOTPRINT.reset()
            before = handle.swap_stats.offloaded_bytes
            with DeviceMemory(track_existing=False) as mem:
                if outer:
                    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                        got = seeded_step(bundle, batch)
                else:
                    got = seeded_step(bundle, batch)
            assert_same_step(got, want, f"{spec} {layers} native={native} step {step}")
        used = handle._executor.swaps.layer_hooks is not None
        offloaded = handle.swap_stats.offloaded_bytes - before
    return {"calls": FOOTPRINT.snapshot(), "offloaded": offloaded, "peak": mem.peak,
            "outer": (hooks.packed, hooks.unpacked), "used": used}


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "worker"])
@pytest.mark.parametrize("spec, layers", [
    ("llama-tiny", ["layers.0", "layers.1", "layers.2"]),
    ("hf:llama", ["model.layers.0"]),
])
@pytest.mark.parametrize("outer", [False, True], ids=["alone", "outer hooks"])
def test_layer_pack_in_cpp_matches_the_python_hooks(spec, layers, overlap, outer, monkeypatch):
    monkeypatch.setattr("adaptive_mem.runtime._native_swap.core_to_spare", lambda: overlap)
    cpp = _run(spec, layers, native=True, outer=outer, monkeypatch=monkeypatch)
    python = _run(spec, layers, native=False, outer=outer, monkeypatch=monkeypatch)
    assert cpp["used"] and not python["used"]
    assert cpp["offloaded"] == python["offloaded"] > 0
    assert cpp["calls"] == python["calls"]
    assert cpp["calls"]["pack"] > 0
    assert cpp["peak"] == python["peak"]
    assert cpp["outer"] == python["outer"]
    assert (cpp["outer"][0] > 0) == outer


@pytest.mark.parametrize("outer", [False, True], ids=["alone", "outer hooks"])
def test_a_model_dropped_with_its_plan_applied_is_collected(outer):
    """What the C++ packer holds of Python (the Python pack, the parameter storages' source, the hooks entered
    before) is not seen by the garbage collector: it must not close a cycle through the model. A model dropped
    with its plan still applied, after a step, is collected."""
    import gc
    import weakref

    bundle = build_model("llama-tiny", seed=0)
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1,
                           "decisions": {f"layers.{i}": {"action": "swap", "backward_prefetch": 1} for i in range(3)}})
    handle = optimize(bundle.model, plan=plan)
    handle.__enter__()
    hooks = _Outer()
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack) if outer else contextlib.nullcontext():
        bundle.loss(bundle.batch(seed=0)).backward()
    assert handle._executor.swaps.layer_hooks is not None
    model = weakref.ref(bundle.model)
    del bundle, handle
    gc.collect()
    assert model() is None
