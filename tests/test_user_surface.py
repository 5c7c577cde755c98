"""Freezes the user surface: subcommands and their flags, the training-script flags, the public names of the
three packages and the plan file's keys.

Changing any of them is a user-visible change: update these tables on purpose.
"""

from __future__ import annotations

import argparse
import importlib

import pytest

from adaptive_mem.cli._main import build_parser

COMMON = {"--debug", "--log-level", "-h", "--help"}

# subcommand -> its flags (option strings, without the common ones); positionals as "<name>".
EXPECTED: dict[str, set[str]] = {
    "profile": {"--model", "--model-args", "--batch-size", "--seq-len", "--dtype", "--device", "--hardware",
                "--optimizer", "--precision", "-o", "--output", "--calibrate", "--compile", "--compile-layout", "--top",
                "--tensor-parallel", "--pipeline-stages", "--virtual-pipeline-stages", "--data-parallel",
                "--micro-batches", "--sequence-parallel", "--zero", "--schedule"},
    "demo": {"--out", "--model", "--compile-backend", "--throughput"},
    "explain": {"--model", "--model-args", "--config", "--recompute-activations", "--recompute-granularity",
                "--recompute-method", "--recompute-num-layers", "--distribute-saved-activations"},
    "units": {"--model", "--model-args", "--profile"},
    "search": {"<profile>", "--hardware", "--budget", "--activation-budget", "--solver", "--pipeline-stages",
               "--micro-batches", "-o", "--output", "--format", "--maximize", "--batch-sizes", "--model",
               "--model-args", "--tensor-parallel", "--virtual-pipeline-stages", "--data-parallel",
               "--sequence-parallel", "--zero", "--schedule", "--seq-lens"},
    "simulate": {"<profile>", "--hardware", "<plan>", "--timeline"},
    "estimate": {"--model", "--model-args", "--hardware", "--gpus", "--precision", "--batch-size", "--seq-len",
                 "--ac", "--solver", "--json", "--compile", "--tensor-parallel", "--pipeline-stages", "--virtual-pipeline-stages",
                 "--data-parallel", "--micro-batches", "--sequence-parallel", "--zero", "--schedule"},
    "pareto": {"<profile>", "--hardware", "--solvers", "--points", "-o", "--output"},
    "run": {"--model", "--model-args", "--batch-size", "--seq-len", "--dtype", "--device", "--plan", "--config",
            "--steps", "--seed", "--optimizer", "--lr", "--device-memory-cap", "--host-store",
            "--adaptive-memory-optimization", "--memory-budget", "--memory-plan", "--memory-plan-cache",
            "--adaptive-batch-size", "--seq-len-buckets", "--max-seq-len", "--host-memory-budget", "--compile",
            "--nproc", "--parallel", "--micro-batches"},
    "bench": {"--model", "--model-args", "--batch-size", "--seq-len", "--budgets", "--policies", "--out", "--steps",
              "--warmup", "--repeats", "--match", "--no-match", "--compile-backend", "--threads", "--timeout",
              "--simulate", "--throughput", "--paired-rounds", "--simulate-only"},
}


def _surface() -> dict[str, set[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    surface = {}
    for name, child in sub.choices.items():
        flags = set()
        for action in child._actions:
            if action.option_strings:
                flags.update(action.option_strings)
            else:
                flags.add(f"<{action.dest}>")
        surface[name] = flags - COMMON
    return surface


def test_subcommands_are_frozen():
    assert set(_surface()) == set(EXPECTED)


def test_flags_are_frozen():
    surface = _surface()
    for name, flags in EXPECTED.items():
        assert surface[name] == flags, name


# flags ``adaptive_mem.add_arguments(parser)`` adds to a training script
SCRIPT_FLAGS = {"--adaptive-memory-optimization", "--memory-budget", "--memory-plan", "--memory-plan-cache",
                "--adaptive-batch-size", "--seq-len-buckets", "--max-seq-len", "--host-memory-budget", "--compile", "--recompute-activations",
                "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                "--distribute-saved-activations"}

PUBLIC = {
    "adaptive_mem": {
        "__version__", "AC_MODES", "AdaptiveBudgetError", "AdaptiveMemory", "ConfigError", "DeviceMemory", "ModelBundle",
        "EstimateError", "EstimateResult", "estimate",
        "ModelSpecError", "OomHook", "OptimizeArgumentError", "OptimizeHandle", "Plan", "PlanCache", "PlanSummary",
        "Profile", "RetryOnOom", "SearchResult", "StageResult", "SwapExhaustedError", "SwapManager",
        "ThroughputSearchResult", "ac_plan", "adapt_mem_func_wrapper", "adaptive_optimize", "add_arguments",
        "add_memory_arguments", "apply_arguments", "build_model", "calibrate", "maximize_throughput", "optimize",
        "plan_from_config", "plan_to_megatron", "plan_to_mindformers", "profile_step", "search", "simulate",
        "wrap_function"},
    "profiler": {
        "CUDA_HARDWARE", "CompileBackendError", "HARDWARE", "HardwareError", "HardwareSpec", "Layout", "LayoutError", "OPTIMIZERS",
        "OpRecord", "PRECISIONS", "PROFILE_FORMAT", "PROFILE_VERSION", "Precision", "PrecisionError", "Profile",
        "ProfileError", "SCHEDULES", "StaticMemory",
        "UnitRecord", "format_summary", "hardware_spec", "is_cuda_hardware", "machinery_scope", "measure_cpu", "measure_device",
        "measure_disk", "measure_link", "profile_compiled", "profile_step", "shard_profile", "compiled_estimate"},
    "search": {
        "Action", "BatchSizesError", "Budget", "BudgetError", "Decision", "DeviceMemoryError",
        "InfeasibleBudgetError", "MachineryCalls", "PLAN_FORMAT", "PLAN_VERSION", "Plan", "PlanError", "PredictedCost",
        "Problem", "ScalingCheck", "SeqLenBucketError", "Simulation", "SolveResult", "Solver", "SolverStats",
        "StepModel", "ThroughputResult", "ThroughputRow", "UnknownSolverError", "fmt_bytes", "get_solver",
        "machinery_calls", "maximize_throughput",
        "merge_plans", "minimum_budget", "parse_bytes", "profile_for_batch", "register_solver", "scale_profile",
        "scale_to_seq_len", "scaling_error", "seq_len_bucket", "simulate", "solver_names"},
}

# a plan file's keys, and one decision's
PLAN_KEYS = ["format", "version", "fingerprint", "model", "decisions", "groups", "distribute_saved_activations",
             "meta"]
DECISION_KEYS = {"action", "backward_prefetch"}
# a plan per sequence-length bucket (``search --seq-lens``): the plan's keys, then its buckets, each {seq_len, plan}
BUCKET_KEYS = {"seq_len", "plan"}


def test_script_flags_are_frozen():
    import adaptive_mem

    parser = argparse.ArgumentParser()
    adaptive_mem.add_arguments(parser)
    assert {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"} == SCRIPT_FLAGS


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_are_frozen(package):
    module = importlib.import_module(package)
    assert set(module.__all__) == PUBLIC[package]
    assert len(module.__all__) == len(set(module.__all__))
    assert all(hasattr(module, name) for name in module.__all__)


def test_plan_keys_are_frozen():
    from search import Action, Decision, Plan

    data = Plan(decisions={"layers.0": Decision(Action.SWAP)}).to_dict()
    assert list(data) == PLAN_KEYS
    assert set(data["decisions"]["layers.0"]) == DECISION_KEYS


def test_bucket_plan_keys_are_frozen():
    from search import Plan
    from search.planning import bucketed_plan

    data = bucketed_plan({16: Plan(model={"seq_len": 16}), 32: Plan(model={"seq_len": 32})}).to_dict()
    assert list(data) == PLAN_KEYS + ["buckets"]
    assert all(set(b) == BUCKET_KEYS and list(b["plan"]) == PLAN_KEYS for b in data["buckets"])
