"""Exact device-memory accounting for devices without an allocator to ask (CPU).

:class:`DeviceMemory` counts the bytes of each distinct storage on the accounted
device until the storage dies. On CPU it is a session of a counting C++
allocator installed in front of PyTorch's (``_cpu_allocator.cpp``: every
allocation and free is seen where it happens, on any thread, at the cost of a
header per allocation); where that cannot be built, a dispatch mode that sees
every op's outputs (one warning says so; see ``_host_marks.py`` for the choice).
Tensors in the swap engine's host store are allocated under
:func:`host_allocations` and never count, so a swapped activation really
leaves "device" memory on CPU too. An optional ``cap`` turns an allocation
that would exceed it into ``torch.OutOfMemoryError`` after giving the
``on_oom`` hooks a chance to free memory (the SwapManager hook point).
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._counters import CppCounter, DispatchCounter
from ._host_marks import accounting_backend, host_allocations, mark_host

__all__ = ["DeviceMemory", "host_allocations", "current_accounting", "mark_host", "accounting_backend"]

_active: list["DeviceMemory"] = []


def _is_tensor(obj: Any) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a weakref.proxy whose referent died
        return False


def current_accounting() -> "DeviceMemory | None":
    return _active[-1] if _active else None


class DeviceMemory(TorchDispatchMode):
    """Live and peak bytes of tensors on ``device``, counted per storage.

    Use as a context manager around training steps::

        with adaptive_mem.DeviceMemory(cap=2 << 30) as mem:
            loss = model(x).sum(); loss.backward()
        print(mem.peak, mem.live)

    Tensors alive on entry are found with a garbage-collector scan
    (``track_existing=True``) or passed explicitly with :meth:`track`; from then
    on their frees count too (also between and after entries). ``backend``:
    ``"cpp"`` or ``"dispatch"`` (default: :func:`accounting_backend`; devices
    other than CPU always use the dispatch mode).
    """

    def __init__(self, *, device: str | torch.device = "cpu", cap: int | None = None,
                 on_oom: Callable[[int], bool] | None = None, track_existing: bool = True,
                 backend: str | None = None) -> None:
        super().__init__()
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"cap={cap!r}: expected a positive number of bytes or None")
        self.device = torch.device(device)
        """Accounted device (``cpu`` here; the same counting works for any device)."""
        self.track_existing = track_existing
        self.on_oom: list[Callable[[int], bool]] = [on_oom] if on_oom is not None else []
        """Hooks ``needed_bytes -> freed_anything`` called before raising OutOfMemoryError."""
        if backend is None:
            backend = accounting_backend() if self.device.type == "cpu" else "dispatch"
        elif backend not in ("cpp", "dispatch"):
            raise ValueError(f"backend={backend!r}: expected 'cpp' or 'dispatch'")
        elif backend == "cpp" and (self.device.type != "cpu" or accounting_backend() != "cpp"):
            raise ValueError(f"backend='cpp' needs a cpu device and the built extension "
                             f"(device {self.device}, back-end {accounting_backend()})")
        self._counter: CppCounter | DispatchCounter = (CppCounter(self) if backend == "cpp"
                                                       else DispatchCounter(self))
        self._cap: int | None = None
        self.cap = cap
        self._pending = 0
        self._pushed: list[bool] = []

    # ------------------------------------------------------------------ public
    @property
    def backend(self) -> str:
        """``"cpp"`` (the counting allocator) or ``"dispatch"`` (the Python fallback)."""
        return self._counter.backend

    @property
    def cap(self) -> int | None:
        """Bytes an allocation may not push ``live`` above, or None."""
        return self._cap

    @cap.setter
    def cap(self, value: int | None) -> None:
        self._cap = value
        self._counter.set_cap(value)

    @property
    def live(self) -> int:
        """Bytes counted now."""
        return self._counter.live

    @property
    def peak(self) -> int:
        """Highest ``live`` since construction or :meth:`reset_peak`."""
        return self._counter.peak

    def reset_peak(self) -> None:
        """Start a new peak window (e.g. per step) at the current live bytes."""
        self._counter.peak = self._counter.live

    def shortfall(self) -> int:
        """Bytes over the cap counting the allocation being decided (0 when within it or uncapped)."""
        if self._cap is None:
            return 0
        return max(0, self._counter.live + self._pending - self._cap)

    def track(self, *objects: Any) -> None:
        """Count tensors that existed before entry: tensors, modules, optimizers, or iterables of them."""
        for obj in objects:
            for t in _tensors_of(obj):
                self._counter.register(t, self.device)

    def add_oom_hook(self, hook: Callable[[int], bool]) -> None:
        self.on_oom.append(hook)

    # ------------------------------------------------------------------ fault injection
    def inject_fault(self, *, at: int, needed: int) -> None:
        """Make allocation number ``at`` (counted from entry, see :attr:`allocations`) fail once
        transiently: the ``on_oom`` hooks are asked for ``needed`` bytes, then it succeeds. Each call
        schedules one more fault; one fires per allocation, at the first from its number on that may
        call the hooks (not inside a rescue, nor in an intra-op parallel region)."""
        if isinstance(at, bool) or not isinstance(at, int) or at < 1:
            raise ValueError(f"inject_fault: at={at!r}: expected an allocation number >= 1")
        if isinstance(needed, bool) or not isinstance(needed, int) or needed < 0:
            raise ValueError(f"inject_fault: needed={needed!r}: expected bytes >= 0")
        self._counter.inject_fault(at, needed)

    def clear_faults(self) -> None:
        """Drop the injected faults that have not fired."""
        self._counter.clear_faults()

    @property
    def allocations(self) -> int:
        """Device allocations counted so far (settable, e.g. to 0 to count one step's)."""
        return self._counter.allocations

    @allocations.setter
    def allocations(self, value: int) -> None:
        self._counter.allocations = value

    @property
    def faults(self) -> int:
        """Injected faults that fired."""
        return self._counter.faults

    # ------------------------------------------------------------------ mode
    def _needs_mode(self) -> bool:
        """The dispatch back-end counts in ``__torch_dispatch__``; the C++ one needs the mode only for a
        subclass that watches ops itself (e.g. a per-op timeline)."""
        return self.backend == "dispatch" or type(self).__torch_dispatch__ is not DeviceMemory.__torch_dispatch__

    def __enter__(self) -> "DeviceMemory":
        self._counter.start()
        if self.track_existing:
            gc.collect()  # unreachable tensors would otherwise count until the collector frees them mid-step
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # isinstance() wakes deprecated lazy module attributes
                self.track([o for o in gc.get_objects() if _is_tensor(o)])
        self._counter.peak = max(self._counter.peak, self._counter.live)
        _active.append(self)
        push = self._needs_mode()
        self._pushed.append(push)
        if push:
            return super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)
        self._counter.stop()
        if self._pushed.pop():
            return super().__exit__(*exc)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._counter.on_op(self, func, out)
        return out

    # ------------------------------------------------------------------ internals
    def _run_hooks(self, pending: int, fault: int) -> None:
        """The ``on_oom`` hooks for an allocation of ``pending`` bytes over the cap (C++: not yet
        counted; dispatch: already counted, ``pending`` = 0), or an injected fault asking ``fault``."""
        self._pending = pending
        try:
            for hook in list(self.on_oom):
                if fault:
                    hook(fault)
                    continue
                over = self.shortfall()
                if over <= 0:
                    break
                hook(over)
        finally:
            self._pending = 0


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
