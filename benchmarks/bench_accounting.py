"""What device-memory accounting and the plan machinery cost on CPU, and how well a small step is predicted.

    python benchmarks/bench_accounting.py                 # the accounting targets (minutes on one thread)
    python benchmarks/bench_accounting.py --repeats 3 --quick

One torch thread. Each case alternates its variants step by step (interleaved rounds, so machine
noise hits all of them alike) after ``--warmup`` untimed rounds and reports medians of ``--repeats``:

1. accounting overhead: the plain training step (forward, backward, Adam step) vs the same step
   inside ``with mem:`` of one ``DeviceMemory`` (the model and optimizer tracked once, as
   ``adaptive-mem run`` keeps one around its steps), on ``llama-small`` batch 2 x seq 512 and
   ``llama-tiny`` batch 2 x seq 128 (targets: <= 2 % and <= 10 %). The one-off cost of entering a
   ``DeviceMemory`` that scans existing tensors (``track_existing=True``: ``gc.collect`` and a scan of
   every Python object) is timed separately: it is paid per ``with``, not per op;
2. machinery overhead: an all-keep plan applied with ``optimize`` to a copy of ``llama-small`` and
   run under ``DeviceMemory``, vs the plain eager model (target <= 2 %);
3. prediction: ``llama-tiny``'s profiled step simulated with no plan vs its measured step under
   ``DeviceMemory`` (target within 10 %).

Prints one table per case with the ratios, then the targets met or missed, and the accounting
back-end in use (``cpp``: the counting C++ allocator; ``dispatch``: the Python fallback).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from typing import Callable

import torch

from adaptive_mem import DeviceMemory, build_model, optimize
from search import Plan, simulate


def _bundle(spec: str, batch: int, seq: int):
    return build_model(spec, batch_size=batch, seq_len=seq, seed=0)


def _stepper(bundle, opt) -> Callable[[int], None]:
    def step(seed: int) -> None:
        loss = bundle.loss(bundle.batch(seed=seed))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _accounted(step: Callable[[int], None], mem: DeviceMemory) -> Callable[[int], None]:
    def run(seed: int) -> None:
        with mem:
            step(seed)
    return run


def interleaved(variants: dict[str, Callable[[int], None]], *, repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds of each variant over ``repeats`` rounds, one step of each per round."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(warmup + repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn(r)
            seconds = time.perf_counter() - start
            if r >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _table(title: str, medians: dict[str, float], base: str) -> dict[str, float]:
    print(f"\n{title}")
    print(f"  {'variant':<44} {'median step':>12} {'ratio':>8}")
    ratios = {}
    for name, seconds in medians.items():
        ratios[name] = seconds / medians[base]
        print(f"  {name:<44} {seconds * 1e3:>9.2f} ms {ratios[name]:>8.3f}")
    return ratios


def accounting_case(spec: str, batch: int, seq: int, args) -> float:
    bundle = _bundle(spec, batch, seq)
    opt = torch.optim.Adam(bundle.model.parameters(), lr=1e-4)
    step = _stepper(bundle, opt)
    step(0)  # the optimizer state exists from now on
    mem = DeviceMemory(track_existing=False)
    mem.track(bundle.model, opt)
    medians = interleaved({"plain step": step, "step under DeviceMemory": _accounted(step, mem)},
                          repeats=args.repeats, warmup=args.warmup)
    ratios = _table(f"accounting overhead: {spec} batch {batch} x seq {seq} ({mem.backend} back-end)",
                    medians, "plain step")
    gc.collect()
    start = time.perf_counter()
    with DeviceMemory():  # track_existing=True: gc.collect and a scan of every Python object
        pass
    print(f"  entering a scanning DeviceMemory (once per `with`): {(time.perf_counter() - start) * 1e3:.1f} ms "
          f"({len(gc.get_objects())} Python objects)")
    return ratios["step under DeviceMemory"] - 1


def machinery_case(spec: str, batch: int, seq: int, args) -> float:
    plain = _bundle(spec, batch, seq)
    planned = copy.copy(plain)
    planned.model = copy.deepcopy(plain.model)
    opts = [torch.optim.Adam(b.model.parameters(), lr=1e-4) for b in (plain, planned)]
    layers = len(planned.model.layers)
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1,
                           "decisions": {f"layers.{i}": "keep" for i in range(layers)}})
    handle = optimize(planned.model, plan=plan)
    try:
        eager, keep = _stepper(plain, opts[0]), _stepper(planned, opts[1])
        eager(0)
        keep(0)
        mem = DeviceMemory(track_existing=False)
        mem.track(planned.model, opts[1])
        medians = interleaved({"plain eager": eager, "all-keep plan (optimize) under DeviceMemory":
                               _accounted(keep, mem)}, repeats=args.repeats, warmup=args.warmup)
    finally:
        handle.remove()
    ratios = _table(f"machinery overhead: {spec} batch {batch} x seq {seq}", medians, "plain eager")
    return ratios["all-keep plan (optimize) under DeviceMemory"] - 1


def prediction_case(spec: str, batch: int, seq: int, args) -> float:
    import profiler

    bundle = _bundle(spec, batch, seq)
    opt = torch.optim.Adam(bundle.model.parameters(), lr=1e-4)
    prof = profiler.profile_step(bundle, optimizer=opt, warmup=1, repeat=max(3, args.repeats))
    predicted = simulate(prof, Plan()).step_time
    step = _stepper(bundle, opt)
    step(0)
    mem = DeviceMemory(track_existing=False)
    mem.track(bundle.model, opt)
    measured = interleaved({"step under DeviceMemory": _accounted(step, mem)}, repeats=args.repeats,
                           warmup=args.warmup)["step under DeviceMemory"]
    error = predicted / measured - 1
    print(f"\nprediction: {spec} batch {batch} x seq {seq}")
    print(f"  simulated (no plan) {predicted * 1e3:.2f} ms, measured under DeviceMemory {measured * 1e3:.2f} ms: "
          f"predicted / measured = {predicted / measured:.3f}")
    return error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed interleaved rounds per case (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--quick", action="store_true", help="skip llama-small (the llama-tiny cases only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: list[tuple[str, float, float]] = []  # (target, measured, limit)
    if not args.quick:
        results.append(("accounting overhead, llama-small 2x512", accounting_case("llama-small", 2, 512, args), 0.02))
    results.append(("accounting overhead, llama-tiny 2x128", accounting_case("llama-tiny", 2, 128, args), 0.10))
    if not args.quick:
        results.append(("machinery overhead (all keep), llama-small 2x512",
                        machinery_case("llama-small", 2, 512, args), 0.02))
    results.append(("|predicted / measured - 1|, llama-tiny 2x128",
                    abs(prediction_case("llama-tiny", 2, 128, args)), 0.10))
    print("\ntargets")
    for name, value, limit in results:
        print(f"  {name:<52} {value * 100:+7.2f} %  (limit {limit * 100:.0f} %)  "
              f"{'met' if value <= limit else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
