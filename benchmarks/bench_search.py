"""Search figures: milp vs every baseline on llama2-7b, and milp solve time / gap on llama2-70b.

    python benchmarks/bench_search.py [--runs 3] [--profiles DIR]

1. llama2-7b (seq 4096, micro-batch 1, bf16, fake tensors, h100 spec): for activation budgets
   0.1 .. 1.0, the predicted step time of milp and of every baseline that meets the budget
   (so each baseline is compared at equal or lower memory than the budget milp meets).
2. Throughput gain over full recompute at full recompute's memory: budget = full recompute's
   predicted peak; gain = t_full / t_milp - 1 (MindSpeed reports +13.7..14.7 % for its
   adaptive mode; the target is >= +20 %).
3. llama2-70b (80 layers): milp solve time (median of --runs) and gap per budget
   (targets <= 2 s, gap <= 0.5 %).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adaptive_mem.cli._main import main as cli
from profiler import Profile
from search import (Budget, InfeasibleBudgetError, Problem, StepModel, fmt_bytes, get_solver, minimum_budget,
                    solver_names)

BUDGETS = [round(0.1 * k, 1) for k in range(1, 11)]


def _profile(spec: str, directory: Path) -> Profile:
    path = directory / f"{spec}.json"
    if not path.exists():
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli(["profile", "--model", spec, "--device", "meta", "--hardware", "h100", "--dtype", "bfloat16",
                        "--seq-len", "4096", "-o", str(path), "--log-level", "WARNING"])
        assert code == 0, f"profiling {spec} failed"
    return Profile.load(path)


def _solve(name: str, model: StepModel, budget: int | Problem):
    try:
        return get_solver(name).solve(budget if isinstance(budget, Problem) else Problem(model, budget))
    except InfeasibleBudgetError:
        return None


def compare_7b(model: StepModel) -> None:
    names = [n for n in solver_names() if n != "milp"]
    print("\n### llama2-7b: predicted step time (ms) per activation budget; '-' = budget not met\n")
    print("| budget | peak budget | milp | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 3) + "|")
    worst = {}
    for f in BUDGETS:
        problem = Budget(activation_fraction=f).problem(model)
        limit = problem.budget
        best = _solve("milp", model, problem)
        cells = []
        for n in names:
            r = _solve(n, model, problem)
            if r is None:
                cells.append("-")
                continue
            cells.append(f"{r.cost.step_time * 1e3:.1f}")
            if best is not None:
                worst[n] = min(worst.get(n, 9.0), r.cost.step_time / best.cost.step_time)
        milp = "-" if best is None else f"{best.cost.step_time * 1e3:.1f}"
        print(f"| {f:.1f} | {fmt_bytes(limit)} | **{milp}** | " + " | ".join(cells) + " |")
    print("\nsmallest (baseline time / milp time) over the budgets where both meet it: "
          + ", ".join(f"{n} {v:.3f}" for n, v in worst.items()))

    full = get_solver("full").solve(Problem(model, model.base + 10**15))
    at_full = get_solver("milp").solve(Problem(model, full.cost.peak_bytes))
    gain = full.cost.step_time / at_full.cost.step_time - 1
    print(f"\nat full recompute's memory ({fmt_bytes(full.cost.peak_bytes)}): full {full.cost.step_time * 1e3:.1f} ms, "
          f"milp {at_full.cost.step_time * 1e3:.1f} ms (peak {fmt_bytes(at_full.cost.peak_bytes)}, "
          f"stall {at_full.cost.stall_time * 1e3:.2f} ms): throughput gain {gain:+.1%}")


def solve_70b(model: StepModel, runs: int) -> None:
    print(f"\n### llama2-70b ({model.num_layers} layers, "
          f"{len(model.positions[1])} units/layer): milp solve time (median of {runs}) and gap\n")
    # With gradients allocated during backward, the unoptimized peak (start of backward) is below
    # static + 10 % of the activations for 70b; sweep between the minimum feasible peak and the
    # unoptimized peak instead, so every budget needs a plan.
    keep = get_solver("none").solve(Problem(model, model.base + 10**15)).cost.peak_bytes
    low, _ = minimum_budget(model)
    print(f"budgets: minimum feasible {fmt_bytes(low)} + f x (unoptimized peak {fmt_bytes(keep)} - minimum)\n")
    print("| f | budget | step time (ms) | solve time (s) | gap | mode |")
    print("|---|---|---|---|---|---|")
    for f in BUDGETS:
        limit = low + int(f * (keep - low))
        times, result = [], None
        for _ in range(runs):
            start = time.perf_counter()
            result = _solve("milp", model, limit)
            times.append(time.perf_counter() - start)
        if result is None:
            print(f"| {f:.1f} | {fmt_bytes(limit)} | infeasible | {statistics.median(times):.2f} | - | - |")
            continue
        print(f"| {f:.1f} | {fmt_bytes(limit)} | {result.cost.step_time * 1e3:.1f} | {statistics.median(times):.2f} | "
              f"{result.stats.gap:.3%} | {result.stats.extra.get('mode')} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="solves per 70b budget (median)")
    parser.add_argument("--only-70b", action="store_true", help="skip the llama2-7b comparison")
    parser.add_argument("--only-7b", action="store_true", help="skip the llama2-70b solve times")
    parser.add_argument("--gradients", default="per-step", choices=["per-step", "persistent"],
                        help="gradient residency (StepModel.build): per-step (the default) or persistent")
    parser.add_argument("--profiles", default=None, help="directory to cache the fake-tensor profiles in")
    args = parser.parse_args(argv)
    directory = Path(args.profiles or tempfile.mkdtemp(prefix="bench-search-"))
    directory.mkdir(parents=True, exist_ok=True)
    print(f"gradients: {args.gradients}")
    if not args.only_70b:
        compare_7b(StepModel.build(_profile("llama2-7b", directory), gradients=args.gradients))
    if not args.only_7b:
        solve_70b(StepModel.build(_profile("llama2-70b", directory), gradients=args.gradients), args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
