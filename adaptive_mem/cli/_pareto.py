"""``adaptive-mem pareto``: memory vs step time of several solvers over a budget sweep, as a figure."""

from __future__ import annotations

import argparse
import logging

from search import Budget, InfeasibleBudgetError, Problem, StepModel, get_solver, solver_names

from ._common import add_profile_arguments, load, positive

NAME = "pareto"
HELP = "plot predicted peak memory vs step time per solver over a sweep of activation budgets"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument("--solvers", default="milp,full,selective,greedy,swap-only", metavar="A,B,...",
                        help="comma-separated solver names (default milp,full,selective,greedy,swap-only)")
    parser.add_argument("--points", default="10", metavar="N",
                        help="activation budgets from 1/N to 1 of the unoptimized activation memory (default 10)")
    parser.add_argument("-o", "--output", required=True, metavar="PNG", help="figure to write")


def sweep(model: StepModel, solvers: list[str], points: int, *, progress: bool = False) -> dict[str, list]:
    """solver -> [(fraction, peak bytes, step seconds)] for the budgets it meets."""
    from tqdm import tqdm
    out: dict[str, list] = {name: [] for name in solvers}
    fractions = [k / points for k in range(1, points + 1)]
    with tqdm(total=len(fractions) * len(solvers), desc="pareto", disable=not progress, leave=False) as bar:
        for f in fractions:
            limit = Budget(activation_fraction=f).resolve(model)
            for name in solvers:
                try:
                    r = get_solver(name).solve(Problem(model, limit))
                    out[name].append((f, r.cost.peak_bytes, r.cost.step_time))
                except InfeasibleBudgetError as exc:
                    log.debug("%s at %.2f: %s", name, f, exc)
                bar.update(1)
    return out


def run(args: argparse.Namespace) -> int:
    solvers = [s.strip() for s in args.solvers.split(",") if s.strip()]
    known = solver_names()
    for name in solvers:
        if name not in known:
            raise ValueError(f"--solvers: {name!r} is not a solver; expected names from {', '.join(known)}")
    if not solvers:
        raise ValueError(f"--solvers={args.solvers!r}: expected comma-separated names from {', '.join(known)}")
    points = positive("--points", args.points)
    profile, hardware = load(args)
    model = StepModel.build(profile, hardware=hardware)
    data = sweep(model, solvers, points, progress=True)

    from adaptive_mem.bench._plots import predicted_pareto

    spec = profile.model.get("spec", "model")
    fig = predicted_pareto(data, title=f"{spec}: predicted step time vs peak memory ({model.hardware.name})")
    fig.savefig(args.output)
    for name, rows in data.items():
        cells = ", ".join(f"{f:.1f}: {t:.4f} s" for f, _, t in rows) or "no budget met"
        print(f"{name:>16}  {cells}")
    print(f"wrote {args.output}")
    return 0
