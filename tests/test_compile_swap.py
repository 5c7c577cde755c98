"""Swap inside per-block compiled models, and the compile front door (``optimize(compile=...)``, ``--compile``).

Note: [swap around compiled blocks] (adaptive_mem/runtime/_compiled_swap.py). A layer the plan swaps as a whole
runs compiled with 0 graph breaks; its saved activations (never parameters or their views) go through the
swap engine; loss and every gradient equal the same compiled model without a plan (``aot_eager``:
``torch.equal``; inductor: ``assert_close``). Graphs are counted as well as breaks: a block dynamo skips
reports 0 breaks too.
"""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from adaptive_mem import ConfigError, DeviceMemory, build_model, optimize
from adaptive_mem.cli._main import main
from adaptive_mem.runtime._graph_ops import graph_swap_stats
from search import Plan

from _compile_common import compiled_step

LAYERS = 2
SWAP = {"layers": {"action": "swap", "backward_prefetch": 1}}


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


def _fresh(seq_len: int = 32):
    torch._dynamo.reset()
    counters.clear()
    bundle = build_model("llama-tiny", model_args={"num_layers": LAYERS}, batch_size=2, seq_len=seq_len, seed=0)
    return bundle.model, bundle.batch(seed=0)


def _blocks(model, backend: str = "aot_eager"):
    for layer in model.layers:
        layer.compile(backend=backend)
    return model


_step = compiled_step


def _graphs() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("adaptive_mem")]


_REFS: dict[str, dict[str, torch.Tensor]] = {}


def _reference(kind: str) -> dict[str, torch.Tensor]:
    if kind not in _REFS:
        model, batch = _fresh()
        call = torch.compile(model, backend="aot_eager") if kind == "whole" else _blocks(model, kind)
        _REFS[kind] = _step(model, call, batch)
        assert _graphs()[0] > 0
    return _REFS[kind]


def _assert_equal(grads, ref) -> None:
    assert grads.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.equal(grads[key], value), key


def _record_offloads(handle) -> list[torch.Tensor]:
    engine = handle._executor.engine
    seen: list[torch.Tensor] = []
    offload = engine.offload

    def spy(t, **kwargs):
        seen.append(t)
        return offload(t, **kwargs)
    engine.offload = spy
    return seen


@pytest.mark.parametrize("order", ["optimize-then-compile", "compile-then-optimize"])
def test_layer_swap_runs_compiled_per_block_and_exact(order: str, caplog):
    ref = _reference("aot_eager")
    model, batch = _fresh()
    caplog.set_level(logging.WARNING)
    if order == "compile-then-optimize":
        _blocks(model)
    handle = optimize(model, plan=_plan(SWAP))
    if order == "optimize-then-compile":
        _blocks(model)
    seen = _record_offloads(handle)
    with handle:
        for _ in range(2):
            _assert_equal(_step(model, model, batch), ref)
        graphs, breaks = _graphs()
        assert graphs > 0 and breaks == 0, dict(counters["graph_break"])
        stats = handle.swap_stats
        assert stats.offloaded_bytes > 0 and stats.reloaded_bytes == stats.offloaded_bytes
        assert stats.on_demand_reloads == 0  # every reload was prefetched by the output-gradient triggers
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        assert seen and not any(t.untyped_storage()._cdata in params for t in seen)  # never weights or their views
        assert {t.dim() for t in seen} >= {3}  # activations (batch, seq, hidden)
    assert _warnings(caplog) == []
    assert all(layer._compiled_call_impl is not None and getattr(layer._compiled_call_impl, "_adaptive_mem_block",
                                                                 None) is None for layer in model.layers)


def test_op_level_swap_block_and_the_whole_layer_one_both_run_compiled(caplog):
    """Note: [op-level swap in a block]: the op-level swap goes into layer 1's own block graph (graph ops), the
    whole-layer swap of layer 0 through the hooks around its block; no warning, 0 breaks, exact."""
    ref = _reference("aot_eager")
    model, batch = _fresh()
    _blocks(model)
    caplog.set_level(logging.WARNING)
    decisions = {"layers.0": {"action": "swap", "backward_prefetch": 1},
                 "layers.1.attention.flash_attention": {"action": "swap", "backward_prefetch": 1}}
    with optimize(model, plan=_plan(decisions)) as handle:
        labels: list[str] = []
        offload = handle._executor.engine.offload
        handle._executor.engine.offload = lambda t, **kw: labels.append(kw["label"]) or offload(t, **kw)
        with graph_swap_stats() as stats:
            for _ in range(2):
                _assert_equal(_step(model, model, batch), ref)
        graphs, breaks = _graphs()
        assert graphs == 2 and breaks == 0, dict(counters["graph_break"])  # the shared block graph, layer 1's own
        assert set(labels) == {"layers.0"}, set(labels)
        keys = {s.key.partition("@")[0] for s in handle._executor.graph.swaps}
        assert keys == {"layers.1.attention.flash_attention"} and stats.offloads == 2  # one a step
    assert _warnings(caplog) == []


def test_swap_and_select_recompute_blocks_both_stay_compiled(caplog):
    ref = _reference("aot_eager")
    model, batch = _fresh()
    _blocks(model)
    caplog.set_level(logging.WARNING)
    decisions = {"layers.0": {"action": "swap", "backward_prefetch": 1}, "layers.1.feed_forward": "recompute"}
    with optimize(model, plan=_plan(decisions)) as handle:
        for _ in range(2):
            _assert_equal(_step(model, model, batch), ref)
        graphs, breaks = _graphs()
        assert graphs == LAYERS and breaks == 0, (graphs, dict(counters["graph_break"]))  # two different blocks
        assert handle.swap_stats.offloaded_bytes > 0
    assert _warnings(caplog) == []


def _held_after_forward(model, batch, plan) -> int:
    """Device bytes the forward leaves alive for backward, once every offload copy has landed."""
    handle = optimize(model, plan=plan) if plan is not None else None
    try:
        _step(model, model, batch)  # compiles outside the measurement
        gc.collect()
        mem = DeviceMemory(track_existing=False)
        mem.track(model, batch)
        with mem:
            base = mem.live
            ids, labels = batch
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
            if handle is not None:  # every offload landed, its source released (both copiers)
                handle._executor.engine.drain()
            held = mem.live - base
            loss.backward()
    finally:
        if handle is not None:
            handle.remove()
    return held


def test_layer_swap_per_block_offloads_the_forward_activations():
    plan = _plan({"layers": {"action": "swap", "backward_prefetch": 0}})
    model, batch = _fresh(seq_len=128)
    eager = _held_after_forward(model, batch, plan)
    model, batch = _fresh(seq_len=128)
    _blocks(model)
    keep = _held_after_forward(model, batch, None)
    swap = _held_after_forward(model, batch, plan)
    assert swap < keep * 0.6, (swap, keep)
    assert swap <= eager, (swap, eager)  # no more left on the device than the eager swap path leaves


def test_layer_swap_per_block_inductor_close():
    model, batch = _fresh()
    ref = _step(model, _blocks(model, "inductor"), batch)
    model, batch = _fresh()
    _blocks(model, "inductor")
    with optimize(model, plan=_plan(SWAP)) as handle:
        grads = _step(model, model, batch)
        assert _graphs()[0] > 0 and _graphs()[1] == 0, dict(counters["graph_break"])
        assert handle.swap_stats.offloaded_bytes > 0
    for key, value in ref.items():
        torch.testing.assert_close(grads[key], value, msg=key)


def test_whole_model_compile_with_swap_stays_compiled_and_exact(caplog):
    """Note: [partitioner hook] (profiler/_partitions.py): the swaps run inside the whole-model graph."""
    ref = _reference("whole")
    model, batch = _fresh()
    caplog.set_level(logging.WARNING)
    with optimize(model, plan=_plan(SWAP)) as handle:
        call = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            got = _step(model, call, batch)
            for name in ref:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
        assert handle.swap_stats.offloaded_bytes > 0
        assert _graphs() == (1, 0)
    assert _warnings(caplog) == []


@pytest.mark.parametrize("name,decisions", [("layer-swap", SWAP), ("full-recompute", {"layers": "recompute"})])
def test_optimize_compile_compiles_each_block_and_remove_restores(name: str, decisions: dict, caplog):
    ref = _reference("aot_eager")
    model, batch = _fresh()
    caplog.set_level(logging.WARNING)
    handle = optimize(model, plan=_plan(decisions), compile="aot_eager")
    assert all(layer._compiled_call_impl is not None for layer in model.layers)
    with handle:
        _assert_equal(_step(model, model, batch), ref)
        graphs, breaks = _graphs()
        assert graphs > 0 and breaks == 0, dict(counters["graph_break"])
        plain = copy.deepcopy(model)  # the copy is plain: no plan, no compiled wrapper of ours
        assert all(getattr(layer._compiled_call_impl, "_adaptive_mem_block", None) is None for layer in plain.layers)
    assert _warnings(caplog) == ["copy of a model with a plan applied (LlamaModel): the plan was not copied; apply it "
                                 "to the copy with adaptive_mem.optimize"]
    for module in model.modules():
        assert module._compiled_call_impl is None and "forward" not in module.__dict__
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_recompute_plan_then_whole_model_compile_is_exact():
    ref = _reference("whole")
    model, batch = _fresh()
    with optimize(model, plan=_plan({"layers": "recompute"})):
        call = torch.compile(model, backend="aot_eager")
        _assert_equal(_step(model, call, batch), ref)
        graphs, breaks = _graphs()
        assert graphs > 0 and breaks == 0, dict(counters["graph_break"])


@pytest.mark.parametrize("value,message", [
    ("nope", "optimize: compile='nope': expected a torch.compile backend name"),
    (3, "optimize: compile=3: expected True, a torch.compile backend name"),
    ({"backend": "nope"}, "optimize: compile.backend='nope': expected a torch.compile backend name"),
    ({"mode": "fast"}, "optimize: compile.mode='fast': expected one of default, reduce-overhead"),
    ({"fullgraph": "yes"}, "optimize: compile.fullgraph='yes': expected True or False"),
    ({"bogus": 1}, "optimize: compile.bogus=1: unknown key; expected keys backend, mode, fullgraph, dynamic"),
])
def test_bad_compile_values_raise_one_line(value, message):
    model, _ = _fresh()
    with pytest.raises(ConfigError) as info:
        optimize(model, plan=_plan(SWAP), compile=value)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert all(not m._forward_pre_hooks and m._compiled_call_impl is None for m in model.modules())  # untouched


def test_compile_of_compiled_blocks_or_with_budget_is_refused():
    model, _ = _fresh()
    _blocks(model)
    with pytest.raises(ConfigError, match=r"^optimize: compile='aot_eager': layers\.0 is already compiled; expected "):
        optimize(model, plan=_plan(SWAP), compile="aot_eager")
    with pytest.raises(ValueError, match=r"^optimize: budget='1GiB': optimize applies a fixed plan; expected "
                       r"adaptive_mem\.adaptive_optimize"):
        optimize(model, budget="1GiB", compile=True)


def test_run_compile_flag(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    _plan(SWAP).save(plan)
    argv = ["run", "--model", "llama-tiny", "--model-args", f"num_layers={LAYERS}", "--seq-len", "32", "--steps", "2",
            "--optimizer", "sgd", "--plan", str(plan)]
    torch._dynamo.reset()
    counters.clear()
    assert main([*argv, "--compile", "aot_eager"]) == 0
    assert "compile: aot_eager (per block)" in capsys.readouterr().out
    assert _graphs()[0] > 0 and _graphs()[1] == 0
    assert main([*argv, "--compile", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compile='nope': expected a torch.compile backend name" in err[0]


def test_flag_set_compile_without_a_plan_compiles_blocks():
    import argparse

    from adaptive_mem import add_arguments, apply_arguments

    ref = _reference("aot_eager")
    model, batch = _fresh()
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--compile", "aot_eager"])
    handle = apply_arguments(model, args)
    assert all(layer._compiled_call_impl is not None for layer in model.layers)
    _assert_equal(_step(model, model, batch), ref)
    handle.remove()
    assert all(layer._compiled_call_impl is None for layer in model.layers)


def test_more_swap_patterns_than_dynamos_recompile_limit_warn_once(caplog):
    """Note: [op-level swap in a block]: each distinct pattern of op-level swaps is one more block graph; past
    dynamo's recompile limit the blocks run eager without their swaps, and one warning says so (gradients exact)."""
    ref = _reference("aot_eager")
    model, batch = _fresh()
    _blocks(model)
    caplog.set_level(logging.WARNING)
    decisions = {"layers.0.attention.flash_attention": "swap", "layers.1.feed_forward.w1.matmul": "swap"}
    with torch._dynamo.config.patch(recompile_limit=2), optimize(model, plan=_plan(decisions)):
        _assert_equal(_step(model, model, batch), ref)
    assert _warnings(caplog) == [
        "adaptive_mem: op-level swaps of 2 distinct layer patterns (from layers.1) need 3 block graphs, over "
        "torch._dynamo.config.recompile_limit=2: blocks past it run eager without their op-level swaps; swap whole "
        "layers, use fewer patterns, compile the whole model, or raise the limit"]
