"""Note: [lean checkpoint] in adaptive_mem/runtime/_lean_checkpoint.py: the eager whole-layer checkpoint gives
PyTorch's checkpoint's gradients bit for bit, frees what it replays, and fails where PyTorch's fails."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

from adaptive_mem import build_model, optimize
from adaptive_mem.runtime import _lean_checkpoint
from adaptive_mem.runtime._lean_checkpoint import _Frame, _Slot, lean_applies, lean_checkpoint
from search import Action, Decision, Plan


class _Block(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = self.drop(torch.nn.functional.gelu(self.a(x)))
        y = self.b(h).sigmoid() * x
        return y * scale if scale is not None else y


def _grads(block: nn.Module, x: torch.Tensor, run, **kwargs) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    torch.manual_seed(7)
    out = run(block, x * 1.5, **kwargs)
    out.square().sum().backward()
    grads = [x.grad] + [p.grad for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return grads


def _torch(block, x, **kwargs):
    return checkpoint(block, x, use_reentrant=False, **kwargs)


def _lean(block, x, **kwargs):
    return lean_checkpoint(block, x, **kwargs)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_gradients_equal_torch_checkpoint_and_plain(p):
    torch.manual_seed(0)
    block, x = _Block(p), torch.randn(4, 16)
    scale = torch.randn(4, 16)
    plain = _grads(block, x, lambda b, x, **k: b(x, **k), scale=scale)
    for got in (_grads(block, x, _torch, scale=scale), _grads(block, x, _lean, scale=scale)):
        assert all(torch.equal(a, b) for a, b in zip(plain, got))


def test_replay_keeps_rng_of_forward_and_restores_it_after():
    torch.manual_seed(0)
    block, x = _Block(0.5), torch.randn(4, 16)
    x = x.requires_grad_()
    torch.manual_seed(3)
    out = lean_checkpoint(block, x)
    after_forward = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), after_forward)


def test_retain_graph_replays_each_backward():
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(4, 16, requires_grad=True)
    out = lean_checkpoint(block, x).sum()
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    assert torch.equal(x.grad, 2 * first)


def test_autograd_grad_with_inputs():
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(4, 16, requires_grad=True)
    (want,) = torch.autograd.grad(checkpoint(block, x, use_reentrant=False).sum(), x)
    (got,) = torch.autograd.grad(lean_checkpoint(block, x).sum(), x)
    assert torch.equal(want, got)


def test_frames_and_replayed_tensors_freed():
    torch.manual_seed(0)
    block = _Block()

    def live() -> tuple[int, int, int]:  # objects of the kinds this test makes (a batch of 7)
        gc.collect()
        found = [type(o) for o in gc.get_objects()
                 if type(o) in (_Frame, _Slot) or isinstance(o, torch.Tensor) and o.dim() == 2 and o.shape[0] == 7]
        return found.count(_Frame), found.count(_Slot), len(found) - found.count(_Frame) - found.count(_Slot)

    before = live()  # what other tests of the process may still hold
    for _ in range(3):
        x = torch.randn(7, 16, requires_grad=True)
        lean_checkpoint(block, x * 2).sum().backward()
        del x
        now = live()
        assert all(n <= b for n, b in zip(now, before)), (now, before)  # no frame, slot or tensor of its own left


def test_input_modified_in_place_after_forward_raises():
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(4, 16, requires_grad=True)
    h = x * 2
    out = lean_checkpoint(block, h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_replay_saving_other_tensors_raises():
    calls = []

    def fn(x):
        calls.append(1)
        y = x if len(calls) == 1 else x[:2]
        return (y * y).sum()
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(CheckpointError, match="shape"):
        lean_checkpoint(fn, x).backward()


def test_not_applied_under_saved_tensor_hooks_or_without_grad():
    assert lean_applies()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not lean_applies()
    with torch.no_grad():
        assert not lean_applies()


def test_whole_layer_plan_runs_lean_with_plain_gradients(monkeypatch):
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    frames = []
    monkeypatch.setattr(_lean_checkpoint._Frame, "__init__", _counting(_Frame.__init__, frames))

    def grads(plan):
        model = copy.deepcopy(bundle.model)
        handle = optimize(model, plan=plan) if plan is not None else None
        run = copy.copy(bundle)
        run.model = model
        run.loss(batch).backward()
        if handle is not None:
            handle.remove()
        return [p.grad for p in model.parameters()]
    plain = grads(None)
    got = grads(Plan(decisions={f"layers.{i}": Decision(Action.RECOMPUTE) for i in range(2)}))
    assert len(frames) == 2
    assert all(torch.equal(a, b) for a, b in zip(plain, got))


def _counting(init, frames):
    def counted(self, *args, **kwargs):
        frames.append(1)
        init(self, *args, **kwargs)
    return counted


def test_replay_under_forward_autocast_and_nested_checkpoint():
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(4, 16)

    def nested(b, x):
        return checkpoint(b, x, use_reentrant=False) * 2

    def autocast(run):
        def go(b, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run(b, x).float()
        return go
    for inner in (nested, lambda b, x: b(x)):
        want = _grads(block, x, autocast(lambda b, x: checkpoint(inner, b, x, use_reentrant=False)))
        got = _grads(block, x, autocast(lambda b, x: lean_checkpoint(inner, b, x)))
        assert all(torch.equal(a, b) for a, b in zip(want, got))
