"""``adaptive-mem bench``: memory policies side by side, each run in its own process, with a report."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

NAME = "bench"
HELP = ("run memory policies side by side (ours and PyTorch's own tools), each in its own process, and write "
        "results.json, report.md and PNG plots")

DEFAULT_POLICIES = "none,full,hf-gc,megatron-selective,op-sac,sac-ilp,compile,ours-milp,ours-milp+compile,ours-adaptive"
COMPILE_BACKENDS = ("inductor", "aot_eager")

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-small", metavar="SPEC",
                        help="model spec: preset, hf:<family> or module:factory (default llama-small)")
    parser.add_argument("--model-args", default=None, metavar="K=V,...", help="model config overrides")
    parser.add_argument("--batch-size", type=int, default=None, help="micro-batch size (default: the spec's)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the spec's)")
    parser.add_argument("--budgets", default="0.3,0.5,0.7", metavar="F,F,...",
                        help="activation budgets, fractions in (0, 1] of the unoptimized activation memory "
                             "(default 0.3,0.5,0.7)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, metavar="A,B,...",
                        help=f"comma-separated policies (default {DEFAULT_POLICIES}); policies that do not apply "
                             "to the model (hf-gc on a non-HF model) are reported as skipped")
    parser.add_argument("--out", default="adaptive-mem-bench", metavar="DIR",
                        help="output directory (default ./adaptive-mem-bench)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5, at least 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per run (default 1)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="processes per (policy, budget), interleaved; medians are reported (default 1)")
    parser.add_argument("--match", action=argparse.BooleanOptionalAction, default=True,
                        help="also run ours-milp at each eager competitor's measured peak, so every competitor "
                             "meets a plan of ours at its own memory, and ours-milp+compile at each compile run's "
                             "(default on; needs ours-milp / ours-milp+compile in --policies)")
    parser.add_argument("--compile-backend", default="inductor", metavar="NAME",
                        help="torch.compile backend of the compile and ours-milp+compile runs: inductor (default) "
                             "or aot_eager (the same partitioner, eager kernels: compiles in seconds)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in each run, the same for all (default 1: stable on a shared machine)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take (default 1800)")
    parser.add_argument("--simulate", default=None, metavar="HARDWARE",
                        help="also write the target-hardware report (llama2-7b, llama2-70b; single device and "
                             "pipeline stages) from fake-tensor profiles on HARDWARE, e.g. h100")
    parser.add_argument("--throughput", default=None, metavar="BATCHES",
                        help="also the throughput table at a fixed memory (the plain model's measured peak at "
                             "--batch-size): largest batch among BATCHES (e.g. 1-8) that fits and tokens/s for no "
                             "plan, full recompute, torch.compile with its memory budget, and ours (batch size and "
                             "plan searched together); with --policies '' only this table")
    parser.add_argument("--paired-rounds", type=int, default=None, metavar="N",
                        help="with --throughput: rounds in which ours' three predicted best batches are also timed "
                             "in one process, a step of each per round, to rank them through the noise between "
                             "processes (default 15; 0: only the separate runs)")
    parser.add_argument("--simulate-only", action="store_true",
                        help="only the target-hardware report (needs --simulate); no measured runs")


def parse_budgets(text: str) -> tuple[float, ...]:
    out = []
    for item in str(text).split(","):
        item = item.strip()
        try:
            value = float(item)
        except ValueError:
            value = -1.0
        if not 0 < value <= 1:
            raise ValueError(f"--budgets item {item!r}: expected fractions in (0, 1], e.g. 0.3,0.5,0.7")
        out.append(value)
    return tuple(out)


def _positive(flag: str, value: int, minimum: int = 1) -> int:
    if value < minimum:
        raise ValueError(f"{flag}={value}: expected an integer >= {minimum}")
    return value


def run(args: argparse.Namespace) -> int:
    from adaptive_mem.bench import BenchConfig, run_bench, simulate_targets, write_outputs
    from adaptive_mem.bench._results import RESULTS_FORMAT, RESULTS_VERSION

    budgets, policies, throughput, out = _check_arguments(args)
    command = "adaptive-mem " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else ""
    config = BenchConfig(spec=args.model, budgets=budgets, policies=policies, out=out,
                         model_args=args.model_args, batch_size=args.batch_size, seq_len=args.seq_len,
                         steps=args.steps, warmup=args.warmup, repeats=args.repeats, threads=args.threads,
                         timeout=args.timeout, match=args.match, command=command,
                         compile_backend=args.compile_backend,
                         paired_rounds=BenchConfig.paired_rounds if args.paired_rounds is None else args.paired_rounds)
    if policies and not args.simulate_only:
        results = run_bench(config)
    else:
        results = {"format": RESULTS_FORMAT, "version": RESULTS_VERSION, "command": command, "runs": [],
                   "model": {}, "machine": {}, "settings": {}, "created": ""}
    if throughput is not None:
        from adaptive_mem.bench._throughput import format_throughput, run_throughput

        results["throughput"] = run_throughput(config, throughput)
        print(format_throughput(results["throughput"]))
    if args.simulate:
        results["simulated"] = simulate_targets(hardware=args.simulate, progress=True)
    paths = write_outputs(results, out)
    _print_summary(results)
    for name, path in paths.items():
        print(f"wrote {path}")
    return 0


def _check_arguments(args: argparse.Namespace):
    """Refuse bad flags before any work: the budgets, policy names, throughput batch sizes and output folder."""
    from adaptive_mem.bench import get_policy

    budgets = parse_budgets(args.budgets)
    if args.compile_backend not in COMPILE_BACKENDS:
        raise ValueError(f"--compile-backend={args.compile_backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    for name in policies:
        get_policy(name)
    throughput = _throughput_sizes(args)
    if not policies and not args.simulate_only and throughput is None:
        raise ValueError(f"--policies={args.policies!r}: expected comma-separated policy names")
    _positive("--steps", args.steps, 5)
    _positive("--warmup", args.warmup)
    _positive("--repeats", args.repeats)
    _positive("--threads", args.threads)
    if args.paired_rounds is not None:
        if throughput is None:
            raise ValueError(f"--paired-rounds={args.paired_rounds} without --throughput: expected both (the rounds "
                             "rank the throughput table's top three)")
        _positive("--paired-rounds", args.paired_rounds, 0)
    if args.simulate_only and not args.simulate:
        raise ValueError("--simulate-only: expected --simulate HARDWARE too (e.g. --simulate h100)")
    if args.simulate:
        import profiler

        profiler.hardware_spec(args.simulate)  # validates the name before any work
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out={args.out!r}: exists and is not a directory")
    return budgets, policies, throughput, out


def _throughput_sizes(args: argparse.Namespace) -> list[int] | None:
    if args.throughput is None:
        return None
    from search.planning import parse_batch_sizes

    throughput = parse_batch_sizes(args.throughput, key="--throughput")
    if args.simulate_only:
        raise ValueError(f"--throughput={args.throughput!r} with --simulate-only: expected one of them "
                         "(the throughput table is measured)")
    return throughput


def _print_summary(results: dict) -> None:
    from adaptive_mem.bench import compare
    from adaptive_mem.bench._results import budget_label

    for r in results["runs"]:
        budget = "" if r["budget"] is None and not r.get("match") else f"@{budget_label(r)}"
        if r["status"] == "ok":
            print(f"{r['policy'] + budget:>24}  peak {r['peak_bytes'] / 2**20:9.1f} MiB  "
                  f"step {r['median_step_time']:.4f} s  {r['tokens_per_s']:9.0f} tok/s")
        else:
            print(f"{r['policy'] + budget:>24}  {r['status']}: {r.get('error', '')}")
    for ours, against, what in (("ours-milp", None, "eager competitors"), ("ours-milp+compile", "compile", "compile")):
        rows = compare(results, ours=ours, against=against) if results["runs"] else []
        if rows:
            verdicts = [r["verdict"] for r in rows]
            print(f"{ours} vs {what} at equal or lower memory: {verdicts.count('pass')} pass, "
                  f"{verdicts.count('fail')} fail, {verdicts.count('no-match')} without a matching run")
