"""Swaps outside checkpointed layers, for the :class:`~adaptive_mem.runtime._executor.Executor`: a dispatch mode
(:class:`_Tracker`) records the unit that produced each storage, and saved-tensor hooks offload the saved tensors
whose producer is a swap unit through the :class:`SwapEngine`. Hooks on the modules that hold swap units push
those hooks around their calls (Note: [swap scopes]); hooks on the model and on each layer begin and end a
forward and trigger prefetches in backward (a tensor hook on a layer's output, and on the model's output; on the
layers up to the last a trigger can be due at: Note: [layer hooks up to the last trigger] in ``_swap_scopes.py``).
Everything here runs outside dynamo (Note: [compile honoured] in ``_op_level.py``).

Note: [swap scopes]. The tracker and the saved-tensor hooks exist only where a swap decision needs them: inside
the calls of the *scope modules*, for each swap target the module it names (an op unit: the module that runs the
op; a container that is never called: each of its modules), outermost first. The tracker leaves with the scope.
A scope that returns a storage a swap unit produced keeps the saved-tensor hooks entered (a later op may save it)
up to the end of the first layer call that does not return it (its locals die with the call: a layer's output
is saved by the next layer at the latest), or of the forward; from the second forward on, only up to its last save
(Note: [hooks leave after the last save] in ``_escapes.py``). A layer swapped as a whole needs no tracker: what
its call saves is its units' but its inputs', its parameters' and buffers' (the rule of the compiled blocks,
Note: [swap around compiled blocks]), and its outputs are recorded as its units'. So a plan deciding one unit
costs a dispatch call per op of its scope module and a pack call per tensor saved there, never one per op of the
model, and after the first step none where its tensor crosses a module boundary before its save (Note: [scopes by
their boundaries] in ``_scope_marks.py``; tests/test_footprint_swap.py). While compiled blocks are wrapped the
hooks and the tracker cover the whole forward, as those blocks expect.

Note: [scope hooks chain outward]. A scope enters its saved-tensor hooks in the middle of the forward, inside
the hooks pushed at the model's call, the SwapManager's among them (the adaptive loop's rescues). Saved-tensor
hooks do not nest: the innermost alone packs. So what a scope saves and does not swap goes through the hooks it
found entered (their pack now, their unpack in backward): else the manager would see nothing saved inside a scope
and could swap none of it out in a rescue (tests/test_adaptive_cli.py: an hf llama step under a 6 MB budget
died with nothing swappable).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from profiler.naming import is_compile_wrapper
from profiler.tracing import tensor_leaves
from search import Action

from ._escapes import Escapes
from ._footprint import FOOTPRINT
from ._layer_pack import LayerHooks, weakly
from ._op_level import eager_only, planned_forward
from ._plan_context import PlanContext
from ._resolve import OUTSIDE_BEFORE, LayerMode, decide
from ._native_swap import is_handle
from ._swap_engine import local_shard, no_cycle
from ._scope_marks import ScopeMarks
from ._swap_scopes import (Outer, Tracker, backward_trigger, hooked_layers, outer_hooks, outputs, pass_outward,
                           produced, scope_modules, storage_keys, whole_layers)

__all__ = ["OpSwaps"]


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
        self.scopes = scope_modules(ctx) if ctx.res.swap_outside_sac and not self.graph_mode else []
        """The modules inside whose calls swap units run (Note: [swap scopes])."""
        self.scoped = True
        """The hooks enter with the scopes; False while compiled blocks are wrapped (the whole forward)."""
        self.entered: list[nn.Module] = []  # the scope calls under way that entered the hooks
        self.hooks: Any = None  # the saved-tensor hooks a scope entered, while entered
        self.outer: tuple[Callable, Callable] | None = None  # the hooks entered before them (Note: [scope hooks
        # chain outward])
        self.tracker: Any = None  # the tracker a scope entered, while entered
        self.params: dict[int, set[int]] = {}  # layer index -> its parameter and buffer storages (:meth:`_frozen`)
        self.holders: dict[int, list[nn.Module]] = {}  # layer index -> its modules with parameters or buffers
        self.whole = {id(m): info for m, info in whole_layers(ctx, self.scopes)}
        """id of a scope that is a layer swapped as a whole -> (layer index, backward prefetch, layer path)."""
        self.fixed: tuple[int, int, str] | None = None  # inside such a layer's call, tracked: its ``whole`` entry
        self.bare: tuple[int, int, str] | None = None  # the same, untracked (the hooks enter with the scopes)
        self.inputs: frozenset[int] = frozenset()  # the storages of that layer call's inputs
        self.escapes = Escapes()  # Note: [hooks leave after the last save]
        self.layer_hooks: LayerHooks | None = None  # Note: [whole-layer pack in C++], made at the first use
        self.native = False  # the hooks entered are a layer's C++ ones
        self.marks = ScopeMarks()  # Note: [scopes by their boundaries]

    def named_roots(self) -> list[nn.Module]:
        """The modules whose calls the unit namer follows (under them the tracker names ops): the scopes but the
        layers swapped as a whole, whose ops need no name (Note: [swap scopes])."""
        if self.graph_mode or not self.scopes:
            return [self.ctx.model]
        return [m for m in self.scopes if id(m) not in self.whole]

    def install(self, track: Callable[..., None]) -> None:
        """The hooks on the model and its layers, and the model's forward outside dynamo; ``track(layer, handle,
        on_layer=True)`` tells the compiled blocks of each layer hook (Note: [swap around compiled blocks])."""
        ctx = self.ctx
        model = ctx.model
        if not self.graph_mode:
            ctx.handles.append(model.register_forward_pre_hook(eager_only(self._root_pre)))
            ctx.handles.append(model.register_forward_hook(eager_only(self._root_post), always_call=True))
        for i, layer in enumerate(ctx.layers[:hooked_layers(ctx, graph_mode=self.graph_mode)]):
            pre, post = (eager_only(functools.partial(f, i)) for f in (self._layer_pre, self._layer_post))
            for handle in (layer.register_forward_pre_hook(pre), layer.register_forward_hook(post, always_call=True)):
                ctx.handles.append(handle)
                track(i, handle, on_layer=True)
        owner = {id(m): i for i, layer in enumerate(ctx.layers) for m in layer.modules()}
        for module in self.scopes:
            for handle in (module.register_forward_pre_hook(self._scope_pre, prepend=True, with_kwargs=True),
                           module.register_forward_hook(self._scope_post, always_call=True)):
                ctx.handles.append(handle)
                track(owner.get(id(module)), handle)
        if self.graph_mode:
            model = model._orig_mod
        had = "forward" in model.__dict__
        ctx.forwards.append((model, had, model.__dict__.get("forward")))
        model.forward = planned_forward(model.__dict__["forward"] if had else type(model).forward.__get__(model))

    def close(self) -> None:
        while self.pushed:
            self.pop()
        self._leave_scope(keep_hooks=False)
        if self.ctx.engine is not None:
            self.ctx.engine.close()
        self.producer.clear()

    # ================================================================== hooks
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not self.pushed:
            self.ctx.engine.begin_forward()
            self.producer.clear()
            self.params.clear()
            self.last_layer = None
            self.on_forward()
        self.push()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if len(self.pushed) == 1:
            self._leave_scope(keep_hooks=False)
        self.pop()
        if self.pushed:
            return
        self.escapes.end_forward()
        self.producer.clear()
        self.ctx.engine.end_forward()
        self.on_grad_of(output, self.ctx.num_layers)

    def _layer_pre(self, i: int, module: nn.Module, args: Any) -> None:
        self.last_layer = i
        self.params.pop(i, None)
        self.quiet_layer = i not in self.swap_layers

    def _layer_post(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        self.quiet_layer = False
        self._release(output)
        self.on_grad_of(output, i)

    def _scope_pre(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        """A scope module's call begins: the saved-tensor hooks enter, and the tracker, but in a layer swapped as a
        whole (Note: [swap scopes]) and in a scope known by its boundaries (Note: [scopes by their boundaries]).
        Called in the planned forward, outside dynamo already; skipped while dynamo traces it."""
        if torch.compiler.is_compiling() or not self.pushed or self.pushed[-1] is None:
            return
        if self.entered or self.ctx.opaque:
            if self.entered:
                self.entered.append(module)
            return
        self.entered.append(module)
        whole = self.whole.get(id(module))
        if not self.scoped:  # the whole forward's hooks and tracker are entered already
            self.fixed = whole
            return
        if whole is None and self.marks.begin(module):  # Note: [scopes by their boundaries]
            return
        if whole is not None:
            self.bare = whole
            self.inputs = storage_keys((args, kwargs))
            self._enter_layer_hooks(whole)
            return
        self._enter_hooks()
        self.tracker = Tracker(self)
        self.tracker.__enter__()

    def _enter_layer_hooks(self, whole: tuple[int, int, str]) -> None:
        """A layer swapped as a whole: its call's hooks in C++ where the engine has a native store (Note: [whole-layer
        pack in C++] in ``_layer_pack.h``), else the Python ones; hooks entered for escaped storages leave for it."""
        if not LayerHooks.available(self.ctx.engine, self.ctx.opaque):
            self._enter_hooks()
            return
        self._exit_hooks()
        if self.layer_hooks is None:
            self.layer_hooks = LayerHooks(self.ctx.engine, self.pack, self.unpack)
        self.outer = outer_hooks()  # Note: [scope hooks chain outward]
        self.hooks = self.layer_hooks.enter(whole, self.inputs, weakly(self._frozen, whole[0]), self.outer)
        self.native = True

    def _exit_hooks(self) -> None:
        if self.hooks is not None:
            hooks, self.hooks, native, self.native = self.hooks, None, self.native, False
            if native:
                self.layer_hooks.exit(hooks)
            else:
                hooks.__exit__(None, None, None)

    def _enter_hooks(self) -> None:
        if self.hooks is None:
            self.outer = outer_hooks()  # Note: [scope hooks chain outward]
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.hooks.__enter__()

    def _scope_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.entered or self.entered[-1] is not module or torch.compiler.is_compiling():
            return
        self.entered.pop()
        if self.entered:
            return
        if self.native:  # the layer's C++ hooks leave with its call; escaped outputs get the Python ones
            self._exit_hooks()
        if self.marks.watching:
            self.marks.end(module, self.producer)
        bare = self.bare
        if bare is not None:  # the layer's outputs are its units' (the tracker would have seen them made)
            for t in tensor_leaves(outputs(output)):
                if local_shard(t).untyped_storage()._cdata not in self.inputs:
                    produced(self.producer, t, bare[2], bare[0], bare[1])
        self.escapes.add(self._escaping(output))
        if self.escapes and not self.escapes.done():
            self._enter_hooks()
        self._leave_scope(keep_hooks=True)
        self._release()

    def record_unit(self, t: torch.Tensor, unit: str) -> None:
        """Note: [scopes by their boundaries]: ``t``'s storage is swap unit ``unit``'s; the hooks enter for its saves."""
        info = self.swap_info(unit)
        if info is not None:
            produced(self.producer, t, unit, info[0], info[1])
            self._enter_hooks()

    def _leave_scope(self, *, keep_hooks: bool) -> None:
        """The outermost scope call ends: the tracker leaves; the hooks too unless ``keep_hooks``."""
        self.entered.clear()
        self.fixed = self.bare = None
        self.inputs = frozenset()
        self.marks.reset()
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.__exit__(None, None, None)
        if self.hooks is not None and not keep_hooks:
            self._exit_hooks()
            self.escapes.clear()

    def _escaping(self, output: Any) -> list[tuple[Any, str]]:
        """(weak storage, unit) of the storages in ``output`` that a swap unit produced (a later op may save them)."""
        producer = self.producer
        if not producer:
            return []
        out = []
        for t in tensor_leaves(outputs(output)):
            st = local_shard(t).untyped_storage()
            info = producer.get(st._cdata)
            if info is not None and info[0]() is st:
                out.append((info[0], info[1]))
        return out

    def _release(self, layer_output: Any = None) -> None:
        """Out of every scope, the saved-tensor hooks leave once no storage escaped a scope (Note: [swap scopes])
        or the escaped ones had their saves (Note: [hooks leave after the last save]); at a layer's end
        (``layer_output``), escaped storages it does not return are taken as dead."""
        if self.hooks is None or self.entered:
            return
        escapes = self.escapes
        if layer_output is not None and escapes:
            escapes.keep_returned(storage_keys(outputs(layer_output)))
        if not escapes or escapes.done():
            self._exit_hooks()

    def _leave_in_pack(self) -> None:
        """Note: [hooks leave after the last save]: the escaped storages had their saves; the hooks leave inside
        their own pack call (autograd holds the hooks it is calling; ours are the innermost, as ours pack)."""
        top = outer_hooks()
        if self.scoped and self.hooks is not None and top is not None and top[0] == self.pack:
            self._exit_hooks()
            self.escapes.clear()

    def on_grad_of(self, output: Any, index: int) -> None:
        """Backward of ``output`` begins layer ``index``'s: the engine's prefetch trigger, where one is due (Note:
        [triggers where due] in ``_swap_engine.py``)."""
        engine = self.ctx.engine
        if not torch.is_grad_enabled() or not engine.wants_trigger(index):
            return
        if type(output) is torch.Tensor:
            t = output if output.requires_grad else None
        else:
            t = next((x for x in tensor_leaves(outputs(output)) if x.requires_grad), None)
        if t is not None:
            FOOTPRINT.trigger += 1
            t.register_hook(functools.partial(backward_trigger, engine, index))

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
        if type(t) is not nn.Parameter:  # a parameter is never swapped (and holds no grad_fn)
            packed = self._swap(t)  # its record drops ``t`` once the offload copy landed: no lasting cycle
            if packed is not None:
                if self.escapes and not self.entered and self.escapes.done():
                    self._leave_in_pack()
                return packed
            t = no_cycle(t)
        outer = self.outer if self.hooks is not None else None
        return pass_outward(t, outer)  # Note: [scope hooks chain outward]

    def _swap(self, t: torch.Tensor) -> Any:
        """``t`` offloaded where a swap unit (or a layer swapped as a whole) saves it, else None."""
        plain = type(t) is torch.Tensor
        if not plain and isinstance(t, nn.Parameter):
            return None
        bare = self.bare
        local = t if plain else local_shard(t)
        # in a layer swapped as a whole, untracked (Note: [swap scopes]): plain tensors and DTensors' shards; another
        # subclass (a collective's async wrapper) is kept, as the tracker never names its wrapper storage
        if bare is not None and not self.ctx.opaque and type(local) is torch.Tensor:
            key = local.untyped_storage()._cdata
            if key not in self.inputs:
                if key in self._frozen(bare[0]):
                    return None
                return self.ctx.engine.offload(t, label=bare[2], layer=bare[0], prefetch=bare[1])
        producer = self.producer
        if not producer:
            return None
        st = local.untyped_storage()
        key = st._cdata
        info = producer.get(key)
        if info is None or info[0]() is not st or key in self._frozen(info[2]):
            return None  # Note: [parameter storages are never swapped] in _swap_engine.py
        self.marks.saved_here(key)
        self.escapes.saved(info[1])
        return self.ctx.engine.offload(t, label=info[1], layer=info[2], prefetch=info[3])

    def _frozen(self, layer: int) -> set[int]:
        """The storages behind the current parameters and buffers of layer ``layer`` (the model's outside the
        layers), found once per call of the layer (once per forward outside it): FSDP2 sets gathered parameters
        before the layer's forward."""
        found = self.params.get(layer)
        if found is None:
            holders = self.holders.get(layer)
            if holders is None:  # the modules holding tensors of their own (fixed; their tensors may change)
                ctx = self.ctx
                owner = ctx.layers[layer] if 0 <= layer < ctx.num_layers else ctx.model
                holders = self.holders[layer] = [m for m in owner.modules() if m._parameters or m._buffers]
            found = self.params[layer] = {t.untyped_storage()._cdata for m in holders
                                          for d in (m._parameters, m._buffers) for t in d.values() if t is not None}
        return found

    @staticmethod
    def unpack(x: Any) -> Any:
        FOOTPRINT.unpack += 1
        if isinstance(x, Outer):
            return x.unpack(x.packed)
        return x.unpack() if is_handle(x) else x

    def push(self) -> None:
        if not torch.is_grad_enabled():
            self.pushed.append(None)
            return
        entry: tuple[Any, ...] = (torch.compiler.set_stance("force_eager"),)  # Note: [compile honoured]
        if not self.scoped or not self.scopes:  # the whole forward (Note: [swap scopes])
            entry += (torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack),)
            if self.ctx.res.swap_outside_sac:
                entry += (Tracker(self),)
        for ctx in entry:
            ctx.__enter__()
        self.pushed.append(entry)

    def pop(self) -> None:
        entry = self.pushed.pop()
        for ctx in reversed(entry or ()):
            ctx.__exit__(None, None, None)
