"""``adaptive-mem search``: the fastest plan for a profile under a memory budget."""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import replace
from pathlib import Path

import yaml

from search import (Budget, InfeasibleBudgetError, Problem, check_feasible, fmt_bytes, fmt_seconds, get_solver,
                    in_flight, merge_plans, minimum_budget, simulate_assignment, solver_names, split_layout)
from profiler import Layout
from search._budget import DeviceMemoryError, activation_peak, device_capacity, device_shortfall, keep_all

from ._common import HARDWARE_NAMES, check_output_path, load, positive, stages_of, write_text_atomic
from ._layout_args import add_layout_arguments, merge_layout
from ._search_layout import chunk_budgets, report_pipeline
from ._search_throughput import add_throughput_arguments, run_throughput

NAME = "search"
HELP = "search a keep/recompute/swap plan minimising step time under a memory budget"
FORMATS = ("plan", "mindformers", "megatron")

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", nargs="+", help="Profile JSON written by `adaptive-mem profile` (with --maximize "
                        "throughput: several, of one model at different batch sizes)")
    parser.add_argument("--hardware", default=None, metavar="NAME",
                        help=f"link bandwidth from this spec instead of the profile's: {', '.join(HARDWARE_NAMES)}")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", metavar="SIZE",
                        help="peak device memory incl. parameters, gradients, optimizer state (e.g. 40GiB, 80GB)")
    budget.add_argument("--activation-budget", metavar="F",
                        help="fraction, in (0, 1], of the unoptimized step's activation peak (the most activation "
                             "bytes on the device at once) that the plan may hold at its own (e.g. 0.5)")
    parser.add_argument("--solver", default="milp", metavar="NAME",
                        help="milp (default), optuna or a baseline: none, full, selective, uniform, block, sqrt, "
                             "greedy, mindformers-swap, swap-only")
    parser.add_argument("--pipeline-stages", default=None, metavar="P",
                        help="pipeline stages (default: the profile's layout, else 1)")
    parser.add_argument("--micro-batches", default=None, metavar="M",
                        help="micro-batches per step (default: the profile's layout, else 1)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the plan")
    parser.add_argument("--format", default="plan", metavar="FMT",
                        help="plan (adaptive-mem plan YAML/JSON, default), mindformers (recompute_config + "
                             "swap_config YAML) or megatron (flags)")
    add_throughput_arguments(parser)
    add_layout_arguments(parser, skip=("--pipeline-stages", "--micro-batches"))


def _write(plan, fmt: str, path: str, num_layers: int, layout: Layout | None = None) -> None:
    if fmt == "plan":
        text = plan.dumps(fmt="json" if Path(path).suffix == ".json" else "yaml")
    elif layout is not None and layout != Layout():
        from adaptive_mem.config import plan_to_megatron_stages, plan_to_mindformers_stages
        stages = {"num_layers": num_layers, "pipeline_stages": layout.pipeline_stages,
                  "interleave": layout.virtual_pipeline_stages}
        if fmt == "mindformers":
            text = yaml.safe_dump(plan_to_mindformers_stages(plan, **stages), sort_keys=False)
        else:
            text = " ".join(plan_to_megatron_stages(plan, **stages, tensor_parallel=layout.tensor_parallel,
                                                    sequence_parallel=layout.sequence_parallel)) + "\n"
    else:
        from adaptive_mem.config import plan_to_megatron, plan_to_mindformers
        if fmt == "mindformers":
            text = yaml.safe_dump(plan_to_mindformers(plan, num_layers=num_layers), sort_keys=False)
        else:
            text = " ".join(plan_to_megatron(plan, num_layers=num_layers)) + "\n"
    write_text_atomic(path, text)


def _static(model) -> int:
    return model.static_bytes


def _check_device(model, budget: Budget, text: str | None, where: str) -> None:
    """Refuse a step whose static memory, or a ``--budget`` that exceeds the named device's memory."""
    shortfall = device_shortfall(model.hardware, static=_static(model))
    if shortfall:
        raise DeviceMemoryError(f"{where}{shortfall}")
    cap = device_capacity(model.hardware)
    if cap is not None and budget.total is not None and budget.total > cap:
        raise DeviceMemoryError(f"--budget={text!r}: {fmt_bytes(budget.total)} is more than the {model.hardware.name}'s "
                                f"{fmt_bytes(cap)} of device memory; expected at most {cap >> 20}MiB, or --hardware "
                                "naming the device the plan is for")


def _check_feasible(problem: Problem, budget: Budget, text: str | None, keep: int, where: str) -> None:
    """``check_feasible``; for a fraction, the error names the smallest feasible fraction."""
    try:
        check_feasible(problem.model, problem.budget, in_flight=problem.in_flight)
    except InfeasibleBudgetError as exc:
        if budget.total is not None:
            raise InfeasibleBudgetError(f"{where}{exc}") from None
        minimum, what = minimum_budget(problem.model, in_flight=problem.in_flight)
        least = math.ceil((minimum - problem.model.base) / keep * 1000) / 1000
        raise InfeasibleBudgetError(f"{where}--activation-budget={text!r}: below the minimum feasible {least:g} of the "
                                    f"keep-all activation peak {fmt_bytes(keep)}: {what}") from None


def _say_if_keep_all_fits(problem: Problem, budget: Budget, args: argparse.Namespace, where: str) -> None:
    sim = simulate_assignment(problem.model, keep_all(problem.model), in_flight=problem.in_flight)
    if sim.peak_bytes > problem.budget:
        return
    if budget.total is not None:
        why = f"--budget {args.budget} (its peak {fmt_bytes(sim.peak_bytes)} <= {fmt_bytes(budget.total)})"
    else:
        why = f"--activation-budget {args.activation_budget} (its activation peak {fmt_bytes(sim.activation_peak)})"
    print(f"{where}the keep-all plan already meets {why}: no decisions needed")


def run(args: argparse.Namespace) -> int:
    if args.maximize is not None:
        return run_throughput(args, write=_write)
    for value, flag in ((args.batch_sizes, "--batch-sizes"), (args.model, "--model"), (args.model_args, "--model-args")):
        if value is not None:
            raise ValueError(f"{flag}={value!r} without --maximize throughput: expected both")
    if len(args.profile) > 1:
        raise ValueError(f"profile={' '.join(args.profile)!r}: {len(args.profile)} profiles; expected one "
                         "(several only with --maximize throughput)")
    args.profile = args.profile[0]
    if args.format not in FORMATS:
        raise ValueError(f"--format={args.format!r}: expected one of {', '.join(FORMATS)}")
    if args.solver not in solver_names():
        raise ValueError(f"--solver={args.solver!r}: unknown solver; expected one of {', '.join(solver_names())}")
    positive("--pipeline-stages", args.pipeline_stages)
    positive("--micro-batches", args.micro_batches)
    budget = Budget.parse(budget=args.budget, activation_budget=args.activation_budget)
    check_output_path(args.output, flag="--output")
    profile, hardware = load(args)
    layout = merge_layout(profile.model.get("layout"), args)
    micro = layout.micro_batches
    if layout.chunks == 1:
        stages = [replace(stages_of(profile, hardware, 1, micro)[0], in_flight=in_flight(layout)[0][0])]
    else:
        stages = split_layout(profile, layout=layout, hardware=hardware)
    budgets = chunk_budgets(stages, budget, layout)
    results = []
    for st, stage_budget in zip(stages, budgets):
        chunk = f", chunk {st.chunk}" if layout.virtual_pipeline_stages > 1 else ""
        where = f"stage {st.index}{chunk} ({st.in_flight} micro-batches in flight): " if layout.chunks > 1 else ""
        _check_device(st.model, stage_budget, args.budget, where)
        problem = stage_budget.problem(st.model, in_flight=st.in_flight, progress=True)
        keep = activation_peak(st.model, keep_all(st.model), in_flight=st.in_flight)
        _check_feasible(problem, stage_budget, args.activation_budget, keep, where)
        _say_if_keep_all_fits(problem, stage_budget, args, where)
        result = get_solver(args.solver).solve(problem)
        results.append(result)
        sim = simulate_assignment(st.model, result.assignment, in_flight=st.in_flight)
        result.plan.meta["predicted_peak_bytes"] = sim.peak_bytes  # the activation model's is an upper bound
        gap = "" if result.stats.gap is None else \
            f", lower bound {fmt_seconds(result.stats.lower_bound)}, gap {result.stats.gap:.3%}"
        if stage_budget.total is not None:
            held = f"(budget {fmt_bytes(stage_budget.total)})"
        else:
            act = activation_peak(st.model, result.assignment, in_flight=st.in_flight)
            held = (f"(activation peak {fmt_bytes(act)} = {act / keep if keep else 0:.3f} of the keep-all "
                    f"{fmt_bytes(keep)}; budget {budget.activation_fraction:g})")
        print(f"{where}peak {fmt_bytes(sim.peak_bytes)} {held}, "
              f"step {fmt_seconds(result.cost.step_time)}, stall {fmt_seconds(result.cost.stall_time)}, "
              f"{args.solver} solved in {result.stats.solve_time:.2f} s{gap}")
        shortfall = device_shortfall(st.model.hardware, static=_static(st.model), peak=sim.peak_bytes)
        if shortfall:
            log.warning("%s%s", where, shortfall)
    plan = results[0].plan if layout.chunks == 1 else merge_plans([r.plan for r in results], stages, micro_batches=micro)
    plan.meta["budget_spec"] = budget.describe()
    if layout != Layout():
        plan.meta["layout"] = layout.to_dict()
        report_pipeline(plan, stages, results, layout)
    _write(plan, args.format, args.output, profile.num_layers, layout)
    print(f"wrote {args.output} ({args.format}, {len(plan.decisions)} decisions)")
    return 0
