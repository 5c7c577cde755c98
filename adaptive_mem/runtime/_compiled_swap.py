"""Compiled blocks under a plan with swaps: each block's call is wrapped outside its compiled frame.

Note: [swap around compiled blocks]. While the swap hooks are pushed the stance is ``force_eager`` and the
op tracker (a dispatch mode) is active (Note: [compile honoured] in ``_op_level.py``). A compiled block
(``layer.compile()``: its ``_compiled_call_impl``; torch.compile's ``OptimizedModule`` at the layer's
path: its ``forward``) gets one wrapper, run outside dynamo, that pops the tracker, restores the default
stance and so runs the block compiled. Saved-tensor hooks entered around a compiled block see every
tensor its compiled function saves, at the end of the block's forward. In a block whose layer the
plan swaps as a whole, the wrapper's hooks offload each of them through the :class:`SwapEngine`
except parameters, buffers and their views (same storage), and tensors sharing a storage with the
block's inputs, which go to the model-level hook (offloaded when a swap unit outside produced them).
The block's outputs are recorded as produced by the swapped layer (saved later, they are offloaded
as the eager path would). The prefetch trigger is a hook on the block's output registered by the
wrapper, in eager code.
The executor's hooks on modules inside a wrapped block are removed (inside the compiled frame each
would be a graph break; a selective layer keeps its namer hooks, skipped while compiling). A block holding
op-level swaps is wrapped too, without the hooks: its swaps are placed in its compiled graph (Note: [op-level
swap in a block]), as are those of a selective layer with swap units (Note: [select recompute with swaps,
compiled] in ``_selective.py``). Guarded by tests/test_compile_swap.py, tests/test_compile_honoured.py and
tests/test_compile_mixed.py.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from profiler.naming import is_compile_wrapper
from profiler.tracing import fresh_code, tensor_leaves, with_code

from ._op_swap import OpSwaps
from ._plan_context import PlanContext
from ._resolve import LayerMode
from ._selective import swaps_inside
from ._swap_engine import local_shard
from ._swap_scopes import produced, storage_keys, whole_swap_prefetch

__all__ = ["CompiledBlocks"]

log = logging.getLogger(__name__)

_MARK = "_adaptive_mem_block"


class CompiledBlocks:
    """The compiled-block wrappers of one executor (Note: [swap around compiled blocks])."""

    def __init__(self, ctx: PlanContext, swaps: OpSwaps, sac: dict[int, Any], on_wrap: Callable[[], None]) -> None:
        """``sac``: the selectively checkpointed layers' states by index (``SelectiveLayers.states``); ``on_wrap``
        runs after new blocks are wrapped (the copy guard takes them in: Note: [copy drops the plan])."""
        self.ctx = ctx
        self.swaps = swaps
        self.sac = sac
        self.on_wrap = on_wrap
        self.handles: dict[int, list[Any]] = {}
        self.layer_hooks: dict[int, list[Any]] = {}  # the executor's hooks on the layer module itself
        self.attrs: list[tuple[nn.Module, str, bool, Any, Any]] = []  # (module, name, had, old, wrapper)
        self.whole_swap = self._whole_swap_layers()
        self.op_swap = [i for i, m in enumerate(ctx.res.modes) if m is LayerMode.SWAP and i not in self.whole_swap
                        or m is LayerMode.SAC and swaps_inside(ctx.plan, ctx.res.layers.layer_path(i))]
        """Layers holding op-level swaps, selective ones too: compiled, their block graphs swap (Note: [op-level swap
        in a block], Note: [select recompute with swaps, compiled] in ``_selective.py``)."""
        self._codes: dict[tuple, Any] = {}
        self._slots = [_slot(ctx, i) for i in range(ctx.num_layers)] if ctx.res.layers is not None else []
        """Per layer, (its parent module, its name there) where found, to see at each forward without a path walk
        that nothing compiled it (:meth:`_plain`)."""
        self._warned = False
        self._limit_warned = False

    def _whole_swap_layers(self) -> dict[int, int]:
        """Layers the plan swaps as a whole -> their backward prefetch; a whole-layer recompute with its input
        swapped too (what its compiled block saves is that input: Note: [swapped checkpoint input])."""
        ctx = self.ctx
        out = dict(ctx.res.input_swaps)
        for i in range(ctx.num_layers):
            prefetch = whole_swap_prefetch(ctx, i)
            if prefetch is not None:
                out[i] = prefetch
        return out

    def track(self, layer: int | None, handle: Any, *, on_layer: bool = False) -> None:
        if layer is not None:
            self.handles.setdefault(layer, []).append(handle)
            if on_layer:
                self.layer_hooks.setdefault(layer, []).append(handle)

    def _plain(self, i: int) -> bool:
        """Layer ``i`` is neither compiled in place nor replaced by a compiled wrapper at its path (the cheap form
        of :meth:`_target` is None, run at every planned forward)."""
        layer = self.ctx.layers[i]
        parent, name = self._slots[i]
        return (parent is not None and parent._modules.get(name) is layer and not is_compile_wrapper(layer)
                and layer.__dict__.get("_compiled_call_impl") is None)

    def _target(self, i: int) -> tuple[nn.Module, str] | None:
        ctx = self.ctx
        current = ctx.model.get_submodule(ctx.res.layers.layer_path(i))
        for module in (current, ctx.layers[i]):
            if is_compile_wrapper(module):
                return module, "forward"
        for module in (ctx.layers[i], current):
            if getattr(module, "_compiled_call_impl", None) is not None:
                return module, "_compiled_call_impl"
        return None

    def sync(self) -> None:
        """Wrap the blocks compiled since the last call (at each planned forward; outside dynamo)."""
        ctx = self.ctx
        if ctx.res.layers is None:
            return
        changed = False
        for i in range(ctx.num_layers):
            if self._plain(i):
                continue
            sac = self.sac.get(i)
            target = self._target(i)
            if target is None:
                continue
            module, name = target
            old = module.__dict__.get(name)
            if getattr(old, _MARK, False):
                continue
            # a selective layer keeps its namer hooks (skipped while compiling, Note: [compiled SAC names])
            for handle in self.handles.pop(i, ()) if sac is None else self.layer_hooks.get(i, ()):
                handle.remove()
            if i in self.op_swap and sac is None:  # a selective layer's forward is its own already
                self._own_graph(i)
            wrapper = self._wrap(i, old if old is not None else getattr(module, name))
            self.attrs.append((module, name, name in module.__dict__, old, wrapper))
            module.__dict__[name] = wrapper
            changed = True
        if changed:
            self.on_wrap()

    def _signature(self, i: int) -> tuple:
        """Layer ``i``'s swap decisions in local names: layers with equal signatures may share one block graph."""
        ctx = self.ctx
        path = ctx.res.layers.layer_path(i)
        return tuple(sorted((t[len(path) + 1:], d.action.value, d.backward_prefetch)
                            for t, d in ctx.plan.decisions.items() if t.startswith(path + ".")))

    def _own_graph(self, i: int) -> None:
        """Note: [op-level swap in a block]. Dynamo compiles one graph for every block of a class (the modules are
        inlined, their parameters are inputs), so a block holding op-level swaps gets an instance forward whose code
        object is one per swap signature (:meth:`_signature`): dynamo guards on the forward's code, compiles one graph
        per signature, and the graph pass (Note: [partitioner hook] in ``profiler/_partitions.py``) places that signature's
        swaps in it, the reload at the start of the block's backward at the latest (a block's backward graph holds
        no other layer). Blocks of one signature share its graph, which is right: their decisions are the same."""
        if "forward" in self.ctx.layers[i].__dict__:
            return
        own = _own_forward(self.ctx.orig(i))
        sig = self._signature(i)
        if sig not in self._codes:
            self._codes[sig] = fresh_code(own)
            self._check_limit(i)
        self.ctx.set_forward(i, with_code(own, self._codes[sig]))

    def remove(self) -> None:
        for module, name, had, old, wrapper in reversed(self.attrs):
            if module.__dict__.get(name) is wrapper:
                if had:
                    module.__dict__[name] = old
                else:
                    del module.__dict__[name]
        self.attrs.clear()
        self.handles.clear()

    def _wrap(self, i: int, call: Callable[..., Any]) -> Callable[..., Any]:
        ctx = self.ctx
        prefetch = self.whole_swap.get(i)

        def block(*args: Any, **kwargs: Any) -> Any:
            entry = self.swaps.pushed[-1] if self.swaps.pushed else None
            if entry is None:  # no grad, or called outside the planned model's forward
                return call(*args, **kwargs)
            self.swaps.last_layer = i
            with contextlib.ExitStack() as stack:
                tracker = entry[-1] if len(entry) > 2 else None
                if tracker is not None and _get_current_dispatch_mode() is not tracker:
                    self._warn_mode(i)
                    self.swaps.quiet_layer = True  # the namer's hooks inside the block are gone
                else:
                    if tracker is not None:
                        stack.enter_context(_pop_mode_temporarily())
                    stack.enter_context(torch.compiler.set_stance("default"))
                if prefetch is not None:
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                        self._packer(i, prefetch, args, kwargs), self.swaps.unpack))
                out = call(*args, **kwargs)
            self.swaps.quiet_layer = False
            if prefetch is not None and i not in ctx.res.input_swaps:  # its outputs are the swapped layer's, as the
                # op tracker records them eagerly
                label = ctx.res.layers.layer_path(i)
                for t in tensor_leaves(out):
                    produced(self.swaps.producer, t, label, i, prefetch)
            self.swaps.on_grad_of(out, i)
            return out

        setattr(block, _MARK, True)
        return torch.compiler.disable(block)

    def _packer(self, i: int, prefetch: int, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], Any]:
        ctx = self.ctx
        layer = ctx.layers[i]
        label = ctx.res.layers.layer_path(i)
        inputs = storage_keys((args, kwargs))
        frozen = {local_shard(t).untyped_storage()._cdata for t in (*layer.parameters(), *layer.buffers())}

        def pack(t: torch.Tensor) -> Any:
            key = local_shard(t).untyped_storage()._cdata  # Note: [DTensor swap]: the local shard's storage
            if key in inputs and i not in ctx.res.input_swaps:
                return self.swaps.pack(t)
            if isinstance(t, nn.Parameter) or key in frozen:
                return t
            return ctx.engine.offload(t, label=label, layer=i, prefetch=prefetch)
        return pack

    def _check_limit(self, i: int) -> None:
        """One warning when the block graphs (the shared one and one per swap signature) pass dynamo's recompile
        limit: dynamo runs the blocks past it eager, where their op-level swaps are not made (gradients unchanged)."""
        import torch._dynamo.config as dynamo_config

        limit = int(getattr(dynamo_config, "recompile_limit", getattr(dynamo_config, "cache_size_limit", 8)))
        if len(self._codes) + 1 > limit and not self._limit_warned:
            self._limit_warned = True
            log.warning("adaptive_mem: op-level swaps of %d distinct layer patterns (from %s) need %d block graphs, "
                        "over torch._dynamo.config.recompile_limit=%d: blocks past it run eager without their "
                        "op-level swaps; swap whole layers, use fewer patterns, compile the whole model, or raise "
                        "the limit", len(self._codes), self.ctx.res.layers.layer_path(i), len(self._codes) + 1, limit)

    def _warn_mode(self, i: int) -> None:
        if not self._warned:
            self._warned = True
            log.warning("adaptive_mem: compiled block %s runs eager: a dispatch mode entered inside the model's "
                        "forward sits above the swap engine's op tracker", self.ctx.res.layers.layer_path(i))


def _slot(ctx: PlanContext, i: int) -> tuple[nn.Module | None, str]:
    """Layer ``i``'s parent module and its name there; ``(None, "")`` where the path does not resolve plainly."""
    parent_path, _, name = ctx.res.layers.layer_path(i).rpartition(".")
    try:
        parent = ctx.model.get_submodule(parent_path) if parent_path else ctx.model
    except AttributeError:
        return None, ""
    return (parent, name) if parent._modules.get(name) is ctx.layers[i] else (None, "")


def _own_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The template of a block's own forward (Note: [op-level swap in a block]): its code is copied per signature."""
    def own_forward(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)
    return own_forward
