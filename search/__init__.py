"""Plan search: the Plan type, the step simulator, and the solvers."""

from ._plan import PLAN_FORMAT, PLAN_VERSION, Action, Decision, Plan, PlanError
from ._model import StepModel
from ._timeline import Simulation
from ._simulator import machinery_calls, simulate
from ._machinery import MachineryCalls
from ._solver import InfeasibleBudgetError, PredictedCost, Problem, SolveResult, Solver, SolverStats
from ._registry import UnknownSolverError, get_solver, register_solver, solver_names
from ._budget import Budget, DeviceMemoryError, minimum_budget
from ._sizes import BudgetError, fmt_bytes, parse_bytes
from ._pipeline import merge_plans
from ._scaling import ScalingCheck, profile_for_batch, scale_profile, scaling_error
from ._seq_scaling import SeqLenBucketError, scale_to_seq_len, seq_len_bucket
from ._throughput import BatchSizesError, ThroughputResult, ThroughputRow, maximize_throughput

__all__ = ["Action", "BatchSizesError", "Budget", "BudgetError", "Decision", "DeviceMemoryError",
           "InfeasibleBudgetError", "MachineryCalls", "PLAN_FORMAT", "PLAN_VERSION", "Plan", "PlanError",
           "PredictedCost", "Problem", "ScalingCheck", "SeqLenBucketError", "Simulation", "SolveResult", "Solver",
           "SolverStats", "StepModel", "ThroughputResult", "ThroughputRow", "UnknownSolverError", "fmt_bytes",
           "get_solver", "machinery_calls", "maximize_throughput", "merge_plans", "minimum_budget", "parse_bytes",
           "profile_for_batch", "register_solver", "scale_profile", "scale_to_seq_len", "scaling_error",
           "seq_len_bucket", "simulate", "solver_names"]
