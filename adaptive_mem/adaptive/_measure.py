"""The adaptive loop's measurements: the live step profiled at warm-up, each step's record (peak, time,
SwapManager rescues, allocator retries), and what the device and the budget leave free.

:class:`StepMeasurement` is a base of :class:`~adaptive_mem.adaptive._loop.AdaptiveMemory` and works on its
state (``model``, ``budget``, ``manager``, ``hook``, ``history``, ...); the loop decides what to do with what
is measured here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from adaptive_mem.runtime._accounting import host_allocations
from adaptive_mem.runtime._spill import HostBudget
from search import BudgetError
from ._target_search import StepRecord, TargetSearch
from ._wrappers import wrapper_memory

__all__ = ["AdaptiveBudgetError", "StepMeasurement"]

# Note: [the loop's logger] every line of the loop goes to ``adaptive_mem.adaptive._loop`` (docs/adaptive.md
# names it; users and tests set its level), whichever of its modules writes it.
log = logging.getLogger("adaptive_mem.adaptive._loop")


class AdaptiveBudgetError(BudgetError):
    """The memory budget is below what the step needs with every swappable activation on the host."""


def _fmt(n: float) -> str:
    from search import fmt_bytes

    return fmt_bytes(n, exact=True)


class StepMeasurement:
    """Profiling and per-step measurement for :class:`~adaptive_mem.adaptive._loop.AdaptiveMemory`."""

    # ------------------------------------------------------------------ one step's record
    def _start_record(self) -> None:
        self.hook.reset_peak()
        self._rescues0 = self.manager.stats.rescues
        self._retries0 = self.hook.retries
        self._step_start = time.perf_counter()

    def _record_step(self) -> StepRecord:
        seconds = time.perf_counter() - self._step_start
        rescues = self.manager.stats.rescues - self._rescues0
        retries = self.hook.retries - self._retries0
        return StepRecord(step=len(self.history) + 1, kind=self._kind, target=self.target, peak=self.hook.peak(),
                          seconds=seconds, rescues=rescues, retries=retries)

    # ------------------------------------------------------------------ warm-up: profile the live step
    def _plan_from_profile(self, args: tuple, kwargs: dict) -> None:
        from search import StepModel, minimum_budget

        self._needs_profile = False
        self._kind = "warmup"
        self._check_static()
        start = time.perf_counter()
        prof = self._take_profile(args, kwargs)
        self._profile = prof
        self.manager.set_profile(prof)
        host = self.host_budget or HostBudget.default()  # the planner knows where swaps spill to disk
        if self.batch is not None:  # --adaptive-batch-size: the next global batch's micro-batch
            self.batch.observe(prof, self.budget - self.manager.prefetch_reserve)
        self._step_model = model = StepModel.build(prof, host_budget=host.limit)
        needed, what = minimum_budget(model)
        if self._overshoot is not None:  # Note: [profile past the budget]: measured, not simulated
            over, largest = self._overshoot
            needed = self.budget + over
            what = f"the profiled step went {_fmt(over)} past the budget with every swappable activation on the " \
                   f"host; {largest}"
        needed = self.ranks.reduce_max([needed])[0]  # every DP rank refuses, or none does
        if needed > self.budget:
            raise AdaptiveBudgetError(
                f"--memory-budget={self.budget}: below the minimum feasible; needed {_fmt(needed)}, "
                f"budget {_fmt(self.budget)} ({what})")
        self._min_needed = needed
        tol = max(1, int(self.tolerance * self.budget))
        self.search = TargetSearch(lo=needed, hi=self.budget + 1, target=self.budget, tolerance=tol)
        log.info("adaptive memory: profiled the model in %.1f s: unoptimized peak %s, minimum feasible %s, "
                 "budget %s", time.perf_counter() - start, _fmt(prof.peak_memory), _fmt(needed), _fmt(self.budget))
        # Note: [one decision per DP group]: the other ranks take the deciding rank's plan at the step's end
        self._pending = self._solve(self.search.target) if self.ranks.decides else False

    def _take_profile(self, args: tuple, kwargs: dict) -> Any:
        """The live step profiled on its inputs, with what the device holds beside it (Note: [other device
        memory]) measured through the loop's hook.

        Note: [profile past the budget] under data parallelism the profiled step runs collectives (FSDP2's gathers,
        DDP's all-reduce): a rank that ran out of memory in it, even with every swappable activation swapped, would
        leave the others waiting in a collective. Where the budget is a cap the loop can lift (``DeviceMemory`` on
        CPU), the step then goes on past it to the end and the overshoot is measured: every rank ends the profile,
        and all of them refuse together, naming what was needed (tests/test_parallel_adaptive_layouts.py, budgets
        below the minimum, FSDP2). A device's own capacity cannot be lifted: there the profile fails as the step
        would."""
        import profiler

        hardware = None
        if self.device.type == "cpu":  # the bandwidth probe's buffers are no device memory of the step
            dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
            with host_allocations():
                hardware = profiler.hardware_spec("cpu", dtype=dtype)
        self._busy += 1
        self._overshoot = None
        moved0 = self.manager.stats.first_out_bytes
        try:
            prof = profiler.profile_step(self.model, inputs=args, loss_fn=self._profile_loss(kwargs),
                                         optimizer=self.optimizer, warmup=0, repeat=0, record=1, hardware=hardware,
                                         optimizer_time=0.0,  # the same for every plan; timing a scratch copy
                                                              # would allocate inside the budget
                                         meter=self.hook if self.hook.live() is not None else None)
        except torch.OutOfMemoryError as exc:
            size, what = self.manager.largest_unswappable()
            short = self.budget + getattr(exc, "needed", 0)
            raise AdaptiveBudgetError(
                f"--memory-budget={self.budget}: below the minimum feasible; needed more than {_fmt(short)}: the "
                f"profiled step does not fit even with every swappable activation on the host (largest unswappable "
                f"tensor: {what}, {_fmt(size)}): {exc}") from None
        finally:
            self._busy -= 1
            self.hook.restore_cap()
        self.profiles_run += 1
        buckets = wrapper_memory(self.model, around=True).buckets
        if buckets > prof.static.other:  # Note: [DDP gradient buckets]: held beside the step, seen or not
            prof.peak_memory += buckets - prof.static.other
            prof.static = dataclasses.replace(prof.static, other=buckets)
        moved = self.manager.stats.first_out_bytes - moved0
        if moved:
            # Note: [profile under rescue] the profiled step survived by swapping; its measured peak is the
            # budget's, not the plain step's. The activations swapped out were all still alive at the start
            # of backward (rescues never move a tensor autograd has released), so the plain peak is at most
            # the measured one plus what was moved, and the workspace the simulator derives from it is kept.
            log.info("adaptive memory: the profiled step needed rescues (%s swapped out): its unoptimized "
                     "peak is taken as measured + swapped", _fmt(moved))
            prof.peak_memory += moved
        return prof

    def _check_static(self) -> None:
        """Parameters, their gradients and what a parallel wrapper surely gathers never leave the device: fail
        before the step if they cannot fit (a lower bound; the profile of the first step measures the rest)."""
        from profiler._static import unique_bytes  # a sharded parameter: this rank's shard

        params = list(self.model.parameters())
        param_bytes = unique_bytes(params)
        grad_bytes = unique_bytes(p for p in params if p.requires_grad and p.grad is None)
        live = self.hook.live()
        wrapper = wrapper_memory(self.model)
        needed = max(live or 0, param_bytes + wrapper.buckets) + grad_bytes + wrapper.gathered
        needed = self.ranks.reduce_max([needed])[0]  # every DP rank refuses, or none does
        if needed > self.budget:
            size, what = self.manager.largest_unswappable()
            held = f", {wrapper.what}" if wrapper.what else ""
            raise AdaptiveBudgetError(
                f"--memory-budget={self.budget}: below the minimum feasible; needed at least {_fmt(needed)} "
                f"(live device memory and the gradients to come{held}), budget {_fmt(self.budget)}; "
                f"largest unswappable tensor: {what}, {_fmt(size)}")

    def _profile_loss(self, kwargs: dict) -> Callable[[nn.Module, tuple], torch.Tensor]:
        loss_fn = self.loss_fn

        def loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
            out = model(*inputs, **kwargs)
            if loss_fn is not None:
                return loss_fn(out)
            first = next(t for t in tree_flatten(out.to_tuple() if hasattr(out, "to_tuple") else out)[0]
                         if isinstance(t, torch.Tensor) and t.is_floating_point())
            return first.sum()
        return loss

    # ------------------------------------------------------------------ what the device leaves free
    def _plan_engines(self) -> list[Any]:
        executor = getattr(self._handle, "_executor", None)
        engine = getattr(executor, "engine", None)
        return [engine] if engine is not None else []

    def _headroom(self) -> int | None:
        room = self.hook.headroom()
        live = self.hook.live()
        if self.budget is not None and live is not None:
            room = min(room, self.budget - live) if room is not None else self.budget - live
        return room

    def _exhausted(self, needed: int, budget: int | None) -> BaseException | None:
        if self.manager._no_rescue:
            return None  # a prefetch that does not fit: it waits for its use
        if self._busy and self.hook.lift_cap():  # Note: [profile past the budget]
            size, what = self.manager.largest_unswappable()
            self._overshoot = (needed, f"largest unswappable tensor: {what}, {_fmt(size)}")
            return None
        return self.manager.exhausted(needed, budget if budget is not None else self.budget)

    def _parallel(self) -> dict[str, Any]:
        sizes = dict(self.parallel)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            sizes.setdefault("world", torch.distributed.get_world_size())
        sizes.update(self.ranks.layout())
        mesh = next((list(p.device_mesh.shape) for p in self.model.parameters() if hasattr(p, "device_mesh")), None)
        if mesh is not None:  # DTensor parameters (FSDP2, tensor parallel): the mesh they are sharded over
            sizes["mesh"] = mesh
        return sizes

    def _default_budget(self) -> int:
        cap = self.hook.capacity()
        if cap is None and self.device.type != "cpu":
            cap = torch.accelerator.get_memory_info(self.device)[1] if hasattr(torch.accelerator, "get_memory_info") \
                else None
        if cap is None:
            raise ValueError("memory budget: none given and the device capacity is unknown; expected "
                             "--memory-budget SIZE (or run under adaptive_mem.DeviceMemory(cap=...) on CPU)")
        return int(cap)
