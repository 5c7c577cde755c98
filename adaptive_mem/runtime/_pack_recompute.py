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
autograd saves anyway (parameters, or storages saved in the traced call and made by no recomputed unit: the recipe
adds no storage to what backward holds), whose output no op of the call writes in place, and whose readers are modules inside the layer (an own save
through a view op escapes the trace: the unit then keeps its output, as keep would); else the layer takes the
selective checkpoint (Note: [narrowed select recompute] in ``_sac_policy.py``). The hooks run in eager code only
(Note: [compile honoured] in ``_op_level.py``): a compiled layer is checkpointed whole. Guarded by
tests/test_footprint_sac.py.

Note: [single-op recompute at pack]. A recomputed unit that is one op of a module's own code (``mlp.mul`` of
Hugging Face's ``act_fn(gate_proj(x)) * up_proj(x)``) is recomputed the same way when that op has positional
tensor arguments only, each the output of a leaf module of the layer (its producers) that autograd saves anyway,
and the other conditions above hold (:func:`op_units`). No op is intercepted: forward hooks on the producers keep
their last outputs (weakly); a reader's pre-hook finds, among its arguments, the tensor whose autograd node is of
the op's node type (learnt once on a one-element call) and whose node's inputs are exactly the producers' outputs
in order (``next_functions``), and while the reader runs a saved tensor on that storage becomes a recipe: the op
and the producers' outputs, run again (grad off) at the first unpack. An output found otherwise (another control
flow, autocast, a producer output that does not require grad) is kept as is. Guarded by tests/test_pack_op.py.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Callable

import torch
from torch import nn

from ._footprint import FOOTPRINT
from ._functions import function_labels
from ._op_level import eager_only
from ._sac_policy import LayerTrace, under
from ._swap_engine import no_cycle
from ._swap_scopes import Outer, outer_hooks, pass_outward

__all__ = ["PackOp", "PackRecompute", "op_units", "pack_units"]


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
        if any(s in trace.producers and not _kept(trace, s, recomputed) for s in reads) or reads & trace.mutated:
            return None
        readers = {next((p for p in paths if under(c, p)), layer_path) for c in trace.consumers.get(unit, ())}
        if not readers or layer_path in readers:
            return None
        out[unit] = sorted(readers)
    return out or None


def _kept(trace: LayerTrace, storage: int, recomputed: list[str]) -> bool:
    """A storage a recipe may hold at no cost: autograd saves it anyway, and it is no output of a unit recomputed
    itself (whose saves become recipes: held by another's recipe it would stay on the device)."""
    return storage in trace.saved and trace.producers.get(storage) not in recomputed


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


class _AtReaders:
    """The saved-tensor hooks entered around each reader's call: a tensor on the unit's output storage is packed as
    its recipe while that output lives (``recipe``, ``storage``, ``output`` set by the subclass before)."""

    recipe: Any
    storage: int
    output: Callable[[], torch.Tensor | None]
    stack: list[Any]

    def _find(self, args: tuple) -> None:
        """The unit's output among a reader's arguments (where the unit is not a module whose output is seen)."""

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self._find(args)
        outer = outer_hooks()  # Note: [scope hooks chain outward]
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self.stack.append((hooks, outer))

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.stack:
            self.stack.pop()[0].__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> Any:
        """A saved tensor on the unit's output: its recipe; any other: as the hooks entered before would pack it
        (the swaps of other layers, the adaptive loop's manager: Note: [scope hooks chain outward] in
        ``_op_swap.py``), else itself."""
        FOOTPRINT.pack += 1
        if self.recipe is None or t.untyped_storage()._cdata != self.storage or self.output() is None:
            outer = self.stack[-1][1] if self.stack else None
            return pass_outward(no_cycle(t), outer)  # Note: [pack without a cycle]
        return self.recipe, t.size(), t.stride(), t.storage_offset()


class PackRecompute(_AtReaders):
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

def _unpack(packed: Any) -> torch.Tensor:
    FOOTPRINT.unpack += 1
    if isinstance(packed, torch.Tensor):
        return packed
    if isinstance(packed, Outer):
        return packed.unpack(packed.packed)
    recipe, size, stride, offset = packed
    return recipe.output().as_strided(size, stride, offset)


def _node_type(func: Any, n: int) -> type | None:
    """The autograd node type of ``func`` called on ``n`` one-element tensors (None: no such call)."""
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes(), torch.enable_grad():
            out = func(*[torch.ones(1, requires_grad=True) for _ in range(n)])
    except Exception:  # noqa: BLE001 - an op this form cannot call is recomputed another way
        return None
    return type(out.grad_fn) if isinstance(out, torch.Tensor) and out.grad_fn is not None else None


def op_units(trace: LayerTrace, actions: dict[str, str], modules: dict[str, nn.Module],
             leaves: Callable[[nn.Module], bool]) -> dict[str, tuple[type, Any, list[str], list[str]]] | None:
    """Recomputed unit -> (its op's node type, the op, its producers' paths in argument order, its readers'
    paths) when Note: [single-op recompute at pack] applies to every recomputed unit of the traced layer call."""
    recomputed = [u for u in trace.units if actions.get(u) == "recompute"]
    paths = sorted(modules, key=len, reverse=True)
    layer_path = next(iter(modules))
    functions = function_labels()  # a wrapped Function's node is its own, never the op's (Note: [wrapped Function unit])
    owner = lambda u: next((p for p in paths if under(u, p)), layer_path)  # noqa: E731
    out: dict[str, tuple[type, Any, list[str], list[str]]] = {}
    for unit in recomputed:
        keys = [k for k in trace.ops if k[0] == unit]
        if re.sub(r"_\d+$", "", unit.rpartition(".")[2]) in functions or len(keys) != 1 or keys[0] not in trace.calls or keys[0] in trace.mutated_ops or unit in trace.random \
                or unit in trace.self_saved:
            return None
        func, storages = trace.calls[keys[0]]
        if not storages or any(s is None or not _kept(trace, s, recomputed) or s in trace.mutated for s in storages):
            return None
        producers = [owner(trace.producers.get(s) or layer_path) for s in storages]
        readers = sorted({owner(c) for c in trace.consumers.get(unit, ())})
        if any(p == layer_path or not leaves(modules[p]) for p in producers) or not readers or layer_path in readers:
            return None
        node = _node_type(func, len(storages))
        if node is None:
            return None
        out[unit] = (node, func, producers, readers)
    return out or None


class _OpRecipe:
    """One call of the unit's op: the producers' outputs, to run it again at the first unpack."""

    __slots__ = ("func", "args", "versions", "value")

    def __init__(self, func: Any, args: list[torch.Tensor]) -> None:
        self.func, self.args = func, args
        self.versions = [a._version for a in args]
        self.value: torch.Tensor | None = None

    def output(self) -> torch.Tensor:
        if self.value is None:
            if [a._version for a in self.args] != self.versions:
                raise RuntimeError(f"op-level recompute: an input of the recomputed op {self.func} was written in "
                                   "place before backward")
            with torch.no_grad():
                self.value = self.func(*[a.detach() for a in self.args])
        return self.value


def _dead() -> None:
    return None


class PackOp(_AtReaders):
    """The hooks of Note: [single-op recompute at pack] for one op unit, its producers and its readers."""

    def __init__(self, node: type, func: Any, producers: list[nn.Module], readers: list[nn.Module]) -> None:
        self.node, self.func = node, func
        self.producers = [id(m) for m in producers]
        self.modules = list({id(m): m for m in producers}.values())
        self.readers = readers
        self.outputs: dict[int, Callable[[], Any]] = {}
        self.recipe: _OpRecipe | None = None
        self.output: Callable[[], Any] = _dead
        self.storage = 0
        self.stack: list[Any] = []

    def install(self, handles: list[Any]) -> None:
        """Register the hooks; their handles go to ``handles``."""
        for module in self.modules:
            handles.append(module.register_forward_hook(eager_only(self._produced)))
        for reader in self.readers:
            handles.append(reader.register_forward_pre_hook(eager_only(self._enter)))
            handles.append(reader.register_forward_hook(eager_only(self._exit), always_call=True))

    def _produced(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.outputs[id(module)] = weakref.ref(output) if isinstance(output, torch.Tensor) else _dead

    def _find(self, args: tuple) -> None:
        """The unit's output among a reader's arguments, and its recipe; none when it is not found."""
        self.recipe, self.output = None, _dead
        if not torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
            return
        ins = [self.outputs.get(p, _dead)() for p in self.producers]
        if any(i is None or i.grad_fn is None for i in ins):
            return
        for a in args:
            node = getattr(a, "grad_fn", None)
            if type(node) is not self.node or torch.is_autocast_enabled(a.device.type):
                continue
            nexts = node.next_functions
            storage = a.untyped_storage()._cdata
            if len(nexts) == len(ins) and all(n is i.grad_fn and k == i.output_nr for (n, k), i in zip(nexts, ins)) \
                    and all(i.untyped_storage()._cdata != storage for i in ins):
                self.recipe, self.storage, self.output = _OpRecipe(self.func, ins), storage, weakref.ref(a)
                return
