"""The single flag: ``add_arguments(parser)`` then, after the model exists, ``apply_arguments(model, args)``.

``--adaptive-memory-optimization`` (with ``--memory-budget``, ``--memory-plan-cache``) starts the
adaptive loop; ``--memory-plan FILE`` applies a fixed plan; Megatron's recompute flags apply their
plan. The seeds' incompatibilities are errors before anything is applied: the adaptive flag with full
(or selective) recompute, or with a manual plan / swap config.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

import torch
from torch import nn

from adaptive_mem.config._megatron_args import add_arguments as add_megatron_arguments

__all__ = ["add_arguments", "add_memory_arguments", "apply_arguments"]

log = logging.getLogger(__name__)

_MEMORY_FLAGS = ("--adaptive-memory-optimization", "--memory-budget", "--memory-plan", "--memory-plan-cache",
                 "--adaptive-batch-size", "--seq-len-buckets", "--max-seq-len")


def add_memory_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--adaptive-memory-optimization``, ``--memory-budget``, ``--memory-plan``, ``--memory-plan-cache``,
    ``--adaptive-batch-size``, ``--seq-len-buckets``, ``--max-seq-len``, ``--host-memory-budget``,
    ``--compile [BACKEND]``."""
    group = parser.add_argument_group("memory optimization (adaptive-mem)")
    have = set(getattr(parser, "_option_string_actions", {}))
    if "--adaptive-memory-optimization" not in have:
        group.add_argument("--adaptive-memory-optimization", action="store_true",
                           help="find and apply the fastest keep/recompute/swap plan under --memory-budget while "
                                "training; out-of-memory is rescued by swapping activations to the host")
    if "--memory-budget" not in have:
        group.add_argument("--memory-budget", default=None, metavar="SIZE",
                           help="peak device memory the step may use, e.g. 12GiB (default: the device capacity)")
    if "--memory-plan" not in have:
        group.add_argument("--memory-plan", default=None, metavar="FILE",
                           help="apply this plan file (YAML/JSON) as it is, without the adaptive loop")
    if "--memory-plan-cache" not in have:
        group.add_argument("--memory-plan-cache", default=None, metavar="DIR",
                           help="where converged adaptive plans are kept (default ~/.cache/adaptive-mem/plans)")
    if "--adaptive-batch-size" not in have:
        group.add_argument("--adaptive-batch-size", action="store_true",
                           help="with --adaptive-memory-optimization: grow the micro-batch to the largest the budget "
                                "allows, keeping the global batch (--batch-size) by gradient accumulation")
    if "--seq-len-buckets" not in have:
        group.add_argument("--seq-len-buckets", default=None, metavar="LENS",
                           help="with --adaptive-memory-optimization: the sequence lengths plans are kept for, e.g. "
                                "128,256,512 (default powers of two); a longer step is an error")
    if "--max-seq-len" not in have:
        group.add_argument("--max-seq-len", default=None, type=int, metavar="N",
                           help="with --adaptive-memory-optimization: the longest sequence the data has; one plan "
                                "for it from the first step on (a longer step is an error)")
    if "--host-memory-budget" not in have:
        group.add_argument("--host-memory-budget", default=None, metavar="SIZE",
                           help="host RAM swapped activations may take, e.g. 16GiB (default half the free RAM); "
                                "beyond it they spill to memory-mapped files in a temporary directory")
    if "--compile" not in have:
        group.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                           help="torch.compile each repeated layer (per block) after the plan is applied, with "
                                "BACKEND (default inductor; e.g. aot_eager)")
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's recompute flags and the memory flags above, on any argparse parser."""
    add_megatron_arguments(parser)
    return add_memory_arguments(parser)


def _recompute_flag(args: argparse.Namespace) -> str | None:
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is not None:
        return f"--recompute-granularity {granularity}"
    if getattr(args, "recompute_activations", False):
        return "--recompute-activations"
    if getattr(args, "recompute_method", None) is not None:
        return f"--recompute-method {args.recompute_method}"
    return None


def _manual_plan(args: argparse.Namespace) -> str | None:
    for dest, flag in (("memory_plan", "--memory-plan"), ("plan", "--plan"), ("config", "--config"),
                       ("swap_config", "--swap-config")):
        value = getattr(args, dest, None)
        if value:
            return f"{flag} {value}"
    return None


def _adaptive_batch(args: argparse.Namespace, adaptive: bool, global_batch: int | None) -> Any:
    if not getattr(args, "adaptive_batch_size", False):
        return None
    if not adaptive:
        raise ValueError("--adaptive-batch-size without --adaptive-memory-optimization: expected both (the adaptive "
                         "loop's profile and budget choose the micro-batch)")
    if global_batch is None:
        global_batch = getattr(args, "global_batch_size", None) or getattr(args, "batch_size", None)
    if global_batch is None:
        raise ValueError("--adaptive-batch-size: no global batch size; expected --batch-size N (or "
                         "apply_arguments(..., global_batch=N))")
    from adaptive_mem.adaptive._batch import AdaptiveBatch

    try:
        global_batch = int(global_batch)
    except (TypeError, ValueError):
        raise ValueError(f"--batch-size={global_batch!r}: expected a positive integer (the global batch)") from None
    return AdaptiveBatch(global_batch)


def apply_arguments(model: nn.Module, args: argparse.Namespace, *, optimizer: Any = None,
                    loss_fn: Callable[[Any], torch.Tensor] | None = None, global_batch: int | None = None,
                    dp_group: Any = None) -> Any:
    """Apply the memory flags of ``args`` to ``model``; returns the handle (``remove()`` restores) or None.

    ``--adaptive-memory-optimization`` -> :class:`AdaptiveMemory`; ``--memory-plan`` or Megatron recompute
    flags -> :class:`OptimizeHandle`; none of them -> None (with ``--compile`` alone: the blocks compiled, a
    :class:`~adaptive_mem.runtime._compile_blocks.CompiledLayers`). ``--compile [BACKEND]`` compiles each
    repeated layer after the plan is applied (``optimize(compile=...)``). ``optimizer`` counts its state in the budget.
    ``--adaptive-batch-size``: the handle's ``batch`` (an :class:`~adaptive_mem.adaptive._batch.AdaptiveBatch`)
    cuts each global batch (``global_batch``, else ``args.global_batch_size`` or ``args.batch_size``) into
    micro-batches for gradient accumulation. ``--seq-len-buckets LENS`` / ``--max-seq-len N``: the sequence
    lengths the adaptive loop keeps plans for (``adaptive_optimize``'s ``seq_len_buckets`` / ``max_seq_len``). ``dp_group``: the data-parallel ranks that agree on one adaptive
    plan (default the world group under ``torch.distributed``; a pipeline stage passes its own).
    """
    adaptive = bool(getattr(args, "adaptive_memory_optimization", False))
    batch = _adaptive_batch(args, adaptive, global_batch)
    host = getattr(args, "host_memory_budget", None)
    if host is not None:
        from adaptive_mem.runtime._spill import as_host_budget

        host = as_host_budget(host, flag="--host-memory-budget")  # a bad size fails before anything is applied
    compile_ = getattr(args, "compile", None)
    if compile_ is not None:
        from adaptive_mem.runtime._compile_blocks import compile_options

        compile_options(compile_, key="--compile")  # a bad backend fails before anything is applied
    if adaptive:
        _check_adaptive(args, compile_)
        from adaptive_mem.adaptive._loop import adaptive_optimize

        return adaptive_optimize(model, budget=getattr(args, "memory_budget", None), optimizer=optimizer,
                                 cache_dir=getattr(args, "memory_plan_cache", None), loss_fn=loss_fn, batch=batch,
                                 host_memory_budget=host, dp_group=dp_group,
                                 seq_len_buckets=getattr(args, "seq_len_buckets", None),
                                 max_seq_len=getattr(args, "max_seq_len", None))
    return _apply_fixed(model, args, host, compile_)


def _check_adaptive(args: argparse.Namespace, compile_: str | None) -> None:
    """The flags the adaptive loop excludes (as in MindSpeed), refused before anything is applied."""
    if compile_ is not None:
        raise ValueError(f"--adaptive-memory-optimization with --compile {compile_}: incompatible (the adaptive "
                         "loop profiles the eager model); expected one of them")
    recompute = _recompute_flag(args)
    if recompute is not None:
        raise ValueError(f"--adaptive-memory-optimization with {recompute}: incompatible (the adaptive plan "
                         "decides recompute itself, as in MindSpeed where it excludes full recompute); "
                         "expected one of them")
    manual = _manual_plan(args)
    if manual is not None:
        raise ValueError(f"--adaptive-memory-optimization with {manual}: incompatible (a manual plan or swap "
                         "config fixes what the adaptive loop would choose); expected one of them")


def _apply_fixed(model: nn.Module, args: argparse.Namespace, host: Any, compile_: str | None) -> Any:
    """Without the adaptive flag: ``--memory-plan``, Megatron's recompute flags, ``--compile`` alone, or nothing."""
    for flag in ("--memory-budget", "--memory-plan-cache", "--seq-len-buckets", "--max-seq-len"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            raise ValueError(f"{flag}={value!r} without --adaptive-memory-optimization: expected both "
                             "(a fixed plan takes --memory-plan FILE)")
    from ._optimize import optimize

    plan = getattr(args, "memory_plan", None)
    if plan is not None:
        if _recompute_flag(args) is not None:
            raise ValueError(f"--memory-plan with {_recompute_flag(args)}: expected one of them")
        return optimize(model, plan=plan, host_memory_budget=host, compile=compile_)
    if _recompute_flag(args) is not None:
        return optimize(model, config=args, host_memory_budget=host, compile=compile_)
    if compile_ is not None:
        from adaptive_mem.runtime._compile_blocks import compile_blocks

        log.info("no memory optimization flags: the model's blocks are compiled as they are")
        return compile_blocks(model, compile_, key="--compile")
    log.info("no memory optimization flags: the model runs as it is")
    return None
