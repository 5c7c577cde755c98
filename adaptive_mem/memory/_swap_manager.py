"""The SwapManager: every saved activation in flight, and swapping them out on demand.

It sits innermost in the saved-tensor hook stack (composing with whatever hooks
were active, e.g. the executor's plan swaps or the profiler's recorder) and
groups what autograd saves by storage. On :meth:`SwapManager.rescue` it frees
the asked bytes by copying whole storages to the host, the one needed furthest
in the future first (cost-aware with a profile: backward seconds until its use
minus its reload time), through the :class:`SwapEngine`'s copy machinery. A
swapped storage comes back when backward reaches the layer before its owner
(prefetch, only into free headroom) or at unpack.

The per-storage records are in ``_storage.py`` (with Note: [never swap a tensor
in use]); the order in which storages go out is ``_eviction.py``'s.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from profiler.naming import named_modules
from profiler.naming import ModelStructure
from profiler.tracing import tensor_leaves

from adaptive_mem.runtime._accounting import host_allocations
from adaptive_mem.runtime._copier import ThreadCopier
from adaptive_mem.runtime._swap_engine import SwapEngine, no_cycle, parameter_storages

from ._eviction import EvictionPolicy
from ._storage import Slot, StorageGroup, SwapState

__all__ = ["SwapManager", "SwapState", "ManagerStats", "SwapExhaustedError"]

log = logging.getLogger(__name__)


class SwapExhaustedError(torch.OutOfMemoryError):
    """Out of device memory with nothing swappable left; ``needed``: the bytes missing."""

    def __init__(self, message: str, *, needed: int = 0) -> None:
        super().__init__(message)
        self.needed = needed


@dataclass
class ManagerStats:
    rescues: int = 0
    """Rescue requests that freed memory."""
    failed_rescues: int = 0
    """Rescue requests that could not free what was asked."""
    swapped_out_bytes: int = 0
    """Bytes moved to the host by rescues (cumulative), evictions of early prefetches included."""
    first_out_bytes: int = 0
    """Bytes a rescue moved off the device for the first time (cumulative): held on top of a rescued step's peak."""
    prefetches: int = 0
    """Reloads started ahead of use."""
    on_demand: int = 0
    """Reloads started at unpack."""
    evicted: int = 0
    """Prefetched storages sent back to the host before use to make room."""
    waits: int = 0
    """Allocations the applied plan's late offloads made room for: waits, not rescues (Note: [late offloads...])."""


class SwapManager:
    """Tracks saved activations of ``model``'s forwards; frees device memory on demand.

    ``profile`` (a :class:`profiler.Profile`, optional) makes the choice cost-aware; ``host_budget`` (a
    ``HostBudget``, optional) bounds the RAM its swap store holds (beyond it: the disk tier).
    """

    def __init__(self, model: nn.Module, *, profile: Any = None, device: torch.device | None = None,
                 host_budget: Any = None, structure: ModelStructure | None = None) -> None:
        self.model = model
        self.device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
        self.layers_info = (structure.of_model(model) if structure is not None else ModelStructure.of(model)).layers
        self.layers = ([model.get_submodule(self.layers_info.layer_path(i)) for i in range(self.layers_info.count)]
                       if self.layers_info else [])
        self.engine = SwapEngine(device=self.device, num_layers=len(self.layers), host_budget=host_budget, native=False)
        if isinstance(self.engine.copier, ThreadCopier):  # a rescue copies inside the allocation that asked, while
            self.engine.copier.inline_bytes = 0  # a step is profiled: inline, the profile counted more beside it
        self.stats = ManagerStats()
        self._groups: dict[int, StorageGroup] = {}
        self._seq = 0
        self._layer: int | None = None
        self._inside = False
        self._path: list[str] = []
        self._names = {id(m): n for n, m in named_modules(model, wrappers=True)}  # Note: [compile wrapper names]
        self._params = parameter_storages(model)
        self._live_params: set[int] | None = None
        self._pushed: list[bool] = []
        self._handles: list[Any] = []
        self._no_rescue = 0
        self.policy = EvictionPolicy(num_layers=len(self.layers))
        self.headroom: Callable[[], int | None] = lambda: None
        """Free device bytes now, or None when unknown (then nothing is prefetched: reloads happen at use)."""
        self.engines: Callable[[], list[SwapEngine]] = lambda: []
        """Other swap engines (the applied plan's): a rescue drops their unused prefetches and waits for
        their in-flight offloads."""
        self.prefetch_reserve = 0
        """Bytes of headroom a prefetch must leave for backward's own allocations."""
        if profile is not None:
            self.set_profile(profile)

    # ------------------------------------------------------------------ install
    def attach(self) -> None:
        """(Re)register the hooks; call again after anything else registers root hooks (stay innermost)."""
        self.detach()
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._root_pre))
        self._handles.append(root.register_forward_hook(self._root_post, prepend=True, always_call=True))
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(functools.partial(self._layer_pre, i)))
            self._handles.append(layer.register_forward_hook(functools.partial(self._layer_post, i)))
        for module in root.modules():
            if module is not root:
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def close(self) -> None:
        self.detach()
        while self._pushed:
            self._pop()
        self.engine.close()
        self._groups.clear()

    def set_profile(self, profile: Any) -> None:
        """Backward seconds before each layer's backward starts, and the reload bandwidth."""
        self.policy.set_profile(profile)

    # ------------------------------------------------------------------ forward hooks
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            self._pushed.append(False)
            return
        if not self._pushed:
            self._layer = None
            self._inside = False
            self._live_params = None
            self._params = parameter_storages(self.model)  # a wrapper applied since (fully_shard) has new ones
            self.engine.begin_forward()
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = (outer if outer is not None else (None, None))
        torch._C._autograd._push_saved_tensors_default_hooks(functools.partial(self._pack, pack, unpack),
                                                             self._unpack)
        self._pushed.append(True)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._pushed:
            self._pop()

    def _pop(self) -> None:
        if self._pushed.pop():
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def _layer_pre(self, i: int, module: nn.Module, args: Any) -> None:
        self._layer = i
        self._inside = True
        self._live_params = None

    def _layer_post(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        self._inside = False
        self._live_params = None
        if not torch.is_grad_enabled():
            return
        t = next((x for x in tensor_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
                  if x.requires_grad), None)
        if t is not None:
            me = weakref.ref(self)  # the graph must not keep the manager (and the model) alive
            t.register_hook(lambda grad: me() is not None and me()._on_backward(i))

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._path.append(self._names.get(id(module), ""))

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._path:
            self._path.pop()

    def _current_parameters(self) -> set[int]:
        """Storages of the running layer's parameters (FSDP2 registers its gathered ones on it), else the model's;
        taken at the first save of each layer call, after FSDP's pre-forward hook has gathered them."""
        if self._live_params is None:
            module = self.layers[self._layer] if self._inside and self._layer is not None else self.model
            self._live_params = parameter_storages(module)
        return self._live_params

    def _position(self) -> int:
        """Layer index of what runs now: -1 before the layers, ``num_layers`` after them."""
        if self._inside and self._layer is not None:
            return self._layer
        return -1 if self._layer is None else len(self.layers)

    # ------------------------------------------------------------------ saved-tensor hooks
    def _pack(self, outer_pack: Callable | None, outer_unpack: Callable | None, t: torch.Tensor) -> Any:
        inner = no_cycle(outer_pack(t) if outer_pack is not None else t)  # Note: [pack without a cycle]
        if (not isinstance(inner, torch.Tensor) or isinstance(inner, nn.Parameter) or inner.device != self.device
                or inner.is_sparse or type(inner) is not torch.Tensor):
            return ("opaque", inner, outer_unpack)
        st = inner.untyped_storage()
        key = st._cdata
        if key in self._params or st.nbytes() == 0 or key in self._current_parameters():
            return ("opaque", inner, outer_unpack)  # Note: [parameter storages are never swapped]
        self._seq += 1
        group = self._groups.get(key)
        if group is None or group.storage() is not st or group.record is not None:
            group = StorageGroup(key, st, self._seq, self._position(), self._path[-1] if self._path else "")
            self._groups[key] = group
        group.seq = self._seq  # next use in backward follows the last save
        slot = Slot(group, inner, outer_unpack)
        group.slots.append(weakref.ref(slot))
        return slot

    def _unpack(self, packed: Any) -> Any:
        if isinstance(packed, tuple):
            _, inner, outer_unpack = packed
            return outer_unpack(inner) if outer_unpack is not None else inner
        slot: Slot = packed
        slot.used = True
        if slot.tensor is not None:
            t = slot.tensor
        else:
            assert slot.packed is not None, "swapped slot without its host copy"
            if slot.group.record.h2d is None:
                self.stats.on_demand += 1
            t = slot.packed.unpack()
        return slot.outer_unpack(t) if slot.outer_unpack is not None else t

    # ------------------------------------------------------------------ queries
    def groups(self) -> list[StorageGroup]:
        """Storages in flight (pruned of those autograd has released)."""
        dead = [k for k, g in self._groups.items() if not g.live_slots()]
        for k in dead:
            del self._groups[k]
        return list(self._groups.values())

    def in_flight_bytes(self, state: SwapState | None = None) -> int:
        return sum(g.nbytes for g in self.groups() if state is None or g.state is state)

    def _exclusive(self, group: StorageGroup) -> bool:
        """Note: [never swap a tensor in use]."""
        return group.exclusive()

    def largest_unswappable(self) -> tuple[int, str]:
        """Largest device tensor the manager cannot move: in-use activations or parameters."""
        best = (0, "")
        for g in self.groups():
            if g.record is None and not self._exclusive(g) and g.nbytes > best[0]:
                best = (g.nbytes, f"activation of {g.unit or 'the model'}")
        for name, p in self.model.named_parameters():
            nbytes = p.untyped_storage().nbytes()
            if nbytes > best[0]:
                best = (nbytes, f"parameter {name}")
        return best

    def exhausted(self, needed: int, budget: int | None) -> SwapExhaustedError:
        """The error for an allocation no swap can make room for, with the numbers."""
        size, what = self.largest_unswappable()
        left = sum(g.nbytes for g in self.groups() if g.record is None and self._exclusive(g))
        return SwapExhaustedError(
            f"out of device memory: needed {needed} more bytes, budget {budget if budget is not None else 'unknown'} "
            f"bytes, swappable left {left} bytes ({self.in_flight_bytes(SwapState.HOST)} bytes already on the "
            f"host); largest unswappable tensor: {what}, {size} bytes", needed=needed)

    # ------------------------------------------------------------------ rescue
    @property
    def prefetching(self) -> bool:
        """Whether a prefetch is reloading now: one that does not fit waits for its use, nothing is rescued for it."""
        return bool(self._no_rescue)

    def rescue(self, needed: int) -> bool:
        """Swap out storages until ``needed`` bytes are released; True if anything was.

        Note: [rescue waits on the host]. The allocation that asked is retried by the host as soon as this
        returns, so each storage's offload copy has landed (and released the device storage) before it does:
        the host waits for the copy. Making only the compute stream wait, as a planned swap does, leaves the
        storage held by a copy in flight on an accelerator's side stream: the retry fails again (seen on an
        H200: 25 rescues of one storage each, then out of memory). Guarded by tests/test_oom.py."""
        if self._no_rescue or needed <= 0:
            return False
        needed -= self._wait_for_offloads()
        if needed <= 0:
            self.stats.waits += 1
            log.debug("rescue: the applied plan's offloads in flight made the room: no swap")
            return True
        candidates = self.policy.candidates(self.groups())
        freed = 0
        with host_allocations():  # the copy bookkeeping aliases existing storages: no device bytes
            for group in candidates:
                if freed >= needed:
                    break
                first = group.record is None
                if self._swap_out(group) if first else self._evict(group):
                    freed += group.nbytes
                    self.stats.first_out_bytes += group.nbytes if first else 0
            for engine in self.engines():  # Note: [budget-aware prefetch]
                if freed >= needed:
                    break
                dropped = engine.evict(needed - freed)
                self.stats.evicted += bool(dropped)
                freed += dropped
        if freed < needed and self._drain():
            freed = max(freed, 1)  # copies in flight landed and released their device bytes: the caller re-checks
        if freed:
            self.stats.rescues += 1
            self.stats.swapped_out_bytes += freed
            log.debug("rescue: asked %d bytes, swapped out %d", needed, freed)
        if freed < needed:
            self.stats.failed_rescues += 1
        return freed > 0

    def _wait_for_offloads(self) -> int:
        """Device bytes released by waiting for the applied plan's offload copies in flight.

        Note: [late offloads are waited for]. A plan is searched as if each offload released its storage once its
        copy ran; a copy landing late (a busy copy thread, a slow link) can put a step of a plan near the budget
        over it by one storage for a moment. The allocation waits for those copies instead of a rescue, which
        would swap what the plan keeps and reopen the adaptive loop's search. Where the free bytes cannot be read
        (no ``headroom``) the copies are waited for after the rescue's swaps (``_drain``). Guarded by
        tests/test_oom.py."""
        before = self.headroom() if self.engines() else None
        if before is None or not self._drain():
            return 0
        after = self.headroom()
        return max(0, after - before) if after is not None else 0

    def _drain(self) -> bool:
        """Wait for the applied plan's offload copies in flight: their device bytes are released when they land
        (:meth:`SwapEngine.drain`)."""
        return any([engine.drain() for engine in self.engines()])

    def _swap_out(self, group: StorageGroup) -> bool:
        slots = [s for s in group.live_slots() if s.tensor is not None]
        if not slots:  # released (e.g. by the garbage collector) since it was chosen
            return False
        label = group.unit or "activation"
        for s in slots:
            s.packed = self.engine.offload(s.tensor, label=label, layer=group.layer, prefetch=0)
            s.tensor = None
        group.record = slots[0].packed.record
        assert all(s.packed.record is group.record for s in slots), "one storage, one host copy"
        self.engine.copier.sync(group.record.d2h)  # Note: [rescue waits on the host]
        return True

    def _evict(self, group: StorageGroup) -> bool:
        """Send a reloaded, not yet used storage back to the host (a fresh copy of the reloaded bytes)."""
        slots = [s for s in group.live_slots() if s.packed is not None and not s.used]
        if not slots:
            return False
        views = [s.packed.unpack() for s in slots]  # waits for the reload; views of the reloaded storage
        packed = [self.engine.offload(v, label=group.unit or "activation", layer=group.layer, prefetch=0)
                  for v in views]
        for s, p in zip(slots, packed):
            s.packed = p  # the old handles go: the reloaded storage is released with the views below
        group.record = packed[0].record
        del views, packed, slots
        self.engine.copier.wait(group.record.d2h)
        self.stats.evicted += 1
        return True

    # ------------------------------------------------------------------ backward
    def _on_backward(self, layer: int) -> None:
        """Backward begins ``layer``: bring back what the next layer needs, if it fits."""
        room = self.headroom()
        if room is None:
            return  # without knowing the free bytes, a prefetch could starve backward: reload on demand only
        room -= self.prefetch_reserve
        for group in sorted(self.groups(), key=lambda g: -g.seq):
            if group.state is not SwapState.HOST or group.layer < layer - 1:
                continue
            if group.nbytes > room:
                break
            self._no_rescue += 1
            try:
                group.record.reload()
            except torch.OutOfMemoryError:
                break  # it will come back on demand
            finally:
                self._no_rescue -= 1
            self.stats.prefetches += 1
            room -= group.nbytes
