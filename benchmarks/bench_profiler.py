"""Profiler figures: profiling overhead on llama-small (CPU) and llama2-70b fake-tensor profile time.

    python benchmarks/bench_profiler.py [--runs 5] [--skip-70b]

1. Overhead: one plain training step (forward + backward) of ``llama-small``
   vs one ``profiler.profile_step(bundle, warmup=0, repeat=0, record=1)`` call (a fully
   recorded step: per-op timing, saved-tensor attribution, memory tracking,
   and building the Profile). Runs alternate plain/profiled; medians reported.
   Target: ratio <= 3x.
2. Fake profile of ``llama2-70b`` (80 layers, seq 4096, micro-batch 1, bf16)
   for h100: model build and ``profile_step`` wall time. Target: <= 60 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import profiler
from adaptive_mem import build_model


def _plain_step(bundle, batch) -> float:
    for p in bundle.model.parameters():
        p.grad = None
    start = time.perf_counter()
    bundle.loss(batch).backward()
    seconds = time.perf_counter() - start
    for p in bundle.model.parameters():
        p.grad = None
    return seconds


def overhead(runs: int) -> dict:
    bundle = build_model("llama-small")
    batch = bundle.batch(seed=0)
    profiler.measure_cpu(dtype=bundle.dtype)  # cached hardware probe: not part of a profiled step
    _plain_step(bundle, batch)  # warm-up
    profiler.profile_step(bundle, warmup=0, repeat=0, record=1)
    plain, profiled = [], []
    for _ in range(runs):
        plain.append(_plain_step(bundle, batch))
        start = time.perf_counter()
        profiler.profile_step(bundle, warmup=0, repeat=0, record=1)
        profiled.append(time.perf_counter() - start)
    return {
        "model": "llama-small", "batch_size": bundle.batch_size, "seq_len": bundle.seq_len,
        "threads": torch.get_num_threads(), "runs": runs,
        "plain_s": statistics.median(plain), "profiled_s": statistics.median(profiled),
        "ratio": statistics.median(profiled) / statistics.median(plain),
        "plain_all": plain, "profiled_all": profiled,
    }


def fake_70b(runs: int) -> dict:
    builds, profiles = [], []
    result = None
    for _ in range(runs):
        start = time.perf_counter()
        bundle = build_model("llama2-70b", device="meta", dtype="bfloat16", batch_size=1, seq_len=4096)
        builds.append(time.perf_counter() - start)
        start = time.perf_counter()
        result = profiler.profile_step(bundle, hardware="h100")
        profiles.append(time.perf_counter() - start)
        del bundle
    return {
        "model": "llama2-70b", "layers": result.num_layers, "ops": len(result.ops), "runs": runs,
        "build_s": statistics.median(builds), "profile_s": statistics.median(profiles),
        "total_s": statistics.median(b + p for b, p in zip(builds, profiles)),
        "saved_GiB": result.saved_bytes / 2**30, "estimated_step_s": result.step_time,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="plain/profiled step pairs (default 5)")
    parser.add_argument("--runs-70b", type=int, default=3, help="llama2-70b fake profiles (default 3)")
    parser.add_argument("--skip-70b", action="store_true")
    args = parser.parse_args()
    report = {"overhead": overhead(args.runs)}
    o = report["overhead"]
    print(f"llama-small (batch {o['batch_size']} x seq {o['seq_len']}, {o['threads']} threads): plain step "
          f"{o['plain_s']:.3f} s, profiled step {o['profiled_s']:.3f} s, overhead {o['ratio']:.2f}x "
          f"(median of {o['runs']})")
    if not args.skip_70b:
        report["fake_70b"] = f = fake_70b(args.runs_70b)
        print(f"llama2-70b fake profile ({f['layers']} layers, seq 4096, bf16, {f['ops']} ops): "
              f"build {f['build_s']:.1f} s"
              f" + profile {f['profile_s']:.1f} s = {f['total_s']:.1f} s (median of {f['runs']}); saved "
              f"{f['saved_GiB']:.1f} GiB, estimated h100 step {f['estimated_step_s']:.2f} s")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
