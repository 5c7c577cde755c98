"""Deterministic CPU kernels for tests that compare gradients bit for bit.

Some plain steps are not bit-reproducible on CPU without them (hf:mixtral's experts' backward runs a parallel
``index_add``): a comparison needs a reference that agrees with itself. A test module opts in with
``from _deterministic import deterministic`` and ``pytestmark = pytest.mark.usefixtures("deterministic")``.
:func:`seeded_step` is the step such tests compare: loss and gradients under one seed.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def seeded_step(bundle, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward of ``bundle`` on ``batch`` under seed 1234 (dropout, routers): the loss and the
    parameters' gradients, copied."""
    model = bundle.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = bundle.loss(batch)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(got, want, what: str) -> None:
    """Two :func:`seeded_step` results bit for bit."""
    loss, grads = got
    assert torch.equal(loss, want[0]), f"{what}: loss {loss} != {want[0]}"
    assert grads.keys() == want[1].keys(), what
    for key, grad in want[1].items():
        assert torch.equal(grads[key], grad), f"{what}: grad of {key} differs"
