"""Acceptance: loss and every parameter gradient are bit-identical to the unoptimized model.

One reference step per model (same weights, same batch, same RNG seed), then
one step per plan of the matrix: recompute / swap per layer and per op, mixed
in one layer, nested targets, groups, every prefetch distance 0..num_layers.
Each plan is run for two steps in a row (the first step also runs the
fake-tensor discovery pass; the second must reuse it).
"""

from __future__ import annotations

import pytest
import torch

from adaptive_mem import build_model, optimize
from search import Plan
from _deterministic import deterministic  # noqa: F401 - the fixture is used by name

MODELS = {
    "llama-tiny": {},
    "hf:llama": {},
    "hf:gpt2": {},
    "hf:mixtral": {},
}


pytestmark = pytest.mark.usefixtures("deterministic")


def _plan(decisions: dict, groups: list | None = None) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions,
                           "groups": groups or []})


def _swap(prefetch: int) -> dict:
    return {"action": "swap", "backward_prefetch": prefetch}


def _llama_plans() -> dict[str, Plan]:
    L = "layers"
    plans = {
        "whole-layer-0": _plan({f"{L}.0": "recompute"}),
        "all-layers-container": _plan({L: "recompute"}),
        "groups-01-23": _plan({L: "recompute"}, [[0, 1], [2, 3]]),
        "group-123": _plan({f"{L}.{i}": "recompute" for i in (1, 2, 3)}, [[1, 2, 3]]),
        "op-silu-layer1": _plan({f"{L}.1.feed_forward.w1.activation.silu": "recompute"}),
        "op-silu-mul-every-layer": _plan({f"{L}.{i}.feed_forward.{u}": "recompute" for i in range(4)
                                          for u in ("w1.activation.silu", "mul")}),
        "module-attention-layer2": _plan({f"{L}.2.attention": "recompute"}),
        "op-flash-attention-layer0": _plan({f"{L}.0.attention.flash_attention": "recompute"}),
        "op-norms-every-layer": _plan({f"{L}.{i}.{n}": "recompute" for i in range(4)
                                       for n in ("attention_norm.norm", "ffn_norm.norm")}),
        "op-residual-add": _plan({f"{L}.0.add": "recompute", f"{L}.3.add_1": "recompute"}),
        "swap-flash-attention-all": _plan({f"{L}.{i}.attention.flash_attention": _swap(1) for i in range(4)}),
        "swap-feed-forward-layer3": _plan({f"{L}.3.feed_forward": _swap(2)}),
        "swap-outside-layers": _plan({"tok_embeddings": _swap(1), "norm": _swap(1), "output": _swap(0)}),
        "swap-everything": _plan({L: _swap(1), "norm": _swap(3), "output": _swap(1)}),
        "mixed-one-layer": _plan({f"{L}.1.feed_forward.w1.activation.silu": "recompute",
                                  f"{L}.1.attention.flash_attention": _swap(2),
                                  f"{L}.1.attention.wq": "keep"}),
        "mixed-swap-matmul-recompute-mul": _plan({f"{L}.2.feed_forward.w2": _swap(1),
                                                  f"{L}.2.feed_forward.mul": "recompute"}),
        "nested-recompute-with-swap-and-keep": _plan({f"{L}.1": "recompute",
                                                      f"{L}.1.attention.flash_attention": _swap(1),
                                                      f"{L}.1.feed_forward.w2": "keep"}),
        "nested-swap-with-recompute": _plan({f"{L}.2": _swap(0), f"{L}.2.feed_forward": "recompute",
                                             f"{L}.2.attention_norm": "keep"}),
        "every-layer-different": _plan({f"{L}.0": "recompute", f"{L}.1.feed_forward.mul": "recompute",
                                        f"{L}.2": _swap(1), f"{L}.3.attention.flash_attention": _swap(0)}),
    }
    for p in range(0, 5):  # every prefetch distance 0..num_layers
        plans[f"swap-layer1-prefetch{p}"] = _plan({f"{L}.1": _swap(p)})
    return plans


def _hf_plans(container: str, attn: str, mlp: str, act: str) -> dict[str, Plan]:
    return {
        "whole-layers": _plan({container: "recompute"}),
        "group-01": _plan({container: "recompute"}, [[0, 1]]),
        "op-mlp-activation": _plan({f"{container}.{i}.{mlp}.{act}": "recompute" for i in range(2)}),
        "swap-attention-prefetch-0-and-2": _plan({f"{container}.0.{attn}": _swap(0),
                                                  f"{container}.1.{attn}": _swap(2)}),
        "mixed-one-layer": _plan({f"{container}.1.{mlp}": "recompute", f"{container}.1.{attn}": _swap(1)}),
    }


PLANS: dict[str, dict[str, Plan]] = {
    "llama-tiny": _llama_plans(),
    "hf:llama": _hf_plans("model.layers", "self_attn", "mlp", "act_fn.silu"),
    "hf:gpt2": _hf_plans("transformer.h", "attn", "mlp", "act.newgelu"),
    "hf:mixtral": _hf_plans("model.layers", "self_attn", "mlp", "experts.act_fn.silu"),
}

CASES = [(spec, name) for spec, plans in PLANS.items() for name in plans]


def _step(bundle, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = bundle.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # dropout (gpt2) draws the same numbers in every run
    loss = bundle.loss(batch)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


_REFS: dict[str, tuple] = {}


def _reference(spec: str):
    if spec not in _REFS:
        bundle = build_model(spec, seed=0, **MODELS[spec])
        batch = bundle.batch(seed=0)
        _REFS[spec] = (bundle, batch, _step(bundle, batch))
    return _REFS[spec]


@pytest.mark.parametrize("spec,name", CASES, ids=[f"{s}-{n}" for s, n in CASES])
def test_gradients_bit_identical(spec: str, name: str):
    bundle, batch, (ref_loss, ref_grads) = _reference(spec)
    plan = PLANS[spec][name]
    with optimize(bundle.model, plan=plan) as handle:
        for _ in range(2):
            loss, grads = _step(bundle, batch)
            assert torch.equal(loss, ref_loss), name
            assert grads.keys() == ref_grads.keys()
            for key, grad in ref_grads.items():
                assert torch.equal(grads[key], grad), f"{name}: grad of {key} differs"
        if any(d.action.value == "swap" for d in plan.decisions.values()) and "nested-recompute" not in name:
            stats = handle.swap_stats
            # a swapped storage no backward unpacks is not reloaded (Note: [reload at the unpack])
            assert 0 < stats.offloaded_bytes and stats.reloaded_bytes <= stats.offloaded_bytes
    _assert_restored(bundle.model)


def _assert_restored(model: torch.nn.Module) -> None:
    for path, module in model.named_modules():
        assert "forward" not in module.__dict__, path
        assert not module._forward_hooks and not module._forward_pre_hooks, path
        assert not module._backward_hooks and not module._backward_pre_hooks, path


def test_router_indices_saved_after_their_topk_node_died_swap_exactly():
    """Note: [dead record] in a layer swap: a router that keeps only topk's indices (its values, and with
    them topk's node, die at once) and gathers with them, as DeepSeek-V3's router does."""

    class Router(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = self.proj(x).sigmoid()
            picked = torch.topk(scores, k=2, dim=-1)[1]
            return x * scores.gather(-1, picked).sum(-1, keepdim=True)

    model = torch.nn.Sequential(*(Router() for _ in range(3)))
    x = torch.randn(8, 16)
    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    plan = {"format": "adaptive-mem-plan", "version": 1, "decisions": {
        str(i): {"action": "swap", "backward_prefetch": 1} for i in range(3)}}
    with optimize(model, plan=plan) as handle:
        model(x).sum().backward()
        assert handle.swap_stats.offloaded_bytes > 0
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
