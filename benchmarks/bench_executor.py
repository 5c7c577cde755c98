"""Executor overhead and recompute cost, measured side by side on one model.

    python benchmarks/bench_executor.py --model llama-small --repeats 5

For each plan: one warm-up step (it also runs the fake-tensor discovery of
selective layers), then ``--repeats`` timed training steps (forward, backward,
SGD step), interleaved across plans so that machine noise hits all of them
alike; the table gives the median step time, its ratio to the plain model,
and the activation bytes alive at the loss (DeviceMemory, one extra step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaptive_mem import DeviceMemory, build_model, optimize
from search import Plan


def _plan(decisions: dict, groups: list | None = None) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions,
                           "groups": groups or []})


def plans(num_layers: int) -> dict[str, Plan | None]:
    every = range(num_layers)
    return {
        "plain model": None,
        "all keep (machinery only)": _plan({f"layers.{i}": "keep" for i in every}),
        "recompute every layer": _plan({"layers": "recompute"}),
        "recompute every other layer": _plan({f"layers.{i}": "recompute" for i in every if i % 2 == 0}),
        "recompute groups of 2 layers": _plan({"layers": "recompute"},
                                              [[i, i + 1] for i in range(0, num_layers - 1, 2)]),
        "recompute silu + mul (op level)": _plan({f"layers.{i}.feed_forward.{u}": "recompute" for i in every
                                                  for u in ("w1.activation.silu", "mul")}),
        "recompute attention core (op level)": _plan({f"layers.{i}.attention.flash_attention": "recompute"
                                                      for i in every}),
        "swap attention core, prefetch 1": _plan({f"layers.{i}.attention.flash_attention":
                                                  {"action": "swap", "backward_prefetch": 1} for i in every}),
    }


def _step(bundle, batch, opt) -> None:
    loss = bundle.loss(batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _activation_bytes(bundle, batch) -> int:
    with DeviceMemory() as mem:
        base = mem.live
        loss = bundle.loss(batch)
        held = mem.live - base
        del loss
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # One model per plan (same seed, same weights), each optimized once: the timed steps see only the
    # steady state, and interleaving them spreads machine noise evenly.
    first = build_model(args.model, seed=0)
    table = plans(first.model.config.num_layers)
    runs = {}
    for name, plan in table.items():
        bundle = first if not runs else build_model(args.model, seed=0)
        handle = optimize(bundle.model, plan=plan) if plan is not None else None
        opt = torch.optim.SGD(bundle.model.parameters(), lr=0.0)  # lr 0: every step sees the same weights
        runs[name] = (bundle, opt, handle)
    batch = first.batch(seed=0)
    times: dict[str, list[float]] = {name: [] for name in table}
    memory: dict[str, int] = {}
    for name, (bundle, opt, _) in runs.items():
        _step(bundle, batch, opt)  # warm-up (selective layers run their fake-tensor discovery here)
        memory[name] = _activation_bytes(bundle, batch)
    for _ in range(args.repeats):
        for name, (bundle, opt, _) in runs.items():
            start = time.perf_counter()
            _step(bundle, batch, opt)
            times[name].append(time.perf_counter() - start)
    for _, _, handle in runs.values():
        if handle is not None:
            handle.remove()
    bundle = first
    plain = statistics.median(times["plain model"])
    print(f"model {args.model}, batch {bundle.batch_size}x{bundle.seq_len}, {args.repeats} interleaved repeats, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| plan | median step (s) | vs plain | activation bytes at the loss | vs plain |")
    print("|---|---|---|---|---|")
    base_mem = memory["plain model"]
    for name in table:
        med = statistics.median(times[name])
        print(f"| {name} | {med:.3f} | {med / plain:.3f} | {memory[name]:,} | {memory[name] / base_mem:.3f} |")


if __name__ == "__main__":
    main()
