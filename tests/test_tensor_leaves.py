"""``profiler.tracing.tensor_leaves``: the hooks' walk of a module's arguments and outputs gives exactly the tensors
of ``torch.utils._pytree.tree_leaves``, in its order, whatever the container."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils import _pytree as pytree

from profiler.tracing import tensor_leaves

_Pair = collections.namedtuple("_Pair", "first second")
_A, _B, _C = torch.ones(2), torch.zeros(3), torch.nn.Parameter(torch.ones(1))
TREES = [_A, _C, None, 3, "x", (), [], {}, (_A, None), [_A, (_B, {"k": _C, "j": 2})], {"z": _A, "a": [_B, None]},
         (_Pair(_A, _B), _C), {"p": _Pair(_B, (_A,))}, ((((_A,),),),), (_A, _A)]


def _same(tree: object) -> None:
    expected = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    assert [id(t) for t in tensor_leaves(tree)] == [id(t) for t in expected]


@pytest.mark.parametrize("tree", TREES, ids=range(len(TREES)))
def test_tensor_leaves_match_pytree(tree: object) -> None:
    _same(tree)


def test_model_outputs_match_pytree() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs", reason="ModelOutput trees need transformers")
    out = outputs.BaseModelOutput(last_hidden_state=_A, hidden_states=(_B, _A))
    _same(out)
    _same((out, [_C]))
