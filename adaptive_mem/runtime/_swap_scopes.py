"""Where the op-level swap path intercepts: the scope modules of a plan's swap targets and the layers swapped as
a whole among them (Note: [swap scopes] in ``_op_swap.py``), found once at install."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from profiler.naming import named_modules
from profiler.tracing import tensor_leaves
from search import Action
from search.planning import matches

from ._footprint import FOOTPRINT
from ._plan_context import PlanContext
from ._resolve import LayerMode, decide
from ._swap_engine import local_shard

__all__ = ["Outer", "Tracker", "backward_trigger", "hooked_layers", "outer_hooks", "outputs", "pass_outward", "produced",
           "scope_modules", "storage_keys", "whole_layers", "whole_swap_prefetch"]


class Tracker(TorchDispatchMode):
    """Records which swap unit produced each storage during forward (Note: [swap scopes] in ``_op_swap.py``)."""

    def __init__(self, swaps: Any) -> None:  # the OpSwaps of the plan
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
        fixed = swaps.fixed  # a layer swapped as a whole: every unit of it (Note: [swap scopes])
        info = fixed if fixed is not None else swaps.swap_info(unit)
        if info is not None:
            label = unit if fixed is None else fixed[2]
            for t in tensor_leaves(out):
                key = produced(swaps.producer, t, label, info[0], info[1])
                swaps.marks.made_here(key)  # Note: [scopes by their boundaries]
        return out


class Outer:
    """What the hooks entered before a scope's packed (Note: [scope hooks chain outward]), with their unpack."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], Any]) -> None:
        self.packed, self.unpack = packed, unpack


def outer_hooks() -> tuple[Callable, Callable] | None:
    """The saved-tensor hooks entered now, which hooks entered inside them pass on to (Note: [scope hooks chain
    outward])."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def backward_trigger(engine: Any, index: int, grad: torch.Tensor) -> None:
    """A layer output's gradient hook: backward begins layer ``index`` (Note: [triggers where due] in
    ``_swap_engine.py``)."""
    engine.on_backward(index)


def pass_outward(t: torch.Tensor, outer: tuple[Callable, Callable] | None) -> Any:
    """``t`` as the hooks ``outer`` (:func:`outer_hooks`) pack it, else itself (Note: [scope hooks chain outward])."""
    return t if outer is None else Outer(outer[0](t), outer[1])


def produced(producer: dict[int, tuple[Any, str, int, int]], t: torch.Tensor, unit: str, layer: int,
             prefetch: int) -> int:
    """Record ``t``'s storage (a DTensor's: its local shard's, Note: [DTensor swap]) as swap unit ``unit``'s in
    ``producer``; returns its key."""
    st = local_shard(t).untyped_storage()
    producer[st._cdata] = (weakref.ref(st), unit, layer, prefetch)
    return st._cdata


def scope_modules(ctx: PlanContext) -> list[nn.Module]:
    """The scope modules of the plan's swap targets outside selective layers, outermost only (Note: [swap
    scopes]): the module a target names, or the one running its op unit; a container's called modules."""
    modules = dict(named_modules(ctx.model))
    paths = [ctx.res.layers.layer_path(i) for i in range(ctx.num_layers)] if ctx.res.layers is not None else []
    found: dict[str, nn.Module] = {}
    for target, decision in ctx.plan.decisions.items():
        if decision.action is not Action.SWAP:
            continue
        owner = next((i for i, p in enumerate(paths) if target == p or target.startswith(p + ".")), None)
        if owner is not None and ctx.res.modes[owner] is not LayerMode.SWAP:
            continue  # a selective layer swaps through its own policy
        path = target
        while path and path not in modules:
            path = path.rpartition(".")[0]
        found.update(_called(path, modules.get(path, ctx.model)))
    return [m for p, m in found.items() if not any(q != p and (q == "" or p.startswith(q + ".")) for q in found)]


def hooked_layers(ctx: PlanContext, *, graph_mode: bool = False) -> int:
    """Note: [layer hooks up to the last trigger]. How many of the first layers get the op-level swap path's layer
    hooks. Those hooks tell the swaps of a layer where its call begins and ends, and give its output the backward
    trigger a reload may be due at: a swap's layer plus its backward prefetch, or with a device cap a lower layer
    (a deferred reload moves down, Note: [budget-aware prefetch]), never a higher one. So the layers above the
    highest layer a swap target covers or lies in, plus its prefetch, need none: a plan swapping in the first
    layers of a deep model costs no Python call in the others. Every layer gets them where a swap target lies
    outside the layers (its units run before or after them) or the model is compiled whole.
    tests/test_footprint_swap.py counts the hooks."""
    n = ctx.num_layers
    if graph_mode or ctx.res.layers is None:
        return n
    paths = [ctx.res.layers.layer_path(i) for i in range(n)]
    top = -1
    for target, decision in ctx.plan.decisions.items():
        if decision.action is not Action.SWAP and not decision.swap_input:
            continue
        held = [i for i, p in enumerate(paths) if matches(target, p) or target.startswith(p + ".")]
        if not held:
            return n
        top = max(top, held[-1] + decision.backward_prefetch)
    return min(top + 1, n)


def whole_layers(ctx: PlanContext, scopes: list[nn.Module]) -> list[tuple[nn.Module, tuple[int, int, str]]]:
    """The scopes that are layers swapped as a whole, with their (layer index, backward prefetch, layer path)."""
    out = []
    index = {id(layer): i for i, layer in enumerate(ctx.layers)}
    for module in scopes:
        i = index.get(id(module))
        prefetch = None if i is None else whole_swap_prefetch(ctx, i)
        if prefetch is not None:
            out.append((module, (i, prefetch, ctx.res.layers.layer_path(i))))
    return out


def whole_swap_prefetch(ctx: PlanContext, i: int) -> int | None:
    """The backward prefetch of layer ``i`` when the plan swaps it as a whole (every unit swapped with one
    backward prefetch), else None."""
    if ctx.res.modes[i] is not LayerMode.SWAP:
        return None
    path = ctx.res.layers.layer_path(i)
    cover = decide(ctx.plan, path)
    inner = [d for t, d in ctx.plan.decisions.items() if t.startswith(path + ".")]
    if cover.action is Action.SWAP and all(
            d.action is Action.SWAP and d.backward_prefetch == cover.backward_prefetch for d in inner):
        return cover.backward_prefetch
    return None


def _called(path: str, module: nn.Module) -> dict[str, nn.Module]:
    """``module``, or for a container that is never called (``ModuleList``, ``ModuleDict``) its called modules."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return {path: module}
    out: dict[str, nn.Module] = {}
    for name, child in module.named_children():
        out.update(_called(f"{path}.{name}" if path else name, child))
    return out


def storage_keys(tree: Any) -> frozenset[int]:
    """The keys (``_cdata``) of the storages of the tensors in ``tree`` (a DTensor's: its local shard's)."""
    return frozenset(local_shard(t).untyped_storage()._cdata for t in tensor_leaves(tree))


def outputs(output: Any) -> Any:
    """A module's output as a pytree (a ``ModelOutput``'s tuple)."""
    if hasattr(output, "to_tuple"):
        return output.to_tuple()
    return output
