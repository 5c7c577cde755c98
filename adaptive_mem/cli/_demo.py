"""``adaptive-mem demo``: the main job on the embedded default model, end to end.

Profile ``llama-small`` on this CPU, pick a budget halfway between full recompute and keeping
everything (so the plan must trade memory for time), search the ``milp`` plan, apply it and
train, next to no checkpointing, full recompute, ``torch.compile`` alone and the plan searched on the
profile of the model compiled whole, then the whole model compiled (its swaps inside the graph; each in its own
process); ours is also searched and run at full recompute's and at compile's measured peaks. With
``--throughput 1-4``, then the throughput table at the plain model's measured peak (largest batch among those
sizes that fits and tokens/s for no plan, full recompute, compile and ours, batch size and plan searched
together; ``bench._throughput``). Then print a short summary and write the bench report (``report.md``,
``results.json``, PNGs) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import time
from pathlib import Path

import profiler

from adaptive_mem._model_spec import build_model

NAME = "demo"
HELP = ("profile the default model (llama-small) on this CPU, search a plan under a budget that forces a "
        "trade-off, train with it next to no checkpointing and full recompute, print a summary, write the report")

DEFAULT_MODEL = "llama-small"
POLICIES = ("none", "full", "compile", "ours-milp", "ours-milp+compile")
THROUGHPUT_BATCHES = "1-4"  # the help's example: llama-small at batch 2 measures 1 to 4 in about 7 minutes
THROUGHPUT_ROUNDS = 6  # the fewest paired rounds whose median has a 95 % interval

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="adaptive-mem-demo", metavar="DIR",
                        help="directory for the demo's files (default ./adaptive-mem-demo)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=argparse.SUPPRESS)  # tests: a faster model
    parser.add_argument("--compile-backend", default="aot_eager", metavar="NAME",
                        help="torch.compile backend of the compiled runs: aot_eager (default: compiles in seconds) "
                             "or inductor (what a user trains with; minutes of compiling on a busy CPU)")
    parser.add_argument("--throughput", default="", metavar="BATCHES",
                        help=f"also the throughput table at the plain model's measured peak over these batch sizes, "
                             f"e.g. {THROUGHPUT_BATCHES} (about 7 more minutes on 2 cores; default: no table)")


def trade_off_budget(model) -> float:
    """The activation budget whose peak limit lies halfway between full recompute's predicted peak and keeping
    everything (``Budget.resolve``: static memory plus the fraction of the keep-all activation peak)."""
    from search import Budget, Problem, get_solver

    none = get_solver("none").solve(Problem(model, 1 << 62)).cost.peak_bytes
    full = get_solver("full").solve(Problem(model, 1 << 62)).cost.peak_bytes
    target = full + (none - full) // 2
    lo, hi = 0.0, 1.0
    for _ in range(40):  # smallest fraction whose budget reaches the target (resolve is monotonic)
        mid = (lo + hi) / 2
        if Budget(activation_fraction=mid).resolve(model) >= target:
            hi = mid
        else:
            lo = mid
    return round(hi, 4)


def run(args: argparse.Namespace) -> int:
    from search import StepModel

    from adaptive_mem.bench import BenchConfig, run_bench, write_outputs
    from adaptive_mem.adaptive._calibrate import calibrate

    from ._bench import COMPILE_BACKENDS

    if args.compile_backend not in COMPILE_BACKENDS:
        raise ValueError(f"--compile-backend={args.compile_backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")
    batch_sizes = None
    if args.throughput.strip():
        from search.planning import parse_batch_sizes

        batch_sizes = parse_batch_sizes(args.throughput, key="--throughput")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out={args.out!r}: exists and is not a directory")
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the runs: one thread each, stable on a shared machine
    try:
        bundle = build_model(args.model)
        log.info("profiling %s (batch %d x seq %d) on cpu", args.model, bundle.batch_size, bundle.seq_len)
        profile = profiler.profile_step(bundle, optimizer="adam")
        profile = calibrate(bundle, profile)  # Note: [swap compute]
    finally:
        torch.set_num_threads(threads)
    print(profiler.format_summary(profile))
    budget = trade_off_budget(StepModel.build(profile))
    log.info("budget: %.3f of the activation memory (halfway between full recompute and keeping everything)", budget)
    config = BenchConfig(spec=args.model, budgets=(budget,), policies=POLICIES, out=out, steps=5, warmup=1,
                         threads=1, match=True, compile_backend=args.compile_backend,
                         command=f"adaptive-mem demo --out {args.out} --compile-backend {args.compile_backend}"
                                 + (f" --throughput {shlex.quote(args.throughput)}" if batch_sizes else ""))
    results = run_bench(config, profile=profile)
    if batch_sizes is not None:
        from adaptive_mem.bench._throughput import format_throughput, run_throughput

        log.info("throughput table: batch sizes %s at the plain model's measured peak", args.throughput)
        results["throughput"] = run_throughput(dataclasses.replace(config, paired_rounds=THROUGHPUT_ROUNDS),
                                               batch_sizes)
    paths = write_outputs(results, out)
    print()
    print(summary(results, seconds=time.perf_counter() - start))
    if batch_sizes is not None:
        print(format_throughput(results["throughput"]))
    print(f"report: {paths['report']}  (results.json, PNG figures and plans/ next to it)")
    # a matched row no plan of ours reaches is a finding the summary prints, not a failed run
    return 0 if all(r["status"] == "ok" or (r.get("match") and r["status"] == "infeasible")
                    for r in results["runs"]) else 1


def summary(results: dict, *, seconds: float) -> str:
    """The demo's short summary, from the bench results."""
    runs = {r["policy"]: r for r in results["runs"] if not r.get("match")}
    matched = {r["match"]: r for r in results["runs"] if r.get("match")}
    m = results["model"]
    ours, none, full = runs.get("ours-milp"), runs.get("none"), runs.get("full")
    lines = [f"adaptive-mem demo: {m['spec']} (batch {m['batch_size']} x seq {m['seq_len']}, {m['dtype']}), "
             f"{seconds:.0f} s in total"]
    if ours is None or ours["status"] != "ok":
        why = "not run" if ours is None else f"{ours['status']}: {ours.get('error', '')}"
        lines.append(f"  our plan: {why}")
        return "\n".join(lines)
    mib = 2**20
    layers = ours.get("plan_layers") or []
    saved = sum(r["keep"] + r["recompute"] + r["swap"] for r in layers) or 1
    moved = sum(r["recompute"] for r in layers) / saved
    swapped = sum(r["swap"] for r in layers) / saved
    lines.append(f"  budget: {ours['budget']:g} of the activation memory = {ours['budget_bytes'] / mib:.1f} MiB peak; "
                 f"the plan recomputes {moved:.0%} and swaps {swapped:.0%} of the layers' saved activations")
    if none is not None and none["status"] == "ok":
        lines.append(f"  memory saved: peak {ours['peak_bytes'] / mib:.1f} MiB vs {none['peak_bytes'] / mib:.1f} MiB "
                     f"without checkpointing ({1 - ours['peak_bytes'] / none['peak_bytes']:.1%} less)")
    if full is not None and full["status"] == "ok":
        ratio = ours["median_step_time"] / full["median_step_time"]
        lines.append(f"  time vs full recompute: {ours['median_step_time']:.3f} s vs {full['median_step_time']:.3f} s "
                     f"per step ({ratio - 1:+.1%}); full recompute peaks at {full['peak_bytes'] / mib:.1f} MiB")
    lines += _matched_lines(runs, matched)
    if ours.get("predicted_peak_bytes") is not None:
        lines.append(f"  predicted vs measured: peak {ours['predicted_peak_bytes'] / mib:.1f} vs "
                     f"{ours['peak_bytes'] / mib:.1f} MiB ({ours['predicted_peak_bytes'] / ours['peak_bytes'] - 1:+.1%}), "
                     f"step {ours['predicted_step_time']:.3f} vs {ours['median_step_time']:.3f} s")
    return "\n".join(lines)


def _versus(what: str, ours: dict | None, theirs: dict | None, name: str) -> list[str]:
    if theirs is None or theirs["status"] != "ok":
        return []
    if ours is None or ours["status"] != "ok":
        why = "not run" if ours is None else f"{ours['status']}: {ours.get('error', '')}"
        return [f"  {what}: {why}"]
    mib = 2**20
    ratio = ours["median_step_time"] / theirs["median_step_time"]
    over = ours["peak_bytes"] - theirs["peak_bytes"]
    note = f"; {over / mib:.1f} MiB over: {ours['over_match']}" if over > 0 and ours.get("over_match") else ""
    return [f"  {what}: peak {ours['peak_bytes'] / mib:.1f} vs {theirs['peak_bytes'] / mib:.1f} MiB, step "
            f"{ours['median_step_time']:.3f} vs {theirs['median_step_time']:.3f} s ({ratio - 1:+.1%} vs {name}{note})"]


def _matched_lines(runs: dict, matched: dict) -> list[str]:
    """Ours at full recompute's measured memory, and compile alone against ours + compile."""
    lines = _versus("ours at full recompute's memory", matched.get("full"), runs.get("full"), "full recompute")
    compile_run = runs.get("compile")
    if compile_run is not None:
        backend = (compile_run.get("info") or {}).get("backend", "")
        label = f"compile@{compile_run['budget']:g}"
        lines += _versus(f"ours + compile ({backend}) at compile's memory", matched.get(label), compile_run,
                         "compile alone")
        lines += _versus(f"ours + compile at budget {compile_run['budget']:g}", runs.get("ours-milp+compile"),
                         compile_run, "compile alone")
    return lines
