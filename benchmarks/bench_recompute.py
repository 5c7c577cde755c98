"""What a recompute plan costs beyond its replays, the checkpoints side by side in one process.

    python benchmarks/bench_recompute.py [--models llama-tiny,hf:llama] [--rounds 16]

At batch 8 x seq 128, one thread, SGD step included: plain; whole-layer recompute of the first layers (up to 3)
under PyTorch's non-reentrant checkpoint, under the lean checkpoint the executor runs eager (Note: [lean
checkpoint] in ``adaptive_mem/runtime/_lean_checkpoint.py``) and under the reentrant checkpoint (no per-tensor
hook at all: the floor); the one-unit select recompute of ``bench_machinery.py``. Each variant on its own copy of
the model, one step of each per round (interleaved), after two untimed; medians of the step's CPU time of this
thread (``time.thread_time``: other processes on a shared machine barely move it) and of its wall time. The
target of ``bench_machinery.py`` is printed beside: the recomputed layers' forward (``Profile.replayed_forward``) + 2 %.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import statistics
import sys
import time
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

import adaptive_mem.runtime._plan_context as plan_context
from adaptive_mem import build_model, optimize, profile_step
from search import Action, Decision, Plan

sys.path.insert(0, __file__.rpartition("/")[0] or ".")
from bench_machinery import _MUL, _unit  # noqa: E402

_MODE = {"checkpoint": "lean"}
_lean_applies = plan_context.lean_applies


def _checkpoint(fn: Any, *args: Any, use_reentrant: bool = False, **kwargs: Any) -> Any:
    if _MODE["checkpoint"] == "reentrant":
        return torch_checkpoint.checkpoint(functools.partial(fn, **kwargs) if kwargs else fn, *args,
                                           use_reentrant=True)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def run_model(spec: str, rounds: int) -> None:
    bundle = build_model(spec, batch_size=8, seq_len=128, seed=0)
    profile = profile_step(bundle, optimizer=torch.optim.SGD(bundle.model.parameters(), lr=1e-3), warmup=1, repeat=3)
    layers = range(min(3, profile.num_layers))
    whole = Plan(decisions={profile.layer_path(i): Decision(Action.RECOMPUTE) for i in layers})
    select = Plan(decisions={_unit(profile, 0, _MUL): Decision(Action.RECOMPUTE)})
    variants = [("plain", None, "lean"), ("whole-layer recompute, PyTorch's checkpoint", whole, "torch"),
                ("whole-layer recompute, lean checkpoint", whole, "lean"),
                ("whole-layer recompute, reentrant checkpoint", whole, "reentrant"),
                ("one-unit select recompute", select, "lean")]
    runs = []
    for name, plan, mode in variants:
        run = copy.copy(bundle)
        run.model = copy.deepcopy(bundle.model)
        handle = optimize(run.model, plan=plan) if plan is not None else None
        opt = torch.optim.SGD(run.model.parameters(), lr=1e-3)
        runs.append((name, mode, run, opt, handle, [], []))
    batches = [bundle.batch(seed=k) for k in range(rounds + 2)]
    for k in range(rounds + 2):
        for name, mode, run, opt, handle, cpu, wall in runs:
            _MODE["checkpoint"] = mode
            start_cpu, start_wall = time.thread_time(), time.perf_counter()
            run.loss(batches[k]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if k >= 2:
                cpu.append(time.thread_time() - start_cpu)
                wall.append(time.perf_counter() - start_wall)
    plain_cpu, plain_wall = statistics.median(runs[0][5]), statistics.median(runs[0][6])
    forward = sum(profile.replayed_forward(i) for i in layers)
    print(f"\n{spec} b8 s128, 1 thread, medians of {rounds} interleaved rounds; recomputed layers' forward "
          f"{forward * 1e3:.2f} ms = {forward / plain_cpu * 100:.1f} % of plain's CPU time (target: that + 2 %)")
    print("| variant | CPU ms | vs plain | wall ms | vs plain |")
    print("|---|---|---|---|---|")
    for name, _, _, _, handle, cpu, wall in runs:
        c, w = statistics.median(cpu), statistics.median(wall)
        print(f"| {name} | {c * 1e3:.2f} | {(c / plain_cpu - 1) * 100:+.1f} % | {w * 1e3:.2f} | "
              f"{(w / plain_wall - 1) * 100:+.1f} % |")
        if handle is not None:
            handle.remove()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-tiny,hf:llama")
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args(argv)
    logging.getLogger("adaptive_mem").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    plan_context.checkpoint = _checkpoint
    plan_context.lean_applies = lambda: _MODE["checkpoint"] == "lean" and _lean_applies()
    for spec in args.models.split(","):
        run_model(spec, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
