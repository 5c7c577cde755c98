"""Plan search: the Plan type, the step simulator, and the solvers."""

from ._plan import KEEP, PLAN_FORMAT, PLAN_VERSION, Action, Decision, Plan, PlanError
from ._model import StepModel
from ._timeline import Interval, Simulation, Timeline
from ._simulator import Assignment, resolve, simulate, simulate_assignment
from ._solver import (
    InfeasibleBudgetError,
    PredictedCost,
    Problem,
    SolveResult,
    Solver,
    SolverStats,
    fmt_seconds,
    plan_from_assignment,
)
from ._registry import UnknownSolverError, get_solver, register_solver, solver_names
from ._budget import (
    Budget,
    DeviceMemoryError,
    activation_peak,
    check_feasible,
    minimum_budget,
)
from ._sizes import BudgetError, fmt_bytes, parse_bytes
from ._pipeline import Stage, merge_plans, split_layout, split_stages
from ._schedules import chunk_layers, in_flight, pipeline_step_time
from ._synthetic import SyntheticUnit, random_profile, synthetic_profile
from ._scaling import (ScalingCheck, align_profiles, keep_all_step_time, profile_for_batch, retime_profile,
                       scale_profile, scaling_error)
from ._throughput import BatchSizesError, ThroughputResult, ThroughputRow, maximize_throughput, parse_batch_sizes

__all__ = ["KEEP", "PLAN_FORMAT", "PLAN_VERSION", "Action", "Decision", "Plan", "PlanError",
           "Assignment", "Budget", "BudgetError", "InfeasibleBudgetError", "Interval", "PredictedCost", "Problem",
           "Simulation", "SolveResult", "Solver", "SolverStats", "Stage", "StepModel", "SyntheticUnit", "Timeline",
           "UnknownSolverError", "DeviceMemoryError", "activation_peak", "check_feasible", "fmt_bytes", "fmt_seconds", "get_solver", "merge_plans", "minimum_budget",
           "parse_bytes", "plan_from_assignment", "random_profile", "register_solver", "resolve", "simulate",
           "simulate_assignment", "solver_names", "split_layout", "split_stages", "chunk_layers", "in_flight",
           "pipeline_step_time", "synthetic_profile",
           "BatchSizesError", "ScalingCheck", "ThroughputResult", "ThroughputRow", "maximize_throughput",
           "parse_batch_sizes", "profile_for_batch", "scale_profile", "scaling_error", "align_profiles",
           "keep_all_step_time", "retime_profile"]
