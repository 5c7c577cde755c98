"""Freezes the command-line surface: subcommands and their flags.

Changing a flag is a user-visible change: update this table on purpose.
"""

from __future__ import annotations

import argparse

from adaptive_mem.cli._main import build_parser

COMMON = {"--debug", "--log-level", "-h", "--help"}

# subcommand -> its flags (option strings, without the common ones); positionals as "<name>".
EXPECTED: dict[str, set[str]] = {
    "profile": {"--model", "--model-args", "--batch-size", "--seq-len", "--dtype", "--device", "--hardware",
                "--optimizer", "-o", "--output", "--calibrate", "--compile", "--top",
                "--tensor-parallel", "--pipeline-stages", "--virtual-pipeline-stages", "--data-parallel",
                "--micro-batches", "--sequence-parallel", "--zero", "--schedule"},
    "demo": {"--out", "--model", "--compile-backend", "--throughput"},
    "explain": {"--model", "--model-args", "--config", "--recompute-activations", "--recompute-granularity",
                "--recompute-method", "--recompute-num-layers", "--distribute-saved-activations"},
    "units": {"--model", "--model-args", "--profile"},
    "search": {"<profile>", "--hardware", "--budget", "--activation-budget", "--solver", "--pipeline-stages",
               "--micro-batches", "-o", "--output", "--format", "--maximize", "--batch-sizes", "--model",
               "--model-args", "--tensor-parallel", "--virtual-pipeline-stages", "--data-parallel",
               "--sequence-parallel", "--zero", "--schedule"},
    "simulate": {"<profile>", "--hardware", "<plan>", "--timeline"},
    "pareto": {"<profile>", "--hardware", "--solvers", "--points", "-o", "--output"},
    "run": {"--model", "--model-args", "--batch-size", "--seq-len", "--dtype", "--device", "--plan", "--config",
            "--steps", "--seed", "--optimizer", "--lr", "--device-memory-cap", "--host-store",
            "--adaptive-memory-optimization", "--memory-budget", "--memory-plan", "--memory-plan-cache",
            "--adaptive-batch-size", "--host-memory-budget", "--compile", "--nproc", "--parallel",
            "--micro-batches"},
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
