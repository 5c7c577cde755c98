"""Which accounting back-end runs, and host marks: memory of the swap store that never counts as device memory.

Back-ends of :class:`~adaptive_mem.DeviceMemory` (chosen once per process, :func:`accounting_backend`):

* ``"cpp"``: the counting CPU allocator (``_cpu_allocator.cpp``), built at first use. The default.
* ``"dispatch"``: a Python dispatch mode that sees every op's outputs. Only the fallback when the
  extension cannot be built here (one warning says so), or forced with
  ``ADAPTIVE_MEM_ACCOUNTING=dispatch``; ``ADAPTIVE_MEM_ACCOUNTING=cpp`` makes a failed build an error.

Host marks: tensors created inside :func:`host_allocations` (on that thread) are host memory; with the
C++ allocator the mark is set in the allocation's header at allocation time and kept until it is freed;
:func:`mark_host` marks an existing tensor's storage (the C++ header or table, else a Python table).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from types import ModuleType
from typing import Iterator

import torch

__all__ = ["accounting_backend", "extension", "host_allocations", "mark_host", "is_host_storage",
           "in_host_block", "ENV"]

log = logging.getLogger("adaptive_mem.runtime._accounting")

ENV = "ADAPTIVE_MEM_ACCOUNTING"
_choice_lock = threading.Lock()
_backend: str | None = None
_ext: ModuleType | None = None
_local = threading.local()
_host_storages: dict[int, weakref.ref] = {}


def accounting_backend() -> str:
    """``"cpp"`` (the counting C++ allocator) or ``"dispatch"`` (the Python fallback); decided once."""
    global _backend, _ext
    if _backend is not None:
        return _backend
    with _choice_lock:
        if _backend is not None:
            return _backend
        choice = os.environ.get(ENV, "").strip().lower() or "auto"
        if choice not in ("auto", "cpp", "dispatch"):
            raise ValueError(f"{ENV}={choice!r}: expected 'cpp', 'dispatch' or unset")
        if choice == "dispatch":
            log.info("device-memory accounting: dispatch mode (%s=dispatch)", ENV)
            _backend = "dispatch"
            return _backend
        from ._cpu_allocator import load_extension

        try:
            _ext = load_extension()
            _backend = "cpp"
        except RuntimeError as exc:
            if choice == "cpp":
                raise
            log.warning("%s; DeviceMemory falls back to dispatch-mode accounting (every op passes through "
                        "Python: slower, and allocations made on other threads are not seen)", exc)
            _backend = "dispatch"
    return _backend


def extension() -> ModuleType | None:
    """The loaded C++ module, or None when the dispatch back-end runs (or nothing was counted yet)."""
    return _ext


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """Tensors created in this block (on this thread) are host-side: never device memory."""
    depth = getattr(_local, "host", 0)
    _local.host = depth + 1
    ext = _ext
    if ext is not None:
        ext.host_enter()
    try:
        yield
    finally:
        if ext is not None:
            ext.host_exit()
        _local.host = depth


def in_host_block() -> bool:
    return getattr(_local, "host", 0) > 0


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Record ``t``'s storage as host-side (a swap-store buffer): never device memory, even when a
    :class:`DeviceMemory` entered later finds it in its scan of existing tensors."""
    st = t.untyped_storage()
    if _ext is not None and st.device.type == "cpu" and _ext.mark_host(st._cdata):
        return t
    key = st._cdata

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _host_storages.get(key) is ref:
            del _host_storages[key]

    _host_storages[key] = weakref.ref(st, forget)
    return t


def is_host_storage(st: torch.UntypedStorage) -> bool:
    ref = _host_storages.get(st._cdata)
    if ref is not None and ref() is st:
        return True
    return _ext is not None and st.device.type == "cpu" and _ext.is_host(st._cdata) == 1
