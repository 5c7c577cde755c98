"""Kinds of layers: the blocks of one stack need not share a module tree.

Note: [layer kinds] a hybrid stack mixes blocks of one class built differently: Qwen3-Next's layers hold
``linear_attn`` or ``self_attn``, LFM2's ``conv`` or ``self_attn`` (by ``config.layer_types``); T5's first
block of a stack also holds the relative position bias. Two layers are of one kind when their module trees
(local paths and classes, Note: [compile wrapper names]) are equal; the names of a kind are those of its
first layer. Config keys are matched per layer against its kind's names and apply where they match
(docs/plan-format.md, "Layers of several kinds"); a plan target naming a module its layer lacks is refused
naming the layer's kind. Guarded by tests/test_hybrid_layers.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ._paths import named_modules
from ._units import LayerInfo

__all__ = ["LayerKinds", "layer_kinds"]


@dataclass(frozen=True)
class LayerKinds:
    first: tuple[int, ...]
    """Per layer, the first layer of its kind."""
    modules: tuple[tuple[str, ...], ...]
    """Per layer, its local module paths in definition order (one tuple shared by the layers of a kind)."""

    @property
    def several(self) -> bool:
        return len(set(self.first)) > 1

    def layers(self, index: int) -> list[int]:
        """The layers of layer ``index``'s kind."""
        return [i for i, f in enumerate(self.first) if f == self.first[index]]

    def describe(self, index: int) -> str:
        """Layer ``index``'s kind in words: the modules it has that not every kind has (``with self_attn``), else
        those it lacks (``without layer.2``)."""
        own = set(self.modules[index])
        kinds = {self.first[i]: set(self.modules[i]) for i in range(len(self.first))}
        common = set.intersection(*kinds.values())
        mine = _top(m for m in self.modules[index] if m not in common)
        if mine:
            return "with " + ", ".join(mine)
        lacks = _top(m for k in kinds for m in kinds[k] if m not in own)
        return "without " + ", ".join(lacks) if lacks else f"like layer {self.first[index]}"


def _top(paths) -> list[str]:
    """The paths not below another of them, in order."""
    paths = list(dict.fromkeys(paths))
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]


def layer_kinds(root: nn.Module, info: LayerInfo) -> LayerKinds:
    """The kind of each of ``root``'s layers (Note: [layer kinds])."""
    seen: dict[tuple[tuple[str, str], ...], tuple[int, tuple[str, ...]]] = {}
    first, modules = [], []
    for i in range(info.count):
        tree = tuple((path, type(module).__name__) for path, module in named_modules(root.get_submodule(
            info.layer_path(i))) if path)
        rep, paths = seen.setdefault(tree, (i, tuple(path for path, _ in tree)))
        first.append(rep)
        modules.append(paths)
    return LayerKinds(tuple(first), tuple(modules))
