"""Ours + compile under a whole-model ``torch.compile``.

Note: [first forward outside dynamo] (adaptive_mem/runtime/_apply.py): a plan naming op-level units, applied
without ``profile=``/``example_inputs=``, then ``torch.compile(model)``: 0 graph breaks, exact, and a bad name
still refused at the first forward. Note: [ours + compile layout] (adaptive_mem/bench/_policy_compiled.py): the
bench policy compiles the whole model for every plan, swaps included. Note: [whole-model offset]
(adaptive_mem/bench/_compiled_match.py): matched rows are planned in whole-model terms.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from adaptive_mem import build_model, optimize
from adaptive_mem.bench import get_policy
from adaptive_mem.bench._compiled_match import whole_model_offset, whole_model_prediction
from adaptive_mem.bench._policy_compiled import compile_layout
from search import Plan, PlanError, StepModel
from search.planning import resolve, simulate_assignment
from _profiles import random_profile

from _compile_common import compiled_step

SELECT = {"layers.0.add": "recompute", "layers.0.feed_forward.w1.activation.silu": "recompute",
          "layers.1.feed_forward": "recompute", "layers.1.attention.flash_attention": "recompute"}
SWAP = {"layers.0": {"action": "swap", "backward_prefetch": 1}, "layers.1.feed_forward": "recompute"}
OP_SWAP = {"layers.1.feed_forward.w1.matmul": {"action": "swap", "backward_prefetch": 1}}


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


def _fresh():
    torch._dynamo.reset()
    counters.clear()
    bundle = build_model("llama-tiny", model_args={"num_layers": 2}, batch_size=2, seq_len=16, seed=0)
    return bundle, bundle.batch(seed=0)


def test_whole_model_select_plan_without_inputs_is_exact_with_no_graph_break():
    bundle, batch = _fresh()
    ref = compiled_step(bundle.model, torch.compile(bundle.model, backend="aot_eager"), batch)
    bundle, batch = _fresh()
    with optimize(bundle.model, plan=_plan(SELECT)) as handle:
        call = torch.compile(bundle.model, backend="aot_eager")
        for _ in range(2):
            grads = compiled_step(bundle.model, call, batch)
            assert grads.keys() == ref.keys()
            for key, grad in ref.items():
                assert torch.equal(grads[key], grad), key
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1
        assert handle._check is None, "the first-forward name check did not run"
        for i in range(2):  # the compiled selective-checkpoint policy tagged the plan's units
            state = handle._executor.selective.states[i]
            assert state.trace is None and state.compiled
            recomputed = {u for u in state.compiled[-1].names if state.compiled[-1].action(u) == "recompute"}
            for target in (t for t in SELECT if t.startswith(f"layers.{i}.")):
                assert any(u == target or u.startswith(target + ".") for u in recomputed), target
    assert not any(k.startswith("_forward") and v for k, v in vars(bundle.model).items() if k.endswith("hooks"))


def test_whole_model_bad_op_name_is_still_refused_at_the_first_forward():
    bundle, batch = _fresh()
    handle = optimize(bundle.model, plan=_plan({"layers.0.add_7": "recompute"}))
    call = torch.compile(bundle.model, backend="aot_eager")
    with pytest.raises(PlanError, match=r"plan.decisions.'layers.0.add_7': no such unit"):
        call(batch[0])
    assert not handle.active
    assert dict(counters["graph_break"]) == {}


def _job(tmp_path, decisions: dict) -> dict:
    path = tmp_path / "plan.yaml"
    _plan(decisions).save(path)
    return {"plan": str(path), "compile_backend": "aot_eager"}


@pytest.mark.parametrize("decisions", [{}, SELECT, SWAP, OP_SWAP], ids=["keep", "select", "swap", "op-swap"])
def test_policy_compiles_the_whole_model(tmp_path, decisions):
    """Note: [ours + compile layout]: every plan, swaps included, runs under one whole-model compile."""
    assert compile_layout(_plan(decisions)) == "whole-model"
    bundle, batch = _fresh()
    optimizer = torch.optim.Adam(bundle.model.parameters(), lr=1e-4)
    applied = get_policy("ours-milp+compile").apply(bundle, optimizer, _job(tmp_path, decisions))
    assert applied.info == {"decisions": len(decisions), "backend": "aot_eager", "compile": "whole-model"}
    model = applied.bundle.model
    assert model is not bundle.model and model._orig_mod is bundle.model
    assert all(layer._compiled_call_impl is None for layer in bundle.model.layers)
    applied.bundle.loss(batch).backward()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    applied.remove()
    assert not bundle.model._forward_pre_hooks and not bundle.model._forward_hooks


def test_matched_rows_are_planned_in_whole_model_terms(tmp_path):
    model = StepModel.build(random_profile(random.Random(0), num_layers=2, units_per_layer=4))
    keep = simulate_assignment(model, resolve(model, _plan({}))).peak_bytes
    rows = [({"policy": "compile", "budget": 0.5}, {}), ({"policy": "compile", "budget": 1.0}, {})]
    measured = [[{"status": "ok", "peak_bytes": 900}], [{"status": "ok", "peak_bytes": 1000}]]
    ctx = SimpleNamespace(model=model)
    assert whole_model_offset(ctx, rows, measured) == keep - 1000
    assert whole_model_offset(ctx, rows[:1], measured[:1]) is None
    assert whole_model_offset(ctx, rows, [measured[0], [{"status": "failed"}]]) is None
    for decisions in (SELECT, SWAP):
        path = tmp_path / "plan.yaml"
        _plan(decisions).save(path)
        prepared = {"plan": str(path), "predicted_peak_bytes": 5000}
        assert whole_model_prediction(prepared, 300) == {
            **prepared, "predicted_peak_bytes": 4700, "predicted_peak_bytes_simulated": 5000,
            "planned_for": "whole-model", "whole_model_offset_bytes": 300}
        assert whole_model_prediction(prepared, None) is None
