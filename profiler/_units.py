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

Repeated blocks (the children of the largest homogeneous ``ModuleList``) get a
layer index; a unit's *local name* is its name with the ``<container>.<i>.``
prefix removed, the form MindFormers configs use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LayerInfo", "UnitNamer", "find_layers", "op_label", "is_view_op"]

_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "_addmm_activation"}
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
    if name in _MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in name and "attention" in name and "backward" not in name:
        return "flash_attention"
    return name


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
    """Path of the ModuleList holding the repeated blocks (``layers``, ``model.layers``, ``transformer.h``)."""
    count: int
    """Number of blocks."""

    def split(self, path: str) -> tuple[int | None, str]:
        """``layers.3.attention.wq`` -> ``(3, "attention.wq")``; paths outside the blocks -> ``(None, path)``."""
        prefix = self.container + "." if self.container else ""
        if not path.startswith(prefix):
            return None, path
        head, _, rest = path[len(prefix):].partition(".")
        if not head.isdigit():
            return None, path
        return int(head), rest

    def layer_path(self, index: int) -> str:
        return f"{self.container}.{index}" if self.container else str(index)


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_layers(root: nn.Module) -> LayerInfo | None:
    """The repeated blocks of ``root``: the homogeneous ModuleList with the most parameters."""
    best: tuple[int, str, int] | None = None
    for path, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1:
            continue
        size = _param_count(module)
        if best is None or size > best[0]:
            best = (size, path, len(module))
    if best is None:
        return None
    return LayerInfo(container=best[1], count=best[2])


def join(path: str, label: str) -> str:
    if not path:
        return label
    if path == label or path.endswith("." + label):
        return path
    return f"{path}.{label}"


_SUFFIX = re.compile(r"_(\d+)$")


class UnitNamer:
    """Names ops by the module that runs them; drive it with :meth:`enter` / :meth:`exit` from module hooks.

    The caller pushes a module on entry to its forward and pops it on exit;
    :meth:`name` returns the unit of an aten op run now, or ``None`` for views.
    """

    def __init__(self, root: nn.Module) -> None:
        self.paths: dict[int, str] = {id(m): p for p, m in root.named_modules()}
        self.leaves: set[int] = {id(m) for m in root.modules() if next(m.children(), None) is None}
        self.labels: dict[int, str] = {id(m): leaf_label(m) for m in root.modules() if id(m) in self.leaves}
        self.layers = find_layers(root)
        self._stack: list[tuple[nn.Module, dict[str, int]]] = []

    def tracks(self, module: nn.Module) -> bool:
        return id(module) in self.paths

    def enter(self, module: nn.Module) -> None:
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

    def name(self, func: torch._ops.OpOverload) -> str | None:
        if is_view_op(func):
            return None
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

    def split(self, unit: str) -> tuple[int | None, str]:
        """``layers.3.feed_forward.mul`` -> ``(3, "feed_forward.mul")``."""
        if self.layers is None:
            return None, unit
        return self.layers.split(unit)
