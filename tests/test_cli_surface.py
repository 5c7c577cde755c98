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
                "--optimizer", "-o", "--output", "--top", "--calibrate"},
    "demo": {"--out", "--model"},
    "explain": {"--model", "--model-args", "--config", "--recompute-activations", "--recompute-granularity",
                "--recompute-method", "--recompute-num-layers", "--distribute-saved-activations"},
    "units": {"--model", "--model-args", "--profile"},
    "search": {"<profile>", "--hardware", "--budget", "--activation-budget", "--solver", "--pipeline-stages",
               "--micro-batches", "-o", "--output", "--format"},
    "simulate": {"<profile>", "--hardware", "<plan>", "--timeline"},
    "pareto": {"<profile>", "--hardware", "--solvers", "--points", "-o", "--output"},
    "run": {"--model", "--model-args", "--batch-size", "--seq-len", "--dtype", "--device", "--plan", "--config",
            "--steps", "--seed", "--optimizer", "--lr", "--device-memory-cap", "--host-store",
            "--adaptive-memory-optimization", "--memory-budget", "--memory-plan", "--memory-plan-cache",
            "--host-memory-budget"},
    "bench": {"--model", "--model-args", "--batch-size", "--seq-len", "--budgets", "--policies", "--out", "--steps",
              "--warmup", "--repeats", "--threads", "--timeout", "--simulate", "--simulate-only", "--match",
              "--no-match"},
}

# #17 throughput mode (added flags; the sets above are unchanged)
EXPECTED["search"] = EXPECTED["search"] | {"--maximize", "--batch-sizes", "--model", "--model-args"}
EXPECTED["run"] = EXPECTED["run"] | {"--adaptive-batch-size"}
EXPECTED["bench"] = EXPECTED["bench"] | {"--throughput", "--paired-rounds"}
# #14 compile per block (added flag)
EXPECTED["run"] = EXPECTED["run"] | {"--compile"}
# #14 profile, bench and demo for compiled models (added flags)
EXPECTED["profile"] = EXPECTED["profile"] | {"--compile"}
EXPECTED["bench"] = EXPECTED["bench"] | {"--compile-backend"}
EXPECTED["demo"] = EXPECTED["demo"] | {"--compile-backend"}
# #17 the demo's throughput table (added flag)
EXPECTED["demo"] = EXPECTED["demo"] | {"--throughput"}

# #15 parallel layouts planned without the ranks (profile and search; search already had the two pipeline flags)
LAYOUT = {"--tensor-parallel", "--pipeline-stages", "--virtual-pipeline-stages", "--data-parallel",
          "--sequence-parallel", "--zero", "--micro-batches", "--schedule"}
EXPECTED["profile"] = EXPECTED["profile"] | LAYOUT
EXPECTED["search"] = EXPECTED["search"] | LAYOUT

# #15 parallel runs: run spawns its own ranks (tests/test_parallel_launch.py)
EXPECTED["run"] = EXPECTED["run"] | {"--nproc", "--parallel", "--micro-batches"}


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
