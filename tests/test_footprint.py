"""The footprint counters (Note: [footprint counters] in adaptive_mem/runtime/_footprint.py): reset and snapshot, and
each kind of call site counts: the op-level swap's dispatch mode and pack/unpack hooks, the SAC policy."""

from __future__ import annotations

import pytest

from adaptive_mem import build_model, optimize
from adaptive_mem.runtime._footprint import FOOTPRINT, Footprint
from search import Plan
from _deterministic import assert_same_step, deterministic, seeded_step  # noqa: F401 - fixture used by name

pytestmark = pytest.mark.usefixtures("deterministic")


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, "groups": []})


def test_reset_and_snapshot():
    fp = Footprint()
    assert fp.snapshot() == {"dispatch": 0, "pack": 0, "unpack": 0, "trigger": 0}
    fp.dispatch += 3
    fp.pack += 2
    fp.unpack += 1
    fp.trigger += 4
    snap = fp.snapshot()
    assert snap == {"dispatch": 3, "pack": 2, "unpack": 1, "trigger": 4}
    fp.reset()
    assert fp.snapshot() == {"dispatch": 0, "pack": 0, "unpack": 0, "trigger": 0}
    assert snap == {"dispatch": 3, "pack": 2, "unpack": 1, "trigger": 4}  # a snapshot is a copy


def _counts(decisions: dict | None) -> dict[str, int]:
    """The counts of one step of llama-tiny (second step, after warm-up) under a plan, its gradients checked
    against the same step with no plan."""
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    if decisions is None:
        FOOTPRINT.reset()
        seeded_step(bundle, batch)
        return FOOTPRINT.snapshot()
    with optimize(bundle.model, plan=_plan(decisions)):
        seeded_step(bundle, batch)
        FOOTPRINT.reset()
        assert_same_step(seeded_step(bundle, batch), want, str(decisions))
        return FOOTPRINT.snapshot()


def test_no_plan_counts_nothing():
    assert _counts(None) == {"dispatch": 0, "pack": 0, "unpack": 0, "trigger": 0}


def test_op_level_swap_counts_dispatch_pack_and_unpack(monkeypatch):
    # attention's core saves its unit's tensor before any module boundary: tracked at every step (Note: [scopes by
    # their boundaries]); copies on the copy thread, so the reload is prefetched by a trigger (Note: [reload at the
    # unpack] in _copier.py)
    monkeypatch.setattr("adaptive_mem.runtime._copier.INLINE_BYTES", 0)
    counts = _counts({"layers.0.attention.flash_attention": {"action": "swap", "backward_prefetch": 1}})
    assert counts["dispatch"] > 0 and counts["pack"] > 0 and counts["unpack"] > 0 and counts["trigger"] > 0


def test_sac_policy_counts_dispatch():
    counts = _counts({"layers.0.attention.flash_attention": "recompute"})  # mul: no policy (Note: [recompute at pack])
    assert counts["dispatch"] > 0
