"""adaptive-mem's own policies in the bench: the ``milp`` plan and the adaptive closed loop."""

from __future__ import annotations

from typing import Any

from ._policy_base import Applied, Policy

__all__ = ["MilpPolicy", "AdaptivePolicy"]

_ADAPTIVE_MAX_WARMUP = 12


class MilpPolicy(Policy):
    name = "ours-milp"
    label = "adaptive-mem: the milp plan (keep/recompute/swap per op) under the budget, searched offline"
    budgeted = True
    eager = False
    ours = True

    def prepare(self, ctx: Any, budget: float | None) -> dict[str, Any]:
        assert budget is not None
        return ctx.predict("milp", self.name, budget=budget)

    def apply(self, bundle, optimizer, job):
        from adaptive_mem._optimize import optimize

        handle = optimize(bundle.model, plan=job["plan"])
        return Applied(bundle, handle.remove, info={"decisions": len(handle.plan.decisions)})


class AdaptivePolicy(Policy):
    name = "ours-adaptive"
    label = "adaptive-mem: adaptive mode (profile, search, adapt the memory target while training)"
    budgeted = True
    eager = False
    ours = True

    def prepare(self, ctx: Any, budget: float | None) -> dict[str, Any]:
        assert budget is not None
        return {"budget_bytes": ctx.budget_bytes(budget)}

    def apply(self, bundle, optimizer, job):
        from adaptive_mem.adaptive._loop import adaptive_optimize

        budget = int(job["budget_bytes"])
        loop = adaptive_optimize(bundle.model, budget=budget, optimizer=optimizer, cache=False)
        steps = {"n": 0}

        def converged() -> bool:
            steps["n"] += 1
            return loop.converged or steps["n"] >= _ADAPTIVE_MAX_WARMUP

        def remove() -> None:
            applied.info.update({"converged": loop.converged, "converged_at": loop.converged_at,
                                 "adaptive_summary": loop.summary()})
            loop.remove()

        applied = Applied(bundle, remove, warmup_until=converged, accounted_warmup=budget)
        return applied
