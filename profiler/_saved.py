"""Which ops' outputs autograd saves: the "saved by autograd" set of the SAC policy.

``docs/plan-format.md`` (Note: [SAC policy]) marks every op whose output
autograd saves as ``MUST_SAVE`` unless its unit is recomputed. This module
answers that question for one module (usually one layer) by running its
forward once under the recorder, on real or fake tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ._recorder import Recorder

if TYPE_CHECKING:
    from ._units import UnitNamer

__all__ = ["OpCounter", "OpKey", "SavedOutputs", "saved_outputs", "saved_output_units"]


class OpKey(NamedTuple):
    """One op of a module's forward: ``(unit, ordinal)``, the key ``adaptive_mem``'s SAC policy uses."""

    unit: str
    """Unit name relative to the module (``feed_forward.w1.activation.silu`` for a layer)."""
    ordinal: int
    """How many non-view ops of this unit ran before it in the same call of the module."""


@dataclass(frozen=True)
class SavedOutputs:
    """Result of :func:`saved_outputs` for one module and input shape."""

    ops: frozenset[OpKey]
    """Ops whose outputs (some storage of them) autograd saves for backward."""
    all_ops: tuple[tuple[OpKey, str], ...]
    """Every non-view op of the forward with its aten overload (``aten.silu.default``), in order."""
    saved_bytes: dict[str, int]
    """Unit -> saved bytes of its outputs."""

    @property
    def units(self) -> frozenset[str]:
        """Units with at least one saved output."""
        return frozenset(k.unit for k in self.ops)

    def __contains__(self, key: object) -> bool:
        return key in self.ops


class OpCounter:
    """Turns the units of one forward's non-view ops, in order, into :class:`OpKey`s: the profiler's saved-output
    pass and the executor's SAC policy key ops alike (Note: [SAC policy]).

    Use a fresh counter (or :meth:`reset`) per call of the module. With a ``namer`` (the executor's
    :class:`~profiler._units.UnitNamer`), :meth:`op_key` names the op's unit first.
    """

    def __init__(self, namer: "UnitNamer | None" = None) -> None:
        self.namer = namer
        self._seen: dict[str, int] = {}

    def reset(self) -> None:
        self._seen = {}

    def key(self, unit: str) -> OpKey:
        n = self._seen.get(unit, 0)
        self._seen[unit] = n + 1
        return OpKey(unit, n)

    def op_key(self, func: Any, args: tuple = ()) -> OpKey | None:
        """The key of aten op ``func`` named by the namer; None for an op of no unit."""
        if self.namer is None:
            raise ValueError("OpCounter.op_key: namer=None; expected a counter built with a UnitNamer")
        unit = self.namer.name(func, args)
        return None if unit is None else self.key(unit)


def _fake_mode_of(tree: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    for t in pytree.tree_leaves(tree):
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


def saved_outputs(module: nn.Module, *args: Any, **kwargs: Any) -> SavedOutputs:
    """Run ``module(*args, **kwargs)`` once and report which ops' outputs autograd saves.

    Pass inputs with ``requires_grad`` as inside the model (the hidden state
    ``h.detach().requires_grad_()``, rotary tables plain): what autograd saves
    depends on it. Fake inputs (and a fake module) run under their
    ``FakeTensorMode``; nothing is allocated then. Unit names are relative to
    ``module``: for ``model.layers[3]`` they are the local names
    (``attention.flash_attention``).
    """
    fake_mode = _fake_mode_of((args, kwargs, list(module.parameters())))
    static = [*module.parameters(), *(b for b in module.buffers() if b is not None)]
    recorder = Recorder(module, timing=None, static=static)
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), torch.enable_grad():
        with recorder.forward():
            out = module(*args, **kwargs)
    del out
    counter = OpCounter()
    keys = [counter.key(e.unit) for e in recorder.events]
    saved = frozenset(k for k, e in zip(keys, recorder.events) if e.saved_storages)
    per_unit: dict[str, int] = {}
    for e in recorder.events:
        per_unit[e.unit] = per_unit.get(e.unit, 0) + e.saved_bytes
    return SavedOutputs(ops=saved, all_ops=tuple((k, str(e.func)) for k, e in zip(keys, recorder.events)),
                        saved_bytes=per_unit)


def saved_output_units(module: nn.Module, *args: Any, **kwargs: Any) -> frozenset[str]:
    """Units of ``module`` with an output autograd saves (see :func:`saved_outputs`)."""
    return saved_outputs(module, *args, **kwargs).units

