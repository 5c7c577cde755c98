"""Select recompute and a swap in one layer, compiled (Note: [select recompute with swaps, compiled] in
adaptive_mem/runtime/_selective.py).

Each layer recomputes its feed-forward and swaps its attention kernel's outputs. Under a whole-model and a per-block
compile, aot_eager and inductor, ``optimize`` before and after ``torch.compile``: the blocks stay compiled with 0
graph breaks and no warning; loss and every gradient are close to the same compiled model without a plan; the
graph pass swaps the attention outputs (graph ops, never the eager engine's hooks); and the partitioned forward
graphs save nothing of the recomputed feed-forward, which they do without the plan.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from adaptive_mem import build_model, optimize
from profiler.naming import ModelStructure, saved_unit_bytes
from profiler.tracing import observe_partitions
from search import Plan

from _compile_common import compiled_step

LAYERS = 2
SWAP = {"action": "swap", "backward_prefetch": 1}
DECISIONS = {**{f"layers.{i}.feed_forward": "recompute" for i in range(LAYERS)},
             **{f"layers.{i}.attention.flash_attention": SWAP for i in range(LAYERS)}}
CASES = [(mode, order, backend) for mode in ("whole", "block")
         for order in ("optimize-then-compile", "compile-then-optimize") for backend in ("aot_eager", "inductor")]


def _fresh():
    torch._dynamo.reset()
    counters.clear()
    bundle = build_model("llama-tiny", model_args={"num_layers": LAYERS}, batch_size=2, seq_len=32, seed=0)
    return bundle.model, bundle.batch(seed=0)


def _compile(model: torch.nn.Module, mode: str, backend: str) -> torch.nn.Module:
    if mode == "whole":
        return torch.compile(model, backend=backend)
    for layer in model.layers:
        layer.compile(backend=backend)
    return model


class _Saved:
    """The units whose values the partitioned forward graphs save for backward (a partition observer)."""

    def __init__(self, namer) -> None:
        self.namer = namer
        self.units: set[str] = set()

    def __call__(self, fw_module, bw_module, num_fwd_outputs: int) -> None:
        self.units |= set(saved_unit_bytes(fw_module, num_fwd_outputs, self.namer))

    def feed_forward(self) -> set[str]:
        return {u for u in self.units if ".feed_forward" in u}


_REFS: dict[tuple[str, str], tuple[dict[str, torch.Tensor], set[str]]] = {}


def _reference(mode: str, backend: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Gradients of the compiled model without a plan, and the feed-forward units its graphs save."""
    if (mode, backend) not in _REFS:
        model, batch = _fresh()
        saved = _Saved(ModelStructure.of(model).namer())
        with observe_partitions(saved):
            grads = compiled_step(model, _compile(model, mode, backend), batch)
        _REFS[mode, backend] = grads, saved.feed_forward()
    return _REFS[mode, backend]


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("adaptive_mem")]


@pytest.mark.parametrize("mode,order,backend", CASES, ids=["-".join(c) for c in CASES])
def test_select_recompute_with_swap_runs_compiled(mode: str, order: str, backend: str, caplog):
    ref, ref_saved = _reference(mode, backend)
    assert ref_saved, "without the plan the graphs save feed-forward values"
    model, batch = _fresh()
    caplog.set_level(logging.WARNING)
    handle = optimize(model, plan=_plan(DECISIONS)) if order == "optimize-then-compile" else None
    call = _compile(model, mode, backend)
    handle = handle or optimize(model, plan=_plan(DECISIONS))
    engine = handle._executor.engine
    eager_offloads: list[str] = []
    offload = engine.offload
    engine.offload = lambda t, **kw: eager_offloads.append(kw["label"]) or offload(t, **kw)
    saved = _Saved(handle._executor.ctx.namer)
    with handle, observe_partitions(saved):
        for _ in range(2):
            grads = compiled_step(model, call, batch)
            assert grads.keys() == ref.keys()
            for key, value in ref.items():
                torch.testing.assert_close(grads[key], value, rtol=1e-5, atol=1e-6, msg=key)
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        assert breaks == 0, dict(counters["graph_break"])
        assert graphs == (1 if mode == "whole" else LAYERS), graphs  # per block: each selective layer its own graph
        keys = {s.key.partition("@")[0] for s in handle._executor.graph.swaps}
        assert keys == {f"layers.{i}.attention.flash_attention" for i in range(LAYERS)}, keys
        stats = handle.swap_stats
        assert stats.offloaded_bytes > 0 and stats.reloaded_bytes == stats.offloaded_bytes
        assert eager_offloads == []  # the graph ops swap, not the engine's hooks
        assert saved.units and saved.feed_forward() == set(), saved.feed_forward()
    assert _warnings(caplog) == []


def _layer_of(stack: dict | None, ids: dict[int, int]) -> int | None:
    for key in stack or {}:
        mid = key.partition("@")[0]
        if mid.isdigit() and int(mid) in ids:
            return ids[int(mid)]
    return None


def test_reload_anchors_at_layer_backward_start_counting_recomputed_ops():
    """Note: [select recompute with swaps, compiled]: the ops recomputed in backward carry ``nn_module_stack`` but no
    ``fwd_nn_module_stack``; a layer's backward begins at its first node by either, and layer 0's reload (prefetch
    1) follows layer 1's."""
    model, batch = _fresh()
    decisions = {"layers.0.attention.flash_attention": SWAP, "layers.1.feed_forward": "recompute"}
    with optimize(model, plan=_plan(decisions)) as handle:
        compiled_step(model, torch.compile(model, backend="aot_eager"), batch)
        swaps = list(handle._executor.graph.swaps)
    assert swaps and {s.key.partition("@")[0] for s in swaps} == {"layers.0.attention.flash_attention"}
    ids = {id(m): i for i, layer in enumerate(model.layers) for m in layer.modules()}
    nodes = list(swaps[0].reload.graph.nodes)
    recomputed = [n for n in nodes if n.op == "call_function" and "fwd_nn_module_stack" not in n.meta
                  and _layer_of(n.meta.get("nn_module_stack"), ids) == 1]
    assert any(n.target is torch.ops.aten.mm.default for n in recomputed)  # the feed-forward's matmuls
    start = next(n for n in nodes if any(a.op == "placeholder" and a.name.startswith("tangents")
                                          for a in n.all_input_nodes))
    first = next(n for n in nodes[nodes.index(start):]
                 if _layer_of(n.meta.get("fwd_nn_module_stack") or n.meta.get("nn_module_stack"), ids) == 1)
    for s in swaps:
        assert s.reload.args[3] == [first]


def test_every_selective_block_compiles_past_dynamos_recompile_limit(caplog):
    """Note: [a code per selective layer]: each selective block compiles a graph of its own, under a code object of
    its own, so none waits on another's cache: with the limit at 1, all three mixed blocks run compiled and their
    swaps are graph ops, none through the eager policy."""
    torch._dynamo.reset()
    counters.clear()
    layers = 3
    bundle = build_model("llama-tiny", model_args={"num_layers": layers}, batch_size=2, seq_len=16, seed=0)
    model, (ids, _) = bundle.model, bundle.batch(seed=0)
    decisions = {**{f"layers.{i}.feed_forward": "recompute" for i in range(layers)},
                 **{f"layers.{i}.attention.flash_attention": SWAP for i in range(layers)}}
    caplog.set_level(logging.WARNING)
    with torch._dynamo.config.patch(recompile_limit=1), optimize(model, plan=_plan(decisions)) as handle:
        engine = handle._executor.engine
        eager_offloads: list[str] = []
        offload = engine.offload
        engine.offload = lambda t, **kw: eager_offloads.append(kw["label"]) or offload(t, **kw)
        _compile(model, "block", "aot_eager")
        for _ in range(2):
            model(ids).sum().backward()
        assert counters["stats"]["unique_graphs"] == layers and not counters["graph_break"]
        keys = {s.key.partition("@")[0] for s in handle._executor.graph.swaps}
        assert keys == {f"layers.{i}.attention.flash_attention" for i in range(layers)}, keys
        assert eager_offloads == []
    assert _warnings(caplog) == []
