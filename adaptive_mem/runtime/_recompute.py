"""Whole-layer recompute of the :class:`~adaptive_mem.runtime._executor.Executor`: a layer decided recompute as a
whole runs in one non-reentrant checkpoint (its input swapped too when the plan says so: Note: [swapped checkpoint
input] in ``_input_swap.py``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._input_swap import swapped_input_checkpoint
from ._layer_cache import cache_snapshot, replays_on_snapshot
from ._plan_context import PlanContext

__all__ = ["WholeLayers"]


class WholeLayers:
    """Makes the checkpointed forward of a layer recomputed as a whole."""

    def __init__(self, ctx: PlanContext) -> None:
        self.ctx = ctx

    def forward(self, i: int) -> Callable[..., Any]:
        """Layer ``i``'s forward under whole-layer recompute."""
        ctx = self.ctx
        orig = ctx.orig(i)
        run = ctx.opaque_run(orig)
        swap_in = ctx.res.input_swaps.get(i)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return orig(*args, **kwargs)
            args, kwargs, fresh = cache_snapshot(ctx.layers[i], args, kwargs, ctx.cache_warned)
            fn = replays_on_snapshot(run, fresh)  # Note: [cache in recompute]
            if swap_in is not None and not torch.compiler.is_compiling():  # compiled: Note: [swap around compiled blocks]
                return swapped_input_checkpoint(fn, *args, engine=ctx.engine, layer=i, prefetch=swap_in,
                                                label=f"{ctx.res.layers.layer_path(i)} input", **kwargs)
            return ctx.checkpoint(i, fn, *args, **kwargs)
        return forward
