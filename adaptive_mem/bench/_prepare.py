"""Parent-side preparation of bench runs: one profile, plans solved per budget, predictions.

The worker processes never profile or solve: they load the plan file written here, so
the measured run and the prediction are about the same plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profiler import Profile
from search import Budget, Problem, StepModel, get_solver
from search.planning import resolve, simulate_assignment
from search import Action

__all__ = ["PrepareContext", "plan_layers"]

log = logging.getLogger(__name__)

_TIMELINE_POINTS = 400


def _thin(points: list[tuple[float, int]], limit: int = _TIMELINE_POINTS) -> list[list[float]]:
    """At most ``limit`` points, keeping the maximum of each stride (the peak survives)."""
    if len(points) <= limit:
        return [[round(t, 6), int(b)] for t, b in points]
    stride = -(-len(points) // limit)
    out = []
    for k in range(0, len(points), stride):
        chunk = points[k:k + stride]
        t, b = max(chunk, key=lambda p: p[1])
        out.append([round(t, 6), int(b)])
    return out


def plan_layers(model: StepModel, plan: Any) -> list[dict[str, int]]:
    """Per layer: saved bytes kept, recomputed and swapped under ``plan`` (the per-layer map)."""
    asg = resolve(model, plan)
    rows = [{"layer": k, "keep": 0, "recompute": 0, "swap": 0} for k in range(model.num_layers)]
    for unit, action in zip(model.units, asg.actions):
        layer = model.layer_of(unit.position)
        if layer is None:
            continue
        key = {Action.KEEP: "keep", Action.RECOMPUTE: "recompute", Action.SWAP: "swap"}[action]
        rows[layer][key] += unit.saved
    grouped = {p for a, b in asg.groups for p in range(a, b + 1)}
    for row in rows:
        if row["layer"] + 1 in grouped:  # a layer of a checkpointed group keeps nothing of its own
            row["recompute"] += row["keep"]
            row["keep"] = 0
    return rows


@dataclass
class PrepareContext:
    profile: Profile
    """The profile of the benchmarked model (measured in the parent before any run)."""
    out: Path
    """Bench output directory; plans go to ``out/plans``."""
    model: StepModel = field(init=False)
    compiled: "PrepareContext | None" = None
    """The same on the profile of the model compiled per block (for policies with ``compiled_profile``)."""

    def __post_init__(self) -> None:
        self.model = StepModel.build(self.profile)
        (self.out / "plans").mkdir(parents=True, exist_ok=True)

    @property
    def unoptimized_peak(self) -> int:
        return self.budget_bytes(1.0)

    def budget_bytes(self, fraction: float | None) -> int | None:
        if fraction is None:
            return None
        return Budget(activation_fraction=fraction).resolve(self.model)

    def predict(self, solver: str, name: str, *, budget: float | None, limit: int | None = None,
                tag: str | None = None) -> dict[str, Any]:
        """Solve ``solver`` (at the activation ``budget`` fraction, at ``limit`` bytes of peak memory, or
        unconstrained), save its plan, return the predictions."""
        if limit is None and budget is not None:
            problem = Budget(activation_fraction=budget).problem(self.model)
        else:
            problem = Problem(self.model, 1 << 62 if limit is None else limit)
        result = get_solver(solver).solve(problem)
        tag = tag or (name if budget is None else f"{name}-{budget:g}")
        path = self.out / "plans" / f"{tag}.yaml"
        result.plan.save(path)
        sim = simulate_assignment(self.model, result.assignment, record=True)
        assert sim.timeline is not None
        return {"plan": str(path), "predicted_peak_bytes": sim.peak_bytes,
                "predicted_step_time": sim.step_time,
                "timeline_predicted": _thin(sim.timeline.memory),
                "plan_layers": plan_layers(self.model, result.plan)}
