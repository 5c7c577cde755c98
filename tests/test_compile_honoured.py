"""torch.compile and plans: every plan runs inside the compiled blocks, with 0 graph breaks and no warning.

Note: [compile honoured] (adaptive_mem/runtime/_op_level.py). Every case counts compiled graphs as well
as graph breaks: a block that dynamo silently skips reports 0 graph breaks, so breaks alone prove nothing.
Matrix: {full recompute, recompute groups, select recompute, layer swap, op swap, select recompute with a swap in
the same layer} x {whole-model
``torch.compile(model)``, per-block ``layer.compile()``, torchtitan's ``model.layers[i] = torch.compile(...)``}
x {optimize then compile, compile then optimize}; gradients are compared with ``torch.equal`` against the
same compiled model without a plan (aot_eager backend).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from adaptive_mem import build_model, optimize
from search import Plan

from _compile_common import compiled_step

BACKEND = "aot_eager"
LAYERS = 2  # llama-tiny with 2 layers: whole-model compiles stay within seconds on 2 cores
SWAP = {"action": "swap", "backward_prefetch": 1}


def _plans() -> dict[str, tuple[dict, list]]:
    """name -> (decisions, groups); the targets are the plain model's names, also for a torchtitan layer (Note:
    [compile wrapper names])."""
    layers = range(LAYERS)
    return {
        "full-recompute": ({"layers": "recompute"}, []),
        "recompute-groups": ({"layers": "recompute"}, [[0, 1]]),
        "select-recompute": ({f"layers.{i}.feed_forward": "recompute" for i in layers}, []),
        "layer-swap": ({"layers": SWAP}, []),
        "op-swap": ({f"layers.{i}.attention.flash_attention": SWAP for i in layers}, []),
        # Note: [select recompute with swaps, compiled]: one layer mixes both
        "select-recompute-swap": ({**{f"layers.{i}.feed_forward": "recompute" for i in layers},
                                   **{f"layers.{i}.attention.flash_attention": SWAP for i in layers}}, []),
    }


MODES = ("whole", "block", "titan")
ORDERS = ("optimize-then-compile", "compile-then-optimize")
CASES = [(mode, order, name) for mode in MODES for order in ORDERS for name in _plans()]


def _compile(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "whole":
        return torch.compile(model, backend=BACKEND)
    if mode == "block":
        for layer in model.layers:
            layer.compile(backend=BACKEND)
    else:
        for i in range(len(model.layers)):
            model.layers[i] = torch.compile(model.layers[i], backend=BACKEND)
    return model


_step = compiled_step


def _fresh():
    torch._dynamo.reset()
    counters.clear()
    bundle = build_model("llama-tiny", model_args={"num_layers": LAYERS}, batch_size=2, seq_len=32, seed=0)
    return bundle.model, bundle.batch(seed=0)


def _graphs() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


_REFS: dict[str, dict[str, torch.Tensor]] = {}


def _reference(mode: str) -> dict[str, torch.Tensor]:
    if mode not in _REFS:
        model, batch = _fresh()
        _REFS[mode] = _step(model, _compile(model, mode), batch)
        assert _graphs()[0] > 0
    return _REFS[mode]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("adaptive_mem")]


@pytest.mark.parametrize("mode,order,name", CASES, ids=[f"{m}-{o}-{n}" for m, o, n in CASES])
def test_plan_runs_compiled(mode: str, order: str, name: str, caplog):
    """Note: [partitioner hook], Note: [swap around compiled blocks], Note: [op-level swap in a block]: every swap
    runs compiled, also next to select recompute in one layer."""
    ref = _reference(mode)
    model, batch = _fresh()
    decisions, groups = _plans()[name]
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, "groups": groups})
    caplog.set_level(logging.WARNING)
    handle = optimize(model, plan=plan) if order == "optimize-then-compile" else None
    call = _compile(model, mode)
    handle = handle or optimize(model, plan=plan)
    with handle:
        for _ in range(2):
            grads = _step(model, call, batch)
            assert grads.keys() == ref.keys()
            for key, grad in ref.items():
                assert torch.equal(grads[key], grad), f"{mode}/{order}/{name}: {key} differs"
        graphs, breaks = _graphs()
        assert graphs > 0 and breaks == 0, (graphs, dict(counters["graph_break"]))
        assert _warnings(caplog) == []
        if "swap" in name:
            assert handle.swap_stats.offloaded_bytes > 0
