"""The MindSpeed seed table in simulation: gpt-175B cut to 8 layers on 8 Ascend 910B, three layouts.

    python benchmarks/bench_parallel_sim.py [--budget 64GiB] [--solver milp]

SIMULATION, not a measurement: each layout's rank is fake-profiled on the meta device (a GPT-like
reference Llama: hidden 12288, 96 heads, MLP 32768 = 12 h^2 parameters per layer like GPT's 4h
GeLU MLP, vocab 50257, seq 8192, bf16, Adam) with times estimated for the ``ascend-910b`` hardware
entry, cut to one rank (``profiler.shard_profile``: TP, sequence parallel, TP all-reduces on HCCS)
and split into pipeline stages/chunks with the schedule's in-flight micro-batches. For each layout it
prints our plan's predicted step time against Megatron full recompute with the seed's
``--recompute-method block --recompute-num-layers N`` (first N layers of every chunk) under the
same model, and the gain next to the seed's measured TFLOPs gain (TFLOPs ~ 1 / step time).
Sequence parallel is assumed on (the seed's table does not say; without it the TP=8 layout's
recompute-3 baseline does not fit 64 GB in this model).
"""

from __future__ import annotations

import argparse
import time

import profiler
from adaptive_mem._model_spec import build_model
from adaptive_mem._search import chunk_budgets
from profiler import Layout
from search import Action, Budget, Decision, Plan, fmt_bytes, get_solver, parse_bytes, simulate
from search.planning import chunk_layers, pipeline_step_time, split_layout
from profiler.tracing import parameter_split

MODEL_ARGS = dict(num_layers=8, hidden_size=12288, intermediate_size=32768, num_heads=96, num_kv_heads=96,
                  vocab_size=50257, max_seq_len=8192)
# (name, layout, micro-batch size, recompute-num-layers, seed gain) from ../shared/seeds/
# mindspeed-adaptive-memory-optimization.zh.txt: gbs / mbs micro-batches per step.
SEED = [
    ("TP8 PP1", Layout(tensor_parallel=8, sequence_parallel=True, micro_batches=40 // 10), 10, 3, 13.68),
    ("TP2 PP4", Layout(tensor_parallel=2, pipeline_stages=4, sequence_parallel=True, micro_batches=9 // 3), 3, 1,
     14.17),
    ("TP2 PP4 VPP2", Layout(tensor_parallel=2, pipeline_stages=4, virtual_pipeline_stages=2, sequence_parallel=True,
                            micro_batches=8 // 2, schedule="interleaved-1f1b"), 2, 1, 14.65),
]


def rank_profile(layout: Layout, batch: int) -> profiler.Profile:
    bundle = build_model("llama2-7b", model_args=MODEL_ARGS, batch_size=batch, seq_len=8192, dtype="bfloat16",
                         device="meta")
    whole = profiler.profile_step(bundle, hardware="ascend-910b", optimizer="adam")
    split = parameter_split(bundle.model, whole.layer_info(), tensor_parallel=layout.tensor_parallel)
    link = profiler.HARDWARE["ascend-910b"].interconnect_bandwidth
    return profiler.shard_profile(whole, layout=layout, split=split, interconnect=link)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="64GiB", help="per-rank device memory (default: the 910B's 64 GiB)")
    parser.add_argument("--solver", default="milp")
    args = parser.parse_args()
    budget = Budget(total=parse_bytes(args.budget))
    print("SIMULATION (fake-tensor profiles, ascend-910b datasheet figures; not measured)")
    print(f"{'layout':<14}{'M':>3}  {'Megatron block':<18}{'its peak':>12}{'step s':>9}  "
          f"{'ours peak':>11}{'step s':>9}  {'gain':>8}  {'seed gain':>9}")
    for name, layout, batch, n, seed in SEED:
        t0 = time.perf_counter()
        profile = rank_profile(layout, batch)
        stages = split_layout(profile, layout=layout)
        base = megatron_block(layout, profile.num_layers, n)
        base_sims = [simulate(st.model, _only(base, st.layers), in_flight=st.in_flight) for st in stages]
        base_step, base_peaks = step_of(stages, base_sims, layout)
        budgets = chunk_budgets(stages, budget, layout)
        ours = [get_solver(args.solver).solve(b.problem(st.model, in_flight=st.in_flight))
                for st, b in zip(stages, budgets)]
        our_sims = [simulate(st.model, r.plan, in_flight=st.in_flight) for st, r in zip(stages, ours)]
        our_step, our_peaks = step_of(stages, our_sims, layout)
        gain = base_step / our_step - 1
        print(f"{name:<14}{layout.micro_batches:>3}  {f'recompute-num-layers {n}':<18}"
              f"{fmt_bytes(max(base_peaks)):>12}{base_step:>9.3f}  {fmt_bytes(max(our_peaks)):>11}{our_step:>9.3f}  "
              f"{gain:>+8.2%}  {seed:>+8.2f}%   ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
