"""The SwapManager's records: one :class:`Slot` per saved tensor, one :class:`StorageGroup` per storage.

Note: [never swap a tensor in use]. A storage is a candidate only while the
manager's slots are its sole owners: the storage's use count equals the
tensors the slots hold (plus their view bases) and no Python reference to
those tensors exists outside the slots. An op reading the tensor holds a
reference to it, so a running op's inputs are never swapped; nor is a slot
autograd has unpacked. Swapping a shared storage would free nothing.
"""

from __future__ import annotations

import enum
import sys
import weakref
from typing import Any, Callable

import torch

from adaptive_mem.runtime._swap_engine import Packed

__all__ = ["SwapState", "Slot", "StorageGroup"]


class SwapState(str, enum.Enum):
    DEVICE = "device"
    COPYING_OUT = "copying-out"
    HOST = "host"
    COPYING_IN = "copying-in"


class Slot:
    """What autograd holds for one saved tensor."""

    __slots__ = ("group", "tensor", "packed", "outer_unpack", "used", "__weakref__")

    def __init__(self, group: "StorageGroup", tensor: torch.Tensor,
                 outer_unpack: Callable[[Any], Any] | None) -> None:
        self.group = group
        self.tensor: torch.Tensor | None = tensor
        self.packed: Packed | None = None
        self.outer_unpack = outer_unpack
        self.used = False


class StorageGroup:
    """All saved tensors sharing one storage."""

    __slots__ = ("key", "storage", "nbytes", "seq", "layer", "unit", "slots", "record", "__weakref__")

    def __init__(self, key: int, storage: torch.UntypedStorage, seq: int, layer: int, unit: str) -> None:
        self.key = key
        self.storage = weakref.ref(storage)
        self.nbytes = storage.nbytes()
        self.seq = seq
        self.layer = layer
        self.unit = unit
        self.slots: list[weakref.ref] = []
        self.record: Any = None

    def live_slots(self) -> list[Slot]:
        return [s for s in (r() for r in self.slots) if s is not None]

    @property
    def state(self) -> SwapState:
        rec = self.record
        if rec is None:
            return SwapState.DEVICE
        if rec.h2d is not None:
            return SwapState.DEVICE if rec.h2d.finished else SwapState.COPYING_IN
        return SwapState.HOST if rec.d2h.finished else SwapState.COPYING_OUT

    def exclusive(self) -> bool:
        """Note: [never swap a tensor in use]."""
        slots = self.live_slots()
        st = self.storage()
        if st is None or not slots or any(s.used or s.tensor is None for s in slots):
            return False
        tensors: dict[int, torch.Tensor] = {}
        holders: dict[int, int] = {}
        for s in slots:
            tensors[id(s.tensor)] = s.tensor
            holders[id(s.tensor)] = holders.get(id(s.tensor), 0) + 1
        for tid in tensors:
            # references: the slots' attributes, the ``tensors`` dict and getrefcount's argument
            if sys.getrefcount(tensors[tid]) - holders[tid] - 2 > 0:
                return False
        bases: dict[int, torch.Tensor] = {}
        for tid in tensors:
            base = tensors[tid]._base
            if base is not None and id(base) not in tensors:
                bases[id(base)] = base
            del base
        for bid in bases:
            # A view's base held by anyone (e.g. the caller's local variable) keeps the storage alive. References
            # when nobody holds it: the ``bases`` dict, getrefcount's argument, and the one the view's autograd
            # metadata keeps on the base's Python object (measured: 3 unheld, 4 held by one local).
            if sys.getrefcount(bases[bid]) - 3 > 0:
                return False
        impls = set(tensors) | set(bases)
        # the storage's owners: the tensors above (and their bases) plus the ``st`` reference here
        return torch._C._storage_Use_Count(st._cdata) <= len(impls) + 1
