"""``adaptive-mem search --maximize throughput``: the micro-batch size and the plan chosen together
(``adaptive_mem.maximize_throughput``; this module parses its flags and prints its answer)."""

from __future__ import annotations

import argparse
import logging
from typing import Callable

from search import Budget, fmt_bytes, solver_names
from search.planning import fmt_seconds, parse_batch_sizes

from adaptive_mem._throughput import check_model_args, maximize_throughput

from ._common import check_output_path, positive

log = logging.getLogger("adaptive_mem.cli._search")

MAXIMIZE = ("throughput",)


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--maximize", default=None, metavar="WHAT",
                        help="throughput: choose the micro-batch size among --batch-sizes together with the plan, "
                             "for the most tokens per second under --budget (default: the fastest plan at the "
                             "profile's batch size)")
    parser.add_argument("--batch-sizes", default=None, metavar="LIST",
                        help="with --maximize throughput: micro-batch sizes to compare, e.g. 1,2,4,8 or 1-16")
    parser.add_argument("--model", default=None, metavar="SPEC",
                        help="with --maximize throughput (--seq-lens): profile each batch size (sequence length) "
                             "that no PROFILE covers with this model spec, as the profile was made (else those are "
                             "extrapolated from the profiles)")
    parser.add_argument("--model-args", default=None, metavar="K=V,...", help="with --model: the model's overrides")


def run_throughput(args: argparse.Namespace, *, write: Callable[..., None]) -> int:
    if args.maximize not in MAXIMIZE:
        raise ValueError(f"--maximize={args.maximize!r}: expected one of {', '.join(MAXIMIZE)}")
    if args.batch_sizes is None:
        raise ValueError("--maximize throughput without --batch-sizes: expected e.g. --batch-sizes 1,2,4,8 or 1-16")
    parse_batch_sizes(args.batch_sizes)
    if args.activation_budget is not None:
        raise ValueError(f"--activation-budget={args.activation_budget!r} with --maximize throughput: a fraction of "
                         "the keep-all activations differs per batch size; expected --budget SIZE")
    for flag, value in (("--pipeline-stages", args.pipeline_stages), ("--micro-batches", args.micro_batches)):
        if value is not None and positive(flag, value) != 1:
            raise ValueError(f"{flag}={value!r} with --maximize throughput: expected 1 (one stage, one micro-batch)")
    for key in ("tensor_parallel", "virtual_pipeline_stages", "data_parallel", "sequence_parallel", "zero", "schedule"):
        if getattr(args, key, None) is not None:
            raise ValueError(f"--{key.replace('_', '-')}={getattr(args, key)!r} with --maximize throughput: expected "
                             "no parallel layout (throughput mode plans one device)")
    check_model_args(args.model, args.model_args)
    if args.format not in ("plan", "mindformers", "megatron"):
        raise ValueError(f"--format={args.format!r}: expected one of plan, mindformers, megatron")
    if args.solver not in solver_names():
        raise ValueError(f"--solver={args.solver!r}: unknown solver; expected one of {', '.join(solver_names())}")
    Budget.parse(budget=args.budget)
    check_output_path(args.output, flag="--output")
    result = maximize_throughput(args.profile, budget=args.budget, batch_sizes=args.batch_sizes, solver=args.solver,
                                 hardware=args.hardware, model=args.model, model_args=args.model_args,
                                 on_check=lambda check: (print if check.ok else log.warning)(check.describe()))
    table = result.table
    print(f"throughput under --budget {args.budget} ({args.solver}):")
    print(table.table())
    print(f"best: batch size {result.batch_size}, {table.best_row.tokens_per_second:,.1f} {table.unit}, "
          f"step {fmt_seconds(result.step_time)}, peak {fmt_bytes(table.best_row.peak_bytes)} ({table.best_row.source})")
    plan = result.plan
    write(plan, args.format, args.output, next(iter(result.profiles.values())).num_layers)
    print(f"wrote {args.output} ({args.format}, batch size {result.batch_size}, {len(plan.decisions)} decisions)")
    return 0
