"""Deterministic CPU kernels for tests that compare gradients bit for bit.

Some plain steps are not bit-reproducible on CPU without them (hf:mixtral's experts' backward runs a parallel
``index_add``): a comparison needs a reference that agrees with itself. A test module opts in with
``from _deterministic import deterministic`` and ``pytestmark = pytest.mark.usefixtures("deterministic")``.
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
