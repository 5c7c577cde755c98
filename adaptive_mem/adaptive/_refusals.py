"""The adaptive loop's refusals: a budget below what the step needs fails with one line naming the needed
bytes, the budget and the largest unswappable tensor, on every rank of the DP group or on none.

Three checks, each at the first moment it can be told: before any step (what never leaves the device),
when the profiled step runs out of memory with every swappable activation swapped, and after the profile
(the minimum feasible budget of the profiled step, or what it measured past the budget).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from search import fmt_bytes

from ._measure import AdaptiveBudgetError
from ._ranks import RankGroup
from ._wrappers import wrapper_memory

__all__ = ["BudgetRefusals"]


class BudgetRefusals:
    """Refusals of a budget the step of ``model`` cannot run under, measured through ``hook`` and ``manager``."""

    def __init__(self, model: nn.Module, *, hook: Any, manager: Any, ranks: RankGroup) -> None:
        self.model = model
        self.hook = hook
        self.manager = manager
        self.ranks = ranks

    def check_static(self, budget: int) -> None:
        """Parameters, their gradients and what a parallel wrapper surely gathers never leave the device: fail
        before the step if they cannot fit (a lower bound; the profile of the first step measures the rest)."""
        from profiler.tracing import unique_bytes

        params = list(self.model.parameters())
        param_bytes = unique_bytes(params)
        grad_bytes = unique_bytes(p for p in params if p.requires_grad and p.grad is None)
        live = self.hook.live()
        wrapper = wrapper_memory(self.model)
        needed = max(live or 0, param_bytes + wrapper.buckets) + grad_bytes + wrapper.gathered
        needed = self.ranks.reduce_max([needed])[0]  # every DP rank refuses, or none does
        if needed > budget:
            size, what = self.manager.largest_unswappable()
            held = f", {wrapper.what}" if wrapper.what else ""
            raise AdaptiveBudgetError(
                f"--memory-budget={budget}: below the minimum feasible; needed at least {fmt_bytes(needed, exact=True)} "
                f"(live device memory and the gradients to come{held}), budget {fmt_bytes(budget, exact=True)}; "
                f"largest unswappable tensor: {what}, {fmt_bytes(size, exact=True)}")

    def profile_out_of_memory(self, exc: torch.OutOfMemoryError, budget: int) -> AdaptiveBudgetError:
        """The refusal of a profiled step that ran out of memory with every swappable activation on the host."""
        size, what = self.manager.largest_unswappable()
        short = budget + getattr(exc, "needed", 0)
        return AdaptiveBudgetError(
            f"--memory-budget={budget}: below the minimum feasible; needed more than {fmt_bytes(short, exact=True)}: the "
            f"profiled step does not fit even with every swappable activation on the host (largest unswappable "
            f"tensor: {what}, {fmt_bytes(size, exact=True)}): {exc}")

    def check_minimum(self, step_model: Any, budget: int, overshoot: tuple[int, str] | None) -> int:
        """The smallest budget the profiled step runs under (the DP group's largest); refused above ``budget``.
        ``overshoot``: bytes the profiled step went past the budget, and why (None when it stayed within)."""
        from search import minimum_budget

        needed, what = minimum_budget(step_model)
        if overshoot is not None:  # Note: [profile past the budget]: measured, not simulated
            over, largest = overshoot
            needed = budget + over
            what = f"the profiled step went {fmt_bytes(over, exact=True)} past the budget with every swappable activation on the " \
                   f"host; {largest}"
        needed = self.ranks.reduce_max([needed])[0]  # every DP rank refuses, or none does
        if needed > budget:
            raise AdaptiveBudgetError(
                f"--memory-budget={budget}: below the minimum feasible; needed {fmt_bytes(needed, exact=True)}, "
                f"budget {fmt_bytes(budget, exact=True)} ({what})")
        return needed
