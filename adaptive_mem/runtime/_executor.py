"""Apply a resolved plan to a live ``nn.Module``: recompute and swap, removable without a trace.

What gets installed, and only when the plan needs it (an all-keep plan installs nothing):

* a layer that is recomputed gets an instance ``forward`` wrapping the class
  forward in non-reentrant checkpoint (whole layer, group, or selective);
* swaps outside checkpointed layers need the unit of the op that *produced*
  each saved storage: module pre/post hooks drive a :class:`UnitNamer`, a
  dispatch mode records producing units of swap storages, and saved-tensor
  hooks hand those to the :class:`SwapEngine`;
* prefetch triggers are tensor hooks on each layer's output (backward
  begins that layer) and on the model output (backward begins).

:meth:`Executor.remove` deletes the instance forwards and every hook handle.
"""

from __future__ import annotations

import functools
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

from ._resolve import OUTSIDE_BEFORE, LayerMode, Resolution, decide
from ._sac_policy import LayerTrace, OpCounter, SacPolicy, trace_layer
from ._accounting import current_accounting
from ._swap_engine import Packed, SwapEngine

__all__ = ["Executor"]

log = logging.getLogger(__name__)


def _accounted_headroom() -> int | None:
    """Free bytes under the active ``DeviceMemory`` cap, less a tenth of it kept for backward's own
    allocations; None without a capped accounting (then every scheduled prefetch is issued)."""
    mem = current_accounting()
    if mem is None or mem.cap is None:
        return None
    return mem.cap - mem.live - mem.cap // 10


def _first_tensor(obj: Any) -> torch.Tensor | None:
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return kwargs.get("hidden_states")


def _with_hidden(args: tuple, kwargs: dict, h: torch.Tensor) -> tuple[tuple, dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (h,) + tuple(args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": h}
    raise RuntimeError("checkpoint group: cannot find the hidden states argument of the layer call "
                       "(expected a tensor as first argument or hidden_states=)")


class _Tracker(TorchDispatchMode):
    """Records which swap unit produced each storage during forward."""

    def __init__(self, executor: "Executor") -> None:
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


class _SacLayer:
    def __init__(self, index: int, counter: OpCounter) -> None:
        self.index = index
        self.counter = counter
        self.trace: LayerTrace | None = None
        self.actions: dict[str, str] = {}
        self.policy: SacPolicy | None = None
        self.swap_outputs: dict[int, str] = {}


class Executor:
    def __init__(self, model: nn.Module, plan: Plan, res: Resolution, *, host_store: str = "memory",
                 host_dir: str | None = None) -> None:
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
        self._group_outputs: dict[int, tuple[torch.Tensor | None, Any]] = {}
        self._sac: dict[int, _SacLayer] = {}
        self.engine: SwapEngine | None = None
        if plan.targets(Action.SWAP):
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            self.engine = SwapEngine(device=device, num_layers=self.num_layers, host_store=host_store,
                                     host_dir=host_dir)
            self.engine.headroom = _accounted_headroom  # Note: [budget-aware prefetch]

    # ================================================================== install / remove
    def install(self) -> None:
        res = self.res
        grouped = {i: g for g in res.groups for i in g}
        for i, mode in enumerate(res.modes):
            if i in grouped:
                group = grouped[i]
                self._set_forward(i, self._group_head(group) if i == group[0] else self._group_member(i))
            elif mode is LayerMode.WHOLE:
                self._set_forward(i, self._whole(i))
            elif mode is LayerMode.SAC:
                self._sac[i] = _SacLayer(i, OpCounter(self.namer))
                self._set_forward(i, self._selective(i))
        needs_names = res.swap_outside_sac or bool(self._sac)
        if needs_names:
            roots = [self.model] if res.swap_outside_sac else [self.layers[i] for i in self._sac]
            seen: set[int] = set()
            for root in roots:
                for module in root.modules():
                    if id(module) in seen:
                        continue
                    seen.add(id(module))
                    self._handles.append(module.register_forward_pre_hook(self._enter))
                    self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        if self.engine is not None:
            self._handles.append(self.model.register_forward_pre_hook(self._root_pre))
            self._handles.append(self.model.register_forward_hook(self._root_post, always_call=True))
            for i, layer in enumerate(self.layers):
                self._handles.append(layer.register_forward_pre_hook(functools.partial(self._layer_pre, i)))
                self._handles.append(layer.register_forward_hook(functools.partial(self._layer_post, i),
                                                                 always_call=True))

    def remove(self) -> None:
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
    def _ckpt(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.plan.distribute_saved_activations:
            from ._distributed_checkpoint import distributed_checkpoint

            return distributed_checkpoint(functools.partial(fn, **kwargs) if kwargs else fn, *args)
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

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return orig(*args, **kwargs)
            return self._ckpt(run, *args, **kwargs)
        return forward

    def _group_head(self, group: list[int]) -> Callable[..., Any]:
        origs = [self._orig(j) for j in group]
        head = origs[0]

        def run_group(*args: Any, **kwargs: Any) -> tuple:
            outs = []
            for orig in origs:
                out = orig(*args, **kwargs)
                outs.append(out)
                args, kwargs = _with_hidden(args, kwargs, _first_tensor(out))
            return tuple(outs)

        run = self._opaque_run(run_group)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return head(*args, **kwargs)
            outs = self._ckpt(run, *args, **kwargs)
            for k, j in enumerate(group[1:]):
                self._group_outputs[j] = (_first_tensor(outs[k]), outs[k + 1])
            return outs[0]
        return forward

    def _group_member(self, i: int) -> Callable[..., Any]:
        orig = self._orig(i)

        def forward(*args: Any, **kwargs: Any) -> Any:
            pending = self._group_outputs.pop(i, None)
            if pending is None:
                if torch.is_grad_enabled():
                    raise RuntimeError(f"layer {i} of a checkpoint group ran without its group's first layer")
                return orig(*args, **kwargs)
            expected, out = pending
            if _hidden_of(args, kwargs) is not expected:
                raise RuntimeError(f"checkpoint group: layer {i} was not called with the previous layer's output; "
                                   "groups need layers that feed each other directly")
            return out
        return forward

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

    def _prepare_sac(self, state: _SacLayer, run: Callable[..., Any], args: tuple, kwargs: dict) -> None:
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

    def _swap_cache_entries(self, state: _SacLayer, fwd_ctx: Any) -> None:
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

    # ================================================================== hooks
    def _enter(self, module: nn.Module, args: Any) -> None:
        self.namer.enter(module)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.namer.exit(module)

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not self._pushed:
            self.engine.begin_forward()
            self._producer.clear()
            self._last_layer = None
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
