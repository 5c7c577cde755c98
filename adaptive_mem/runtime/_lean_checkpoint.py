"""The checkpoint of a layer recomputed as a whole, eager: PyTorch's non-reentrant checkpoint with its per-tensor
work cut to a slot and a weak reference.

Note: [lean checkpoint]. ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` runs Python for every tensor the
layer saves: a pack hook in forward (a holder, a weak reference, a metadata dict under ``no_grad``), a
dynamo-disabled pack hook in the replay and an unpack hook in backward (a graph-group lookup, a weak-keyed dict per
graph task): about 10 us per saved tensor, 0.4 ms per llama-tiny layer, more than a small layer's forward takes
beyond its kernels. :func:`lean_checkpoint` keeps its semantics with less per tensor:

* forward: each saved tensor becomes a :class:`_Slot` (its shape and dtype, the determinism check) held weakly by
  the frame; the tensor arguments' versions are recorded before the call (an argument modified in place after
  it fails the replay, as the checkpoint's saved inputs do);
* the first unpack of a backward (its graph task, or graph-execution group) replays the function on the same
  arguments with grad enabled, the forward's CPU RNG state (and the devices' where their module is initialized)
  and autocast state, and stops once every live slot is filled; each slot then holds its replayed tensor
  (detached) until its node unpacks it once, so a replayed tensor lives as long as it does in PyTorch's checkpoint;
* a replay that saves more tensors, fewer, or others of another shape or dtype raises ``CheckpointError``; a slot
  unpacked twice in one backward raises too.

It runs only where nothing else could see the difference (:func:`lean_applies`): eager, no dispatch or function
mode, no saved-tensor hooks outside the layer (a swap engine's hooks see the checkpoint's saved inputs), grad
enabled; elsewhere the layer runs in PyTorch's checkpoint. Guarded by tests/test_lean_checkpoint.py (gradients
``torch.equal`` to PyTorch's checkpoint and to the model without a plan, retain_graph, errors).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointError, get_device_states, set_device_states

__all__ = ["lean_applies", "lean_checkpoint"]

_C = torch._C


class _Stop(Exception):
    """Every live slot is filled: the replay stops."""


class _Slot:
    __slots__ = ("t", "gid", "shape", "dtype", "__weakref__")


def lean_applies() -> bool:
    """A call may run under :func:`lean_checkpoint` (Note: [lean checkpoint])."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling() and not _C._len_torch_dispatch_stack()
            and not _C._len_torch_function_stack() and _C._autograd._top_saved_tensors_default_hooks(False) is None)


def _autocast(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    """The autocast state of ``device_type`` and the CPU: ``(device, enabled, dtype)`` each."""
    types = [device_type] if device_type == "cpu" else [device_type, "cpu"]
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in types
            if torch.amp.is_autocast_available(d)]


@torch.compiler.disable
def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` in a replay, outside dynamo (as PyTorch's checkpoint replays)."""
    return fn(*args, **kwargs)


class _Frame:
    """One checkpointed call: its function, arguments, slots and the state its replay restores."""

    __slots__ = ("fn", "args", "kwargs", "versions", "slots", "n", "gid", "cpu_rng", "devices", "device_rng",
                 "device_type", "autocast", "cache", "__weakref__")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.versions = [(a, a._version) for a in args if isinstance(a, torch.Tensor)]
        self.slots: list[weakref.ref[_Slot]] = []
        self.n = 0
        self.gid: Any = None
        self.cpu_rng = torch.get_rng_state()
        self.device_type = next((a.device.type for a, _ in self.versions if a.device.type != "cpu"), "cpu")
        self.devices: list[int] = []
        self.device_rng: list[torch.Tensor] = []
        module = getattr(torch, self.device_type, None) if self.device_type != "cpu" else None
        if module is not None and getattr(module, "_initialized", False):
            self.devices, self.device_rng = get_device_states(*args)
        self.autocast = _autocast(self.device_type)
        self.cache = torch.is_autocast_cache_enabled()

    def pack(self, x: torch.Tensor) -> _Slot:
        slot = _Slot()
        slot.t, slot.gid, slot.shape, slot.dtype = None, None, x.shape, x.dtype
        self.slots.append(weakref.ref(slot))
        return slot

    def unpack(self, slot: _Slot) -> torch.Tensor:
        gid = _C._get_graph_exec_group()
        if gid is None:
            gid = _C._current_graph_task_id()
            if gid == -1:  # outside a backward: a replay of its own
                gid = object()
        if slot.gid != gid:
            if self.gid != gid:
                self.replay(gid)
            if slot.gid != gid:
                raise CheckpointError("torch.utils.checkpoint: the replay did not save this tensor again "
                                      "(unpacked twice, or a backward inside the checkpointed forward)")
        t = slot.t
        if t is None:
            raise CheckpointError("torch.utils.checkpoint: Unpack is being triggered for a tensor that was already "
                                  "unpacked once in this backward")
        slot.t = None
        return t

    def replay(self, gid: Any) -> None:
        """Run the function again and fill the live slots for graph task ``gid``."""
        for a, version in self.versions:
            if a._version != version:
                raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                                   f"inplace operation: a checkpointed layer's input is at version {a._version}; "
                                   f"expected version {version} instead")
        self.gid, self.n = gid, 0
        try:
            with _ReplayHooks(self, gid), torch.autograd.enable_grad(), self._state():
                _run(self.fn, *self.args, **self.kwargs)
        except _Stop:
            return
        if self.n != len(self.slots):
            raise CheckpointError(f"torch.utils.checkpoint: the replay saved {self.n} tensors, the forward "
                                  f"{len(self.slots)}: the checkpointed function is not deterministic")

    @contextlib.contextmanager
    def _state(self) -> Any:
        """The forward's RNG and autocast state for the replay; the current RNG state back after it."""
        cpu_now = torch.get_rng_state()
        devices_now = get_device_states(*self.args)[1] if self.devices else None
        torch.set_rng_state(self.cpu_rng)
        if self.devices:
            set_device_states(self.devices, self.device_rng, device_type=self.device_type)
        try:
            with contextlib.ExitStack() as stack:
                if any(torch.is_autocast_enabled(d) != on or on for d, on, _ in self.autocast):
                    for d, on, dtype in self.autocast:
                        stack.enter_context(torch.amp.autocast(d, enabled=on, dtype=dtype,
                                                               cache_enabled=self.cache))
                yield
        finally:
            torch.set_rng_state(cpu_now)
            if devices_now is not None:
                set_device_states(self.devices, devices_now, device_type=self.device_type)


class _ReplayHooks(torch.autograd.graph.saved_tensors_hooks):
    """The replay's hooks: each saved tensor fills the next slot."""

    def __init__(self, frame: _Frame, gid: Any) -> None:
        slots = frame.slots
        total = len(slots)
        ref = weakref.ref(frame)  # the replay's graph holds this hook: a strong reference would keep the frame

        def pack(x: torch.Tensor) -> torch.Tensor:
            owner = ref()
            assert owner is not None, "lean checkpoint: replay without its frame"
            i = owner.n
            if i >= total:
                raise CheckpointError("torch.utils.checkpoint: trying to save more tensors during recomputation "
                                      "than during the original forward pass")
            owner.n = i + 1
            x = x.detach() if x.requires_grad else x  # a saved output holding its own node would never be freed
            slot = slots[i]()
            if slot is not None:
                if x.shape != slot.shape or x.dtype != slot.dtype:
                    raise CheckpointError(f"torch.utils.checkpoint: recomputed tensor {i} has shape {tuple(x.shape)} "
                                          f"and dtype {x.dtype}; the forward saved {tuple(slot.shape)}, {slot.dtype}")
                slot.t, slot.gid = x, gid
            if i + 1 == total:
                raise _Stop
            return x

        super().__init__(pack, lambda x: x)


def lean_checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``checkpoint(fn, *args, use_reentrant=False, **kwargs)`` with the per-tensor work of Note: [lean
    checkpoint]; call it where :func:`lean_applies`."""
    frame = _Frame(fn, args, kwargs)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args, **kwargs)
