"""Op-level paths of the :class:`~adaptive_mem.runtime._executor.Executor`: per-op decisions inside a layer.

* selective checkpoint (a layer in ``LayerMode.SAC``): the layer runs under a
  :class:`SacPolicy` that keeps, recomputes or swaps each aten op's output, and
  cache slots of swapped outputs are handed to the :class:`SwapEngine`;
* swap outside checkpointed layers: a dispatch mode (:class:`_Tracker`) records
  the unit that produced each storage, and saved-tensor hooks offload the
  saved tensors whose producer is a swap unit.

:class:`OpLevelPaths` is a mixin of ``Executor``; the attributes annotated on it
are set by ``Executor.__init__``.

Note: [compile honoured]. Dynamo cannot trace these two paths (a dispatch mode and
saved-tensor hooks; the SAC policy names each op by module), and a compiled frame
first entered under a non-infra dispatch mode is marked to run eager for good (the
block stays eager after ``remove()``, with 0 graphs and 0 graph breaks reported).
So both eager paths run outside dynamo on purpose: the eager selective-checkpoint forward
and every executor hook are ``torch.compiler.disable``d, and while the swap hooks are pushed
the model's forward is disabled and the stance is ``force_eager``, so compiled blocks run
eager without being marked, except those the executor wraps (Note: [swap around compiled blocks]
in ``_compiled_swap.py``: whole-layer swap and blocks without swaps stay compiled). A selective layer without swap units chooses at call time:
while dynamo traces it (``torch.compiler.is_compiling()``) it runs a plain checkpoint whose
``context_fn`` is the compile-mode policy (Note: [compiled SAC names]), and the namer hooks
are skipped (:func:`eager_only`), so select recompute stays inside the compiled block with
0 graph breaks; eager, it takes the eager path. Whole-layer and group recompute stay
traceable too (tests/test_compile_sac.py). When compiled blocks meet an eager-only path
(swap; a selective layer with swap units), one warning per
plan application names the blocks and the reason (:meth:`OpLevelPaths._check_compile`,
at install and at each forward until it has warned; guarded by
tests/test_compile_honoured.py).
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from profiler._paths import is_compile_wrapper
from profiler._units import UnitNamer
from search._plan import Action, Plan, matches

from ._compiled_sac import CompiledSacPolicy, compiled_sac_context
from ._layer_cache import cache_snapshot, replays_on_snapshot
from ._resolve import OUTSIDE_BEFORE, Resolution, decide, is_collective_unit, kept_collectives
from ._sac_policy import LayerTrace, OpCounter, SacPolicy, trace_layer
from ._swap_engine import Packed, SwapEngine, backs_parameter, local_shard, no_cycle

__all__ = ["OpLevelPaths", "SacLayer", "eager_only", "outside_dynamo"]

log = logging.getLogger(__name__)

_WHOLE_SWAP_WHY = ("a whole-model graph hands its saved tensors to autograd only at the end of its forward, too late "
                   "for offloading to lower the peak; compile each block instead (layer.compile() or "
                   "optimize(compile=...))")
_OP_SWAP_WHY = "the op that produced a saved tensor is not visible inside a compiled block; swap whole layers instead"
_SAC_WHY = ("its swap units are offloaded from the cache of the eager selective-checkpoint policy (a dispatch "
            "mode naming each op by module), which dynamo cannot trace")


def _is_compiled(module: nn.Module) -> bool:
    """``module.compile()``d, or torch.compile's ``OptimizedModule`` wrapper."""
    return getattr(module, "_compiled_call_impl", None) is not None or is_compile_wrapper(module)


def _in_optimized_module() -> bool:
    """True inside the call of a ``torch.compile(module)`` wrapper (the whole model compiled)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    check = getattr(eval_frame, "_is_in_optimized_module", None)
    return bool(check is not None and check())


def outside_dynamo(fn: Callable[..., Any], *, eager_callees: bool = False) -> Callable[..., Any]:
    """``fn`` never traced by dynamo; with ``eager_callees`` compiled modules it calls run eager, unmarked
    (Note: [compile honoured])."""
    if eager_callees:
        inner = fn

        @functools.wraps(inner)
        def fn(*args: Any, **kwargs: Any) -> Any:
            with torch.compiler.set_stance("force_eager"):
                return inner(*args, **kwargs)
    return torch.compiler.disable(fn)


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A hook run outside dynamo in eager code and skipped inside a compiled frame, where a call of a
    ``torch.compiler.disable``d function would break the graph (Note: [compile honoured])."""
    off = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return off(*args, **kwargs)
    return hook


def _span(container: str, indices: list[int]) -> str:
    """``layers.0-3``, ``layers.1, layers.3``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{container}.{r[0]}" + (f"-{r[-1]}" if len(r) > 1 else "") for r in runs)


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
        unit = ex.namer.name(func, args)
        if unit is None:
            return out
        info = ex._swap_info(unit)
        if info is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = local_shard(t).untyped_storage()  # Note: [DTensor swap]
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
        self.swaps = False  # some unit of the layer is swapped: the layer runs the eager policy
        self.compiled: list[CompiledSacPolicy] = []  # policies of the compiled bodies traced (Note: [compiled SAC names])


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
    _pushed: list[tuple[Any, ...] | None]
    _sac: dict[int, SacLayer]
    _orig: Callable[[int], Callable[..., Any]]
    _compile_warned: bool
    _blocks: Any  # CompiledBlocks (Note: [swap around compiled blocks])
    _cache_warned: set[str]

    # ================================================================== torch.compile (Note: [compile honoured])
    def _compiled_blocks(self, *, in_forward: bool) -> tuple[bool, list[int]]:
        """Whether the whole model is compiled, and the compiled blocks (also those compiled after install)."""
        whole = _is_compiled(self.model) or (in_forward and _in_optimized_module())
        info = self.res.layers
        blocks = [i for i in range(self.num_layers)
                  if _is_compiled(self.layers[i]) or _is_compiled(self.model.get_submodule(info.layer_path(i)))]
        return whole, blocks

    def eager_blocks(self) -> list[int]:
        """Layers whose compiled block runs eager under this plan: op-level swaps, select recompute with swaps."""
        out = set(self._blocks.op_swap) if self.engine is not None else set()
        return sorted(out | {i for i, st in self._sac.items() if st.swaps})

    def _check_compile(self, *, in_forward: bool = False) -> None:
        """Warn once when compiled blocks meet a path dynamo cannot trace."""
        if self._compile_warned or (self.engine is None and not self._sac):
            return
        whole, blocks = self._compiled_blocks(in_forward=in_forward)
        if not whole and not blocks:
            return
        container = self.res.layers.container if self.res.layers is not None else ""
        parts = []
        if self.engine is not None:
            op_swap = [i for i in blocks if i in self._blocks.op_swap]  # Note: [swap around compiled blocks]
            if whole:
                parts.append(f"swap of the whole model runs outside the compiled region: {_WHOLE_SWAP_WHY}")
            elif op_swap:
                parts.append(f"op-level swap of {_span(container, op_swap)} runs outside the compiled region: "
                             f"{_OP_SWAP_WHY}")
        sac = sorted(i for i, st in self._sac.items() if st.swaps and (whole or i in blocks))
        if sac:
            parts.append(f"select recompute of {_span(container, sac)} runs outside the compiled region: {_SAC_WHY}")
        if parts:
            self._compile_warned = True
            log.warning("adaptive_mem: %s; the blocks run eager", "; ".join(parts))

    def _watch_compile(self, module: nn.Module, args: Any) -> None:
        self._check_compile(in_forward=True)

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

        run = outside_dynamo(run, eager_callees=True)  # also when backward replays it

        def context_fn() -> tuple[Any, Any]:
            fwd_ctx, rec_ctx = create_selective_checkpoint_contexts(state.policy)
            contexts.append(fwd_ctx)
            return fwd_ctx, rec_ctx

        contexts: list[Any] = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return orig(*args, **kwargs)
            args, kwargs, fresh = cache_snapshot(layer, args, kwargs, self._cache_warned)  # Note: [cache in recompute]
            if state.trace is None:
                self._prepare_sac(state, layer, orig, *(fresh() if fresh is not None else (args, kwargs)))
            state.swap_outputs = {}
            contexts.clear()
            out = checkpoint(replays_on_snapshot(run, fresh), *args, use_reentrant=False, context_fn=context_fn,
                             **kwargs)
            if state.swap_outputs:
                self._swap_cache_entries(state, contexts[0])
            contexts.clear()
            return out
        eager = outside_dynamo(forward, eager_callees=True)
        cover = decide(self.plan, self.namer.paths[id(layer)]).action
        state.swaps = cover is Action.SWAP or any(
            d.action is Action.SWAP and matches(self.namer.paths[id(layer)], t) for t, d in self.plan.decisions.items())
        if state.swaps:  # Note: [compile honoured]: the swapped cache slots need the eager policy
            return eager
        inner = getattr(layer, "_orig_mod", None) if hasattr(layer, "dynamo_ctx") else None
        body = inner if inner is not None else orig
        actions: dict[str, str] = {}

        def action(unit: str) -> str:
            if unit not in actions:
                actions[unit] = decide(self.plan, unit).action.value
            return actions[unit]

        compiled_ctx = compiled_sac_context(namer=self.namer, layer=layer, action=action, seen=state.compiled)

        def traced(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                return eager(*args, **kwargs)
            if not torch.is_grad_enabled():
                return body(*args, **kwargs)
            args, kwargs, fresh = cache_snapshot(layer, args, kwargs, self._cache_warned)
            return checkpoint(replays_on_snapshot(body, fresh), *args, use_reentrant=False, context_fn=compiled_ctx,
                              **kwargs)
        return layer.dynamo_ctx(traced) if inner is not None else traced

    def _prepare_sac(self, state: SacLayer, layer: nn.Module, forward: Callable[..., Any], args: tuple,
                     kwargs: dict) -> None:
        state.trace = trace = trace_layer(layer, forward, state.counter, args, kwargs)
        prefix = self.namer.layers.layer_path(state.index) + "." if self.namer.layers else ""
        for target in (t for t in self.plan.decisions if t.startswith(prefix) and is_collective_unit(t)):
            if not any(matches(target, u) for u in trace.units):
                log.warning("plan target %s: layer %d issues no such collective (no tensor-parallel layout here); "
                            "it decides nothing", target, state.index)  # Note: [collective units]
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
                                 on_swap_output, cached=kept_collectives(self.plan, trace.units))

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
        t = no_cycle(t)
        if not self._producer or isinstance(t, nn.Parameter):
            return t
        st = local_shard(t).untyped_storage()
        info = self._producer.get(st._cdata)
        if info is None or info[0]() is not st:
            return t
        owner = self.layers[info[2]] if 0 <= info[2] < self.num_layers else self.model
        if backs_parameter(st, owner):  # Note: [parameter storages are never swapped] in _swap_engine.py
            return t
        return self.engine.offload(t, label=info[1], layer=info[2], prefetch=info[3])

    @staticmethod
    def _unpack(x: Any) -> Any:
        return x.unpack() if isinstance(x, Packed) else x

    def _push(self) -> None:
        if not torch.is_grad_enabled():
            self._pushed.append(None)
            return
        entry: tuple[Any, ...] = (torch.compiler.set_stance("force_eager"),  # Note: [compile honoured]
                                  torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        if self.res.swap_outside_sac:
            entry += (_Tracker(self),)
        for ctx in entry:
            ctx.__enter__()
        self._pushed.append(entry)

    def _pop(self) -> None:
        entry = self._pushed.pop()
        for ctx in reversed(entry or ()):
            ctx.__exit__(None, None, None)
