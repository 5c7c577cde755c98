"""``adaptive-mem search``: the fastest plan for a profile under a memory budget."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import yaml

from search import Budget, fmt_bytes
from search.planning import fmt_seconds, parse_seq_lens
from profiler import Layout

from adaptive_mem._search import StageResult, check_arguments, search

from ._common import HARDWARE_NAMES, check_output_path, write_text_atomic
from ._layout_args import add_layout_arguments, given_flags
from ._search_layout import report_pipeline
from ._search_throughput import add_throughput_arguments, run_throughput

NAME = "search"
HELP = "search a keep/recompute/swap plan minimising step time under a memory budget"
FORMATS = ("plan", "mindformers", "megatron")

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", nargs="+", help="Profile JSON written by `adaptive-mem profile` (with --maximize "
                        "throughput: several, of one model at different batch sizes; with --seq-lens: at different "
                        "sequence lengths)")
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
    parser.add_argument("--seq-lens", default=None, metavar="LIST",
                        help="a plan per sequence-length bucket, e.g. 512,1024,2048,4096, in one plan file: each "
                             "searched under the same budget on the profile scaled to that length (or, with "
                             "--model, profiled there); optimize and run --plan pick the plan per step from the "
                             "input's length")
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


def _say_if_keep_all_fits(stage: StageResult, args: argparse.Namespace) -> None:
    if not stage.keep_all_fits:
        return
    if stage.budget.total is not None:
        why = f"--budget {args.budget} (its peak {fmt_bytes(stage.keep_all_peak)} <= {fmt_bytes(stage.budget.total)})"
    else:
        why = (f"--activation-budget {args.activation_budget} (its activation peak "
               f"{fmt_bytes(stage.keep_all_activation_peak)})")
    print(f"{stage.where}the keep-all plan already meets {why}: no decisions needed")


def _report_stage(stage: StageResult, args: argparse.Namespace) -> None:
    _say_if_keep_all_fits(stage, args)
    gap = "" if stage.gap is None else f", lower bound {fmt_seconds(stage.lower_bound)}, gap {stage.gap:.3%}"
    if stage.budget.total is not None:
        held = f"(budget {fmt_bytes(stage.budget.total)})"
    else:
        act, keep = stage.activation_peak, stage.keep_all_activation_peak
        held = (f"(activation peak {fmt_bytes(act)} = {act / keep if keep else 0:.3f} of the keep-all "
                f"{fmt_bytes(keep)}; budget {stage.budget.activation_fraction:g})")
    held_by_cache = stage.peak_reserved_bytes  # a CUDA target's: Note: [allocator reserve]
    reserved = "" if held_by_cache is None else f" allocated, {fmt_bytes(held_by_cache)} reserved"
    print(f"{stage.where}peak {fmt_bytes(stage.peak_bytes)}{reserved} {held}, "
          f"step {fmt_seconds(stage.step_time)}, stall {fmt_seconds(stage.stall_time)}, "
          f"{args.solver} solved in {stage.solve_time:.2f} s{gap}")
    if stage.shortfall:
        log.warning("%s%s", stage.where, stage.shortfall)


def _say_bucket(seq_len: int, profile) -> None:
    made = profile.model.get("extrapolated_from_seq_lens")
    how = "a profile at that length" if made is None else f"scaled from {', '.join(map(str, made))}"
    print(f"sequence length {seq_len} ({how}):")


def _run_buckets(args: argparse.Namespace) -> int:
    """``--seq-lens``: a plan per bucket in one plan file (Note: [plan buckets])."""
    if args.maximize is not None:
        raise ValueError(f"--seq-lens={args.seq_lens!r} with --maximize {args.maximize}: expected one of them")
    if args.batch_sizes is not None:
        raise ValueError(f"--batch-sizes={args.batch_sizes!r} with --seq-lens: expected --maximize throughput for "
                         "batch sizes (a plan per length keeps the profile's batch size)")
    if args.format != "plan":
        raise ValueError(f"--format={args.format!r} with --seq-lens: expected plan (one file holding a plan per "
                         "bucket)")
    parse_seq_lens(args.seq_lens)
    check_arguments(solver=args.solver, solver_options={}, pipeline_stages=args.pipeline_stages,
                    micro_batches=args.micro_batches, budget=args.budget, activation_budget=args.activation_budget)
    Budget.parse(budget=args.budget, activation_budget=args.activation_budget)
    check_output_path(args.output, flag="--output")
    result = search(args.profile, budget=args.budget, activation_budget=args.activation_budget, solver=args.solver,
                    hardware=args.hardware, progress=True, on_stage=lambda stage: _report_stage(stage, args),
                    seq_lens=args.seq_lens, model=args.model, model_args=args.model_args, on_bucket=_say_bucket,
                    **given_flags(args))
    _write(result.plan, "plan", args.output, result.profile.num_layers)
    lengths = ",".join(str(s) for s, _ in result.buckets)
    print(f"wrote {args.output} (plan, {len(result.buckets)} buckets: sequence lengths {lengths})")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.seq_lens is not None:
        return _run_buckets(args)
    if args.maximize is not None:
        return run_throughput(args, write=_write)
    if args.batch_sizes is not None:
        raise ValueError(f"--batch-sizes={args.batch_sizes!r} without --maximize throughput: expected both")
    for value, flag in ((args.model, "--model"), (args.model_args, "--model-args")):
        if value is not None:
            raise ValueError(f"{flag}={value!r} without --maximize throughput or --seq-lens: expected one of them")
    if len(args.profile) > 1:
        raise ValueError(f"profile={' '.join(args.profile)!r}: {len(args.profile)} profiles; expected one "
                         "(several only with --maximize throughput)")
    if args.format not in FORMATS:
        raise ValueError(f"--format={args.format!r}: expected one of {', '.join(FORMATS)}")
    check_arguments(solver=args.solver, solver_options={}, pipeline_stages=args.pipeline_stages,
                    micro_batches=args.micro_batches, budget=args.budget, activation_budget=args.activation_budget)
    Budget.parse(budget=args.budget, activation_budget=args.activation_budget)  # --budget takes no percentage
    check_output_path(args.output, flag="--output")
    result = search(args.profile[0], budget=args.budget, activation_budget=args.activation_budget,
                    solver=args.solver, hardware=args.hardware, progress=True,
                    on_stage=lambda stage: _report_stage(stage, args), **given_flags(args))
    if result.ranks:
        report_pipeline(result)
    plan = result.plan
    _write(plan, args.format, args.output, result.profile.num_layers, result.layout)
    print(f"wrote {args.output} ({args.format}, {len(plan.decisions)} decisions)")
    return 0
