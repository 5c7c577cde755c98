"""Throughput mode: the micro-batch size and the plan chosen together, at a fixed device memory.

    python benchmarks/bench_throughput.py [--batch-sizes 1-16] [--dp 1] [--profiles DIR] [--json FILE]

Simulated target: llama2-7b, seq 4096, bf16, fake-tensor profiles with h100 roofline estimates, budget
the h100's 80 GB. Profiles are taken at batch 1 and 2 and checked against batch 4 (Note: [batch
scaling]); other batch sizes are extrapolated from the two nearest. For each batch size:

* no plan: the keep-all step, if its simulated peak fits;
* full recompute (every layer checkpointed), if it fits;
* ours: ``search.maximize_throughput`` (milp) over the batch sizes.

Each baseline is read at its own largest batch that fits. Targets: ours >= 1.15x full recompute's
tokens/s, and ours > no plan's tokens/s. ``--dp N`` shards the Adam state over N data-parallel ranks
(distributed optimizer), as the bench's simulated section does (default 8: unsharded, parameters, gradients
and Adam state of llama2-7b alone do not fit in 80 GB).
(``torch.compile``'s memory-budget partitioner is not modelled by the simulator: it is in the measured
table only.)

Measured target (llama-small seq 512 fp32 on this CPU, memory = the measured peak of batch 2 without a
plan), run on a quiet machine:

    adaptive-mem bench --model llama-small --policies '' --throughput 1-8 --steps 5 --out bench-throughput
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from adaptive_mem.cli._main import main as cli
from profiler import Profile
from search import (InfeasibleBudgetError, Problem, StepModel, fmt_bytes, get_solver, maximize_throughput, profile_for_batch, scaling_error)
from search.planning import parse_batch_sizes

GB = 10**9


def _profile(batch: int, directory: Path) -> Profile:
    path = directory / f"llama2-7b-b{batch}.json"
    if not path.exists():
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli(["profile", "--model", "llama2-7b", "--device", "meta", "--hardware", "h100", "--dtype",
                        "bfloat16", "--seq-len", "4096", "--batch-size", str(batch), "-o", str(path),
                        "--log-level", "WARNING"])
        assert code == 0, f"profiling llama2-7b at batch {batch} failed"
    return Profile.load(path)


def _sharded(profile: Profile, dp: int) -> Profile:
    from adaptive_mem.bench._simulated import _sharded as shard

    return profile if dp == 1 else shard(profile, dp)


def _baseline(profiles: dict[int, Profile], sizes: list[int], solver: str, budget: int) -> list[dict]:
    rows = []
    for b in sizes:
        model = StepModel.build(profile_for_batch(profiles, b))
        try:
            r = get_solver(solver).solve(Problem(model, budget))
        except InfeasibleBudgetError:
            rows.append({"batch_size": b, "fits": False})
            continue
        seq = model.profile.model["seq_len"]
        rows.append({"batch_size": b, "fits": True, "step_time": r.cost.step_time, "peak_bytes": r.cost.peak_bytes,
                     "tokens_per_s": b * seq / r.cost.step_time})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1-16")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel ranks the Adam state is sharded over (default 8)")
    parser.add_argument("--budget", default="80GB", help="device memory (default the h100's 80GB)")
    parser.add_argument("--profiles", default=None, help="directory to keep the fake-tensor profiles in")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    sizes = parse_batch_sizes(args.batch_sizes)
    from search import parse_bytes

    budget = parse_bytes(args.budget)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.profiles or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        profiles = {b: _sharded(_profile(b, directory), args.dp) for b in (1, 2, 4)}
    for check in scaling_error(profiles):
        print(check.describe())
    given = {1: profiles[1], 2: profiles[2]}  # batch 4 only checks the scaling
    print(f"llama2-7b seq 4096 bf16, h100 spec, budget {fmt_bytes(budget)} ({args.budget}), DP={args.dp} "
          f"(Adam state {'sharded' if args.dp > 1 else 'unsharded'}); batch sizes {args.batch_sizes}")
    result = maximize_throughput(profiles=given, batch_sizes=sizes, budget=budget)
    print(result.table())
    figures: dict = {"budget_bytes": budget, "dp": args.dp, "batch_sizes": sizes,
                     "scaling_checks": [c.describe() for c in scaling_error(profiles)]}
    best = {}
    for name, solver in (("no plan", "none"), ("full recompute", "full")):
        rows = _baseline(given, sizes, solver, budget)
        fitting = [r for r in rows if r["fits"]]
        best[name] = max(fitting, key=lambda r: r["batch_size"]) if fitting else None
        figures[name] = rows
    batch, res = result.best
    ours = result.best_row.tokens_per_second
    print(f"\n{'policy':>16}  {'largest batch':>13}  {'tokens/s':>10}  {'peak':>10}")
    for name, row in best.items():
        if row is None:
            print(f"{name:>16}  {'-':>13}  does not fit at any batch size")
        else:
            print(f"{name:>16}  {row['batch_size']:>13}  {row['tokens_per_s']:>10.1f}  {fmt_bytes(row['peak_bytes']):>10}")
    print(f"{'ours':>16}  {batch:>13}  {ours:>10.1f}  {fmt_bytes(result.best_row.peak_bytes):>10}  "
          f"({len(res.plan.decisions)} decisions, {result.best_row.source})")
    full, none = best["full recompute"], best["no plan"]
    ratio_full = ours / full["tokens_per_s"] if full else float("inf")
    ratio_none = ours / none["tokens_per_s"] if none else float("inf")
    ok_full, ok_none = ratio_full >= 1.15, ratio_none > 1.0
    print(f"\ntarget 1: ours / full recompute at its largest batch = {ratio_full:.3f} (>= 1.15: "
          f"{'pass' if ok_full else 'FAIL'})")
    print(f"target 2: ours / no plan at its largest batch = {ratio_none:.3f} (> 1: {'pass' if ok_none else 'FAIL'})")
    figures.update({"ours": {"batch_size": batch, "tokens_per_s": ours, "peak_bytes": result.best_row.peak_bytes,
                             "decisions": len(res.plan.decisions)},
                    "ours_table": [{"batch_size": r.batch_size, "fits": r.fits, "tokens_per_s": r.tokens_per_second,
                                    "step_time": r.step_time, "peak_bytes": r.peak_bytes, "source": r.source}
                                   for r in result.rows],
                    "ratio_full": ratio_full, "ratio_none": ratio_none})
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if ok_full and ok_none else 1


if __name__ == "__main__":
    sys.exit(main())
