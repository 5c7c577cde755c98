"""Apply a resolved plan to a live ``nn.Module``: recompute and swap, removable without a trace.

What gets installed, and only when the plan needs it (an all-keep plan installs nothing):

* a layer that is recomputed gets an instance ``forward`` wrapping the class
  forward in non-reentrant checkpoint (whole layer, group, or selective);
* swaps outside checkpointed layers need the unit of the op that *produced*
  each saved storage: module pre/post hooks drive a :class:`UnitNamer`, a
  dispatch mode records producing units of swap storages, and saved-tensor
  hooks hand those to the :class:`SwapEngine`;
* prefetch triggers are tensor hooks on each layer's output (backward
  begins that layer) and on the model output (backward begins);
* with swaps, the model's forward runs outside dynamo (an instance ``forward``;
  Note: [compile honoured] in ``_op_level.py``); compiled blocks get a wrapper around their
  compiled call that keeps them compiled (Note: [swap around compiled blocks] in ``_compiled_swap.py``).

:meth:`Executor.remove` deletes the instance forwards and every hook handle.

Copies of the model (``copy.deepcopy``, ``pickle``, ``torch.save``) leave all of it out
(Note: [copy drops the plan] in ``_copy_guard.py``).

This module holds the layer-level part (install / remove, whole-layer recompute, hooks);
checkpoint groups are in ``_groups.py`` (Note: [group inputs]); selective checkpoint and the
op-level swap path (the dispatch mode and saved-tensor hooks) are in ``_op_level.py``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from adaptive_mem.config._collective_names import layout_styles
from profiler._units import UnitNamer
from search._plan import Action, Plan

from ._accounting import current_accounting
from ._compiled_swap import CompiledBlocks
from ._copy_guard import CopyGuard
from ._layer_cache import cache_snapshot, replays_on_snapshot
from ._input_swap import swapped_input_checkpoint
from ._groups import GroupPaths
from ._op_level import OpLevelPaths, SacLayer, eager_only, outside_dynamo
from ._resolve import LayerMode, Resolution
from ._sac_policy import OpCounter
from ._swap_engine import SwapEngine

__all__ = ["Executor"]

log = logging.getLogger(__name__)


def _accounted_headroom() -> int | None:
    """Free bytes under the active ``DeviceMemory`` cap, less a tenth of it kept for backward's own
    allocations; None without a capped accounting (then every scheduled prefetch is issued)."""
    mem = current_accounting()
    if mem is None or mem.cap is None:
        return None
    return mem.cap - mem.live - mem.cap // 10


class Executor(OpLevelPaths, GroupPaths):
    def __init__(self, model: nn.Module, plan: Plan, res: Resolution, *, host_store: str = "memory",
                 host_dir: str | None = None, host_budget: Any = None) -> None:
        self.model = model
        self.plan = plan
        self.res = res
        self.namer = UnitNamer(model)
        info = res.layers
        self.num_layers = info.count if info is not None else 0
        self.layers = [model.get_submodule(info.layer_path(i)) for i in range(self.num_layers)] if info else []
        self._handles: list[Any] = []
        self._forwards: list[tuple[nn.Module, bool, Any]] = []
        self._opaque = 0
        self._producer: dict[int, tuple[Any, str, int, int]] = {}
        self._swap_cache: dict[str, tuple[int | None, int] | None] = {}
        self._last_layer: int | None = None
        self._quiet_layer = False  # inside a layer that swaps nothing: the tracker skips naming
        self._swap_layers = {i for i, m in enumerate(res.modes) if m is LayerMode.SWAP}
        self._pushed: list[tuple[Any, Any] | None] = []
        self._group_outputs: dict[int, tuple[torch.Tensor | None, Any, tuple, dict]] = {}
        self._split_groups: set[int] = set()
        self._checked_groups: set[int] = set()
        self._sac: dict[int, SacLayer] = {}
        self._blocks = CompiledBlocks(self)  # Note: [swap around compiled blocks]
        self._copies = CopyGuard(model, handles=self._handles, forwards=self._forwards, attrs=self._blocks.attrs)
        self._compile_warned = False
        self._cache_warned: set[str] = set()
        self._leave_ids: dict[int, int] = {}
        self._layouts: dict[int, bool] = {}
        self.engine: SwapEngine | None = None
        if plan.targets(Action.SWAP) or res.input_swaps:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            self.engine = SwapEngine(device=device, num_layers=self.num_layers, host_store=host_store,
                                     host_dir=host_dir, host_budget=host_budget)
            self.engine.headroom = _accounted_headroom  # Note: [budget-aware prefetch]

    # ================================================================== install / remove
    def install(self) -> None:
        res = self.res
        grouped = {i: g for g in res.groups for i in g}
        for i, mode in enumerate(res.modes):
            if i in grouped:
                group = grouped[i]
                self._set_forward(i, self._group_head(group) if i == group[0] else self._group_member(i, group))
            elif mode is LayerMode.WHOLE:
                self._set_forward(i, self._whole(i))
            elif mode is LayerMode.SAC:
                self._sac[i] = SacLayer(i, OpCounter(self.namer))
                self._set_forward(i, self._selective(i))
        needs_names = res.swap_outside_sac or bool(self._sac)
        owner = {id(m): i for i, layer in enumerate(self.layers) for m in layer.modules()}
        if needs_names:
            roots = [self.model] if res.swap_outside_sac else [self.layers[i] for i in self._sac]
            seen: set[int] = set()
            enter, leave = eager_only(self._enter), eager_only(self._exit)  # Note: [compile honoured]
            for root in roots:
                for module in root.modules():
                    if id(module) in seen:
                        continue
                    seen.add(id(module))
                    # Note: [collective units]: before a layout's input hooks; after FSDP2's (its unshard is no unit)
                    layout = any(True for _ in layout_styles(module))
                    for handle in (module.register_forward_pre_hook(enter, prepend=layout),
                                   module.register_forward_hook(leave, always_call=True)):
                        self._handles.append(handle)
                        self._blocks.track(owner.get(id(module)), handle)
                    self._leave_ids[id(module)] = self._handles[-1].id
        if self.engine is not None:
            model = self.model
            self._handles.append(model.register_forward_pre_hook(outside_dynamo(self._root_pre)))
            self._handles.append(model.register_forward_hook(outside_dynamo(self._root_post), always_call=True))
            for i, layer in enumerate(self.layers):
                pre, post = (outside_dynamo(functools.partial(f, i)) for f in (self._layer_pre, self._layer_post))
                for handle in (layer.register_forward_pre_hook(pre),
                               layer.register_forward_hook(post, always_call=True)):
                    self._handles.append(handle)
                    self._blocks.track(i, handle, on_layer=True)
            had = "forward" in model.__dict__
            self._forwards.append((model, had, model.__dict__.get("forward")))
            model.forward = outside_dynamo(model.__dict__["forward"] if had else type(model).forward.__get__(model))
        if self.engine is not None or self._sac:
            self._handles.append(self.model.register_forward_pre_hook(eager_only(self._watch_compile)))
            self._check_compile()
        self._copies.install()
        if self.engine is not None:
            self._blocks.sync()

    def own(self, handle: Any) -> None:
        """Take a hook handle registered on the model for this plan: removed and left out of copies with the rest."""
        self._handles.append(handle)

    def remove(self) -> None:
        self._copies.remove()
        self._blocks.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, had, old in reversed(self._forwards):
            if had:
                module.forward = old
            else:
                del module.forward
        self._forwards.clear()
        while self._pushed:
            self._pop()
        if self.engine is not None:
            self.engine.close()
        self._producer.clear()
        self._group_outputs.clear()

    def _set_forward(self, i: int, fn: Callable[..., Any]) -> None:
        layer = self.layers[i]
        had = "forward" in layer.__dict__
        self._forwards.append((layer, had, layer.__dict__.get("forward")))
        layer.forward = fn

    def _orig(self, i: int) -> Callable[..., Any]:
        layer = self.layers[i]
        for module, had, old in self._forwards:
            if module is layer:
                return old if had else type(layer).forward.__get__(layer)
        return layer.forward

    # ================================================================== recompute
    def _ckpt(self, index: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.plan.distribute_saved_activations:
            from ._distributed_checkpoint import distributed_checkpoint

            return distributed_checkpoint(functools.partial(fn, **kwargs) if kwargs else fn, *args,
                                          layer=self.layers[index])
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def _opaque_run(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._opaque += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._opaque -= 1
        return run

    def _whole(self, i: int) -> Callable[..., Any]:
        orig = self._orig(i)
        run = self._opaque_run(orig)

        swap_in = self.res.input_swaps.get(i)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return orig(*args, **kwargs)
            args, kwargs, fresh = cache_snapshot(self.layers[i], args, kwargs, self._cache_warned)
            fn = replays_on_snapshot(run, fresh)  # Note: [cache in recompute]
            if swap_in is not None and not torch.compiler.is_compiling():  # compiled: Note: [swap around compiled blocks]
                return swapped_input_checkpoint(fn, *args, engine=self.engine, layer=i, prefetch=swap_in,
                                                label=f"{self.res.layers.layer_path(i)} input", **kwargs)
            return self._ckpt(i, fn, *args, **kwargs)
        return forward

    # ================================================================== hooks
    def _enter(self, module: nn.Module, args: Any) -> None:
        # Note: [collective units]: a module's layout hooks (registered before or after the plan) run inside it;
        # only DTensor layout modules are reordered (FSDP2's own hooks must keep their order)
        layout = self._layouts.get(id(module))
        if layout is None:
            layout = self._layouts[id(module)] = any(True for _ in layout_styles(module))
        if layout:
            hooks, leave = module._forward_hooks, self._leave_ids[id(module)]
            if leave in hooks:
                hooks.move_to_end(leave)
        self.namer.enter(module)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.namer.exit(module)

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not self._pushed:
            self.engine.begin_forward()
            self._producer.clear()
            self._last_layer = None
            self._blocks.sync()
            self._check_compile(in_forward=True)  # also under a whole-model compile, where _watch_compile is skipped
        self._push()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._pop()
        if self._pushed:
            return
        self._producer.clear()
        self.engine.end_forward()
        self._on_grad_of(output, self.num_layers)

    def _layer_pre(self, i: int, module: nn.Module, args: Any) -> None:
        self._last_layer = i
        self._quiet_layer = i not in self._swap_layers

    def _layer_post(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        self._quiet_layer = False
        self._on_grad_of(output, i)

    def _on_grad_of(self, output: Any, index: int) -> None:
        if not torch.is_grad_enabled():
            return
        t = next((x for x in tree_flatten(_outputs(output))[0]
                  if isinstance(x, torch.Tensor) and x.requires_grad), None)
        if t is not None:
            engine = self.engine
            t.register_hook(lambda grad: engine.on_backward(index))


def _outputs(output: Any) -> Any:
    if hasattr(output, "to_tuple"):
        return output.to_tuple()
    return output
