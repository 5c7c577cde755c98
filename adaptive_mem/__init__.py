"""adaptive-mem: keep, recompute or swap every activation under a memory budget."""

from ._version import __version__

from ._model_spec import ModelBundle, ModelSpecError, build_model
from ._flags import add_arguments, add_memory_arguments, apply_arguments
from .config import AC_MODES, ConfigError, ac_plan, plan_from_config, plan_to_megatron, plan_to_mindformers
from adaptive_mem.runtime._accounting import DeviceMemory
from adaptive_mem.runtime._summary import PlanSummary
from adaptive_mem.runtime._functions import adapt_mem_func_wrapper, wrap_function
from ._optimize import OptimizeArgumentError, OptimizeHandle, optimize
from adaptive_mem.memory._swap_manager import SwapExhaustedError, SwapManager
from adaptive_mem.memory._hook import OomHook
from adaptive_mem.memory._oom import RetryOnOom
from adaptive_mem.adaptive._plan_cache import PlanCache
from adaptive_mem.adaptive._loop import AdaptiveBudgetError, AdaptiveMemory, adaptive_optimize
from adaptive_mem.adaptive._calibrate import calibrate
from profiler import Profile, profile_step
from search import Plan, simulate
from ._search import SearchResult, StageResult, search
from ._throughput import ThroughputSearchResult, maximize_throughput
from ._estimate import EstimateError, EstimateResult, estimate

__all__ = ["__version__", "ModelBundle", "ModelSpecError", "build_model",
           "add_arguments", "AC_MODES", "ConfigError", "ac_plan", "plan_from_config", "plan_to_megatron", "plan_to_mindformers",
           "DeviceMemory", "OptimizeArgumentError", "OptimizeHandle", "PlanSummary", "optimize",
           "add_memory_arguments", "apply_arguments", "SwapManager", "SwapExhaustedError", "OomHook", "RetryOnOom",
           "PlanCache", "AdaptiveBudgetError", "AdaptiveMemory", "adaptive_optimize", "calibrate",
           "wrap_function", "adapt_mem_func_wrapper",
           "Plan", "Profile", "profile_step", "search", "SearchResult", "StageResult", "simulate",
           "maximize_throughput", "ThroughputSearchResult",
           "EstimateError", "EstimateResult", "estimate"]
