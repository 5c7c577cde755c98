"""``adaptive-mem bench``: policies side by side, each in its own process; results, report and plots."""

from ._output import write_outputs
from ._policies import POLICIES, Applied, Policy, PolicyError, get_policy, policy_names
from ._report import compare, compile_landing, render_report
from ._results import ResultsError, load_results, save_results
from ._runner import BenchConfig, run_bench
from ._simulated import DEFAULT_CONFIGS, SimConfig, simulate_targets

__all__ = ["Applied", "BenchConfig", "DEFAULT_CONFIGS", "POLICIES", "Policy", "PolicyError", "ResultsError",
           "SimConfig", "compare", "compile_landing", "get_policy", "load_results", "policy_names", "render_report",
           "run_bench", "save_results", "simulate_targets", "write_outputs"]
