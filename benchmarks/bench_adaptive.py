"""The adaptive loop vs the offline milp plan vs full recompute, at budgets relative to the unoptimized peak.

For each budget fraction f (device budget = f x the measured peak of a plain step, enforced on CPU by
``DeviceMemory(cap=...)``), side by side in one process on the same model and batches:

* adaptive: ``adaptive_optimize(model, budget=...)`` from the first step; steps until the target stops
  moving, then the median time of ``--steady`` steps;
* offline: profile once (outside the cap), ``milp`` plan for the budget, ``--steady`` steps under the cap;
* full recompute: ``layers: recompute``, ``--steady`` steps under the cap.

Offline and full recompute run with the SwapManager attached too (so a plan whose real peak exceeds the
simulator's runs instead of crashing); their rescues are reported. Finally the cost of one OOM rescue:
a plain step whose allocation in the middle of forward is refused once for ``--rescue-fraction`` of the
step's activation bytes, vs the same step without the fault (medians).

    python benchmarks/bench_adaptive.py --model llama-small --batch-size 4 --steady 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import profiler
from adaptive_mem import DeviceMemory, SwapManager, adaptive_optimize, build_model, optimize
from adaptive_mem.memory._oom import AccountedHook
from search import Plan, Problem, StepModel, get_solver


def _bundle(args):
    return build_model(args.model, seed=0, batch_size=args.batch_size, seq_len=args.seq_len)


def _opt(model):
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def _step(b, opt, seed: int) -> float:
    start = time.perf_counter()
    b.loss(b.batch(seed=seed)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def plain_peak(args) -> tuple[int, float]:
    b = _bundle(args)
    opt = _opt(b.model)
    with DeviceMemory(track_existing=False) as mem:
        mem.track(b.model, opt)
        times = [_step(b, opt, s) for s in range(2)]
    return mem.peak, times[-1]


def run_adaptive(args, budget: int) -> dict:
    b = _bundle(args)
    opt = _opt(b.model)
    out: dict = {}
    with DeviceMemory(cap=budget, track_existing=False) as mem:
        mem.track(b.model, opt)
        with adaptive_optimize(b.model, budget=budget, optimizer=opt, cache=False) as am:
            step = 0
            try:
                while not am.converged and step < args.max_steps:
                    _step(b, opt, step)
                    step += 1
            except ValueError as exc:  # the budget is below what the step needs
                return {"error": str(exc).split(":", 1)[-1].strip()[:300]}
            out["steps_to_convergence"] = am.converged_at
            mem.reset_peak()
            times = [_step(b, opt, step + k) for k in range(args.steady)]
            steady = am.history[-args.steady:]
            out.update(step_time=statistics.median(times), peak=mem.peak, budget=budget,
                       steady_rescues=sum(r.rescues for r in steady), target=am.target,
                       plan=len(am.plan.decisions) if am.plan else 0)
    return out


def run_plan(args, budget: int, plan: Plan) -> dict:
    b = _bundle(args)
    opt = _opt(b.model)
    with optimize(b.model, plan=plan):
        manager = SwapManager(b.model)
        manager.attach()
        hook = AccountedHook(manager.rescue)
        manager.headroom = hook.headroom
        manager.prefetch_reserve = budget // 10
        try:
            with DeviceMemory(cap=budget, track_existing=False) as mem:
                mem.track(b.model, opt)
                hook.begin_step()
                _step(b, opt, 0)  # first step: host pools, selective-checkpoint traces
                mem.reset_peak()
                before = manager.stats.rescues
                times = [_step(b, opt, 1 + k) for k in range(args.steady)]
        except torch.OutOfMemoryError as exc:
            return {"error": str(exc)[:300]}
        finally:
            manager.close()
    return {"step_time": statistics.median(times), "peak": mem.peak, "rescues": manager.stats.rescues - before}


def offline_plan(args, budget: int, model: StepModel) -> Plan:
    return get_solver("milp").solve(Problem(model, budget)).plan


class _RefuseOnce(DeviceMemory):
    def __init__(self, *, fail_at: int, needed: int) -> None:
        super().__init__(track_existing=False)
        self.inject_fault(at=fail_at, needed=needed)


def rescue_cost(args, activation_bytes: int) -> dict:
    b = _bundle(args)
    opt = _opt(b.model)
    manager = SwapManager(b.model)
    manager.attach()
    try:
        counter = _RefuseOnce(fail_at=1 << 62, needed=0)
        with counter:
            counter.track(b.model, opt)
            counter.allocations = 0
            b.loss(b.batch(seed=0)).backward()
        opt.zero_grad(set_to_none=True)
        needed = int(args.rescue_fraction * activation_bytes)
        clean, rescued, freed = [], [], []
        for k in range(args.steady):
            for fault in (False, True):
                mem = _RefuseOnce(fail_at=counter.allocations // 4 if fault else 1 << 62, needed=needed)
                hook = AccountedHook(manager.rescue)
                before = manager.stats.swapped_out_bytes
                with mem:
                    mem.track(b.model, opt)
                    mem.allocations = 0
                    hook.begin_step()
                    t = _step(b, opt, k)
                hook.remove()
                (rescued if fault else clean).append(t)
                if fault:
                    freed.append(manager.stats.swapped_out_bytes - before)
    finally:
        manager.close()
    extra = statistics.median(rescued) - statistics.median(clean)
    return {"clean_step": statistics.median(clean), "rescued_step": statistics.median(rescued),
            "extra_seconds": extra, "swapped_bytes": int(statistics.median(freed))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--budgets", default="0.4,0.6,0.8", help="fractions of the unoptimized peak")
    parser.add_argument("--steady", type=int, default=3, help="timed steps after convergence (median)")
    parser.add_argument("--max-steps", type=int, default=12, help="give up on convergence after this many steps")
    parser.add_argument("--rescue-fraction", type=float, default=0.25)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    peak, plain_time = plain_peak(args)
    print(f"{args.model} batch {args.batch_size or 'default'}: unoptimized peak {peak / 2**20:.1f} MiB, "
          f"plain step {plain_time:.3f} s", flush=True)
    b = _bundle(args)
    prof = profiler.profile_step(b, optimizer=_opt(b.model))
    model = StepModel.build(prof)
    results: dict = {"model": args.model, "batch_size": b.batch_size, "seq_len": b.seq_len, "peak": peak,
                     "plain_step": plain_time, "budgets": {}}
    rows = []
    full = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers": "recompute"}})
    for frac in [float(f) for f in args.budgets.split(",")]:
        budget = int(frac * peak)
        entry = {"adaptive": run_adaptive(args, budget)}
        try:
            entry["offline"] = run_plan(args, budget, offline_plan(args, budget, model))
        except ValueError as exc:
            entry["offline"] = {"error": str(exc)[:300]}
        entry["full_recompute"] = run_plan(args, budget, full)
        results["budgets"][frac] = entry
        rows.append((frac, budget, entry))
        print(json.dumps({frac: entry}, default=str), flush=True)
    cost = rescue_cost(args, model.activation_bytes)
    results["rescue"] = cost

    print("\n| budget | adaptive: steps to converge | adaptive step (s) | offline milp (s) | full recompute (s) "
          "| adaptive / offline | adaptive / full | steady rescues |")
    print("|---|---|---|---|---|---|---|---|")
    for frac, budget, e in rows:
        a, o, f = e["adaptive"], e["offline"], e["full_recompute"]

        def t(x):
            return f"{x['step_time']:.3f}" if "step_time" in x else "infeasible"
        ratio_o = f"{a['step_time'] / o['step_time']:.2f}" if "step_time" in a and "step_time" in o else "-"
        ratio_f = f"{a['step_time'] / f['step_time']:.2f}" if "step_time" in a and "step_time" in f else "-"
        print(f"| {frac:.0%} ({budget / 2**20:.0f} MiB) | {a.get('steps_to_convergence', '-')} | {t(a)} | {t(o)} | "
              f"{t(f)} | {ratio_o} | {ratio_f} | {a.get('steady_rescues', '-')} |")
    print(f"\nOOM rescue: {cost['swapped_bytes'] / 2**20:.1f} MiB swapped out mid-forward costs "
          f"{cost['extra_seconds']:+.3f} s on a {cost['clean_step']:.3f} s step")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
