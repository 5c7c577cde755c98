"""The tensors of a pytree, for hooks that run at every module call or op of a planned step."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

__all__ = ["tensor_leaves"]

_NO_TENSORS = (type(None), bool, int, float, str)


def tensor_leaves(tree: object) -> list[torch.Tensor]:
    """The tensors among ``tree``'s pytree leaves, in ``torch.utils._pytree.tree_leaves`` order.

    Plain tuples, lists and dicts (a module's usual arguments and outputs) are walked here: ``tree_leaves`` costs
    several microseconds even on a pair, which a hook paying it at each module call multiplies by the model's calls.
    Any other container (named tuples, ``ModelOutput`` and the types registered with pytree) goes to ``tree_leaves``.
    """
    kind = type(tree)
    if kind is torch.Tensor or isinstance(tree, torch.Tensor):
        return [tree]  # type: ignore[list-item]
    if kind in _NO_TENSORS:
        return []
    if kind is tuple or kind is list:
        out: list[torch.Tensor] = []
        for item in tree:  # type: ignore[attr-defined]
            if type(item) is torch.Tensor:
                out.append(item)
            elif type(item) not in _NO_TENSORS:
                out.extend(tensor_leaves(item))
        return out
    if kind is dict:
        return tensor_leaves(list(tree.values()))  # type: ignore[attr-defined]
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
