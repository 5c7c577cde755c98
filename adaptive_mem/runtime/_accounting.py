"""Exact device-memory accounting for devices without an allocator to ask (CPU).

:class:`DeviceMemory` is a dispatch mode that sees every tensor an op creates
and counts the bytes of each distinct storage on the accounted device until
the storage dies. Tensors in the swap engine's host store are allocated under
:func:`host_allocations` and never count, so a swapped activation really
leaves "device" memory on CPU too. An optional ``cap`` turns an allocation
that would exceed it into ``torch.OutOfMemoryError`` after giving the
``on_oom`` hooks a chance to free memory (the SwapManager hook point).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["DeviceMemory", "host_allocations", "current_accounting", "mark_host"]

_local = threading.local()
_active: list["DeviceMemory"] = []


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """Tensors created in this block (on this thread) are host-side: never device memory."""
    depth = getattr(_local, "host", 0)
    _local.host = depth + 1
    try:
        yield
    finally:
        _local.host = depth


def _in_host_block() -> bool:
    return getattr(_local, "host", 0) > 0


_host_storages: dict[int, weakref.ref] = {}


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Record ``t``'s storage as host-side (a swap-store buffer): never device memory, even when a
    :class:`DeviceMemory` entered later finds it in its scan of existing tensors."""
    st = t.untyped_storage()
    key = st._cdata

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _host_storages.get(key) is ref:
            del _host_storages[key]

    _host_storages[key] = weakref.ref(st, forget)
    return t


def _is_host_storage(st: torch.UntypedStorage) -> bool:
    ref = _host_storages.get(st._cdata)
    return ref is not None and ref() is st


def _is_tensor(obj: Any) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a weakref.proxy whose referent died
        return False


def current_accounting() -> "DeviceMemory | None":
    return _active[-1] if _active else None


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor" or t.device.type == "meta"


class DeviceMemory(TorchDispatchMode):
    """Live and peak bytes of tensors on ``device``, counted per storage.

    Use as a context manager around training steps::

        with adaptive_mem.DeviceMemory(cap=2 << 30) as mem:
            loss = model(x).sum(); loss.backward()
        print(mem.peak, mem.live)

    Tensors alive on entry are found with a garbage-collector scan
    (``track_existing=True``) or passed explicitly with :meth:`track`.
    """

    def __init__(self, *, device: str | torch.device = "cpu", cap: int | None = None,
                 on_oom: Callable[[int], bool] | None = None, track_existing: bool = True) -> None:
        super().__init__()
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"cap={cap!r}: expected a positive number of bytes or None")
        self.device = torch.device(device)
        """Accounted device (``cpu`` here; the same counting works for any device)."""
        self.cap = cap
        """Bytes an allocation may not push ``live`` above, or None."""
        self.track_existing = track_existing
        self.on_oom: list[Callable[[int], bool]] = [on_oom] if on_oom is not None else []
        """Hooks ``needed_bytes -> freed_anything`` called before raising OutOfMemoryError."""
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, tuple[Any, int]] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ public
    def reset_peak(self) -> None:
        """Start a new peak window (e.g. per step) at the current live bytes."""
        self.peak = self.live

    def track(self, *objects: Any) -> None:
        """Count tensors that existed before entry: tensors, modules, optimizers, or iterables of them."""
        for obj in objects:
            for t in _tensors_of(obj):
                self._register(t)

    def add_oom_hook(self, hook: Callable[[int], bool]) -> None:
        self.on_oom.append(hook)

    # ------------------------------------------------------------------ mode
    def __enter__(self) -> "DeviceMemory":
        if self.track_existing:
            gc.collect()  # unreachable tensors would otherwise count until the collector frees them mid-step
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # isinstance() wakes deprecated lazy module attributes
                self.track([o for o in gc.get_objects() if _is_tensor(o)])
        self.peak = max(self.peak, self.live)
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _in_host_block():
            return out
        peak_before, added = self.peak, 0
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                added += self._register(t)
        if added and self.cap is not None and self.live > self.cap:
            self._over_cap(added, func, peak_before)
        return out

    # ------------------------------------------------------------------ internals
    def _register(self, t: torch.Tensor) -> int:
        if t.device != self.device or _is_fake(t) or t.is_sparse:
            return 0
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # storage-less wrapper subclasses
            return 0
        if _is_host_storage(st):
            return 0
        key = st._cdata
        nbytes = st.nbytes()
        with self._lock:
            known = self._sizes.get(key)
            if known is not None and known[0]() is not None:
                delta = nbytes - known[1]  # resized in place
                if delta:
                    self._sizes[key] = (known[0], nbytes)
                    self._add(delta)
                return max(delta, 0)
            ref = weakref.ref(st, lambda _r, key=key: self._dead(key, _r))
            self._sizes[key] = (ref, nbytes)
            self._add(nbytes)
        return nbytes

    def _add(self, delta: int) -> None:
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live

    def _dead(self, key: int, ref: Any) -> None:
        with self._lock:
            known = self._sizes.get(key)
            if known is not None and known[0] is ref:
                del self._sizes[key]
                self.live -= known[1]

    def _over_cap(self, added: int, func: Any, peak_before: int) -> None:
        for hook in self.on_oom:
            if self.live <= self.cap:
                break
            hook(self.live - self.cap)
        if self.live <= self.cap:
            # A real allocator frees first and allocates after: the moment over the cap never happened.
            self.peak = max(peak_before, self.live)
            return
        if self.live > self.cap:
            # The op's outputs die with this exception: the refused allocation never counts in the peak.
            self.peak = max(peak_before, self.live - added)
            raise torch.OutOfMemoryError(
                f"device memory cap exceeded: {func} needs {added} bytes with {self.live - added} live "
                f"of cap {self.cap}"
            )


def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        for t in list(obj.parameters()) + list(obj.buffers()):
            yield from _tensors_of(t)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple, set)) or hasattr(obj, "__next__"):
        for v in obj:
            yield from _tensors_of(v)
