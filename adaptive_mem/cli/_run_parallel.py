"""``adaptive-mem run --nproc N --parallel ddp|fsdp|tp|pp``: spawn N local ranks (gloo on CPU, a free local port),
each training its share of the layout (``adaptive_mem.models.parallelize``) with the plan or the adaptive loop;
rank 0 prints the figures. Every collective has a timeout, and so has the whole spawn."""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["add_parallel_arguments", "check_parallel", "run_parallel"]

TIMEOUT = 300  # seconds: every collective; the whole spawn gets twice this plus a second per step


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    from adaptive_mem.models import KINDS

    parser.add_argument("--nproc", type=int, default=1, help="local ranks to spawn (gloo on CPU; default 1)")
    parser.add_argument("--parallel", default=None, choices=KINDS,
                        help="layout over the --nproc ranks: ddp, fsdp (FSDP2 per layer), tp (tensor parallel) or "
                             "pp (one pipeline stage per rank)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="--parallel pp: micro-batches per step (GPipe below --nproc, 1F1B from there; default 1)")


def check_parallel(args: argparse.Namespace) -> bool:
    """Whether ``args`` asks for ranks; refuses flags that disagree, before anything is spawned."""
    from adaptive_mem.models import Parallel

    if args.nproc < 1:
        raise ValueError(f"--nproc={args.nproc}: expected a positive number of ranks")
    if args.parallel is None:
        if args.nproc > 1:
            raise ValueError(f"--nproc={args.nproc} without --parallel: expected --parallel ddp, fsdp, tp or pp")
        if args.micro_batches != 1:
            raise ValueError(f"--micro-batches={args.micro_batches} without --parallel pp: expected --parallel pp")
        return False
    Parallel(args.parallel, args.nproc, args.micro_batches)
    if args.micro_batches != 1 and args.parallel != "pp":
        raise ValueError(f"--micro-batches={args.micro_batches} with --parallel={args.parallel}: expected "
                         "--parallel pp (the others step the whole batch)")
    if args.device != "cpu":
        raise ValueError(f"--device={args.device} with --parallel: expected --device cpu (the ranks use gloo; "
                         "accelerators: torchrun examples/train.py)")
    for flag, value in (("--adaptive-batch-size", args.adaptive_batch_size), ("--config", args.config),
                        ("--host-store", None if args.host_store == "memory" else args.host_store)):
        if value:
            raise ValueError(f"{flag} with --parallel: not supported on spawned ranks; expected --plan, "
                             "--memory-plan or --adaptive-memory-optimization")
    if args.parallel == "pp" and args.micro_batches > 1 and args.adaptive_memory_optimization:
        raise ValueError(f"--adaptive-memory-optimization with --parallel pp --micro-batches={args.micro_batches}: "
                         "the loop measures one forward and its backward per step; expected --micro-batches 1")
    if args.steps <= 0:
        raise ValueError(f"--steps={args.steps}: expected a positive integer")
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_parallel(args: argparse.Namespace) -> int:
    """Spawn the ranks, wait for them (with a deadline) and return rank 0's exit status."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="adaptive-mem-run-") as out:
        context = mp.spawn(_worker, args=(args.nproc, _free_port(), args, out), nprocs=args.nproc, join=False)
        deadline = time.monotonic() + 2 * TIMEOUT + args.steps
        died: Exception | None = None
        try:
            while not context.join(timeout=2):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"--nproc={args.nproc}: ranks still running after {2 * TIMEOUT + args.steps} s")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
            died = exc  # a refusal on one rank can abort its peer inside a collective: the refusal is the cause
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
        errors = sorted(Path(out).glob("error-rank*.txt"))
        if errors:
            raise ValueError(errors[0].read_text())
        if died is not None:
            raise died
        return int((Path(out) / "rc").read_text())


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    level = getattr(logging, getattr(args, "log_level", "INFO")) if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"%(levelname)s - rank {rank}: %(message)s")  # spawned: nothing inherited
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    try:
        rc = _train(rank, world, args)
        if rank == 0:
            Path(out, "rc").write_text(str(rc))
        gc.collect()  # DDP's reducer, held in reference cycles of the hooks, goes before its process group
        dist.barrier()
    except ValueError as exc:  # a refusal: the parent prints it as one line
        Path(out, f"error-rank{rank}.txt").write_text(" ".join(str(exc).split()))
    finally:
        dist.destroy_process_group()


def _apply(pm: Any, args: argparse.Namespace, opt: Any, batch_size: int) -> Any:
    from search import Plan

    from adaptive_mem._flags import apply_arguments
    from adaptive_mem._optimize import optimize
    from adaptive_mem.models._parallelize import stage_decisions

    if args.memory_plan and args.plan:
        raise ValueError("--memory-plan with --plan: expected one of them")
    path = args.plan or args.memory_plan
    plan = Plan.load(path) if path else None
    if plan is not None and pm.layout.kind == "pp":
        lo, hi = pm.bounds
        plan = Plan(decisions=stage_decisions(plan.decisions, lo=lo, hi=hi, stage=pm.module), groups=[],
                    meta={**plan.meta, "stage": pm.rank})
    if args.adaptive_memory_optimization or args.memory_budget or args.memory_plan_cache:
        return apply_arguments(pm.module, args, optimizer=opt, global_batch=batch_size, dp_group=pm.dp_group)
    if plan is not None:
        return optimize(pm.module, plan=plan, host_memory_budget=args.host_memory_budget)
    return None


def _train(rank: int, world: int, args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from adaptive_mem._model_spec import build_model
    from adaptive_mem.models import Parallel, parallelize
    from adaptive_mem.runtime._accounting import DeviceMemory
    from search import parse_bytes

    bundle = build_model(args.model, model_args=args.model_args, batch_size=args.batch_size, seq_len=args.seq_len,
                         dtype=args.dtype, device="cpu", seed=args.seed)
    pm = parallelize(bundle.model, layout=Parallel(args.parallel, world, args.micro_batches),
                     batch_size=bundle.batch_size)
    params = [p for p in pm.module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=args.lr) if args.optimizer == "adam" else torch.optim.SGD(params, lr=args.lr)
    handle = _apply(pm, args, opt, bundle.batch_size)
    cap = args.device_memory_cap or args.memory_budget
    mem = DeviceMemory(cap=parse_bytes(cap, key="--device-memory-cap", plain=True) if cap else None, track_existing=False)
    times: list[float] = []
    losses: list[float] = []
    try:
        with mem:
            mem.track(pm.module, opt)
            for step in range(args.steps):
                ids, labels = pm.batch(*bundle.batch(seed=args.seed + step))
                start = time.perf_counter()
                loss = pm.step(ids, labels)
                opt.step()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - start)
                losses.append(float(loss))
    except torch.OutOfMemoryError as exc:
        print(f"adaptive-mem run: rank {rank}: out of device memory at step {len(times)}: {exc}", file=sys.stderr)
        return 1
    finally:
        summary = handle.summary() if handle is not None and hasattr(handle, "summary") else None
        if handle is not None:
            handle.remove()
    peaks = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor(mem.peak, dtype=torch.int64))
    if rank == 0:
        warm = min(2, len(times) - 1)
        shown = args.plan or args.memory_plan or ("adaptive" if args.adaptive_memory_optimization else "none")
        print(f"model: {bundle.spec}  batch: {bundle.batch_size}x{bundle.seq_len}  dtype: {str(bundle.dtype)[6:]}  "
              f"plan: {shown}  parallel: {args.parallel} over {world} ranks (gloo)")
        if summary is not None:
            print(f"rank 0: {summary}")
        print(f"steps: {len(times)}  loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"peak device memory: rank 0 {mem.peak} bytes ({mem.peak / 2**20:.1f} MiB); per rank "
              f"{[int(p) for p in peaks]}")
        print(f"median step time: {statistics.median(times[warm:]):.4f} s (over {len(times) - warm} steps, rank 0)")
        sys.stdout.flush()
    return 0
