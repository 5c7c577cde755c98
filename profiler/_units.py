"""Stable unit names for the aten ops of a forward pass.

A *unit* is what a plan decides about: one logical op of the model, named by
its module path and an op label, e.g. ``layers.3.feed_forward.w1.activation.silu``.

Naming rules (see ``docs/profile-format.md``):

1. A leaf module (no children) is one unit, whatever aten ops it runs:
   ``<path>.<label>`` where the label is the module's ``unit_label`` attribute
   or derived from its class (``Linear``/``Conv1D`` -> ``matmul``, ``*Norm`` ->
   ``norm``, activations -> their name). If the path already ends in the label
   (``attention.flash_attention``, ``feed_forward.mul``) it is not repeated.
2. An op run directly by a non-leaf module's own code is ``<path>.<op label>``,
   with ``_1``, ``_2``... for the second, third... op of that label in one call
   of the module (``layers.0.add``, ``layers.0.add_1``).
3. View and metadata-only ops create no unit: they allocate nothing.
4. The ops of a custom autograd Function called through ``adaptive_mem.wrap_function`` are one
   unit ``<path>.<Function label>`` (its ``unit_label`` attribute, else its class name), numbered
   like rule 2, whatever module it runs in (:func:`function_scope`).
5. Ops run by the profiler's or the executor's own machinery create no unit and count for no
   suffix (:func:`machinery_scope`, Note: [machinery ops]).
6. Ops a parallel wrapper runs in regions of its own (FSDP2's all-gathers and copy-outs), and the
   ``record_function`` markers of any region, create no unit and count for no suffix (Note: [wrapper ops]).

Note: [machinery ops]. A plan is searched on the profiler's names and applied by the executor's, so
both passes must count the same ops. The executor's saved-tensor hooks and swap engine run aten ops
of their own in the middle of a module call (a host buffer ``empty``, a ``set_`` onto the saved
storage, an inline ``copy_`` on an accelerator stream) that the profiler's pass never runs; counted,
they would shift the suffix of every later op of that label in the module call (``empty`` -> the
executor's ``empty_2``), so a plan would decide another op than the one profiled. Machinery runs
inside :func:`machinery_scope`, and the namer, and the recorder, skip what runs there (guarded by
tests/test_units.py ``test_swap_machinery_ops_are_no_units``). Only a Python dispatch mode sees ops to name, so a
function decorated with the scope, called while none is entered on its thread (every step after a unit's first), runs
without marking it (its ops reach no mode that could ask).

Repeated blocks (the children of the largest homogeneous ``ModuleList``) get a
layer index; a unit's *local name* is its name with the ``<container>.<i>.``
prefix removed, the form MindFormers configs use.

Note: [several layer stacks] an encoder-decoder model has two lists of blocks (T5's ``encoder.block`` and
``decoder.block``): both are layers, with one global index (encoder first), full-path unit names and local
names relative to the block (docs/plan-format.md "Several layer stacks"; tests/test_encoder_decoder.py).
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from ._machinery import in_machinery, machinery_scope
from ._paths import COMPILE_CHILD, module_path, named_modules
from ._regions import Regions

__all__ = ["COLLECTIVE_LABELS", "LayerInfo", "UnitNamer", "collective_label", "find_layers", "op_label", "is_view_op",
           "function_scope", "in_machinery", "machinery_scope"]

MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "_addmm_activation"}
_LEAF_LABELS: dict[str, str] = {
    "linear": "matmul", "conv1d": "matmul", "conv2d": "matmul", "nonDynamicallyQuantizableLinear": "matmul",
    "embedding": "embedding", "dropout": "dropout",
}


_METADATA_OPS = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous", "is_same_size",
                 "_local_scalar_dense", "is_nonzero", "size", "stride", "numel", "dim"}


def is_view_op(func: torch._ops.OpOverload) -> bool:
    """True for ops that allocate nothing: views (outputs alias inputs) and metadata queries."""
    if getattr(func, "is_view", False) or func.namespace == "prim":
        return True
    name = func.overloadpacket.__name__
    return name in {"detach", "alias", "lift_fresh", "_unsafe_view"} or name in _METADATA_OPS


def op_label(func: torch._ops.OpOverload) -> str:
    """Short label of an aten op: ``mm`` -> ``matmul``, SDPA kernels -> ``flash_attention``."""
    name = func.overloadpacket.__name__.strip("_")
    if name in MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in name and "attention" in name and "backward" not in name:
        return "flash_attention"
    return name


COLLECTIVE_LABELS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def collective_label(func: torch._ops.OpOverload) -> str | None:
    """``all_reduce`` / ``all_gather`` / ``reduce_scatter`` / ``all_to_all`` for a functional collective (what
    DTensor's redistribute runs), ``"wait"`` for its ``wait_tensor``, else ``None``."""
    name = func.overloadpacket.__name__
    if name.endswith("wrap_tensor_autograd"):  # DTensor's autograd wrapper of a collective's output
        return "wait"
    if func.namespace not in _COLLECTIVE_NAMESPACES:
        return None
    if name == "wait_tensor":
        return "wait"
    return next((label for label in COLLECTIVE_LABELS if name.startswith(label)), name)


def leaf_label(module: nn.Module) -> str:
    explicit = getattr(module, "unit_label", None)
    if isinstance(explicit, str) and explicit:
        return explicit
    cls = type(module).__name__
    lowered = cls.lower()
    if lowered in _LEAF_LABELS:
        return _LEAF_LABELS[lowered]
    if lowered.endswith("linear") or lowered.startswith("conv"):
        return "matmul"
    if "norm" in lowered:
        return "norm"
    if lowered.endswith("rotaryembedding"):
        return "rope"
    if lowered.endswith("router"):
        return "router"
    if lowered.endswith("activation"):
        return lowered[: -len("activation")] or lowered
    return lowered


@dataclass(frozen=True)
class LayerInfo:
    container: str
    """Path of the ModuleList holding the repeated blocks (``layers``, ``model.layers``, ``transformer.h``);
    with several stacks the first one's (``encoder.block``)."""
    count: int
    """Number of blocks, over all stacks."""
    stacks: tuple[tuple[str, int], ...] = ()
    """``(container, blocks)`` of each stack in definition order (``encoder.block`` then ``decoder.block``);
    ``((container, count),)`` for one stack. Global layer ``i`` runs through the stacks in this order."""

    def __post_init__(self) -> None:
        if not self.stacks:
            object.__setattr__(self, "stacks", ((self.container, self.count),))

    @classmethod
    def of(cls, stacks: list[tuple[str, int]] | tuple[tuple[str, int], ...]) -> "LayerInfo":
        """Several stacks (Note: [several layer stacks])."""
        stacks = tuple((str(c), int(n)) for c, n in stacks)
        return cls(container=stacks[0][0], count=sum(n for _, n in stacks), stacks=stacks)

    @property
    def containers(self) -> tuple[str, ...]:
        return tuple(c for c, _ in self.stacks)

    def stack_of(self, index: int) -> int:
        """Which stack global layer ``index`` belongs to."""
        for s, (_, n) in enumerate(self.stacks):
            if index < n:
                return s
            index -= n
        raise IndexError(f"layer {index}: beyond the {self.count} layers")

    def first(self, stack: int) -> int:
        """Global index of the first block of ``stack``."""
        return sum(n for _, n in self.stacks[:stack])

    def split(self, path: str) -> tuple[int | None, str]:
        """``layers.3.attention.wq`` -> ``(3, "attention.wq")``; paths outside the blocks -> ``(None, path)``.

        With several stacks the index is global: ``decoder.block.1.layer.0`` -> ``(n_encoder + 1, "layer.0")``.
        A compiled block's ``_orig_mod`` is no part of a path (Note: [compile wrapper names]).
        """
        path = module_path(path)
        offset = 0
        for container, n in self.stacks:
            prefix = container + "." if container else ""
            if path.startswith(prefix):
                head, _, rest = path[len(prefix):].partition(".")
                if head.isdigit() and int(head) < n:
                    return offset + int(head), rest
            offset += n
        return None, path

    def layer_path(self, index: int) -> str:
        s = self.stack_of(index)
        container, local = self.stacks[s][0], index - self.first(s)
        return f"{container}.{local}" if container else str(local)


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_layers(root: nn.Module) -> LayerInfo | None:
    """The repeated blocks of ``root``: the homogeneous ModuleList with the most parameters, and every
    other stack of blocks beside it (Note: [several layer stacks])."""
    candidates: list[tuple[int, int, str, int]] = []  # (parameters, definition order, path, blocks)
    for order, (path, module) in enumerate(named_modules(root)):  # Note: [compile wrapper names]
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        kinds = {type(child._modules.get(COMPILE_CHILD, child)) for child in module}
        if len(kinds) != 1:
            continue
        candidates.append((_param_count(module), order, path, len(module)))
    if not candidates:
        return None
    best = max(candidates, key=lambda c: (c[0], -c[1]))
    chosen = [best]
    block = _param_count(root.get_submodule(_join_path(best[2], "0")))
    for cand in sorted(candidates, key=lambda c: (-c[0], c[1])):
        if cand is best or any(_nested(cand[2], c[2]) for c in chosen):
            continue
        first = root.get_submodule(_join_path(cand[2], "0"))
        if next(first.children(), None) is None or 4 * _param_count(first) < block or block == 0:
            continue
        chosen.append(cand)
    chosen.sort(key=lambda c: c[1])
    if len(chosen) == 1:
        return LayerInfo(container=best[2], count=best[3])
    return LayerInfo.of([(c[2], c[3]) for c in chosen])


def _join_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _nested(a: str, b: str) -> bool:
    """One path lies in (or is) the other."""
    return a == b or a == "" or b == "" or a.startswith(b + ".") or b.startswith(a + ".")


def join(path: str, label: str) -> str:
    if not path:
        return label
    if path == label or path.endswith("." + label):
        return path
    return f"{path}.{label}"


_SUFFIX = re.compile(r"_(\d+)$")


@dataclass
class _FunctionScope:
    label: str
    names: dict[int, str] = field(default_factory=dict)
    """Namer id -> the unit name that namer gave this call (counted once per call)."""


_scopes = threading.local()


@contextlib.contextmanager
def function_scope(label: str) -> Iterator[None]:
    """Every op run inside is one unit ``<module path>.<label>`` (``_1``, ``_2``... for later calls in
    one module call), for each :class:`UnitNamer`: a wrapped custom autograd Function
    (``adaptive_mem.wrap_function``). The outermost scope wins; thread-local, so a replay in backward
    names its own call."""
    stack = _scopes.__dict__.setdefault("stack", [])
    stack.append(_FunctionScope(label))
    try:
        yield
    finally:
        stack.pop()


def _function_unit(namer: "UnitNamer") -> str | None:
    stack = getattr(_scopes, "stack", None)
    if not stack:
        return None
    scope = stack[0]
    name = scope.names.get(id(namer))
    if name is None:
        module, counters = namer._stack[-1] if namer._stack else (None, {})
        seen = counters.get(scope.label, 0)
        counters[scope.label] = seen + 1
        label = scope.label if seen == 0 else f"{scope.label}_{seen}"
        name = scope.names[id(namer)] = join(namer.paths[id(module)] if module is not None else "", label)
    return name


_FIND = object()


class UnitNamer:
    """Names ops by the module that runs them; drive it with :meth:`enter` / :meth:`exit` from module hooks.

    The caller pushes a module on entry to its forward and pops it on exit;
    :meth:`name` returns the unit of an aten op run now, or ``None`` for views.
    """

    def __init__(self, root: nn.Module, *, layers: LayerInfo | None | object = _FIND) -> None:
        """``layers``: ``root``'s repeated blocks when already found (``ModelStructure.namer``), else found here."""
        self.paths: dict[int, str] = {id(m): p for p, m in named_modules(root, wrappers=True)}
        self.leaves: set[int] = {id(m) for m in root.modules() if next(m.children(), None) is None}
        self.labels: dict[int, str] = {id(m): leaf_label(m) for m in root.modules() if id(m) in self.leaves}
        self.layers: LayerInfo | None = find_layers(root) if layers is _FIND else layers  # type: ignore[assignment]
        self._stack: list[tuple[nn.Module, dict[str, int]]] = []
        self._collective: str | None = None
        self.regions = Regions()
        """Open ``record_function`` regions, a wrapper's among them (Note: [wrapper ops])."""

    def tracks(self, module: nn.Module) -> bool:
        return id(module) in self.paths

    def enter(self, module: nn.Module) -> None:
        if not self._stack:
            self.regions.clear()  # a new forward: no region of an earlier one is open
        self._stack.append((module, {}))

    def exit(self, module: nn.Module) -> None:
        # Pop back to ``module``: an exception inside a child may have skipped its exit.
        while self._stack:
            top, _ = self._stack.pop()
            if top is module:
                return

    @property
    def module_path(self) -> str:
        return self.paths[id(self._stack[-1][0])] if self._stack else ""

    def name(self, func: torch._ops.OpOverload, args: tuple = ()) -> str | None:
        """The unit of op ``func`` (called with ``args``) run now; None for views, region markers and a wrapper's
        own ops (Note: [wrapper ops])."""
        if self.regions.observe(func, args) or self.regions.wrapper or is_view_op(func) or in_machinery():  # 3, 5, 6
            return None
        function_unit = _function_unit(self)
        if function_unit is not None:
            return function_unit
        collective = collective_label(func)
        if collective is not None:
            return self._collective_unit(collective)
        if not self._stack:
            return op_label(func)
        module, counters = self._stack[-1]
        path = self.paths[id(module)]
        # A leaf module is one unit; so is any module inside a leaf-labelled subtree.
        for outer, _ in self._stack:
            if id(outer) in self.leaves:
                return join(self.paths[id(outer)], self.labels[id(outer)])
        label = op_label(func)
        seen = counters.get(label, 0)
        counters[label] = seen + 1
        return join(path, label if seen == 0 else f"{label}_{seen}")

    def _collective_unit(self, label: str) -> str:
        """Note: [collective units] a collective is its own unit ``<module path>.<label>`` (numbered like rule 2),
        also inside a leaf module, named by the module on top of the stack: the one whose forward or layout
        hooks (DTensor ``parallelize_module``) issue it; its ``wait_tensor`` belongs to the last collective
        issued. Plans and configs target them (``layers.0.attention.wo.all_reduce``); tests/test_parallel_comm.py."""
        if label == "wait":
            return self._collective or "wait_tensor"
        if not self._stack:
            self._collective = label
            return label
        module, counters = self._stack[-1]
        seen = counters.get(label, 0)
        counters[label] = seen + 1
        self._collective = _join_path(self.paths[id(module)], label if seen == 0 else f"{label}_{seen}")
        return self._collective

    def split(self, unit: str) -> tuple[int | None, str]:
        """``layers.3.feed_forward.mul`` -> ``(3, "feed_forward.mul")``."""
        if self.layers is None:
            return None, unit
        return self.layers.split(unit)
