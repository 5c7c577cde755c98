"""``adaptive_mem.optimize``, the front door for a fixed plan (``runtime._apply``); the adaptive loop under a
budget is the other entry, ``adaptive_mem.adaptive_optimize`` (``adaptive._loop``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from profiler.naming import ModelStructure
from search import Plan

from adaptive_mem.runtime._apply import OptimizeHandle
from adaptive_mem.runtime._buckets import apply_any_plan
from adaptive_mem.runtime._compile_blocks import check_blocks, compile_blocks, compile_options

__all__ = ["optimize", "OptimizeHandle", "OptimizeArgumentError"]


class OptimizeArgumentError(ValueError):
    """An argument of :func:`optimize` that belongs to the adaptive loop (``adaptive_mem.adaptive_optimize``)."""


def optimize(model: nn.Module, *, plan: Plan | str | Path | dict | None = None, config: Any = None,
             profile: Any = None, example_inputs: tuple | None = None, host_store: str = "memory",
             host_dir: str | None = None, host_memory_budget: int | str | None = None, compile: Any = None,
             budget: int | str | None = None) -> OptimizeHandle:
    """Apply a keep/recompute/swap plan to ``model`` until the returned handle is removed.

    ``plan`` is a :class:`search.Plan`, a plan dict or a YAML/JSON file; ``config`` a MindFormers or
    Megatron config turned into a plan by the config front-ends. Unit names are checked against
    ``profile`` (a :class:`profiler.Profile`), else a fake-tensor trace on ``example_inputs``, else
    the module tree plus a trace at the first forward. A plan that does not fit raises
    :class:`search.PlanError` and leaves the model untouched. ``host_store`` is ``memory`` (pinned
    RAM on accelerators) or ``file`` (a temporary file under ``host_dir``; CPU only).
    ``host_memory_budget`` (bytes or a size such as ``"8GiB"``; default half the free RAM, per process):
    RAM the ``memory`` store may hold; swapped activations beyond it spill to memory-mapped files in a
    per-process directory under ``host_dir`` (default the system temporary directory).

    What took effect is logged at INFO as one line and kept as ``handle.summary()`` (a
    :class:`adaptive_mem.PlanSummary`): layers and units recomputed, swapped and kept (units are counted
    with ``profile`` or ``example_inputs``), the planned device bytes saved (with ``profile``) and the
    targets that change nothing, with why. A plan that asks for recompute or swap but changes nothing
    logs one WARNING naming the cause. ``config={}`` (asking for nothing) raises
    :class:`adaptive_mem.ConfigError`.

    ``compile`` (``True`` = inductor, a backend name such as ``"aot_eager"``, or a dict with ``backend``,
    ``mode``, ``fullgraph``, ``dynamic``): after the plan is applied, each repeated layer is compiled in
    place (``layer.compile``, per block as torchtitan does), so the plan's recompute and swap run inside or
    around the compiled blocks; ``handle.remove()`` makes them plain again. The other order works too:
    compile each block yourself, then ``optimize``; for recompute plans, ``torch.compile(model)`` after
    ``optimize`` also works, as does ``torch.compile(model)`` for swap plans (the swaps go into its graph).

    A plan with a plan per sequence-length bucket (``adaptive-mem search --seq-lens``) applies, at each forward,
    the plan of the smallest bucket at least as long as the inputs (dim 1 of the first integer tensor), switching
    only when the bucket changes; a longer input raises :class:`search.SeqLenBucketError`.

    ``budget`` raises :class:`OptimizeArgumentError`: the loop that finds the fastest plan under a budget
    while training is ``adaptive_mem.adaptive_optimize(model, budget=...)``.
    """
    if budget is not None:
        raise OptimizeArgumentError(f"optimize: budget={budget!r}: optimize applies a fixed plan; expected "
                                    "adaptive_mem.adaptive_optimize(model, budget=...) for the adaptive loop")
    options = compile_options(compile, key="optimize: compile")
    structure = ModelStructure.of(model) if options is not None else None  # made once, handed down
    if options is not None:
        check_blocks(model, compile, key="optimize: compile", structure=structure)
    handle = apply_any_plan(model, plan=plan, config=config, profile=profile, example_inputs=example_inputs,
                            host_store=host_store, host_dir=host_dir, host_memory_budget=host_memory_budget,
                            structure=structure, compile_options=options)
    if options is not None:
        handle.compiled = compile_blocks(model, compile, key="optimize: compile", structure=structure)
    return handle
