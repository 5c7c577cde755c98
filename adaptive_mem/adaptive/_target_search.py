"""The adaptive loop's policy: binary search on the memory target, what each step recorded, and the loop's
decision state.

``TargetSearch.observe`` returns a :class:`Move` for one measured step: a rescue tightens the target,
a clean step relaxes it toward the budget (MindSpeed's binary search on the memory target), and a
closed interval converges. :class:`SearchState` is what one decision changes: the search, whether it
converged, the plan to apply at the step's end and whether the next step profiles; the deciding rank
broadcasts it to the others (``_ranks.share_decision``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Move", "TargetSearch", "StepRecord", "SearchState"]


class Move(str, enum.Enum):
    TIGHTEN = "tighten"
    """A rescue happened: the plan needs more room than the simulator thought."""
    RELAX = "relax"
    """A clean step with room left: try a faster plan."""
    CONVERGED = "converged"
    """The interval is closed: keep this target."""


@dataclass
class TargetSearch:
    """Binary search on the memory target given to the solver, between ``lo`` (known clean or the
    minimum feasible) and ``hi`` (known to need rescues, or just above the budget)."""

    lo: int
    hi: int
    target: int
    tolerance: int

    def observe(self, *, rescued: bool) -> Move:
        if rescued:
            self.hi = self.target
            if self.hi - self.lo <= self.tolerance:
                self.target = self.lo
                return Move.CONVERGED
        else:
            self.lo = self.target
            if self.hi - self.lo <= self.tolerance:
                return Move.CONVERGED
        self.target = (self.lo + self.hi) // 2
        return Move.TIGHTEN if rescued else Move.RELAX


@dataclass
class StepRecord:
    step: int
    """1-based step index since the loop started."""
    kind: str
    """``warmup`` (plain model, profiling), ``cached`` (plan from the cache applied after it), ``bucket`` (a longer
    sequence bucket's plan applied after it), ``adapt``, ``steady`` (converged)."""
    target: int | None
    """Memory target the step's plan was searched for."""
    peak: int | None
    """Measured peak device bytes of the step (None where the device cannot tell)."""
    seconds: float
    """Forward + backward wall time."""
    rescues: int
    """SwapManager rescues during the step."""
    retries: int
    """Allocator retries during the step."""
    decision: str = ""
    """What the loop decided after the step, and why."""
    local_peak: int | None = None
    """Under ``torch.distributed``: this rank's own peak (``peak`` is the DP group's maximum)."""
    local_rescues: int | None = None
    """Under ``torch.distributed``: this rank's own rescues (``rescues`` is the DP group's maximum)."""


@dataclass
class SearchState:
    """The adaptive loop's decision state, changed by the warm-up and by each step's decision."""

    search: TargetSearch | None = None
    """The binary search on the memory target (None before the first plan of an input shape)."""
    converged_at: int | None = None
    """Step after which the target stopped moving (None while searching)."""
    pending: Any = False
    """The plan to apply at the step's end: False no change, None the plain model, else a ``search.Plan``."""
    needs_profile: bool = False
    """Whether the next step profiles the model (a shape change under a plan, a rescue under a cached plan)."""
    kind: str = "adapt"
    """The current step's :attr:`StepRecord.kind`."""

    @property
    def converged(self) -> bool:
        return self.converged_at is not None

    @property
    def target(self) -> int | None:
        return self.search.target if self.search is not None else None
