"""Selective checkpoint of the :class:`~adaptive_mem.runtime._executor.Executor`: a layer in ``LayerMode.SAC`` runs
under a :class:`SacPolicy` that keeps, recomputes or swaps each aten op's output, and the cache slots of swapped
outputs are handed to the :class:`SwapEngine`. Eager, the policy names each op by module (the namer's hooks) at
a learning call and answers from the table it learnt at the others (Note: [SAC table] in ``_sac_policy.py``), over
the innermost module holding the decided units where that is not the layer (Note: [narrowed select recompute]);
while dynamo traces a layer, the compile-mode policy names each op (Note: [compiled SAC names] in
``_compiled_sac.py``; Note: [compile honoured] in ``_op_level.py``).

Note: [select recompute with swaps, compiled]. A selective layer whose plan also swaps some of its units runs the
same compiled checkpoint as one without swaps: the compile-mode policy tags recompute units ``PREFER_RECOMPUTE``
and the others, swap units included, ``PREFER_SAVE``; the graph pass then swaps the saved values of the swap units
(Note: [graph swap names] in ``_graph_plan.py``). The saved values of the checkpointed region carry their forward
``nn_module_stack``, so they are named as outside it; recomputed ops in the backward graph carry their forward
``nn_module_stack`` but no ``fwd_nn_module_stack``, and the reload anchors read either (Note: [graph swap
placement]). Under a whole-model compile the model's graph is the plan's (``GraphPlan.owns``); a block compiled
on its own is wrapped and owned like a block holding op-level swaps (``CompiledBlocks.op_swap``: Note: [op-level
swap in a block]; its block has a graph of its own: Note: [a code per selective layer]), and no eager hook swaps
inside it. Eager, the layer keeps the eager policy, which offloads the swap units' slots of the
checkpoint cache. One difference: eager, a swap unit whose output a recomputed unit reads is kept (its cache slot
feeds the replay); compiled, that output is saved for the recompute in backward and swapped like any saved value.
Guarded by tests/test_compile_mixed.py and tests/test_compile_honoured.py.

Note: [a code per selective layer]. Dynamo compiles a selective layer's forward as a frame of its own and guards on
the layer's modules (and the namer's hooks on them under swaps), which differ per layer, so every selective block
compiles a graph of its own. Frames of one code object share dynamo's cache and its ``recompile_limit`` (8): with
one code for every selective forward, the blocks past the eighth (counted over every plan applied in the process)
would run eager. Each selective forward has a code object of its own (:func:`with_code`): one cache entry each, none
past the limit (tests/test_compile_mixed.py lowers the limit to 1).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from adaptive_mem.config._collective_names import layout_styles
from profiler.naming import is_compile_wrapper
from profiler.tracing import tensor_leaves, with_code
from search import Action, Plan
from search.planning import matches

from ._compiled_sac import CompiledSacPolicy, compiled_sac_context
from ._layer_cache import cache_snapshot, replays_on_snapshot
from ._op_level import outside_dynamo
from ._pack_recompute import PackOp, PackRecompute, op_units, pack_units
from ._plan_context import PlanContext
from ._resolve import decide, is_collective_unit, kept_collectives
from ._sac_policy import (LayerTrace, OpCounter, SacPolicy, TablePolicy, is_dtensor, region_path, trace_layer,
                          under)

__all__ = ["SacLayer", "SelectiveLayers", "swaps_inside"]

log = logging.getLogger(__name__)


def swaps_inside(plan: Plan, path: str) -> bool:
    """Some unit of the layer at ``path`` is swapped (Note: [select recompute with swaps, compiled])."""
    return decide(plan, path).action is Action.SWAP or any(
        d.action is Action.SWAP and matches(path, t) for t, d in plan.decisions.items())


class _SwappedEntry:
    """Stands in a selective-checkpoint cache slot for a swapped output; reloads on first use."""

    def __init__(self, packed: Any) -> None:
        self.packed: Any = packed  # the swap engine's handle

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        packed, self.packed = self.packed, None
        assert packed is not None, "selective-checkpoint cache entry read twice"
        return packed.unpack()


class SacLayer:
    """Per-layer state of a selectively checkpointed layer (traced on its first call with grad)."""

    def __init__(self, index: int, counter: OpCounter, hooked: bool) -> None:
        self.index = index
        self.counter = counter
        self.hooked = hooked
        """The executor's namer hooks sit on the layer's modules (swaps in the plan); else a learning call adds its
        own for that call (Note: [SAC table])."""
        self.trace: LayerTrace | None = None
        self.actions: dict[str, str] = {}
        self.named: Callable[[], SacPolicy] | None = None
        self.policy: SacPolicy | TablePolicy | None = None
        self.table: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None
        self.tabled = False
        """No swap unit in the layer: calls after a learning one run the table (Note: [SAC table])."""
        self.region: nn.Module | None = None
        """The module checkpointed instead of the layer (Note: [narrowed select recompute])."""
        self.region_forward: Callable[..., Any] | None = None
        self.packed = False
        """Its units are recomputed by saved-tensor hooks, no checkpoint (Note: [recompute at pack])."""
        self.calls = 0
        self.swap_outputs: dict[int, str] = {}
        self.swap_slots: dict[tuple[Any, int], str] = {}
        """Cache slots ``(func, index)`` of swap units where the policy sees no output (Note: [swap slots without
        op_output] in ``_sac_policy.py``)."""
        self.compiled: list[CompiledSacPolicy] = []  # policies of the compiled bodies traced (Note: [compiled SAC names])


class SelectiveLayers:
    """The selectively checkpointed layers of one plan: ``states`` by layer index."""

    def __init__(self, ctx: PlanContext) -> None:
        self.ctx = ctx
        self.states: dict[int, SacLayer] = {}
        self.on_hooks: Callable[[], None] = lambda: None
        """Runs after hooks are registered at a layer's first call (the copy guard takes them in)."""

    def hooked(self, i: int) -> bool:
        """Layer ``i`` needs the executor's namer hooks on its modules: the plan swaps inside it or outside SAC."""
        ctx = self.ctx
        return ctx.res.swap_outside_sac or swaps_inside(ctx.plan, ctx.res.layers.layer_path(i))

    def forward(self, i: int) -> Callable[..., Any]:
        """Layer ``i``'s forward under selective checkpoint."""
        ctx = self.ctx
        layer = ctx.layers[i]
        orig = ctx.orig(i)
        state = self.states[i] = SacLayer(i, OpCounter(ctx.namer), self.hooked(i))
        eager = outside_dynamo(self._eager_forward(state, layer, orig), eager_callees=True)
        return self._compilable_forward(state, layer, orig, eager)

    def _runner(self, state: SacLayer, root: nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (the checkpointed body of ``root``), its ops named from ``root`` down and blind to the op tracker;
        outside dynamo, also when backward replays it."""
        ctx = self.ctx

        def run(*args: Any, **kwargs: Any) -> Any:
            saved_stack = ctx.namer._stack
            ctx.namer._stack = [(root, {})]
            state.counter.reset()
            ctx.opaque += 1
            try:
                return fn(*args, **kwargs)
            finally:
                ctx.opaque -= 1
                ctx.namer._stack = saved_stack
        return outside_dynamo(run, eager_callees=True)

    def _eager_forward(self, state: SacLayer, layer: nn.Module, orig: Callable[..., Any]) -> Callable[..., Any]:
        """The checkpoint under the eager policy, whose replay names its ops from the layer down."""
        ctx = self.ctx
        run = self._runner(state, layer, orig)
        contexts: list[Any] = []

        def context_fn() -> tuple[Any, Any]:
            fwd_ctx, rec_ctx = create_selective_checkpoint_contexts(state.policy)
            contexts.append(fwd_ctx)
            if isinstance(state.policy, SacPolicy):
                state.policy.storage = fwd_ctx.storage  # Note: [swap slots without op_output]
            return fwd_ctx, rec_ctx

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or state.packed:
                return orig(*args, **kwargs)
            if state.region is not None:
                return self._region_call(state, orig, args, kwargs)
            args, kwargs, fresh = cache_snapshot(layer, args, kwargs, ctx.cache_warned)  # Note: [cache in recompute]
            if state.trace is None:
                self._prepare(state, layer, orig, *(fresh() if fresh is not None else (args, kwargs)))
                if fresh is None and self._narrow(state, layer):
                    return self._region_call(state, orig, args, kwargs)
                if state.packed:
                    return orig(*args, **kwargs)
            state.swap_outputs, state.swap_slots = {}, {}
            contexts.clear()
            with self._policy(state, layer):
                out = checkpoint(replays_on_snapshot(run, fresh), *args, use_reentrant=False, context_fn=context_fn,
                                 **kwargs)
            if state.swap_outputs or state.swap_slots:
                self._swap_cache_entries(state, contexts[0])
            contexts.clear()
            return out
        return forward

    @contextlib.contextmanager
    def _policy(self, state: SacLayer, root: nn.Module) -> Iterator[None]:
        """The policy of one call of ``root``'s checkpoint: the table when learnt, else the naming policy (with the
        namer's hooks on ``root``'s modules for the call), whose answers become the table (Note: [SAC table])."""
        if state.table is not None:
            state.policy = table = TablePolicy(*state.table)
            yield
            if not table.finished():
                state.table = None
            return
        assert state.named is not None
        state.policy = named = state.named()
        with self._namer_hooks(state, root):
            yield
        if state.tabled:
            state.table = (tuple(named.funcs), tuple(named.policies))

    @contextlib.contextmanager
    def _namer_hooks(self, state: SacLayer, root: nn.Module) -> Iterator[None]:
        """The namer's enter / exit hooks on the modules under ``root`` for one call, unless the executor's are there
        (the checkpointed body starts the namer's stack at ``root``: :meth:`_runner`)."""
        namer = self.ctx.namer
        handles = []
        if not state.hooked:
            for module in root.modules():
                if module is root or id(module) not in namer.paths:
                    continue
                layout = any(True for _ in layout_styles(module))  # Note: [collective units]
                handles.append(module.register_forward_pre_hook(lambda m, a: namer.enter(m), prepend=layout))
                handles.append(module.register_forward_hook(lambda m, a, o: namer.exit(m), always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _narrow(self, state: SacLayer, layer: nn.Module) -> bool:
        """After the layer's trace: install Note: [recompute at pack] (``state.packed``), else choose the region of
        Note: [narrowed select recompute] (True); False: the layer is checkpointed."""
        trace, ctx = state.trace, self.ctx
        assert trace is not None
        paths = {ctx.namer.paths[id(m)]: m for m in layer.modules() if id(m) in ctx.namer.paths}
        # a layer without swaps: swaps of other layers chain through its hooks (Note: [scope hooks chain outward])
        plain = not swaps_inside(ctx.plan, ctx.res.layers.layer_path(state.index)) and state.tabled \
            and not any(is_collective_unit(u) for u in trace.units) \
            and not any(is_dtensor(p) for p in layer.parameters())  # Note: [tensor-parallel trace]
        leaf = lambda m: id(m) in ctx.namer.leaves  # noqa: E731
        units = pack_units(trace, state.actions, paths, leaf) if plain else None
        ops = op_units(trace, state.actions, paths, leaf) if plain and units is None else None
        if units is not None or ops is not None:  # Note: [recompute at pack], [single-op recompute at pack]
            for unit, readers in (units or {}).items():
                owner = next(p for p in sorted(paths, key=len, reverse=True) if under(unit, p))
                PackRecompute(paths[owner], [paths[r] for r in readers]).install(ctx.handles)
            for node, func, producers, readers in (ops or {}).values():
                PackOp(node, func, [paths[p] for p in producers], [paths[r] for r in readers]).install(ctx.handles)
            self.on_hooks()
            state.packed = True
            return False
        path = region_path(trace, state.actions, paths) if plain else None
        module = paths.get(path) if path is not None else None
        if module is None or module is layer or "forward" in module.__dict__ or is_compile_wrapper(module) \
                or getattr(module, "_compiled_call_impl", None) is not None:
            return False
        run = self._runner(state, module, type(module).forward.__get__(module))
        context_fn = lambda: create_selective_checkpoint_contexts(state.policy)  # noqa: E731

        def region_forward(*args: Any, **kwargs: Any) -> Any:
            state.calls += 1
            args, kwargs, fresh = cache_snapshot(module, args, kwargs, ctx.cache_warned)
            return checkpoint(replays_on_snapshot(run, fresh), *args, use_reentrant=False, context_fn=context_fn,
                              **kwargs)
        state.region, state.region_forward = module, region_forward
        return True

    def _region_call(self, state: SacLayer, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One layer call with its region checkpointed (an instance forward for the call); the region must run once
        and, at a learning call, run the ops the trace gave it, else the layer is checkpointed from its next call."""
        region = state.region
        assert region is not None and state.trace is not None
        learning = state.table is None
        state.calls = 0
        region.__dict__["forward"] = state.region_forward
        try:
            with self._policy(state, region):
                out = orig(*args, **kwargs)
        finally:
            del region.__dict__["forward"]
        path = self.ctx.namer.paths[id(region)]
        if state.calls != 1 or learning and [k for k in state.policy.keys if k is not None] != [
                k for k in state.trace.ops if under(k[0], path)]:
            state.region = state.region_forward = state.table = None
        return out

    def _compilable_forward(self, state: SacLayer, layer: nn.Module, orig: Callable[..., Any],
                            eager: Callable[..., Any]) -> Callable[..., Any]:
        """Eager: ``eager``; while dynamo traces the layer: a checkpoint under the compile-mode policy."""
        ctx = self.ctx
        inner = getattr(layer, "_orig_mod", None) if hasattr(layer, "dynamo_ctx") else None
        body = inner if inner is not None else orig
        actions: dict[str, str] = {}

        def action(unit: str) -> str:
            if unit not in actions:
                actions[unit] = decide(ctx.plan, unit).action.value
            return actions[unit]

        compiled_ctx = compiled_sac_context(namer=ctx.namer, layer=layer, action=action, seen=state.compiled)

        def traced(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                return eager(*args, **kwargs)
            if not torch.is_grad_enabled():
                return body(*args, **kwargs)
            args, kwargs, fresh = cache_snapshot(layer, args, kwargs, ctx.cache_warned)
            return checkpoint(replays_on_snapshot(body, fresh), *args, use_reentrant=False, context_fn=compiled_ctx,
                              **kwargs)
        traced = with_code(traced)  # Note: [a code per selective layer]
        return layer.dynamo_ctx(traced) if inner is not None else traced

    def _prepare(self, state: SacLayer, layer: nn.Module, forward: Callable[..., Any], args: tuple,
                 kwargs: dict) -> None:
        ctx = self.ctx
        state.trace = trace = trace_layer(layer, forward, state.counter, args, kwargs)
        prefix = ctx.namer.layers.layer_path(state.index) + "." if ctx.namer.layers else ""
        for target in (t for t in ctx.plan.decisions if t.startswith(prefix) and is_collective_unit(t)):
            if not any(matches(target, u) for u in trace.units):
                log.warning("plan target %s: layer %d issues no such collective (no tensor-parallel layout here); "
                            "it decides nothing", target, state.index)  # Note: [collective units]
        actions = {u: decide(ctx.plan, u).action for u in trace.units}
        for unit in trace.units:
            if actions[unit] is Action.SWAP:
                recomputed = sorted(c for c in trace.consumers.get(unit, ()) if actions.get(c) is Action.RECOMPUTE)
                if recomputed:
                    log.info("Swap of %s dropped: its output is consumed by recomputed %s", unit, recomputed[0])
                    actions[unit] = Action.KEEP
        state.actions = {u: a.value for u, a in actions.items()}
        if ctx.engine is None:
            assert all(a != "swap" for a in state.actions.values())

        def on_swap_output(out: Any, unit: str) -> None:
            for t in tensor_leaves(out):
                state.swap_outputs[t.untyped_storage()._cdata] = unit

        cached = kept_collectives(ctx.plan, trace.units)
        def named() -> SacPolicy:
            policy = SacPolicy(state.counter, trace,
                               lambda unit: state.actions.get(unit) or decide(ctx.plan, unit).action.value,
                               on_swap_output, cached=cached)
            policy.on_swap_slot = lambda func, index, unit: state.swap_slots.__setitem__((func, index), unit)
            return policy
        state.named = named
        state.tabled = all(a != "swap" for a in state.actions.values())

    def _swap_cache_entries(self, state: SacLayer, fwd_ctx: Any) -> None:
        """Offload the selective-checkpoint cache slots holding outputs of swap units (private SAC storage:
        ``{key: {index: tree of _VersionWrapper}}``; guarded by the mixed-layer tests)."""
        engine = self.ctx.engine
        assert engine is not None

        def swap(leaf: Any, slot_unit: str | None = None) -> Any:
            val = getattr(leaf, "val", None)
            if not isinstance(val, torch.Tensor):
                return leaf
            unit = slot_unit or state.swap_outputs.get(val.untyped_storage()._cdata)
            if unit is None:
                return leaf
            prefetch = decide(self.ctx.plan, unit).backward_prefetch
            return _SwappedEntry(engine.offload(val, label=unit, layer=state.index, prefetch=prefetch))

        for key, slots in fwd_ctx.storage.items():
            keys = slots.keys() if isinstance(slots, dict) else range(len(slots))
            for k in list(keys):
                unit = state.swap_slots.get((key, k))  # Note: [swap slots without op_output]
                slots[k] = tree_map(lambda leaf, unit=unit: swap(leaf, unit), slots[k])
