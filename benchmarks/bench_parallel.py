"""Measured parallel runs: DDP and a 2-stage 1F1B pipeline on 2 gloo ranks, our plan against full
recompute at full recompute's measured per-rank peak, and our predicted per-rank (per-stage) peak against the
measured one.

    python benchmarks/bench_parallel.py --model llama-small --micro-batches 4 --steps 6

1. Profile the model on one process (``profiler.profile_step``, Adam): the whole model for DDP (each rank runs
   it on its own batch), one micro-batch for the pipeline, cut into 2 stages with 1F1B's in-flight micro-batches
   (``search.planning.split_layout``).
2. Run full recompute on 2 spawned gloo ranks: each rank's peak device memory (``DeviceMemory``, the counting
   CPU allocator, parameters, gradients and Adam state included) and median step time.
3. Search our plan per rank (DDP) / per stage (pipeline) with the budget = full recompute's measured peak of
   that rank, run it the same way, and compare: step time (ours vs full), measured peak vs the budget, and the
   simulator's predicted peak vs the measured one (target: within 5 %).

DDP runs with ``gradient_as_bucket_view=True``; its rank is simulated with resident gradients (DDP's buckets hold
them all step: measured + the gradient bytes over one process whatever the bucket size). Pipeline stages hold
their gradients over the micro-batches (Note: [accumulated gradients] in ``search/_pipeline.py``). CPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 2


def _bundle(args: argparse.Namespace, batch: int):
    from adaptive_mem import build_model

    extra = {"num_layers": args.layers} if args.layers else None
    return build_model(args.model, seed=0, model_args=extra, batch_size=batch, seq_len=args.seq_len)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _measure(step, params: list[nn.Parameter], steps: int) -> dict[str, Any]:
    from adaptive_mem import DeviceMemory

    opt = torch.optim.Adam(params, lr=1e-4)
    times = []
    with DeviceMemory() as mem:
        for i in range(steps):
            if i == 2:  # steady state: step 0 creates the Adam state, DDP rebuilds its buckets after step 1
                mem.reset_peak()
            dist.barrier()
            start = time.perf_counter()
            step(i)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    return {"peak": mem.peak, "step_time": statistics.median(times[2:] if len(times) > 2 else times)}


def _ddp_run(rank: int, args: argparse.Namespace, plan: Any) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from adaptive_mem import optimize

    b = _bundle(args, args.batch_size)
    batches = [b.batch(seed=100 * rank + i) for i in range(args.steps)]
    handle = optimize(b.model, plan=plan)
    ddp = DistributedDataParallel(b.model, gradient_as_bucket_view=True)

    def step(i: int) -> None:
        ids, labels = batches[i]
        _loss(ddp(ids), labels).backward()
    try:
        return _measure(step, list(ddp.parameters()), args.steps)
    finally:
        handle.remove()


def _pp_run(rank: int, args: argparse.Namespace, plan: Any) -> dict[str, Any]:
    from torch.distributed import pipelining

    from adaptive_mem import optimize

    b = _bundle(args, args.batch_size * args.micro_batches)
    # one step's batch at a time, as a data loader gives it (the prediction counts one: Note: [pipelining buffers])
    shape, vocab = (b.batch_size, b.seq_len + 1), b.vocab_size
    n = len(b.model.layers)
    from adaptive_mem.models._parallelize import Stage

    module = Stage(b.model, *((0, n // 2) if rank == 0 else (n // 2, n)))
    del b  # the rest of the model is not this rank's: it must not count in the rank's memory
    handle = optimize(module, plan=plan)
    stage = pipelining.PipelineStage(module, rank, WORLD, torch.device("cpu"))
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=_loss)

    def step(i: int) -> None:
        tokens = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(i))
        ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        del tokens
        if rank == 0:
            schedule.step(ids, return_outputs=False)
        else:
            schedule.step(target=labels, losses=[], return_outputs=False)
    try:
        return _measure(step, list(module.parameters()), args.steps)
    finally:
        handle.remove()


def _rank(rank: int, port: int, args: argparse.Namespace, plans: dict, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    results: dict[str, Any] = {}
    try:
        for name in ("full", "ours"):
            results[f"ddp-{name}"] = _ddp_run(rank, args, plans["ddp"][name][rank])
            results[f"pp-{name}"] = _pp_run(rank, args, plans["pp"][name][rank])
        torch.save(results, f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(args: argparse.Namespace, plans: dict) -> list[dict]:
    out = tempfile.mkdtemp(prefix="bench_parallel_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args, plans, out), nprocs=WORLD, join=True)
    return [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _local(plan, lo: int):
    """A stage's plan with its layers renumbered from 0 (the stage module's own names)."""
    from search import Plan

    def rename(target: str) -> str:
        head, _, rest = target.partition(".")
        if head == "layers" and rest:
            index, _, tail = rest.partition(".")
            return ".".join(p for p in ("layers", str(int(index) - lo), tail) if p)
        return target
    return Plan(decisions={rename(t): d for t, d in plan.decisions.items()})


def _solve_or(fallback: Any, solver: Any, problem: Any) -> Any:
    """The solver's plan, or ``fallback`` (full recompute) when no plan of its space fits below it."""
    from search import InfeasibleBudgetError

    try:
        return solver.solve(problem).plan
    except InfeasibleBudgetError:
        return fallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--batch-size", type=int, default=2, help="per-rank batch (DDP) and micro-batch (pipeline)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (>= 3: the first 2 warm up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--solver", default="milp")
    parser.add_argument("--swap", action="store_true",
                        help="let the solver swap (off by default: CPU 'device' and host are one memory here)")
    parser.add_argument("--sac-op-overhead", type=float, default=2e-4,
                        help="seconds per aten op of an op-level layer charged by the search (docs/plan-format.md "
                             "Note: [swap compute]: about 0.2 ms measured on this CPU)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    import profiler
    from profiler import Layout
    from search import Action, Budget, Decision, Plan, StepModel, get_solver, simulate
    from search.planning import split_layout

    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    bundle = _bundle(args, args.batch_size)
    args.seq_len = bundle.seq_len
    n = len(bundle.model.layers)
    whole = profiler.profile_step(bundle, optimizer="adam")  # DDP: one rank runs the whole model per batch
    hardware = replace(whole.hardware, sac_op_overhead=args.sac_op_overhead,
                       **({} if args.swap else {"h2d_bandwidth": 1.0, "d2h_bandwidth": 1.0}))
    # DDP's reducer holds every gradient in its buckets for the whole step (measured here: + the gradient bytes,
    # whatever bucket_cap_mb, gradient_as_bucket_view or set_to_none): gradients are resident
    ddp_rank = StepModel.build(whole, hardware=hardware, gradients="persistent")
    layout = Layout(pipeline_stages=WORLD, micro_batches=args.micro_batches, schedule="1f1b")
    stages = split_layout(whole, layout=layout, hardware=hardware)  # the micro-batch is the profiled batch
    full = Plan(decisions={f"layers.{i}": Decision(Action.RECOMPUTE) for i in range(n)})
    stage_full = [Plan(decisions={f"layers.{i}": Decision(Action.RECOMPUTE) for i in st.layers}) for st in stages]
    plans = {"ddp": {"full": [full] * WORLD, "ours": [None] * WORLD},
             "pp": {"full": [_local(p, st.layers.start) for p, st in zip(stage_full, stages)], "ours": [None] * WORLD}}
    print(f"profiled {args.model} ({n} layers, batch {args.batch_size} x seq {args.seq_len}) in "
          f"{time.perf_counter() - t0:.0f} s; running full recompute on {WORLD} gloo ranks", flush=True)
    plans["ddp"]["ours"] = plans["ddp"]["full"]
    plans["pp"]["ours"] = plans["pp"]["full"]
    measured_full = _spawn(args, plans)

    solver = get_solver(args.solver)
    # Full recompute's measured peak, put in the simulator's terms: the simulator knows that plan, so the budget
    # starts at its predicted peak (as the bench's matched rows do). A plan of ours still measured over full's
    # peak (the prediction error differs between plans) is searched again at its budget scaled by full / ours
    # and rerun, at most 3 runs (Note: [matched at no more memory] in adaptive_mem/bench/_runner.py).
    ddp_total = simulate(ddp_rank, full).peak_bytes
    pp_totals = [simulate(st.model, stage_full[r], in_flight=st.in_flight).peak_bytes for r, st in enumerate(stages)]
    for attempt in range(3):
        predicted = {"ddp-full": [], "ddp-ours": [], "pp-full": [], "pp-ours": []}
        ddp_plan = _solve_or(full, solver, Budget(total=ddp_total).problem(ddp_rank))  # DP ranks run one plan
        ours_pp = []
        for r, st in enumerate(stages):
            predicted["ddp-full"].append(simulate(ddp_rank, full).peak_bytes)
            predicted["ddp-ours"].append(simulate(ddp_rank, ddp_plan).peak_bytes)
            plan = _solve_or(stage_full[r], solver, Budget(total=pp_totals[r]).problem(st.model, in_flight=st.in_flight))
            ours_pp.append(plan)
            predicted["pp-full"].append(simulate(st.model, stage_full[r], in_flight=st.in_flight).peak_bytes)
            predicted["pp-ours"].append(simulate(st.model, plan, in_flight=st.in_flight).peak_bytes)
        plans["ddp"]["ours"] = [ddp_plan] * WORLD
        plans["pp"]["ours"] = [_local(p, st.layers.start) for p, st in zip(ours_pp, stages)]
        print("running our plans" + (f" (searched again, {attempt})" if attempt else ""), flush=True)
        measured_ours = _spawn(args, plans)
        over_ddp = max(measured_ours[r]["ddp-ours"]["peak"] / measured_full[r]["ddp-full"]["peak"] for r in range(WORLD))
        over_pp = [measured_ours[r]["pp-ours"]["peak"] / measured_full[r]["pp-full"]["peak"] for r in range(WORLD)]
        if over_ddp <= 1 and all(o <= 1 for o in over_pp):
            break
        ddp_total = int(ddp_total / max(over_ddp, 1.0)) - (over_ddp > 1)
        pp_totals = [int(t / max(o, 1.0)) - (o > 1) for t, o in zip(pp_totals, over_pp)]

    rows = []
    print(f"\n{args.model}: {n} layers, batch {args.batch_size} x seq {args.seq_len}, fp32, CPU, gloo {WORLD} ranks, "
          f"{args.threads} thread(s) each; pipeline: 1F1B, {args.micro_batches} micro-batches")
    print(f"{'layout':<6}{'rank':>5}  {'full peak':>12}{'full s':>9}  {'ours peak':>12}{'predicted':>12}{'err':>8}"
          f"{'ours s':>9}{'speed-up':>10}  plan")
    for kind in ("ddp", "pp"):
        for r in range(WORLD):
            f, o = measured_full[r][f"{kind}-full"], measured_ours[r][f"{kind}-ours"]
            pred = predicted[f"{kind}-ours"][r]
            plan = plans[kind]["ours"][r]
            recomputed = sorted(t for t, d in plan.decisions.items() if d.action is Action.RECOMPUTE)
            row = {"layout": kind, "rank": r, "full_peak": f["peak"], "full_step": f["step_time"],
                   "full_predicted": predicted[f"{kind}-full"][r], "ours_peak": o["peak"], "ours_predicted": pred,
                   "error": pred / o["peak"] - 1, "ours_step": o["step_time"],
                   "speedup": f["step_time"] / o["step_time"] - 1,
                   "decisions": {t: d.action.value for t, d in plan.decisions.items()}}
            rows.append(row)
            print(f"{kind:<6}{r:>5}  {f['peak']:>12,}{f['step_time']:>9.3f}  {o['peak']:>12,}{pred:>12,}"
                  f"{row['error']:>+8.1%}{o['step_time']:>9.3f}{row['speedup']:>+10.1%}  "
                  f"{len(plan.decisions)} decisions, recompute {recomputed[:4]}{' ...' if len(recomputed) > 4 else ''}")
    print("(full recompute predicted vs measured peak: "
          + ", ".join(f"{r['layout']} rank {r['rank']} {r['full_predicted'] / r['full_peak'] - 1:+.1%}" for r in rows)
          + f"; total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
