"""``adaptive-mem pareto``: memory vs step time of several solvers over a budget sweep, as a figure."""

from __future__ import annotations

import argparse

from search import StepModel, solver_names

from ._common import add_profile_arguments, load, positive

NAME = "pareto"
HELP = "plot predicted peak memory vs step time per solver over a sweep of activation budgets"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument("--solvers", default="milp,full,selective,greedy,swap-only", metavar="A,B,...",
                        help="comma-separated solver names (default milp,full,selective,greedy,swap-only)")
    parser.add_argument("--points", default="10", metavar="N",
                        help="activation budgets from 1/N to 1 of the unoptimized activation memory (default 10)")
    parser.add_argument("-o", "--output", required=True, metavar="PNG", help="figure to write")


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

    from adaptive_mem.bench._plots import predicted_pareto
    from adaptive_mem.bench._sweep import sweep

    data = sweep(model, solvers, points, progress=True)

    spec = profile.model.get("spec", "model")
    fig = predicted_pareto(data, title=f"{spec}: predicted step time vs peak memory ({model.hardware.name})")
    fig.savefig(args.output)
    for name, rows in data.items():
        cells = ", ".join(f"{f:.1f}: {t:.4f} s" for f, _, t in rows) or "no budget met"
        print(f"{name:>16}  {cells}")
    print(f"wrote {args.output}")
    return 0
