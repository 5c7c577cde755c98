"""A rank's budget over its interleaved chunks (Note: [chunk budgets]): each chunk gets its minimum feasible peak
when the minimums together fit, the rest shared by what each keep-all needs beyond it; the rank's predicted peak
stays within the budget; a budget below the minimums together is refused."""

from __future__ import annotations

import pytest

import adaptive_mem as am
from _profiles import SyntheticUnit, synthetic_profile
from adaptive_mem._search import chunk_budgets, stages_of
from profiler import Layout
from search import Budget, InfeasibleBudgetError, minimum_budget

MiB = 1 << 20
_WIDE = [SyntheticUnit(f"u{i}.matmul", 10 * MiB, 1e-3, 2e-3) for i in range(8)]  # much to save, little it must keep
_DENSE = [SyntheticUnit("big.matmul", 2 * MiB, 1e-3, 2e-3),  # its keep-all little above its minimum
          SyntheticUnit("act", 30 * MiB, 1e-3, 2e-3, output_bytes=2 * MiB)]
LAYOUT = dict(pipeline_stages=2, virtual_pipeline_stages=2, micro_batches=4, schedule="interleaved-1f1b")


def _profile():
    # rank 0 holds layers 0 (wide) and 2 (dense): minimums 140 + 120 MiB, keep-all 290 + 122 MiB
    return synthetic_profile(layers=[_WIDE, _WIDE, _DENSE, _DENSE], static=40 * MiB)


def test_each_chunk_gets_at_least_its_minimum():
    stages = stages_of(_profile(), Layout(**LAYOUT), None)
    budgets = chunk_budgets(stages, Budget(total=280 * MiB), Layout(**LAYOUT))
    for st, b in zip(stages, budgets):
        assert b.total >= minimum_budget(st.model, in_flight=st.in_flight)[0], (st.index, st.chunk)
    for s in (0, 1):
        assert sum(b.total for st, b in zip(stages, budgets) if st.index == s) <= 280 * MiB  # no buffers here


def test_a_rank_whose_minimums_fit_is_planned_within_its_budget():
    """A split by keep-all activations gave rank 0's dense chunk 94 MiB against its minimum of 120 MiB."""
    found = am.search(_profile(), budget=280 * MiB, **LAYOUT)
    assert found.ranks and all(r["predicted_peak_bytes"] <= 280 * MiB for r in found.ranks)
    assert found.peak_bytes <= 280 * MiB


def test_a_budget_below_the_chunks_minimums_together_is_refused():
    with pytest.raises(InfeasibleBudgetError, match=r"stage 0: --budget 250\.00 ?MiB is below the minimum feasible "
                                                    r"260\.00 ?MiB .* of its 2 chunks together"):
        am.search(_profile(), budget=250 * MiB, **LAYOUT)
