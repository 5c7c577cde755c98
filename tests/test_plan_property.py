"""Property: any per-unit plan (keep / recompute / swap on the units of the family's profile) is exact.

For three Hugging Face families, hypothesis draws a decision for a random subset of the units inside
the layers (names taken from the family's own profile), applies the plan and runs one training step:
loss and every gradient ``torch.equal`` to the same model without a plan.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import profiler
from adaptive_mem import build_model, optimize
from search import Plan
from _deterministic import deterministic, seeded_step as _step  # noqa: F401 - the fixture is used by name

FAMILIES = ("llama", "gpt2", "opt")
BATCH, SEQ = 2, 8


@functools.lru_cache(maxsize=None)
def _family(family: str):
    bundle = build_model(f"hf:{family}", batch_size=BATCH, seq_len=SEQ, seed=0)
    batch = bundle.batch(seed=0)
    profile = profiler.profile_step(bundle, warmup=0, repeat=0, record=1, optimizer_time=0.0)
    units = sorted(u.name for u in profile.units if u.layer is not None)
    return bundle, batch, profile, units, _step(bundle, batch)


def _decision(action: str, prefetch: int):
    return {"action": "swap", "backward_prefetch": prefetch} if action == "swap" else action


_one = st.tuples(st.integers(0, 10_000), st.sampled_from(("keep", "recompute", "swap")), st.integers(0, 3))
decisions = st.tuples(st.tuples(st.integers(0, 10_000), st.sampled_from(("recompute", "swap")), st.integers(0, 3)),
                      st.lists(_one, max_size=23)).map(lambda d: [d[0], *d[1]])  # never an all-keep plan


pytestmark = pytest.mark.usefixtures("deterministic")


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=8, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(drawn=decisions)
def test_random_unit_plans_are_exact(family: str, drawn):
    bundle, batch, profile, units, (ref_loss, ref_grads) = _family(family)
    chosen = {units[k % len(units)]: _decision(action, prefetch) for k, action, prefetch in drawn}
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": chosen, "groups": []})
    with optimize(bundle.model, plan=plan, profile=profile):
        loss, grads = _step(bundle, batch)
    assert torch.equal(loss, ref_loss), chosen
    assert grads.keys() == ref_grads.keys(), chosen
    for key, grad in ref_grads.items():
        assert torch.equal(grads[key], grad), f"grad of {key} differs under {chosen}"
