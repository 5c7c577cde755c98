"""Device memory beside the step's own tensors: what a recorded step holds that the recorder does not count.

The recorder counts the step's tensors storage by storage: parameters, inputs, activations, gradients. A
device also holds what a parallel wrapper allocates for itself (DDP's gradient buckets, FSDP2's gathered
block and its collective buffers: Note: [wrapper ops]), optimizer state, and any other tensor the program
keeps there. :class:`OtherMemory` measures the largest amount of it held during a recorded step:

* with a :class:`MemoryMeter` (the device's live bytes: ``torch.accelerator``'s allocator statistics, or
  ``adaptive_mem.DeviceMemory`` on CPU), after every op the meter's live bytes minus the bytes the recorder
  counts: every allocation held across ops is seen, also one made outside any op (a storage ``resize_``,
  another thread). A buffer an op allocates and frees inside itself is its workspace, not held memory;
* without one, the bytes of the storages a wrapper's ops allocated, sampled after each of its ops (their
  current sizes: FSDP2 frees its buffers with ``resize_(0)``, which kills no storage).

Note: [other device memory] the profile records it as ``static.other`` and counts it in ``peak_memory``; the
step model holds it for the whole step, which is safe where it peaks at another moment than the activations
(FSDP2's gathered block and its gradients in backward), the case an admitted budget must survive. Guarded by
tests/test_parallel_adaptive_layouts.py and tests/test_wrapper_ops.py.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Protocol

import torch

__all__ = ["AcceleratorMeter", "MemoryMeter", "OtherMemory", "measured_memory", "read"]


def read(meter: "MemoryMeter", name: str) -> int:
    """``meter.live`` / ``meter.peak``: a method's value or an attribute (0 when the meter knows none)."""
    value = getattr(meter, name)
    return int((value() if callable(value) else value) or 0)


class MemoryMeter(Protocol):
    """Live and peak bytes of the profiled device (``live`` and ``peak`` methods or attributes, as
    ``adaptive_mem.DeviceMemory`` has them)."""

    def live(self) -> int | None:
        """Bytes allocated now."""

    def peak(self) -> int | None:
        """Highest ``live`` since the last :meth:`reset_peak`."""

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""


class OtherMemory:
    """Largest device bytes beside the recorder's own during one recorded step (module docstring)."""

    def __init__(self, meter: MemoryMeter | None) -> None:
        self.meter = meter
        self.peak = 0
        """Largest bytes beside the recorder's seen so far."""
        self._wrapper: dict[int, weakref.ref] = {}

    def is_wrapper(self, key: int | None) -> bool:
        """Whether storage ``key`` was allocated by a wrapper's op (and still lives)."""
        ref = self._wrapper.get(key) if key is not None else None
        return ref is not None and ref() is not None

    def add_wrapper(self, storage: torch.UntypedStorage) -> None:
        """A storage a wrapper's op allocated: never an activation, the wrapper's memory."""
        key = storage._cdata
        self._wrapper[key] = weakref.ref(storage, lambda ref, k=key: self._drop(k, ref))

    def _drop(self, key: int, ref: weakref.ref) -> None:
        if self._wrapper.get(key) is ref:
            del self._wrapper[key]

    def sample(self, counted: int, *, wrapper_op: bool = False) -> None:
        """After an op: ``counted`` is the bytes the recorder counts now."""
        if self.meter is not None:
            self.peak = max(self.peak, read(self.meter, "live") - counted)
        elif wrapper_op:
            sizes = [st.nbytes() for st in (ref() for ref in list(self._wrapper.values())) if st is not None]
            self.peak = max(self.peak, sum(sizes))


class AcceleratorMeter:
    """An accelerator's allocator statistics as a :class:`MemoryMeter`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def live(self) -> int:
        return torch.accelerator.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.accelerator.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.device)


def measured_memory(recorder: Any, static: Any, *, present: int) -> tuple[Any, int]:
    """``static`` (a ``StaticMemory``) with what the device held beside the step's tensors (``other``), and the
    step's peak bytes before the optimizer state: the recorder's count plus ``other``, or more where the meter saw
    more (kernels' scratch buffers, which the recorder does not see). ``present``: optimizer state bytes allocated
    during the recording, which the meter saw and ``static`` counts already."""
    other = max(0, recorder.other.peak - present)
    peak = recorder.peak_bytes + other
    if recorder.device_peak is not None:
        peak = max(peak, recorder.device_peak - present)
    return dataclasses.replace(static, other=int(other)), int(peak)
