"""A whole-layer checkpoint whose input leaves the device between the layer's forward and its recompute.

Note: [swapped checkpoint input]. Full recompute keeps one tensor per layer: the hidden states the layer was
called with, which the non-reentrant checkpoint saves (``_CheckpointFrame.save_inputs``: a saved tensor, packed
by the saved-tensor hooks active around the ``checkpoint`` call, unpacked for the recompute).
``swapped_input_checkpoint`` runs ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` under hooks
whose pack hands that input's storage to the swap engine (copied to host like any swapped activation, same
prefetch triggers: ``backward_prefetch`` layers before the layer's backward, or on demand when the recompute
unpacks it); the checkpoint's other inputs are kept. The device bytes are freed once the copy landed and the
caller dropped its own reference (a model that also keeps its layer inputs, ``output_hidden_states``, keeps
them: then the copy costs bandwidth only). The hooks are outside the checkpoint's own (which hold the layer's
saved activations), so nothing inside the layer is affected.

Only the first positional floating-point tensor argument is swapped (the hidden states: what the simulator's
``StepModel.input_swap`` counts); masks, position tables and keyword arguments stay where they are. A DTensor
input moves its local shard (Note: [DTensor swap]). Tests: tests/test_input_swap.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from ._footprint import FOOTPRINT
from ._native_swap import is_handle
from ._swap_engine import SwapEngine, no_cycle

__all__ = ["swapped_input_checkpoint"]


def _first_input(args: tuple) -> torch.Tensor | None:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or not first.is_floating_point() or isinstance(first, torch.nn.Parameter):
        return None
    return first


def swapped_input_checkpoint(fn: Callable[..., Any], *args: Any, engine: SwapEngine, layer: int, prefetch: int,
                             label: str, **kwargs: Any) -> Any:
    """``checkpoint(fn, *args, use_reentrant=False, **kwargs)`` with the first tensor argument swapped out
    between the forward and the recompute (Note: [swapped checkpoint input])."""
    first = _first_input(args)
    if first is None:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    key = first.untyped_storage()._cdata

    def pack(t: torch.Tensor) -> Any:
        if t.untyped_storage()._cdata == key:
            return engine.offload(no_cycle(t), label=label, layer=layer, prefetch=prefetch)
        return no_cycle(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack_saved):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def unpack_saved(x: Any) -> Any:
    FOOTPRINT.unpack += 1
    return x.unpack() if is_handle(x) else x
