"""Variable sequence lengths: the adaptive loop (a plan per length bucket) vs the best fixed plan for the maximum length.

``--steps`` training steps (Adam) whose lengths are drawn from a log-normal (median ``--median``, ``--sigma``,
``--seed``) clipped to ``--min-len``..``--max-len``; the budget is ``--budget-fraction`` of the plain step's peak at
the maximum length, enforced on CPU by ``DeviceMemory(cap=...)``. Two variants on the same lengths and batches:

* loop: ``adaptive_optimize(model, budget=...)`` with ``max_seq_len`` unset (buckets: powers of two);
* fixed: ``adaptive_mem.search(profile, seq_lens=[max_len])``, the milp plan for the maximum length, applied with
  ``optimize``, a SwapManager attached (a plan whose real peak exceeds the simulator's is rescued, and counted).

Each run is its own process; the variants alternate (loop, fixed, loop, fixed, ...) for ``--rounds`` rounds, and the
table shows medians: tokens/s over steps 2..N (the first step's one-time costs left out, for both) and over all
steps, the peak of the engine's exact device counter, rescues, profiles and the loop's convergence step.

    python benchmarks/bench_seqlens.py --model llama-small --batch-size 2 --steps 50 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = ("loop", "fixed")


def lengths_of(args) -> list[int]:
    """The steps' sequence lengths: log-normal around ``args.median``, clipped to the range, seeded."""
    import numpy as np

    draws = np.random.default_rng(args.seed).lognormal(math.log(args.median), args.sigma, args.steps)
    return [int(min(args.max_len, max(args.min_len, round(float(x))))) for x in draws]


def _bundle(args):
    from adaptive_mem import build_model

    return build_model(args.model, batch_size=args.batch_size, seq_len=args.max_len, seed=0)


def _opt(model):
    return torch.optim.Adam(model.parameters(), lr=1e-4)


def _step(b, opt, length: int, seed: int) -> float:
    ids, labels = b.batch(seed=seed)
    start = time.perf_counter()
    b.loss((ids[:, :length].contiguous(), labels[:, :length].contiguous())).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def plain_peak(args) -> int:
    """The peak of a plain step at the maximum length (the second of two: Adam's state exists)."""
    from adaptive_mem import DeviceMemory

    b = _bundle(args)
    opt = _opt(b.model)
    with DeviceMemory(track_existing=False) as mem:
        mem.track(b.model, opt)
        for s in range(2):
            _step(b, opt, args.max_len, s)
    return mem.peak


def fixed_plan(args, budget: int, path: Path) -> None:
    """Search the milp plan for the maximum length under ``budget``; write it to ``path``."""
    import adaptive_mem
    import profiler

    b = _bundle(args)
    prof = profiler.profile_step(b, optimizer=_opt(b.model))
    adaptive_mem.search(prof, budget=budget, seq_lens=[args.max_len]).plan.save(path)


def _timed(b, opt, lengths: list[int], mem, on_step=None) -> dict:
    """Run the steps; wall-clock tokens/s, and tokens per CPU second of the process (every thread: the copier's
    too), the steadier figure on a loaded machine."""
    times, cpu = [], 0.0
    for i, n in enumerate(lengths):
        if on_step is not None:
            on_step()
        start = time.process_time()
        times.append(_step(b, opt, n, i))
        cpu += time.process_time() - start if i else 0.0
    tokens = [b.batch_size * n for n in lengths]
    return {"tokens_per_s": sum(tokens[1:]) / sum(times[1:]), "tokens_per_s_all": sum(tokens) / sum(times),
            "tokens_per_cpu_s": sum(tokens[1:]) / cpu, "peak": mem.peak, "seconds": sum(times)}


def run_loop(args, budget: int, lengths: list[int]) -> dict:
    from adaptive_mem import DeviceMemory, adaptive_optimize

    b = _bundle(args)
    opt = _opt(b.model)
    with DeviceMemory(cap=budget, track_existing=False) as mem:
        mem.track(b.model, opt)
        with adaptive_optimize(b.model, budget=budget, optimizer=opt, cache=False) as am:
            out = _timed(b, opt, lengths, mem)
            out.update(rescues=sum(r.rescues for r in am.history), profiles=am.profiles_run,
                       converged_at=am.buckets.converged_at(), summary=am.summary(),
                       buckets=sorted(k.shape.bucket or 0 for k in am.buckets.buckets.values()))
    return out


def run_fixed(args, budget: int, lengths: list[int], plan: Path) -> dict:
    from adaptive_mem import DeviceMemory, SwapManager, optimize
    from adaptive_mem.memory._oom import AccountedHook

    b = _bundle(args)
    opt = _opt(b.model)
    with optimize(b.model, plan=str(plan)):
        manager = SwapManager(b.model)
        manager.attach()
        hook = AccountedHook(manager.rescue)
        manager.headroom = hook.headroom
        manager.prefetch_reserve = budget // 10
        try:
            with DeviceMemory(cap=budget, track_existing=False) as mem:
                mem.track(b.model, opt)
                out = _timed(b, opt, lengths, mem, on_step=hook.begin_step)
        finally:
            hook.remove()
            manager.close()
    out.update(rescues=manager.stats.rescues, profiles=1, converged_at=None)
    return out


def _child(args) -> int:
    torch.set_num_threads(args.threads)
    lengths = lengths_of(args)
    if args.variant == "loop":
        out = run_loop(args, args.budget, lengths)
    else:
        out = run_fixed(args, args.budget, lengths, Path(args.plan))
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def _spawn(argv: list[str], variant: str, budget: int, plan: Path) -> dict:
    cmd = [sys.executable, __file__, *argv, "--variant", variant, "--budget", str(budget), "--plan", str(plan)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{variant} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def _table(runs: dict[str, list[dict]]) -> str:
    keys = ("tokens_per_s", "tokens_per_s_all", "tokens_per_cpu_s", "peak", "rescues")
    med = {v: {k: statistics.median(r[k] for r in runs[v]) for k in keys} for v in VARIANTS}
    loop, fixed = med["loop"], med["fixed"]
    rows = ["| variant | tokens/s (steps 2..N) | tokens/s (all steps) | tokens per CPU s (steps 2..N) | peak (MiB) "
            "| rescues | profiles | converged at |", "|---|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        m, last = med[v], runs[v][-1]
        rows.append(f"| {v} | {m['tokens_per_s']:.1f} | {m['tokens_per_s_all']:.1f} | {m['tokens_per_cpu_s']:.1f} | "
                    f"{m['peak'] / 2**20:.1f} | {m['rescues']:g} | {last['profiles']} | {last['converged_at'] or '-'} |")
    rows.append("| loop / fixed | " + " | ".join(f"{loop[k] / fixed[k]:.3f}" for k in keys[:4]) + " | | | |")
    pairs = [f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}" for a, b in zip(runs["loop"], runs["fixed"])]
    return "\n".join(rows) + f"\n\nloop / fixed tokens/s per round: {', '.join(pairs)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--median", type=float, default=256)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-fraction", type=float, default=0.7, help="of the plain peak at --max-len")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, in a child process
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant is not None:
        return _child(args)

    torch.set_num_threads(args.threads)
    lengths = lengths_of(args)
    peak = plain_peak(args)
    budget = int(args.budget_fraction * peak)
    print(f"{args.model} batch {args.batch_size}, {args.steps} steps, lengths {min(lengths)}..{max(lengths)} "
          f"(mean {statistics.mean(lengths):.0f}, median {statistics.median(lengths):g}); plain peak at "
          f"{args.max_len}: {peak / 2**20:.1f} MiB, budget {budget / 2**20:.1f} MiB", flush=True)
    child = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("model", "batch_size", "steps", "median", "sigma",
                                                                   "min_len", "max_len", "seed", "threads")]
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "fixed.yaml"
        fixed_plan(args, budget, plan)
        for r in range(args.rounds):
            for v in VARIANTS:
                res = _spawn(child, v, budget, plan)
                runs[v].append(res)
                print(f"round {r + 1} {v}: " + json.dumps({k: res[k] for k in ("tokens_per_s", "tokens_per_s_all",
                      "tokens_per_cpu_s", "peak", "rescues", "profiles", "converged_at")}), flush=True)
    print("\n" + _table(runs))
    print(f"\nloop: {runs['loop'][-1]['summary']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"lengths": lengths, "plain_peak": peak, "budget": budget,
                                              "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
