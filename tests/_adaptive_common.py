"""Shared by the SwapManager / OOM / adaptive / plan-cache tests: a reference run and a capped run.

Memory is measured by ``DeviceMemory`` (the executor's exact CPU accounting), which is independent
of the SwapManager: it counts storages, the manager only asks it for room.
"""

from __future__ import annotations

import torch

from adaptive_mem import DeviceMemory, build_model

SPEC = dict(spec="llama-tiny", batch_size=4, seq_len=128)


def bundle(**overrides):
    kw = {**SPEC, **overrides}
    return build_model(kw.pop("spec"), seed=0, **kw)


def optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def reference(steps: int, **overrides) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Per-step gradients of an unconstrained run, and the peak device bytes of its first step."""
    b = bundle(**overrides)
    opt = optimizer(b.model)
    grads = []
    peak = 0
    with DeviceMemory(track_existing=False) as mem:
        mem.track(b.model, opt)
        for step in range(steps):
            mem.reset_peak()
            b.loss(b.batch(seed=step)).backward()
            peak = peak or mem.peak
            with torch.no_grad():
                grads.append({n: p.grad.clone() for n, p in b.model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return grads, peak


def train(b, opt, steps: int, *, cap: int | None, memory: DeviceMemory | None = None, check=None) -> list[int]:
    """Run ``steps`` steps under ``DeviceMemory(cap=cap)``; ``check(step)`` runs with the grads in place.

    Returns the accounted peak of every step."""
    mem = memory or DeviceMemory(cap=cap, track_existing=False)
    peaks = []
    with mem:
        mem.track(b.model, opt)
        for step in range(steps):
            mem.reset_peak()
            loss = b.loss(b.batch(seed=step))
            loss.backward()
            del loss
            peaks.append(mem.peak)
            if check is not None:
                check(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return peaks


def assert_grads(model, expected: dict[str, torch.Tensor], step: int) -> None:
    for name, p in model.named_parameters():
        assert p.grad is not None, f"step {step}: {name} has no grad"
        assert torch.equal(p.grad, expected[name]), f"step {step}: gradient of {name} differs"
