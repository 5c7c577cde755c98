"""Note: [single-op recompute at pack] in adaptive_mem/runtime/_pack_recompute.py: a recomputed op of a module's own
code (Hugging Face's ``mlp.mul``) is recomputed by saved-tensor hooks on its reader, no op intercepted, with the
gradients of the model without a plan; an output found another way is kept."""

from __future__ import annotations

import copy

import pytest
import torch

from adaptive_mem import build_model, optimize
from adaptive_mem.runtime import _pack_recompute
from adaptive_mem.runtime._footprint import FOOTPRINT
from search import Action, Decision, Plan

UNIT = "model.layers.0.mlp.mul"


@pytest.fixture(scope="module")
def bundle():
    return build_model("hf:llama", batch_size=2, seq_len=16, seed=0)


def _run(bundle, plan, monkeypatch, steps=2, autocast=False):
    recomputed = []
    output = _pack_recompute._OpRecipe.output

    def counted(self):
        recomputed.append(self.func)
        return output(self)
    monkeypatch.setattr(_pack_recompute._OpRecipe, "output", counted)
    model = copy.deepcopy(bundle.model)
    run = copy.copy(bundle)
    run.model = model
    handle = optimize(model, plan=plan) if plan is not None else None
    calls = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        FOOTPRINT.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = run.loss(bundle.batch(seed=0))
        loss.backward()
        calls.append(FOOTPRINT.snapshot())
    if handle is not None:
        handle.remove()
    return [p.grad for p in model.parameters()], calls, recomputed


def test_single_op_recomputed_at_pack_with_plain_gradients(bundle, monkeypatch):
    plain, _, _ = _run(bundle, None, monkeypatch)
    got, calls, recomputed = _run(bundle, Plan(decisions={UNIT: Decision(Action.RECOMPUTE)}), monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert recomputed == [torch.ops.aten.mul.Tensor] * 2  # once per step
    assert calls[-1]["dispatch"] == 0 and 0 < calls[-1]["pack"] <= 2


def test_autocast_keeps_the_output(bundle, monkeypatch):
    plain, _, _ = _run(bundle, None, monkeypatch, autocast=True)
    got, calls, recomputed = _run(bundle, Plan(decisions={UNIT: Decision(Action.RECOMPUTE)}), monkeypatch,
                                  autocast=True)
    assert recomputed == []
    assert all(torch.equal(a, b) for a, b in zip(plain, got))


def test_cost_model_counts_the_runtime_calls(bundle, monkeypatch):
    from adaptive_mem import profile_step
    from search import machinery_calls

    plan = Plan(decisions={UNIT: Decision(Action.RECOMPUTE)})
    profile = profile_step(bundle, optimizer=torch.optim.SGD(bundle.model.parameters(), lr=1e-3), warmup=1, repeat=1)
    _, calls, _ = _run(bundle, plan, monkeypatch)
    model = machinery_calls(profile, plan)
    assert (model.dispatch, model.pack) == (calls[-1]["dispatch"], calls[-1]["pack"]) == (0, calls[-1]["pack"])
