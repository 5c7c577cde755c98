"""The CPU swap store of the native extension, for the :class:`~adaptive_mem.runtime._swap_engine.SwapEngine`
(Note: [native swap records] in ``_swap_store.cpp``): which engines get one, its statistics folded into the
engine's, and the handle types the unpack hooks serve."""

from __future__ import annotations

import os
from typing import Any

import torch

from ._host_marks import accounting_backend, extension
from ._swap_record import Packed, SwapStats

__all__ = ["HANDLES", "is_handle", "native_store", "close_store", "core_to_spare", "NativeStats"]

HANDLES: tuple[type, ...] = (Packed,)
"""The types of what a swap's pack hook returns: :class:`Packed` and, once the native extension is loaded, its
``SwapHandle``; both have ``unpack()``."""


def is_handle(x: Any) -> bool:
    return isinstance(x, HANDLES)


def native_store(device: torch.device, budget: Any) -> Any | None:
    """A C++ swap store for a CPU engine on the host-memory tier, with the C++ accounting back-end (the
    extension built); None elsewhere: the Python records serve every save."""
    global HANDLES
    if device.type != "cpu" or accounting_backend() != "cpp":
        return None
    ext = extension()
    if ext is None:
        return None
    if ext.SwapHandle not in HANDLES:
        HANDLES = (Packed, ext.SwapHandle)
    store = ext.SwapStore(take=budget.take, give=budget.give)
    store.overlap = core_to_spare()
    return store


def core_to_spare(threads: int | None = None) -> bool:
    """Whether the compute's threads (torch's intra-op threads unless given) leave a core free for the store's
    copy worker (Note: [overlapped native copies] in ``_swap_store.cpp``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores > (torch.get_num_threads() if threads is None else threads)


def close_store(store: Any, budget: Any) -> None:
    """Drop the store's free host buffers and give their bytes back to the budget (those still holding a copy go
    back when released); run by :meth:`SwapEngine.close` or when the engine is collected unclosed."""
    budget.give(store.close())


def _live(name: str) -> property:
    """A counter of the Python records plus the native store's: ``+=`` on it adds to the Python part."""

    def get(self: "NativeStats") -> int:
        return self._own[name] + getattr(self._store, name)

    def set_(self: "NativeStats", value: int) -> None:
        self._own[name] = value - getattr(self._store, name)

    return property(get, set_)


class NativeStats(SwapStats):
    """An engine's :class:`SwapStats` with a native store: the store's copies counted in, read live."""

    offloaded_bytes = _live("offloaded_bytes")  # type: ignore[assignment]
    reloaded_bytes = _live("reloaded_bytes")  # type: ignore[assignment]
    on_demand_reloads = _live("on_demand_reloads")  # type: ignore[assignment]

    def __init__(self, store: Any) -> None:
        self._store = store
        self._own = {"offloaded_bytes": 0, "reloaded_bytes": 0, "on_demand_reloads": 0}
        super().__init__()
