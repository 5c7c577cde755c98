"""The adaptive loop's decision after a measured step: move the memory target (a rescue tightens it, a clean
step relaxes it), converge, or reopen a converged search after a rescue; and the warm-up's decision line.

Both work on the loop's :class:`~adaptive_mem.adaptive._target_search.SearchState`, handed to them, and return
the decision's log line.
"""

from __future__ import annotations

from typing import Callable

from search import Plan, fmt_bytes

from ._planner import Planner, describe
from ._target_search import Move, SearchState, StepRecord

__all__ = ["decide", "describe_pending"]


def decide(state: SearchState, planner: Planner, record: StepRecord, *, current: dict, budget: int | None,
           save: Callable[[int, Plan], None]) -> str:
    """Move ``state``'s search on ``record`` (``current``: the decisions of the plan the step ran) and set the plan
    to apply; ``save`` keeps a converged plan. The decision's log line."""
    search = state.search
    assert search is not None
    if state.converged:  # a rescue after convergence: reopen
        closed = _reopen(state, planner, record)
        if closed:
            return closed
    before = search.target
    why = (f"{record.rescues} rescues, {record.retries} allocator retries, peak {fmt_bytes(record.peak or 0, exact=True)}"
           if record.rescues else f"no rescues, peak {fmt_bytes(record.peak or 0, exact=True)} of budget {fmt_bytes(budget, exact=True)}")
    move = search.observe(rescued=record.rescues > 0)
    # A target whose plan is the one just measured has a known outcome: keep moving.
    while move is not Move.CONVERGED and planner.solve(search.target).decisions == current:
        move = search.observe(rescued=record.rescues > 0)
    if move is Move.CONVERGED:
        state.converged_at = record.step
        plan = planner.solve(search.target)
        if plan.decisions != current:
            state.pending = plan
        save(search.target, plan)
        return (f"{why}: converged at target {fmt_bytes(search.target, exact=True)} after {record.step} steps "
                f"({len(plan.decisions)} decisions)")
    state.pending = planner.solve(search.target)
    verb = "tightening" if move is Move.TIGHTEN else "relaxing"
    return f"{why}: {verb} the target {fmt_bytes(before, exact=True)} -> {fmt_bytes(search.target, exact=True)}; {describe(state.pending)}"


def _reopen(state: SearchState, planner: Planner, record: StepRecord) -> str:
    """Reopen a converged search after a rescue; the decision's line where it cannot go on searching, else ""."""
    search = state.search
    assert search is not None
    state.converged_at = None
    if planner.step_model is None:  # a cached plan: no profile to search with yet
        state.needs_profile = True
        state.pending = None
        return (f"{record.rescues} rescues under the cached plan: profiling again at the next step "
                "(plain model until then)")
    if search.target <= planner.min_needed:
        state.converged_at = record.step
        return (f"{record.rescues} rescues at the most memory-saving target {fmt_bytes(search.target, exact=True)}: "
                "nothing tighter to try; the SwapManager keeps the steps alive")
    search.lo = planner.min_needed
    return ""


def describe_pending(state: SearchState) -> str:
    """The warm-up's decision line: the plan (cached or searched) applied at the step's end ("" for none)."""
    if state.pending is False:
        return ""
    what = "cached " if state.kind == "cached" else ""
    target = f" for target {fmt_bytes(state.target, exact=True)}" if state.target is not None else ""
    lead = "sequence-length bucket" if state.kind == "bucket" else "warm-up done"  # Note: [each bucket its own plan]
    return f"{lead}: applying the {what}{describe(state.pending)}{target}"
