"""The adaptive loop under DDP, FSDP2 and tensor parallel on 2 gloo ranks, applied before and after the wrapper: every step of every
rank has the loss and local gradients of the same layout without the loop (``torch.equal``) at a budget above the
plain peak and at one between the loop's measured minimum and that peak; a budget below the minimum is refused
before the first step; injected out-of-memory faults at random allocations change nothing (cases in
tests/_parallel_layout_cases.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _parallel_layout_cases import FAULTS, LAYOUTS, ORDERS, STEPS, TIMEOUT, worker  # noqa: E402
from _spawn import spawn_ranks  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(worker, out=tmp_path_factory.mktemp("ranks"), timeout=TIMEOUT)


def _case(ranks: list[dict], name: str) -> list[dict]:
    found = [r[name] for r in ranks]
    for rank, result in enumerate(found):
        assert result["error"] is None, f"rank {rank} {name}: {result['error']}\n{result.get('trace')}"
    return found


def _assert_exact(ranks: list[dict], layout: str, name: str) -> None:
    plain, got = _case(ranks, f"{layout}-plain"), _case(ranks, name)
    for rank in range(len(ranks)):
        assert len(got[rank]["losses"]) == STEPS, (rank, name)
        for step in range(STEPS):
            assert torch.equal(got[rank]["losses"][step], plain[rank]["losses"][step]), \
                f"rank {rank} {name} step {step}: loss {got[rank]['losses'][step]} != {plain[rank]['losses'][step]}"
            want = plain[rank]["grads"][step]
            assert got[rank]["grads"][step].keys() == want.keys()
            differ = [n for n, g in want.items() if not torch.equal(got[rank]["grads"][step][n], g)]
            assert not differ, f"rank {rank} {name} step {step}: gradients differ: {differ[:5]}"


def test_an_fsdp2_profile_has_the_models_units_and_the_ranks_shards(ranks):
    """Note: [wrapper ops]: FSDP2's all-gathers, copy-outs and their buffers are no units, and the blocks' saves of
    the gathered weights no activation bytes: the profile of a rank is the plain model's, its parameters the rank's
    shards, and what FSDP2 holds beside the step is ``static.other``."""
    import profiler
    from _parallel_layout_cases import _bundle

    b = _bundle()
    ids, _ = b.batch(seed=0)
    plain = profiler.profile_step(b.model, inputs=(ids,), loss_fn=lambda m, inputs: m(*inputs).sum(),
                                  optimizer="sgd", warmup=0, repeat=0, record=1, optimizer_time=0.0)
    whole = plain.static.parameters
    for rank, found in enumerate(_case(ranks, "fsdp-profile")):
        assert found["units"] == [(u.name, u.saved_bytes) for u in plain.units], rank
        assert found["static"].parameters == whole // 2 and found["static"].gradients == whole // 2, found["static"]
        assert found["static"].other > 0, "FSDP2's gathered blocks were not seen"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("budget", ["above", "between"])
def test_adaptive_loop_is_exact_on_every_rank(ranks, layout, order, budget):
    # Note: [hooks before the loop's] (order "before" under FSDP2), [wrapper ops], [other device memory],
    # [DDP gradient buckets] (order "before" under DDP: the loop sees no wrapper until it looks around the model)
    _assert_exact(ranks, layout, f"{layout}-{order}-{budget}")
    history = _case(ranks, f"{layout}-{order}-{budget}")[0]["history"]
    assert history[0][0] == "warmup" and len(history) == STEPS


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("order", ORDERS)
def test_between_budget_lies_between_the_minimum_and_the_plain_peak_and_moves_activations(ranks, layout, order):
    budgets = ranks[0][f"{layout}-{order}-budgets"]
    assert budgets["minimum"] < budgets["between"] < budgets["peak"], budgets
    found = _case(ranks, f"{layout}-{order}-between")
    for rank, result in enumerate(found):
        assert max(result["peaks"]) <= budgets["between"], (rank, result["peaks"], budgets)
        applied = [d for kind, _, d in result["history"] if d and "applying the plan {" in d]
        assert applied or result["rescues"], f"rank {rank}: nothing was moved under a budget below the plain peak"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("order", ORDERS)
def test_budget_below_the_minimum_is_refused_before_the_first_step(ranks, layout, order):
    minimum = ranks[0][f"{layout}-{order}-budgets"]["minimum"]
    for rank, result in enumerate(_case(ranks, f"{layout}-{order}-refused")):
        message = result["refused"]
        assert message is not None, f"rank {rank}: a budget of 0.9 x the minimum trained {result.get('steps')} steps"
        assert f"--memory-budget={int(0.9 * minimum)}: below the minimum feasible; needed" in message, message
        assert "\n" not in message
        assert result["grads"] == [], f"rank {rank}: the refused step wrote gradients"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_injected_out_of_memory_faults_change_nothing(ranks, layout):
    _assert_exact(ranks, layout, f"{layout}-injected")
    for rank, result in enumerate(_case(ranks, f"{layout}-injected")):
        assert result["faults"] == FAULTS, f"rank {rank}: {result['faults']} of {FAULTS} faults fired"
        assert result["rescues"] > 0, f"rank {rank}: no fault found anything to swap"
