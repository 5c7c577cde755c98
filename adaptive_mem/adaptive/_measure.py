"""The adaptive loop's measurements: the live step profiled at warm-up (:class:`StepProfiler`), each step's
record (:class:`StepMeter`: peak, time, SwapManager rescues, allocator retries), and what the device and the
budget leave free. The loop decides what to do with what is measured here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from search import BudgetError, fmt_bytes

from adaptive_mem.runtime._accounting import host_allocations
from ._target_search import StepRecord
from ._wrappers import wrapper_memory

__all__ = ["AdaptiveBudgetError", "StepMeter", "StepProfiler", "default_budget", "headroom"]

# Note: [the loop's logger] every line of the loop goes to ``adaptive_mem.adaptive._loop`` (docs/adaptive.md
# names it; users and tests set its level), whichever of its modules writes it.
log = logging.getLogger("adaptive_mem.adaptive._loop")


class AdaptiveBudgetError(BudgetError):
    """The memory budget is below what the step needs with every swappable activation on the host."""



class StepMeter:
    """One step's record from the out-of-memory ``hook`` (peak, allocator retries) and the SwapManager's rescues."""

    def __init__(self, hook: Any, manager: Any) -> None:
        self.hook = hook
        self.manager = manager
        self._start = 0.0
        self._rescues0 = 0
        self._retries0 = 0

    def start(self) -> None:
        self.hook.reset_peak()
        self._rescues0 = self.manager.stats.rescues
        self._retries0 = self.hook.retries
        self._start = time.perf_counter()

    def record(self, *, step: int, kind: str, target: int | None) -> StepRecord:
        seconds = time.perf_counter() - self._start
        rescues = self.manager.stats.rescues - self._rescues0
        retries = self.hook.retries - self._retries0
        return StepRecord(step=step, kind=kind, target=target, peak=self.hook.peak(), seconds=seconds,
                          rescues=rescues, retries=retries)


class StepProfiler:
    """The live step of ``model`` profiled on its inputs, with what the device holds beside it measured through
    the loop's out-of-memory ``hook``; ``refusals`` words a step that cannot fit."""

    def __init__(self, model: nn.Module, *, device: torch.device, hook: Any, manager: Any, refusals: Any,
                 optimizer: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> None:
        self.model = model
        self.device = device
        self.hook = hook
        self.manager = manager
        self.refusals = refusals
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.profile: Any = None
        """The last profile taken (None before it)."""
        self.profiles_run = 0
        """Profiles taken (0 on a run served by the plan cache)."""
        self.busy = 0
        """Nonzero while the profile runs: the step boundaries and the rescues leave its forwards alone."""
        self.overshoot: tuple[int, str] | None = None
        """Bytes the last profiled step went past the budget with every swappable activation swapped, and why."""

    def take(self, args: tuple, kwargs: dict, budget: int) -> Any:
        """The live step profiled on its inputs, with what the device holds beside it (Note: [other device
        memory]) measured through the loop's hook.

        Note: [profile past the budget] under data parallelism the profiled step runs collectives (FSDP2's gathers,
        DDP's all-reduce): a rank that ran out of memory in it, even with every swappable activation swapped, would
        leave the others waiting in a collective. Where the budget is a cap the loop can lift (``DeviceMemory`` on
        CPU), the step then goes on past it to the end and the overshoot is measured: every rank ends the profile,
        and all of them refuse together, naming what was needed (tests/test_parallel_adaptive_layouts.py, budgets
        below the minimum, FSDP2). A device's own capacity cannot be lifted: there the profile fails as the step
        would."""
        hardware = self._hardware()
        self.busy += 1
        self.overshoot = None
        moved0 = self.manager.stats.first_out_bytes
        try:
            prof = self._run(args, kwargs, hardware)
        except torch.OutOfMemoryError as exc:
            raise self.refusals.profile_out_of_memory(exc, budget) from None
        finally:
            self.busy -= 1
            self.hook.restore_cap()
        self.profiles_run += 1
        self._add_held_beside(prof, self.manager.stats.first_out_bytes - moved0)
        self.profile = prof
        return prof

    def past_budget(self, needed: int) -> bool:
        """Whether an allocation of ``needed`` bytes past the budget goes on: during the profile, where the cap
        can be lifted (Note: [profile past the budget]); the overshoot is kept for the refusal."""
        if not (self.busy and self.hook.lift_cap()):
            return False
        size, what = self.manager.largest_unswappable()
        self.overshoot = (needed, f"largest unswappable tensor: {what}, {fmt_bytes(size, exact=True)}")
        return True

    def _hardware(self) -> Any:
        import profiler

        if self.device.type != "cpu":
            return None
        # the bandwidth probe's buffers are no device memory of the step
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        with host_allocations():
            return profiler.hardware_spec("cpu", dtype=dtype)

    def _run(self, args: tuple, kwargs: dict, hardware: Any) -> Any:
        import profiler

        return profiler.profile_step(self.model, inputs=args, loss_fn=self._loss(kwargs),
                                     optimizer=self.optimizer, warmup=0, repeat=0, record=1, hardware=hardware,
                                     optimizer_time=0.0,  # the same for every plan; timing a scratch copy
                                                          # would allocate inside the budget
                                     meter=self.hook if self.hook.live() is not None else None)

    def _add_held_beside(self, prof: Any, moved: int) -> None:
        buckets = wrapper_memory(self.model, around=True).buckets
        if buckets > prof.static.other:  # Note: [DDP gradient buckets]: held beside the step, seen or not
            prof.peak_memory += buckets - prof.static.other
            prof.static = dataclasses.replace(prof.static, other=buckets)
        if moved:
            # Note: [profile under rescue] the profiled step survived by swapping; its measured peak is the
            # budget's, not the plain step's. The activations swapped out were all still alive at the start
            # of backward (rescues never move a tensor autograd has released), so the plain peak is at most
            # the measured one plus what was moved, and the workspace the simulator derives from it is kept.
            log.info("adaptive memory: the profiled step needed rescues (%s swapped out): its unoptimized "
                     "peak is taken as measured + swapped", fmt_bytes(moved, exact=True))
            prof.peak_memory += moved

    def _loss(self, kwargs: dict) -> Callable[[nn.Module, tuple], torch.Tensor]:
        loss_fn = self.loss_fn

        def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
            out = model(*inputs, **kwargs)
            if loss_fn is not None:
                return loss_fn(out)
            first = next(t for t in tree_flatten(out.to_tuple() if hasattr(out, "to_tuple") else out)[0]
                         if isinstance(t, torch.Tensor) and t.is_floating_point())
            return first.sum()
        return loss


# --------------------------------------------------------------------------- what the device leaves free
def headroom(hook: Any, budget: int | None) -> int | None:
    """Bytes the device and the budget leave free now (None where neither can tell)."""
    room = hook.headroom()
    live = hook.live()
    if budget is not None and live is not None:
        room = min(room, budget - live) if room is not None else budget - live
    return room


def default_budget(hook: Any, device: torch.device) -> int:
    """The device capacity (on CPU the active ``DeviceMemory``'s cap), the budget when none is given."""
    cap = hook.capacity()
    if cap is None and device.type != "cpu":
        cap = torch.accelerator.get_memory_info(device)[1] if hasattr(torch.accelerator, "get_memory_info") \
            else None
    if cap is None:
        raise ValueError("memory budget: none given and the device capacity is unknown; expected "
                         "--memory-budget SIZE (or run under adaptive_mem.DeviceMemory(cap=...) on CPU)")
    return int(cap)
