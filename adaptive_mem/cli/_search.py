"""``adaptive-mem search``: the fastest plan for a profile under a memory budget."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import yaml

from search import Budget, Problem, check_feasible, fmt_bytes, fmt_seconds, get_solver, merge_plans, solver_names

from ._common import add_profile_arguments, check_output_path, load, positive, stages_of, write_text_atomic

NAME = "search"
HELP = "search a keep/recompute/swap plan minimising step time under a memory budget"
FORMATS = ("plan", "mindformers", "megatron")

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", metavar="SIZE",
                        help="peak device memory incl. parameters, gradients, optimizer state (e.g. 40GiB, 80GB)")
    budget.add_argument("--activation-budget", metavar="F",
                        help="fraction of the unoptimized activation memory, in (0, 1] (e.g. 0.5)")
    parser.add_argument("--solver", default="milp", metavar="NAME",
                        help="milp (default), optuna or a baseline: none, full, selective, uniform, block, sqrt, "
                             "greedy, mindformers-swap, swap-only")
    parser.add_argument("--pipeline-stages", default="1", metavar="P", help="pipeline stages (1F1B; default 1)")
    parser.add_argument("--micro-batches", default="1", metavar="M", help="micro-batches per step (default 1)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the plan")
    parser.add_argument("--format", default="plan", metavar="FMT",
                        help="plan (adaptive-mem plan YAML/JSON, default), mindformers (recompute_config + "
                             "swap_config YAML) or megatron (flags)")


def _write(plan, fmt: str, path: str, num_layers: int) -> None:
    if fmt == "plan":
        text = plan.dumps(fmt="json" if Path(path).suffix == ".json" else "yaml")
    else:
        from adaptive_mem.config import plan_to_megatron, plan_to_mindformers
        if fmt == "mindformers":
            text = yaml.safe_dump(plan_to_mindformers(plan, num_layers=num_layers), sort_keys=False)
        else:
            text = " ".join(plan_to_megatron(plan, num_layers=num_layers)) + "\n"
    write_text_atomic(path, text)


def run(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise ValueError(f"--format={args.format!r}: expected one of {', '.join(FORMATS)}")
    if args.solver not in solver_names():
        raise ValueError(f"--solver={args.solver!r}: unknown solver; expected one of {', '.join(solver_names())}")
    stages_n = positive("--pipeline-stages", args.pipeline_stages)
    micro = positive("--micro-batches", args.micro_batches)
    budget = Budget.parse(budget=args.budget, activation_budget=args.activation_budget)
    check_output_path(args.output, flag="--output")
    profile, hardware = load(args)
    stages = stages_of(profile, hardware, stages_n, micro)
    results = []
    for st in stages:
        limit = budget.resolve(st.model, in_flight=st.in_flight)
        check_feasible(st.model, limit, in_flight=st.in_flight)
        result = get_solver(args.solver).solve(Problem(st.model, limit, in_flight=st.in_flight, progress=True))
        results.append(result)
        gap = "" if result.stats.gap is None else \
            f", lower bound {fmt_seconds(result.stats.lower_bound)}, gap {result.stats.gap:.3%}"
        where = f"stage {st.index} ({st.in_flight} micro-batches in flight): " if stages_n > 1 else ""
        print(f"{where}peak {fmt_bytes(result.cost.peak_bytes)} (budget {fmt_bytes(limit)}), "
              f"step {fmt_seconds(result.cost.step_time)}, stall {fmt_seconds(result.cost.stall_time)}, "
              f"{args.solver} solved in {result.stats.solve_time:.2f} s{gap}")
    plan = results[0].plan if stages_n == 1 else merge_plans([r.plan for r in results], stages, micro_batches=micro)
    plan.meta["budget_spec"] = budget.describe()
    _write(plan, args.format, args.output, profile.num_layers)
    print(f"wrote {args.output} ({args.format}, {len(plan.decisions)} decisions)")
    return 0
