"""adaptive-mem: keep, recompute or swap every activation under a memory budget."""

__version__ = "0.1.0"

from ._model_spec import ModelBundle, ModelSpecError, build_model
from ._flags import add_arguments, add_memory_arguments, apply_arguments
from ._config import ConfigError, plan_from_config, plan_to_megatron, plan_to_mindformers
from ._accounting import DeviceMemory
from ._optimize import OptimizeHandle, optimize
from ._swap_manager import SwapExhaustedError, SwapManager
from ._oom import OomHook, RetryOnOom
from ._plan_cache import PlanCache
from ._adaptive import AdaptiveBudgetError, AdaptiveMemory, adaptive_optimize
from ._calibrate import calibrate

__all__ = ["__version__", "ModelBundle", "ModelSpecError", "build_model",
           "add_arguments", "ConfigError", "plan_from_config", "plan_to_megatron", "plan_to_mindformers",
           "DeviceMemory", "OptimizeHandle", "optimize",
           "add_memory_arguments", "apply_arguments", "SwapManager", "SwapExhaustedError", "OomHook", "RetryOnOom",
           "PlanCache", "AdaptiveBudgetError", "AdaptiveMemory", "adaptive_optimize", "calibrate"]
