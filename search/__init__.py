"""Plan search: the Plan type, the step simulator, and the solvers."""

from ._plan import KEEP, PLAN_FORMAT, PLAN_VERSION, Action, Decision, Plan, PlanError

__all__ = ["KEEP", "PLAN_FORMAT", "PLAN_VERSION", "Action", "Decision", "Plan", "PlanError"]
