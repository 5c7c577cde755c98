"""Swaps outside checkpointed layers, for the :class:`~adaptive_mem.runtime._executor.Executor`: a dispatch mode
(:class:`_Tracker`) records the unit that produced each storage, and saved-tensor hooks offload the saved tensors
whose producer is a swap unit through the :class:`SwapEngine`. Hooks on the model and on each layer push those
hooks around the model's forward and trigger prefetches in backward (a tensor hook on each layer's output, and on
the model's output). Everything here runs outside dynamo (Note: [compile honoured] in ``_op_level.py``).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from profiler.naming import is_compile_wrapper
from profiler.tracing import with_code
from search import Action

from ._footprint import FOOTPRINT
from ._op_level import eager_only, outside_dynamo
from ._plan_context import PlanContext
from ._resolve import OUTSIDE_BEFORE, LayerMode, decide
from ._swap_engine import Packed, backs_parameter, local_shard, no_cycle

__all__ = ["OpSwaps"]


class _Tracker(TorchDispatchMode):
    """Records which swap unit produced each storage during forward."""

    def __init__(self, swaps: "OpSwaps") -> None:
        super().__init__()
        self.swaps = swaps

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        FOOTPRINT.dispatch += 1
        out = func(*args, **(kwargs or {}))
        swaps = self.swaps
        if swaps.ctx.opaque or swaps.quiet_layer:
            return out
        unit = swaps.ctx.namer.name(func, args)
        if unit is None:
            return out
        info = swaps.swap_info(unit)
        if info is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = local_shard(t).untyped_storage()  # Note: [DTensor swap]
                    swaps.producer[st._cdata] = (weakref.ref(st), unit, info[0], info[1])
        return out


class OpSwaps:
    """The swap path of one plan: producers of swap storages, the pushed saved-tensor hooks, the prefetch triggers.

    ``on_forward`` runs at the start of each outermost planned forward, after the engine begins it."""

    def __init__(self, ctx: PlanContext, on_forward: Callable[[], None]) -> None:
        self.ctx = ctx
        self.on_forward = on_forward
        self.producer: dict[int, tuple[Any, str, int, int]] = {}
        """Storage key -> (weak storage, unit, layer index, backward prefetch) of the storages swap units made."""
        self.swap_cache: dict[str, tuple[int | None, int] | None] = {}
        self.last_layer: int | None = None
        self.quiet_layer = False  # inside a layer that swaps nothing: the tracker skips naming
        self.swap_layers = {i for i, m in enumerate(ctx.res.modes) if m is LayerMode.SWAP}
        self.pushed: list[tuple[Any, ...] | None] = []
        self.graph_mode = is_compile_wrapper(ctx.model)
        """The model is ``torch.compile``'s wrapper: its graphs swap (Note: [partitioner hook]); no root hooks."""

    def install(self, track: Callable[..., None]) -> None:
        """The hooks on the model and its layers, and the model's forward outside dynamo; ``track(layer, handle,
        on_layer=True)`` tells the compiled blocks of each layer hook (Note: [swap around compiled blocks])."""
        ctx = self.ctx
        model = ctx.model
        if not self.graph_mode:
            ctx.handles.append(model.register_forward_pre_hook(eager_only(self._root_pre)))
            ctx.handles.append(model.register_forward_hook(eager_only(self._root_post), always_call=True))
        for i, layer in enumerate(ctx.layers):
            pre, post = (eager_only(functools.partial(f, i)) for f in (self._layer_pre, self._layer_post))
            for handle in (layer.register_forward_pre_hook(pre), layer.register_forward_hook(post, always_call=True)):
                ctx.handles.append(handle)
                track(i, handle, on_layer=True)
        if self.graph_mode:
            model = model._orig_mod
        had = "forward" in model.__dict__
        ctx.forwards.append((model, had, model.__dict__.get("forward")))
        model.forward = _two_way(model.__dict__["forward"] if had else type(model).forward.__get__(model))

    def close(self) -> None:
        while self.pushed:
            self.pop()
        if self.ctx.engine is not None:
            self.ctx.engine.close()
        self.producer.clear()

    # ================================================================== hooks
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not self.pushed:
            self.ctx.engine.begin_forward()
            self.producer.clear()
            self.last_layer = None
            self.on_forward()
        self.push()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self.pop()
        if self.pushed:
            return
        self.producer.clear()
        self.ctx.engine.end_forward()
        self.on_grad_of(output, self.ctx.num_layers)

    def _layer_pre(self, i: int, module: nn.Module, args: Any) -> None:
        self.last_layer = i
        self.quiet_layer = i not in self.swap_layers

    def _layer_post(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        self.quiet_layer = False
        self.on_grad_of(output, i)

    def on_grad_of(self, output: Any, index: int) -> None:
        """Backward of ``output`` begins layer ``index``'s: the engine's prefetch trigger."""
        if not torch.is_grad_enabled():
            return
        t = next((x for x in tree_flatten(_outputs(output))[0]
                  if isinstance(x, torch.Tensor) and x.requires_grad), None)
        if t is not None:
            engine = self.ctx.engine
            t.register_hook(lambda grad: engine.on_backward(index))

    # ================================================================== saved tensors
    def swap_info(self, unit: str) -> tuple[int, int] | None:
        """``(layer index, backward_prefetch)`` of a swap unit, None for the others (Semantics: Swap)."""
        ctx = self.ctx
        if unit not in self.swap_cache:
            decision = decide(ctx.plan, unit)
            layer, _ = ctx.namer.split(unit)
            self.swap_cache[unit] = (layer, decision.backward_prefetch) if decision.action is Action.SWAP else None
        info = self.swap_cache[unit]
        if info is None or info[0] is not None:
            return info
        outside = OUTSIDE_BEFORE if self.last_layer is None else ctx.num_layers
        return outside, info[1]

    def pack(self, t: torch.Tensor) -> Any:
        FOOTPRINT.pack += 1
        ctx = self.ctx
        t = no_cycle(t)
        if not self.producer or isinstance(t, nn.Parameter):
            return t
        st = local_shard(t).untyped_storage()
        info = self.producer.get(st._cdata)
        if info is None or info[0]() is not st:
            return t
        owner = ctx.layers[info[2]] if 0 <= info[2] < ctx.num_layers else ctx.model
        if backs_parameter(st, owner):  # Note: [parameter storages are never swapped] in _swap_engine.py
            return t
        return ctx.engine.offload(t, label=info[1], layer=info[2], prefetch=info[3])

    @staticmethod
    def unpack(x: Any) -> Any:
        FOOTPRINT.unpack += 1
        return x.unpack() if isinstance(x, Packed) else x

    def push(self) -> None:
        if not torch.is_grad_enabled():
            self.pushed.append(None)
            return
        entry: tuple[Any, ...] = (torch.compiler.set_stance("force_eager"),  # Note: [compile honoured]
                                  torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
        if self.ctx.res.swap_outside_sac:
            entry += (_Tracker(self),)
        for ctx in entry:
            ctx.__enter__()
        self.pushed.append(entry)

    def pop(self) -> None:
        entry = self.pushed.pop()
        for ctx in reversed(entry or ()):
            ctx.__exit__(None, None, None)


def _two_way(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The model's forward under a plan with swaps. Eager, it runs outside dynamo with the swap hooks (Note:
    [compile honoured]); traced by dynamo (the whole model compiled), it is the plain forward, and a pass over the
    partitioned graphs places the swaps in them (Note: [partitioner hook] in ``profiler/_partitions.py``). Its code object
    is one per plan (:func:`with_code`): dynamo compiles the planned model anew, never serving the graph of an
    earlier plan, and the graph meets the pass."""
    eager = outside_dynamo(forward)

    def planned_forward(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        return eager(*args, **kwargs)
    return functools.wraps(forward)(with_code(planned_forward))


def _outputs(output: Any) -> Any:
    if hasattr(output, "to_tuple"):
        return output.to_tuple()
    return output
