"""Ranking candidates timed in paired rounds (Note: [paired rounds] in ``_worker``).

Each round times one step of every candidate in one process; the ratio of two candidates' tokens/s within a round
cancels what the round's load did to both. Candidates are ranked by the median over rounds of their ratio to the
reference (the predicted best), and the ranking counts as resolved when a distribution-free 95 % interval of the
second's median ratio to the best lies below 1.
"""

from __future__ import annotations

import statistics
from math import comb
from typing import Any, Sequence

__all__ = ["CONFIDENCE", "median_interval", "paired_ranking"]

CONFIDENCE = 0.95


def median_interval(values: Sequence[float], *, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The order statistics ``[x_(k), x_(n+1-k)]`` that hold the median with at least ``confidence`` whatever the
    (continuous) distribution: the largest ``k`` with ``2 P(Bin(n, 1/2) <= k - 1) <= 1 - confidence``. None when
    even ``k = 1`` (the smallest and largest value) falls short, i.e. fewer than 6 values at 95 %."""
    xs = sorted(values)
    n, alpha = len(xs), 1.0 - confidence
    k, below = 0, 0.0
    while k < n // 2:
        below += comb(n, k) / 2 ** n  # P(Bin(n, 1/2) <= k)
        if 2 * below > alpha:
            break
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None


def paired_ranking(step_times: Sequence[Sequence[float]], tokens_per_step: Sequence[int], *,
                   reference: int = 0) -> dict[str, Any]:
    """``step_times[c][r]``: candidate ``c``'s step in round ``r``. Returns per candidate the median tokens/s and
    the median (with its interval) of its per-round ratio to ``reference``; the measured best (index), the second,
    the best's lead over the second (median of the per-round ratios, minus 1) and the verdict."""
    rounds = min(len(t) for t in step_times)
    tps = [[tokens / t[r] for r in range(rounds)] for tokens, t in zip(tokens_per_step, step_times)]
    ratios = [[c[r] / tps[reference][r] for r in range(rounds)] for c in tps]
    medians = [statistics.median(r) for r in ratios]
    order = sorted(range(len(tps)), key=lambda c: (-medians[c], c != reference, c))
    best, second = order[0], order[1]
    lead = [tps[best][r] / tps[second][r] for r in range(rounds)]
    interval = median_interval(lead)
    if interval is None:
        verdict = f"noise not measured (fewer than 6 rounds at {CONFIDENCE:.0%})"
    else:
        verdict = "resolved" if interval[0] > 1.0 else "within noise"
    return {"rounds": rounds, "tokens_per_s": [statistics.median(c) for c in tps], "ratio": medians,
            "ratio_interval": [None if c == reference else median_interval(ratios[c]) for c in range(len(tps))],
            "measured_best": best, "second": second, "gap": statistics.median(lead) - 1.0, "lead_interval": interval,
            "ranking": verdict}
