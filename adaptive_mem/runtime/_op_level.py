"""Op-level paths of the :class:`~adaptive_mem.runtime._executor.Executor`: per-op decisions inside a layer.

* selective checkpoint (a layer in ``LayerMode.SAC``): the layer runs under a
  :class:`SacPolicy` that keeps, recomputes or swaps each aten op's output, and
  cache slots of swapped outputs are handed to the :class:`SwapEngine`;
* swap outside checkpointed layers: a dispatch mode (:class:`_Tracker`) records
  the unit that produced each storage, and saved-tensor hooks offload the
  saved tensors whose producer is a swap unit.

:class:`OpLevelPaths` is a mixin of ``Executor``; the attributes annotated on it
are set by ``Executor.__init__``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from profiler._units import UnitNamer
from search._plan import Action, Plan

from ._resolve import OUTSIDE_BEFORE, Resolution, decide
from ._sac_policy import LayerTrace, OpCounter, SacPolicy, trace_layer
from ._swap_engine import Packed, SwapEngine

__all__ = ["OpLevelPaths", "SacLayer"]

log = logging.getLogger(__name__)

class _Tracker(TorchDispatchMode):
    """Records which swap unit produced each storage during forward."""

    def __init__(self, executor: "OpLevelPaths") -> None:
        super().__init__()
        self.ex = executor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ex = self.ex
        if ex._opaque or ex._quiet_layer:
            return out
        unit = ex.namer.name(func)
        if unit is None:
            return out
        info = ex._swap_info(unit)
        if info is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    ex._producer[st._cdata] = (weakref.ref(st), unit, info[0], info[1])
        return out


class _SwappedEntry:
    """Stands in a selective-checkpoint cache slot for a swapped output; reloads on first use."""

    def __init__(self, packed: Packed) -> None:
        self.packed: Packed | None = packed

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        packed, self.packed = self.packed, None
        assert packed is not None, "selective-checkpoint cache entry read twice"
        return packed.unpack()


class SacLayer:
    """Per-layer state of a selectively checkpointed layer (traced on its first call with grad)."""

    def __init__(self, index: int, counter: OpCounter) -> None:
        self.index = index
        self.counter = counter
        self.trace: LayerTrace | None = None
        self.actions: dict[str, str] = {}
        self.policy: SacPolicy | None = None
        self.swap_outputs: dict[int, str] = {}


class OpLevelPaths:
    """The op-level half of ``Executor``: selective checkpoint and swap of saved tensors by producing op."""

    model: nn.Module
    plan: Plan
    res: Resolution
    namer: UnitNamer
    num_layers: int
    layers: list[nn.Module]
    engine: SwapEngine | None
    _opaque: int  # > 0 inside a checkpointed layer: the tracker does not name its ops
    _producer: dict[int, tuple[Any, str, int, int]]
    _swap_cache: dict[str, tuple[int | None, int] | None]
    _last_layer: int | None
    _quiet_layer: bool
    _pushed: list[tuple[Any, Any] | None]
    _sac: dict[int, SacLayer]
    _orig: Callable[[int], Callable[..., Any]]

    # ================================================================== selective checkpoint
    def _selective(self, i: int) -> Callable[..., Any]:
        orig = self._orig(i)
        layer = self.layers[i]
        state = self._sac[i]

        def run(*args: Any, **kwargs: Any) -> Any:
            saved_stack = self.namer._stack
            self.namer._stack = [(layer, {})]
            state.counter.reset()
            self._opaque += 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._opaque -= 1
                self.namer._stack = saved_stack

        def context_fn() -> tuple[Any, Any]:
            fwd_ctx, rec_ctx = create_selective_checkpoint_contexts(state.policy)
            contexts.append(fwd_ctx)
            return fwd_ctx, rec_ctx

        contexts: list[Any] = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return orig(*args, **kwargs)
            if state.trace is None:
                self._prepare_sac(state, run, args, kwargs)
            state.swap_outputs = {}
            contexts.clear()
            out = checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
            if state.swap_outputs:
                self._swap_cache_entries(state, contexts[0])
            contexts.clear()
            return out
        return forward

    def _prepare_sac(self, state: SacLayer, run: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        state.trace = trace = trace_layer(run, state.counter, args, kwargs)
        actions = {u: decide(self.plan, u).action for u in trace.units}
        for unit in trace.units:
            if actions[unit] is Action.SWAP:
                recomputed = sorted(c for c in trace.consumers.get(unit, ()) if actions.get(c) is Action.RECOMPUTE)
                if recomputed:
                    log.info("Swap of %s dropped: its output is consumed by recomputed %s", unit, recomputed[0])
                    actions[unit] = Action.KEEP
        state.actions = {u: a.value for u, a in actions.items()}
        if self.engine is None:
            assert all(a != "swap" for a in state.actions.values())

        def on_swap_output(out: Any, unit: str) -> None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    state.swap_outputs[t.untyped_storage()._cdata] = unit

        state.policy = SacPolicy(state.counter, trace,
                                 lambda unit: state.actions.get(unit) or decide(self.plan, unit).action.value,
                                 on_swap_output)

    def _swap_cache_entries(self, state: SacLayer, fwd_ctx: Any) -> None:
        """Offload the selective-checkpoint cache slots holding outputs of swap units (private SAC storage:
        ``{key: {index: tree of _VersionWrapper}}``; guarded by the mixed-layer tests)."""
        engine = self.engine
        assert engine is not None

        def swap(leaf: Any) -> Any:
            val = getattr(leaf, "val", None)
            if not isinstance(val, torch.Tensor):
                return leaf
            unit = state.swap_outputs.get(val.untyped_storage()._cdata)
            if unit is None:
                return leaf
            prefetch = decide(self.plan, unit).backward_prefetch
            return _SwappedEntry(engine.offload(val, label=unit, layer=state.index, prefetch=prefetch))

        for slots in fwd_ctx.storage.values():
            keys = slots.keys() if isinstance(slots, dict) else range(len(slots))
            for k in list(keys):
                slots[k] = tree_map(swap, slots[k])

    # ================================================================== swap outside checkpoints
    def _swap_info(self, unit: str) -> tuple[int, int] | None:
        """``(layer index, backward_prefetch)`` of a swap unit, None for the others (Semantics: Swap)."""
        if unit not in self._swap_cache:
            decision = decide(self.plan, unit)
            layer, _ = self.namer.split(unit)
            self._swap_cache[unit] = (layer, decision.backward_prefetch) if decision.action is Action.SWAP else None
        info = self._swap_cache[unit]
        if info is None or info[0] is not None:
            return info
        outside = OUTSIDE_BEFORE if self._last_layer is None else self.num_layers
        return outside, info[1]

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._producer or isinstance(t, nn.Parameter):
            return t
        st = t.untyped_storage()
        info = self._producer.get(st._cdata)
        if info is None or info[0]() is not st:
            return t
        return self.engine.offload(t, label=info[1], layer=info[2], prefetch=info[3])

    @staticmethod
    def _unpack(x: Any) -> Any:
        return x.unpack() if isinstance(x, Packed) else x

    def _push(self) -> None:
        if not torch.is_grad_enabled():
            self._pushed.append(None)
            return
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        tracker = _Tracker(self) if self.res.swap_outside_sac else None
        hooks.__enter__()
        if tracker is not None:
            tracker.__enter__()
        self._pushed.append((hooks, tracker))

    def _pop(self) -> None:
        entry = self._pushed.pop()
        if entry is not None:
            hooks, tracker = entry
            if tracker is not None:
                tracker.__exit__(None, None, None)
            hooks.__exit__(None, None, None)
