"""The core recorder: one dispatch mode that sees every aten op of a training step.

Forward: each non-view op gets a unit name (module hooks drive a
:class:`UnitNamer`), its new output storages, the ops that read them, FLOPs and
a time. ``saved_tensors_hooks`` attribute every tensor autograd saves to the op
that produced its storage. Backward: each op is charged to the forward op whose
autograd node is running.

Note: [sequence numbers] Autograd numbers nodes in creation order, and an
op's node is created *before* the op reaches this mode. So the nodes created
since the previous op entered the mode belong to the current op (a view op's
nodes are charged to the producer of the viewed storage); in backward
``torch._C._current_autograd_node()._sequence_nr()`` names the forward op whose
backward is running. Guarded by ``tests/test_profiler.py::test_backward_time_is_attributed``.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ._cost import op_flops, op_seconds
from ._leaves import tensor_leaves
from ._other_memory import MemoryMeter, OtherMemory
from ._profile import HardwareSpec
from ._units import UnitNamer, in_machinery, is_view_op

__all__ = ["OpEvent", "Recorder", "local_shard", "no_cycle", "storage_key"]


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage (a DTensor's: its local shard's, what the rank holds); None for tensors without one
    (sparse, some wrapper subclasses)."""
    t = local_shard(t)
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what its rank holds: the wrapper's storage has the global size); any other tensor
    itself. Profiles count it, the swap engine moves it (Note: [DTensor swap])."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) and type(t).__name__ == "DTensor" else t


def no_cycle(t: object) -> object:
    """Note: [pack without a cycle]. What a pack hook returns is held by the autograd node that saves it;
    a tensor that node produced (ops saving their output: exp, softmax, ...) holds that node as its
    ``grad_fn``, a cycle through C++ that the garbage collector cannot see. Backward frees it; a graph
    dropped without backward (a step that failed in forward, an evaluation under grad) would leak its
    activations, and whatever the hooks hold (the model), for good. Saving ``t.detach()`` breaks the cycle:
    autograd re-attaches the metadata on unpack (tests/test_swap_manager.py
    ``test_a_graph_dropped_without_backward_leaks_nothing``, tests/test_adaptive.py
    ``test_a_failed_forward_leaves_nothing_alive``)."""
    return t.detach() if isinstance(t, torch.Tensor) and t.grad_fn is not None else t


def storage_key(t: torch.Tensor) -> int | None:
    st = _storage(t)
    return None if st is None else st._cdata


@dataclass
class OpEvent:
    """One forward op while it is being recorded (mutable; frozen into an ``OpRecord`` later)."""

    index: int
    func: torch._ops.OpOverload
    unit: str
    module: str
    output_bytes: int = 0
    saved_bytes: int = 0
    fwd_time: float = 0.0
    bwd_time: float = 0.0
    flops: int = 0
    consumers: set[int] = field(default_factory=set)
    saved_storages: int = 0
    """How many distinct storages of this op's outputs autograd saved."""
    saves_inputs: bool = False
    """This op's autograd node saved a tensor before the op ran (an input or a parameter)."""
    saves_outputs: bool = False
    """This op's autograd node saved a tensor after the op ran (its own output)."""
    saved_tensors: int = 0
    """How many tensors this op's autograd node saved (pack calls)."""
    view_ops: int = 0
    """Forward ops without an event of their own (views, detach, metadata) dispatched since the previous op."""


class Recorder(TorchDispatchMode):
    """Record a forward (inside :meth:`forward`) and a backward (inside :meth:`backward`).

    ``timing``: ``"measure"`` (perf_counter around each op, synchronizing an
    accelerator), ``"estimate"`` (roofline from ``hardware``; for fake tensors)
    or ``None`` (no times). ``static`` are tensors that live outside the step
    (parameters, buffers): saving them costs nothing and they are never an
    op's output. ``meter``: the device's live bytes, to measure what it holds
    beside the step's tensors (:attr:`other`, ``_other_memory.py``).
    """

    def __init__(self, root: nn.Module, *, timing: str | None, hardware: HardwareSpec | None = None,
                 static: Iterable[torch.Tensor] = (), sync_device: torch.device | None = None,
                 meter: MemoryMeter | None = None) -> None:
        super().__init__()
        assert timing in ("measure", "estimate", None), timing
        assert timing != "estimate" or hardware is not None
        self.namer = UnitNamer(root)
        self.timing = timing
        self.hardware = hardware
        self.sync_device = sync_device
        self.events: list[OpEvent] = []
        self.static_keys: set[int] = {storage_key(t) for t in static}
        self.saved_input_bytes = 0
        self.unattributed_bwd_time = 0.0
        self.phase = "idle"
        self._producer: dict[int, int] = {}
        self._saved: set[int] = set()
        self._seq_to_op: dict[int, int] = {}
        self._packs: list[tuple[int, bool]] = []
        self._last_seq = 0
        self._view_ops = 0  # forward ops without an event since the last event (OpEvent.view_ops)
        self._alive: dict[int, weakref.ref] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.other = OtherMemory(meter)
        """Device bytes beside the step's tensors (a wrapper's buffers, optimizer state...), at most."""
        self.device_peak: int | None = None
        """The device's peak bytes over the recorded step, by the meter (None without one)."""
        self.wrapper_time = 0.0
        """Seconds of a parallel wrapper's own forward ops (Note: [wrapper ops]): step time of no unit."""
        self.layer_forward: list[float] = []
        """Each block's median forward seconds in the plain steps (Note: [layer forward time]); set by the
        profiler after the steps."""

    # ------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def forward(self) -> Iterator["Recorder"]:
        """Record the forward pass run inside this context (module hooks + saved-tensor hooks on)."""
        pre = nn.modules.module.register_module_forward_pre_hook(self._enter)
        post = nn.modules.module.register_module_forward_hook(self._exit, always_call=True)
        self.phase = "forward"
        self._last_seq = torch.autograd._get_sequence_nr()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack), self:
                yield self
        finally:
            self.phase = "idle"
            pre.remove()
            post.remove()
            self._attribute_packs()

    def _attribute_packs(self) -> None:
        for node, before_kernel in self._packs:
            owner = self._seq_to_op.get(node)
            if owner is None:
                continue
            self.events[owner].saved_tensors += 1
            if before_kernel:
                self.events[owner].saves_inputs = True
            else:
                self.events[owner].saves_outputs = True
        self._packs.clear()

    @contextlib.contextmanager
    def backward(self) -> Iterator["Recorder"]:
        """Charge the backward ops run inside this context to forward ops."""
        self.phase = "backward"
        try:
            with self:
                yield self
        finally:
            self.phase = "idle"

    def _enter(self, module: nn.Module, args: object) -> None:
        if self.namer.tracks(module):
            self.namer.enter(module)

    def _exit(self, module: nn.Module, args: object, output: object) -> None:
        if self.namer.tracks(module):
            self.namer.exit(module)

    # ------------------------------------------------------------------ memory
    def _track(self, t: torch.Tensor, input_keys: set[int]) -> int:
        """Bytes of ``t``'s storage if it is new (0 for inputs, in-place results, already-seen storages)."""
        st = _storage(t)
        if st is None:
            return 0
        key = st._cdata
        if key in input_keys or key in self.static_keys or self.other.is_wrapper(key):
            return 0
        ref = self._alive.get(key)
        if ref is not None and ref() is st:
            return 0
        nbytes = st.nbytes()
        self._alive[key] = weakref.ref(st, self._make_release(key, nbytes))
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return nbytes

    def _make_release(self, key: int, nbytes: int):
        def release(ref: weakref.ref) -> None:
            self.live_bytes -= nbytes
            if self._alive.get(key) is ref:
                del self._alive[key]
                self._producer.pop(key, None)

        return release

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Note: [saver of a pack] the node saving ``t`` is the newest one; if its op has not been
        # dispatched yet, autograd is saving before the kernel runs (inputs, parameters).
        node = torch.autograd._get_sequence_nr() - 1
        self._packs.append((node, node not in self._seq_to_op))
        st = _storage(t)
        if st is None:
            return no_cycle(t)
        key = st._cdata
        if key in self.static_keys or key in self._saved or self.other.is_wrapper(key):
            return no_cycle(t)  # a wrapper's buffer (a gathered parameter) is the wrapper's memory: Note: [wrapper ops]
        self._saved.add(key)
        producer = self._producer.get(key)
        if producer is None:
            self.saved_input_bytes += st.nbytes()
        else:
            event = self.events[producer]
            event.saved_bytes += st.nbytes()
            event.saved_storages += 1
        return no_cycle(t)

    # ------------------------------------------------------------------ dispatch
    def _sync(self) -> None:
        if self.sync_device is not None:
            torch.accelerator.synchronize(self.sync_device)

    def _run(self, func, args, kwargs) -> tuple[object, float]:
        if self.timing != "measure":
            return func(*args, **kwargs), 0.0
        self._sync()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self._sync()
        return out, time.perf_counter() - start

    def _estimate(self, func, args, kwargs, out, flops: int) -> float:
        return op_seconds(self.hardware, func, args, kwargs, out, flops)  # Note: [op pricing]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if in_machinery():  # Note: [machinery ops]: not the model's, neither named nor timed nor counted
            return func(*args, **kwargs)
        if self.phase == "forward":
            return self._forward_op(func, args, kwargs)
        if self.phase == "backward":
            return self._backward_op(func, args, kwargs)
        return func(*args, **kwargs)

    def _wrapper_op(self, func, args, kwargs):
        """A region marker or a parallel wrapper's own op (Note: [wrapper ops]): no unit; what it allocates is the
        wrapper's memory; its time is the step's, of no unit."""
        out, seconds = self._run(func, args, kwargs)
        for t in tensor_leaves(out):
            st = _storage(t)
            if st is not None and st.nbytes() and storage_key(t) not in self._alive:
                self.other.add_wrapper(st)
        self.other.sample(self.live_bytes, wrapper_op=True)
        return out, seconds

    def _forward_op(self, func, args, kwargs):
        if func.overloadpacket is torch.ops.aten.detach:
            # makes no autograd node: the nodes made since the last op are the next op's (a pack hook detaches what
            # it saves before the saving op's kernel runs: Note: [pack without a cycle], Note: [sequence numbers])
            self._view_ops += 1
            return func(*args, **kwargs)
        unit = self.namer.name(func, args)
        if unit is None and (func.namespace == "profiler" or self.namer.regions.wrapper):
            self._last_seq = torch.autograd._get_sequence_nr()
            out, seconds = self._wrapper_op(func, args, kwargs)
            self.wrapper_time += seconds
            return out
        if unit is None and func.namespace == "prim":  # metadata (fake tensors' .device): no node of its own
            self._view_ops += 1
            return func(*args, **kwargs)
        seq = torch.autograd._get_sequence_nr()
        new_nodes = range(self._last_seq, seq)
        self._last_seq = seq
        inputs = tensor_leaves((args, kwargs))
        input_keys = {storage_key(t) for t in inputs}
        out, seconds = self._run(func, args, kwargs)
        outputs = tensor_leaves(out)
        if unit is None:  # a view: allocates nothing; its nodes belong to the viewed storage's producer
            self._view_ops += 1
            owner = next((self._producer[k] for k in input_keys if k in self._producer), None)
            if owner is not None:
                for nr in new_nodes:
                    self._seq_to_op[nr] = owner
            return out
        index = len(self.events)
        event = OpEvent(index=index, func=func, unit=unit, module=self.namer.module_path, view_ops=self._view_ops)
        self._view_ops = 0
        self.events.append(event)
        for nr in new_nodes:
            self._seq_to_op[nr] = index
        for key in input_keys:
            producer = self._producer.get(key)
            if producer is not None and producer != index:
                self.events[producer].consumers.add(index)
        for t in outputs:
            nbytes = self._track(t, input_keys)
            if nbytes:
                self._producer[storage_key(t)] = index
                event.output_bytes += nbytes
        event.flops = op_flops(func, args, kwargs, out)
        event.fwd_time = self._estimate(func, args, kwargs, out, event.flops) if self.timing == "estimate" else seconds
        self.other.sample(self.live_bytes)
        return out

    def _backward_op(self, func, args, kwargs):
        # A wrapper's backward ops (FSDP2's reduce-scatter) are tracked like the gradients they make: their
        # outputs become the sharded gradients, which the profile counts as such.
        out, seconds = self._run(func, args, kwargs)
        input_keys = {storage_key(t) for t in tensor_leaves((args, kwargs))}
        for t in tensor_leaves(out):
            self._track(t, input_keys)
        self.other.sample(self.live_bytes)
        if self.timing is None or is_view_op(func):
            return out
        if self.timing == "estimate":
            seconds = self._estimate(func, args, kwargs, out, op_flops(func, args, kwargs, out))
        node = torch._C._current_autograd_node()
        owner = self._seq_to_op.get(node._sequence_nr()) if node is not None else None
        if owner is None:
            self.unattributed_bwd_time += seconds
        else:
            self.events[owner].bwd_time += seconds
        return out

    # ------------------------------------------------------------------ results
    def start_memory(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count storages alive before the step (parameters, inputs) in the live/peak bytes."""
        seen: set[int] = set()
        for t in tensors:
            st = _storage(t)
            if st is not None and st._cdata not in seen:
                seen.add(st._cdata)
                self.live_bytes += st.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
