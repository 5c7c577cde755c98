"""The MindSpeed seed table in simulation: gpt-175B cut to 8 layers on 8 Ascend 910B, three layouts.

    python benchmarks/bench_parallel_sim.py [--budget 64GiB] [--solver milp] [--precision megatron-bf16]

SIMULATION, not a measurement: each layout's rank is fake-profiled on the meta device (a GPT-like
reference Llama: hidden 12288, 96 heads, MLP 32768 = 12 h^2 parameters per layer like GPT's 4h
GeLU MLP, vocab 50257, seq 8192, bf16, Adam, fused RMSNorm and SwiGLU as MindSpeed runs them) with times
estimated for the ``ascend-910b`` hardware entry, cut to one rank (``profiler.shard_profile``: TP, sequence
parallel, TP all-reduces on HCCS) and split into pipeline stages/chunks with the schedule's in-flight micro-batches. For each layout it
prints our plan's predicted step time against Megatron full recompute with the seed's
``--recompute-method block --recompute-num-layers N`` (first N layers of every chunk) under the
same model, and the gain next to the seed's measured TFLOPs gain (TFLOPs ~ 1 / step time).
Sequence parallel is assumed on (the seed's table does not say; without it the TP=8 layout's
recompute-3 baseline does not fit 64 GB in this model). ``--precision`` names a precision recipe
(``profiler.PRECISIONS``, e.g. ``megatron-bf16``: MindSpeed runs Megatron's mixed precision); without it the
model's own bf16 dtypes count (bf16 parameters and gradients, fp32 Adam moments).
"""

from __future__ import annotations

import argparse
import time

import profiler
import torch
from adaptive_mem._model_spec import build_model
from adaptive_mem._search import chunk_budgets
from profiler import Layout
from search import (Action, Budget, Decision, InfeasibleBudgetError, Plan, fmt_bytes, get_solver, parse_bytes,
                    simulate)
from search.planning import chunk_layers, pipeline_step_time, split_layout
from profiler.tracing import precision_of, rank_share

# The seed does not list its kernel flags; MindSpeed's example scripts train with --use-fused-rmsnorm and
# --use-fused-swiglu, so the stand-in layer runs fused kernels that save what those save: the norm's input
# and inverse RMS, the SwiGLU's input only (adaptive_mem/models/_fused.py).
MODEL_ARGS = dict(num_layers=8, hidden_size=12288, intermediate_size=32768, num_heads=96, num_kv_heads=96,
                  vocab_size=50257, max_seq_len=8192, fused_norm=True, fused_swiglu=True)
# (name, layout, micro-batch size, recompute-num-layers, seed gain) from ../shared/seeds/
# mindspeed-adaptive-memory-optimization.zh.txt: gbs / mbs micro-batches per step.
SEED = [
    ("TP8 PP1", Layout(tensor_parallel=8, sequence_parallel=True, micro_batches=40 // 10), 10, 3, 13.68),
    ("TP2 PP4", Layout(tensor_parallel=2, pipeline_stages=4, sequence_parallel=True, micro_batches=9 // 3), 3, 1,
     14.17),
    ("TP2 PP4 VPP2", Layout(tensor_parallel=2, pipeline_stages=4, virtual_pipeline_stages=2, sequence_parallel=True,
                            micro_batches=8 // 2, schedule="interleaved-1f1b"), 2, 1, 14.65),
]


def rank_profile(layout: Layout, batch: int, precision: str | None = None) -> profiler.Profile:
    """One rank's fake-tensor profile; ``precision``: a recipe name, or None for the model's own dtypes."""
    recipe = precision_of(precision, key="--precision")
    dtype = recipe.model_dtype if recipe is not None else "bfloat16"
    bundle = build_model("llama2-7b", model_args=MODEL_ARGS, batch_size=batch, seq_len=8192, dtype=dtype,
                         device="meta")
    hardware = profiler.hardware_spec("ascend-910b", dtype=getattr(torch, recipe.compute if recipe else dtype))
    whole = profiler.profile_step(bundle, hardware=hardware, optimizer="adam",
                                  precision=recipe.name if recipe else None)
    return rank_share(whole, bundle.model, layout)  # each group on the link it spans (Note: [group links])


def megatron_block(layout: Layout, num_layers: int, n: int) -> Plan:
    chunks = chunk_layers(num_layers, layout)
    layers = [i for stage in chunks for rng in stage for i in list(rng)[:n]]
    return Plan(decisions={f"layers.{i}": Decision(Action.RECOMPUTE) for i in layers})


def _only(plan: Plan, layers: range) -> Plan:
    return Plan(decisions={t: d for t, d in plan.decisions.items() if int(t.split(".")[1]) in layers})


def step_of(stages, sims, layout: Layout) -> tuple[float, list[int]]:
    per_rank, peaks = [], []
    for s in range(layout.pipeline_stages):
        mine = [(st, sim) for st, sim in zip(stages, sims) if st.index == s]
        per_rank.append(sum(sim.step_time - st.model.other_time for st, sim in mine))
        peaks.append(sum(sim.peak_bytes for _, sim in mine))
    other = stages[0].model.profile.optimizer_time / layout.pipeline_stages
    return pipeline_step_time(per_rank, layout, other=other), peaks


def seed_row(layout: Layout, batch: int, n: int, *, budget: Budget, solver: str = "milp",
             precision: str | None = None) -> dict:
    """One seed layout simulated: Megatron block recompute of ``n`` layers per chunk against our plan under
    ``budget``; peaks are the busiest rank's, ``gain`` = baseline step / our step - 1. Where no plan fits a
    chunk's budget, ``gain`` is None and ``error`` says why."""
    profile = rank_profile(layout, batch, precision)
    stages = split_layout(profile, layout=layout)
    base = megatron_block(layout, profile.num_layers, n)
    base_sims = [simulate(st.model, _only(base, st.layers), in_flight=st.in_flight) for st in stages]
    base_step, base_peaks = step_of(stages, base_sims, layout)
    budgets = chunk_budgets(stages, budget, layout)
    try:
        ours = [get_solver(solver).solve(b.problem(st.model, in_flight=st.in_flight))
                for st, b in zip(stages, budgets)]
    except InfeasibleBudgetError as exc:
        return dict(base_peak=max(base_peaks), base_step=base_step, our_peak=None, our_step=None, gain=None,
                    error=" ".join(str(exc).split()))
    our_sims = [simulate(st.model, r.plan, in_flight=st.in_flight) for st, r in zip(stages, ours)]
    our_step, our_peaks = step_of(stages, our_sims, layout)
    return dict(base_peak=max(base_peaks), base_step=base_step, our_peak=max(our_peaks), our_step=our_step,
                gain=base_step / our_step - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="64GiB", help="per-rank device memory (default: the 910B's 64 GiB)")
    parser.add_argument("--solver", default="milp")
    parser.add_argument("--precision", default=None, help="a precision recipe (default: the model's bf16 dtypes)")
    args = parser.parse_args()
    budget = Budget(total=parse_bytes(args.budget))
    print("SIMULATION (fake-tensor profiles, ascend-910b datasheet figures; not measured)")
    print(f"{'layout':<14}{'M':>3}  {'Megatron block':<18}{'its peak':>12}{'step s':>9}  "
          f"{'ours peak':>11}{'step s':>9}  {'gain':>8}  {'seed gain':>9}")
    for name, layout, batch, n, seed in SEED:
        t0 = time.perf_counter()
        r = seed_row(layout, batch, n, budget=budget, solver=args.solver, precision=args.precision)
        if r["gain"] is None:
            print(f"{name:<14}{layout.micro_batches:>3}  {fmt_bytes(r['base_peak'])} {r['base_step']:.3f} s; "
                  f"ours: {r['error']}")
            continue
        print(f"{name:<14}{layout.micro_batches:>3}  {f'recompute-num-layers {n}':<18}"
              f"{fmt_bytes(r['base_peak']):>12}{r['base_step']:>9.3f}  {fmt_bytes(r['our_peak']):>11}"
              f"{r['our_step']:>9.3f}  {r['gain']:>+8.2%}  {seed:>+8.2f}%   ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
