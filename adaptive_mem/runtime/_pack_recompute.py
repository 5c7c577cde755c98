"""Op-level recompute of a module unit by saved-tensor hooks, with no checkpoint and no dispatch mode.

Note: [recompute at pack]. A recomputed unit that is a module of its own (a leaf: ``feed_forward.mul`` on
llama-tiny, an activation module) frees its output when every op that saves it is an op of a module reading it:
while such a reader runs, a saved-tensor hook replaces a saved tensor on the unit's output storage by a recipe (the
unit's module and its inputs, and the saved view's geometry), and unpacking the recipe in backward runs the module's
forward again on those inputs (once per unit call; the saved view taken from it). Nothing else of the layer is
intercepted: its cost is the unit's recomputed forward, one hook call per reader's saved tensor, one module hook
call on the unit and two on each reader. The recomputed tensor equals the output bit for bit: the same module on the
same inputs under the same grad and autocast state; an input written in place before backward raises instead.

It applies (:func:`pack_units`) when every recomputed unit of a layer without swaps is a leaf module that draws no
random numbers, whose ops do not save what it produced (else its own node would keep the output), whose inputs
autograd saves anyway (parameters, or storages saved in the traced call: the recipe adds no storage to what backward
holds), whose output no op of the call writes in place, and whose readers are modules inside the layer (an own save
through a view op escapes the trace: the unit then keeps its output, as keep would); else the layer takes the
selective checkpoint (Note: [narrowed select recompute] in ``_sac_policy.py``). The hooks run in eager code only
(Note: [compile honoured] in ``_op_level.py``): a compiled layer is checkpointed whole. Guarded by
tests/test_footprint_sac.py.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from ._footprint import FOOTPRINT
from ._op_level import eager_only
from ._sac_policy import LayerTrace, under

__all__ = ["PackRecompute", "pack_units"]


def pack_units(trace: LayerTrace, actions: dict[str, str], modules: dict[str, nn.Module],
               leaves: Callable[[nn.Module], bool]) -> dict[str, list[str]] | None:
    """Recomputed unit -> the paths of the modules reading its output, when Note: [recompute at pack] applies to
    every recomputed unit of the traced layer call; ``modules``: the layer's modules by path, the layer first."""
    recomputed = [u for u in trace.units if actions.get(u) == "recompute"]
    paths = sorted(modules, key=len, reverse=True)
    layer_path = next(iter(modules))
    out: dict[str, list[str]] = {}
    for unit in recomputed:
        owner = next((p for p in paths if under(unit, p)), layer_path)
        if not leaves(modules[owner]) or unit in trace.random or unit in trace.self_saved:
            return None
        if any(k[0] == unit for k in trace.mutated_ops):
            return None
        reads = trace.reads.get(unit, set())
        if any(s not in trace.saved and s in trace.producers for s in reads) or reads & trace.mutated:
            return None
        readers = {next((p for p in paths if under(c, p)), layer_path) for c in trace.consumers.get(unit, ())}
        if not readers or layer_path in readers:
            return None
        out[unit] = sorted(readers)
    return out or None


class _Recipe:
    """One call of the unit's module: its inputs, to run it again at the first unpack."""

    __slots__ = ("module", "args", "kwargs", "versions", "grad", "autocast", "value")

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.module, self.args, self.kwargs = module, args, kwargs
        self.versions = [a._version for a in args if isinstance(a, torch.Tensor)]
        self.grad = torch.is_grad_enabled()
        devices = {a.device.type for a in args if isinstance(a, torch.Tensor)} | {"cpu"}
        self.autocast = [(d, torch.get_autocast_dtype(d)) for d in sorted(devices) if torch.is_autocast_enabled(d)]
        self.value: torch.Tensor | None = None

    def output(self) -> torch.Tensor:
        if self.value is None:
            if [a._version for a in self.args if isinstance(a, torch.Tensor)] != self.versions:
                raise RuntimeError("op-level recompute: an input of the recomputed module "
                                   f"{type(self.module).__name__} was written in place before backward")
            args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                         for a in self.args)
            with torch.set_grad_enabled(self.grad), _autocast(self.autocast):
                self.value = self.module.forward(*args, **self.kwargs).detach()
        return self.value


class _autocast:
    """Re-enter the autocast regions of a recorded forward."""

    def __init__(self, regions: list[tuple[str, torch.dtype]]) -> None:
        self.contexts = [torch.autocast(d, dtype=dtype) for d, dtype in regions]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


class PackRecompute:
    """The hooks of Note: [recompute at pack] for one unit module and the modules reading its output."""

    def __init__(self, module: nn.Module, readers: list[nn.Module]) -> None:
        self.module = module
        self.readers = readers
        self.recipe: _Recipe | None = None
        self.output: Callable[[], torch.Tensor | None] = lambda: None
        """The unit's last output while it lives (a weak reference): a storage id matches only then, never a
        storage allocated again at its address."""
        self.storage = 0
        self.stack: list[Any] = []

    def install(self, handles: list[Any]) -> None:
        """Register the hooks; their handles go to ``handles``."""
        handles.append(self.module.register_forward_hook(eager_only(self._produced), with_kwargs=True))
        for reader in self.readers:
            handles.append(reader.register_forward_pre_hook(eager_only(self._enter)))
            handles.append(reader.register_forward_hook(eager_only(self._exit), always_call=True))

    def _produced(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not torch.is_grad_enabled():
            self.recipe, self.output = None, lambda: None
            return
        self.recipe, self.storage = _Recipe(module, args, kwargs), output.untyped_storage()._cdata
        self.output = weakref.ref(output)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self.stack.append(hooks)

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.stack:
            self.stack.pop().__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> Any:
        FOOTPRINT.pack += 1
        if self.recipe is None or t.untyped_storage()._cdata != self.storage or self.output() is None:
            return t
        return self.recipe, t.size(), t.stride(), t.storage_offset()


def _unpack(packed: Any) -> torch.Tensor:
    FOOTPRINT.unpack += 1
    if isinstance(packed, torch.Tensor):
        return packed
    recipe, size, stride, offset = packed
    return recipe.output().as_strided(size, stride, offset)
