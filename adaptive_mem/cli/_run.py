"""``adaptive-mem run``: train N steps with a plan applied; report peak device memory and step time."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
from tqdm import tqdm

from search import parse_bytes

NAME = "run"
HELP = "train N steps of a model with a plan (or a MindFormers/Megatron config) applied and print the measured " \
       "peak device memory and median step time"

log = logging.getLogger(__name__)

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-tiny", help="model spec: preset, hf:<family> or module:factory "
                        "(default llama-tiny)")
    parser.add_argument("--model-args", default=None, help="overrides, e.g. num_layers=8,hidden_size=256")
    parser.add_argument("--batch-size", type=int, default=None, help="micro-batch size (default: the spec's)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the spec's)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    parser.add_argument("--device", default="cpu", help="torch device to train on (default cpu)")
    parser.add_argument("--plan", default=None, help="plan file (YAML or JSON); none = the plain model")
    parser.add_argument("--config", default=None, help="MindFormers YAML whose recompute_config/swap_config "
                        "gives the plan (instead of --plan)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="weights and batches seed (default 0)")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"], help="optimizer (default adam)")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    parser.add_argument("--device-memory-cap", default=None,
                        help="CPU only: fail with out-of-memory when device memory would exceed this (e.g. 2GiB)")
    parser.add_argument("--host-store", default="memory", choices=["memory", "file"],
                        help="where swapped activations go: host memory or a temporary file (CPU only)")
    from adaptive_mem._flags import add_memory_arguments

    add_memory_arguments(parser)  # --adaptive-memory-optimization, --memory-budget, --memory-plan(-cache)
    from ._run_parallel import add_parallel_arguments

    add_parallel_arguments(parser)  # --nproc, --parallel, --micro-batches


def _forward_backward(bundle, batch, adaptive_batch) -> torch.Tensor:
    """One global batch: forward and backward, in micro-batches with --adaptive-batch-size."""
    if adaptive_batch is None:
        loss = bundle.loss(batch)
        loss.backward()
        return loss
    total = 0.0
    for piece, weight in adaptive_batch.split(batch):
        loss = bundle.loss(piece) * weight
        loss.backward()
        total += float(loss.detach())
    return torch.tensor(total)


def run(args: argparse.Namespace) -> int:
    from ._run_parallel import check_parallel, run_parallel

    if check_parallel(args):
        return run_parallel(args)
    cap = _check_arguments(args)
    loaded, batch_size = _load_plan(args)
    bundle = _build(args, batch_size, cap)
    model = bundle.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=args.lr) if args.optimizer == "adam" else torch.optim.SGD(params, lr=args.lr)
    handle, cap = _apply(args, bundle, opt, loaded, cap)
    trained = _train(args, bundle, opt, handle, cap)
    if trained is None:
        return 1
    times, losses, peak, how = trained
    warm = min(2, len(times) - 1) if cap is None else 0  # the first steps create the optimizer state
    _report(args, bundle, handle, times[warm:], losses, peak, how)
    return 0


def _check_arguments(args: argparse.Namespace) -> int | None:
    """Refuse contradictory flags before anything is built; the CPU device's cap in bytes, if given."""
    if args.steps <= 0:
        raise ValueError(f"--steps={args.steps}: expected a positive integer")
    if args.plan is not None and args.config is not None:
        raise ValueError("--plan and --config both given: expected one of them")
    cap = parse_bytes(args.device_memory_cap, key="--device-memory-cap", plain=True) if args.device_memory_cap else None
    if args.compile is not None:
        from adaptive_mem.runtime._compile_blocks import compile_options

        compile_options(args.compile, key="--compile")
    return cap


def _load_plan(args: argparse.Namespace):
    """The ``--plan`` file (or None) and the batch size to build: ``--batch-size``, else the plan's, else None."""
    if args.plan is None:
        return None, args.batch_size
    from search import Plan

    loaded = Plan.load(args.plan)
    batch_size = args.batch_size
    if batch_size is None and loaded.model.get("batch_size") is not None:
        batch_size = loaded.model["batch_size"]  # the plan's batch size (throughput mode chose it)
        log.info("batch size %d from the plan %s (--batch-size overrides)", batch_size, args.plan)
    return loaded, batch_size


def _build(args: argparse.Namespace, batch_size: int | None, cap: int | None):
    from adaptive_mem._model_spec import build_model

    bundle = build_model(args.model, model_args=args.model_args, batch_size=batch_size, seq_len=args.seq_len,
                         dtype=args.dtype, device=args.device, seed=args.seed)
    if bundle.is_fake:
        raise ValueError(f"--device={args.device}: expected a real device (meta builds fake tensors, nothing to train)")
    if cap is not None and bundle.device.type != "cpu":
        raise ValueError(f"--device-memory-cap on {bundle.device}: expected --device cpu (accelerators have their "
                         "own capacity)")
    return bundle


def _apply(args: argparse.Namespace, bundle, opt, loaded, cap: int | None):
    """Whatever the flags ask for on the model: the memory flags, a plan or config, or a per-block compile.

    Returns the handle (None for the plain model) and the cap, which a CPU run's --memory-budget sets."""
    from adaptive_mem._optimize import optimize

    model = bundle.model
    if (args.adaptive_memory_optimization or args.memory_plan or args.memory_budget or args.memory_plan_cache
            or args.adaptive_batch_size):
        from adaptive_mem._flags import apply_arguments

        if args.memory_plan and (args.plan or args.config):
            raise ValueError("--memory-plan with --plan/--config: expected one of them")
        if args.memory_budget and cap is None and bundle.device.type == "cpu":
            cap = parse_bytes(args.memory_budget, key="--memory-budget", plain=True)  # the budget is the CPU device's size
        return apply_arguments(model, args, optimizer=opt, global_batch=bundle.batch_size), cap
    if args.plan is not None or args.config is not None:
        plan = args.plan
        if plan is not None:  # refuse a plan for other inputs before it logs anything as applied
            from adaptive_mem.runtime._apply import check_inputs
            from adaptive_mem.runtime._buckets import plan_for_inputs

            plan, batch = loaded, bundle.batch(seed=args.seed)
            check_inputs(plan_for_inputs(plan, batch), model, batch, {})
        return optimize(model, plan=plan, config=args.config, host_store=args.host_store,
                        host_memory_budget=args.host_memory_budget, compile=args.compile), cap
    if args.compile is not None:
        from adaptive_mem.runtime._compile_blocks import compile_blocks

        log.info("no --plan or --config: training the plain model, compiled per block")
        return compile_blocks(model, args.compile, key="--compile"), cap
    log.info("no --plan or --config: training the plain model")
    return None, cap


def _train(args: argparse.Namespace, bundle, opt, handle, cap: int | None):
    """Train ``--steps`` steps; the step times, losses, peak device memory and how the steps were timed.

    Out of device memory, it prints the step it happened at and returns None; the handle is removed either way."""
    from adaptive_mem.runtime._accounting import DeviceMemory

    on_cpu = bundle.device.type == "cpu"
    # Note: [run timing] the C++ allocator hook counts at no measurable cost: every step is accounted.
    # Only the dispatch-mode fallback taxes every op (more so for plans that run more ops): then, without
    # a cap to enforce, only the first two steps (the optimizer state is created in the first) are
    # accounted for the peak and the steps after them are timed untracked, as the bench worker does.
    # Without a cap the first two steps (the optimizer state is created in the first) are not timed.
    mem = DeviceMemory(device=bundle.device, cap=cap) if on_cpu else None
    cheap = mem is None or mem.backend == "cpp"
    accounted_steps = args.steps if (cap is not None or cheap) else min(2, args.steps)
    times: list[float] = []
    losses: list[float] = []
    try:
        if mem is not None:
            mem.__enter__()
        else:
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats()
        for step in tqdm(range(args.steps), desc="run", unit="step", file=sys.stderr, disable=None):
            if mem is not None and step == accounted_steps:
                mem.__exit__(None, None, None)
                peak, mem = mem.peak, None
            batch = bundle.batch(seed=args.seed + step)
            start = time.perf_counter()
            loss = _forward_backward(bundle, batch, getattr(handle, "batch", None))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if not on_cpu:
                torch.accelerator.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
            del loss
    except torch.OutOfMemoryError as exc:
        print(f"adaptive-mem run: out of device memory at step {len(times)}: {exc}", file=sys.stderr)
        return None
    finally:
        if mem is not None:
            mem.__exit__(None, None, None)
            peak = mem.peak
        _close(handle)
    if not on_cpu:
        peak = torch.accelerator.max_memory_allocated()
    how = "synchronized" if not on_cpu else ("accounted" if accounted_steps >= len(times) else "untracked")
    return times, losses, peak, how


def _close(handle) -> None:
    """Log what the handle swapped (and the adaptive loop's summary), then remove it from the model."""
    from adaptive_mem._optimize import OptimizeHandle

    if handle is None:
        return
    stats = handle.swap_stats
    if stats is not None:
        log.info("swapped %d bytes out, %d back; %d late reloads (%.3f s waiting); host pool %d bytes; "
                 "%d bytes spilled to disk", stats.offloaded_bytes, stats.reloaded_bytes, stats.late_reloads,
                 stats.wait_seconds, handle.host_bytes, stats.spilled_bytes)
    if not isinstance(handle, OptimizeHandle):  # a plan's summary was logged when it was applied
        log.info("%s", handle.summary())
    handle.remove()


def _report(args: argparse.Namespace, bundle, handle, timed: list[float], losses: list[float], peak: int,
            how: str) -> None:
    shown = args.plan or args.config or args.memory_plan or ("adaptive" if args.adaptive_memory_optimization else "none")
    if args.compile is not None:
        shown += f"  compile: {args.compile} (per block)"
    print(f"model: {bundle.spec}  batch: {bundle.batch_size}x{bundle.seq_len}  dtype: {str(bundle.dtype)[6:]}  "
          f"plan: {shown}")
    adaptive_batch = getattr(handle, "batch", None)
    if adaptive_batch is not None:
        print(f"micro-batch: {adaptive_batch.micro_batch} x {adaptive_batch.accumulation_steps} accumulation steps "
              f"(global batch {adaptive_batch.global_batch}, --adaptive-batch-size)")
    print(f"steps: {len(losses)}  loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"peak device memory: {peak} bytes ({peak / 2**20:.1f} MiB)")
    print(f"median step time: {statistics.median(timed):.4f} s (over {len(timed)} {how} steps)")
