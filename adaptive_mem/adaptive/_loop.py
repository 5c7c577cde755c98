"""The adaptive closed loop behind ``--adaptive-memory-optimization``.

``adaptive_optimize(model, budget=...)`` hooks the model; the user's training
loop stays as it is. Each step (one forward + its backward):

1. Warm-up: the first step of an input shape runs the plain model under the
   SwapManager's protection (out-of-memory becomes a swap-out, not a crash)
   and profiles the real model on the step's inputs (or finds the plan cache).
   Sequence lengths fall in buckets (``_buckets``): another bucket's plan is
   searched on the profile scaled to its length, not profiled again (``_warmup``).
2. The search (``milp``) picks the fastest plan whose simulated peak fits the
   memory *target*; it is applied between steps (at the end of backward).
3. Every step is watched: peak, time, SwapManager rescues, allocator retries.
   A rescue means the target was too optimistic: binary search tightens it;
   a clean step relaxes it toward the budget (MindSpeed's binary search on the
   memory target). When the interval is closed the plan is cached and the loop
   stops solving; a rescue after that reopens the search.

Plans change only between steps, before the model's call or at the end of backward: hooks are never
added while a forward runs. Each sequence-length bucket runs its own plan (Note: [each bucket its own plan]).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from profiler.naming import ModelStructure
from profiler.tracing import tensor_leaves
from search import Plan, fmt_bytes

from adaptive_mem.memory._oom import OomHook, make_hook
from adaptive_mem.memory._swap_manager import SwapManager
from adaptive_mem.runtime._apply import apply_plan
from adaptive_mem.runtime._buckets import pick_before_call, stop_picking
from ._adapt import decide, describe_pending
from ._arguments import check_arguments, mark, unmark
from ._batch import AdaptiveBatch
from ._buckets import Bucket, Shape, ShapeBuckets, check_seq_lens
from ._warmup import BucketWarmup
from ._entry import hooks_before, run_again_then_first
from adaptive_mem.runtime._spill import HostBudget, as_host_budget
from ._measure import AdaptiveBudgetError, StepMeter, StepProfiler, default_budget, headroom
from ._plan_cache import CacheEntry, PlanCache
from ._planner import Planner, describe
from ._ranks import RankGroup, share_decision
from ._refusals import BudgetRefusals
from ._target_search import Move, SearchState, StepRecord, TargetSearch
from ._wrappers import is_laid_out, warn_untested

__all__ = ["adaptive_optimize", "AdaptiveMemory", "AdaptiveBudgetError", "StepRecord", "TargetSearch", "Move"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the handle
class AdaptiveMemory(BucketWarmup):
    """What :func:`adaptive_optimize` returns; a context manager whose exit (or :meth:`remove`) restores the model.

    It composes the loop's collaborators, each handed its state: :attr:`profiler` (the live step profiled),
    :attr:`meter` (each step's record), :attr:`refusals` (budgets the step cannot run under), :attr:`planner`
    (plans per target), :attr:`state` (the target search and what to apply next) and :attr:`cache_entry`."""

    def __init__(self, model: nn.Module, *, budget: int | None, optimizer: Any, cache: PlanCache | None,
                 solver: str, parallel: dict[str, int] | None, loss_fn: Callable[[Any], torch.Tensor] | None,
                 tolerance: float, pluggable_allocator: bool, host_budget: HostBudget | None = None,
                 ranks: RankGroup | None = None, buckets: ShapeBuckets | None = None) -> None:
        self.model = model
        self.ranks = ranks or RankGroup()
        """The data-parallel group that agrees on one plan (Note: [one decision per DP group])."""
        self.host_budget = host_budget
        """RAM the swap stores may hold (the plan's and the SwapManager's together); None: the process default."""
        self.budget = budget
        self.cache = cache
        self.parallel = dict(parallel or {})
        self.tolerance = tolerance
        self.prefetch_reserve = 0.1
        """Fraction of the budget a SwapManager prefetch leaves free for backward's own allocations."""
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        warn_untested(model)
        self.structure = ModelStructure.of(model)
        """The model's layers, names and fingerprint, found once and handed to the SwapManager and each plan."""
        self.manager = SwapManager(model, device=self.device, host_budget=host_budget, structure=self.structure)
        self.hook: OomHook = make_hook(self.manager.rescue, self.device, pluggable=pluggable_allocator,
                                       exhausted=self._exhausted)
        self.refusals = BudgetRefusals(model, hook=self.hook, manager=self.manager, ranks=self.ranks)
        self.profiler = StepProfiler(model, device=self.device, hook=self.hook, manager=self.manager,
                                     refusals=self.refusals, optimizer=optimizer, loss_fn=loss_fn)
        self.meter = StepMeter(self.hook, self.manager)
        self.planner = Planner(solver)
        self.state = SearchState()
        self.cache_entry = CacheEntry(cache, self.ranks)
        self.buckets = buckets or ShapeBuckets()
        """The plans per input shape (sequence-length bucket), each bucket's search, planner and cache entry."""
        self.history: list[StepRecord] = []
        """One record per step."""
        self.plan: Plan | None = None
        """The plan applied now (None: the plain model)."""
        self.cache_hits = 0
        self.batch: AdaptiveBatch | None = None
        """With ``--adaptive-batch-size``: the micro-batch size and accumulation steps the training loop uses."""
        self._structure = self.structure.fingerprint
        self._handle: Any = None
        self._in_step = False
        self._started = False
        """Whether :meth:`pick` started the step of the call under way."""
        self._depth = 0
        self._shape: Shape | None = None
        self._bucket: Bucket | None = None
        """The bucket of the step under way, whose plan is in force (Note: [each bucket its own plan])."""
        self._connect()

    def _connect(self) -> None:
        """Hook the loop into the model and the SwapManager."""
        self.manager.headroom = self._headroom
        self.manager.engines = self._plan_engines
        self._handles = [self.model.register_forward_pre_hook(self._pre, prepend=True, with_kwargs=True),
                         self.model.register_forward_hook(self._post, always_call=True)]
        self.manager.attach()
        mark(self.model, self)
        pick_before_call(self.model, self)

    # ------------------------------------------------------------------ public
    @property
    def optimizer(self) -> Any:
        return self.profiler.optimizer

    @property
    def loss_fn(self) -> Callable[[Any], torch.Tensor] | None:
        return self.profiler.loss_fn

    @property
    def solver(self) -> str:
        return self.planner.solver

    @property
    def search(self) -> TargetSearch | None:
        return self.state.search

    @property
    def converged_at(self) -> int | None:
        """Step after which the target stopped moving (None while searching)."""
        return self.state.converged_at

    @property
    def converged(self) -> bool:
        return self.state.converged

    @property
    def profiles_run(self) -> int:
        """Profiles taken (0 on a run served by the plan cache)."""
        return self.profiler.profiles_run

    @property
    def minimum(self) -> int | None:
        """The smallest budget the profiled step can run under (bytes, the group's largest under data parallelism),
        measured at the last profile; None before it."""
        return self.planner.min_needed or None

    @property
    def target(self) -> int | None:
        return self.state.target

    @property
    def swap_stats(self) -> Any:
        """The applied plan's swap statistics (None without plan swaps); rescues are in ``manager.stats``."""
        return self._handle.swap_stats if self._handle is not None else None

    @property
    def host_bytes(self) -> int:
        """Host bytes held by the plan's swap pool and the SwapManager's."""
        return (self._handle.host_bytes if self._handle is not None else 0) + self.manager.engine.host_bytes

    def summary(self) -> str:
        """One line: where the loop stands."""
        rescues = sum(r.rescues for r in self.history)
        state = f"converged at step {self.converged_at}" if self.converged else "still searching"
        target = fmt_bytes(self.target, exact=True) if self.target is not None else "none"
        return (f"adaptive memory: {state}, target {target}, budget {fmt_bytes(self.budget or 0, exact=True)}, "
                f"{len(self.history)} steps, {rescues} rescues, {self.profiles_run} profiles, "
                f"{self.cache_hits} cache hits; {describe(self.plan)}")

    def remove(self) -> None:
        """Take the plan, the SwapManager and every hook off the model; safe to call twice."""
        stop_picking(self.model, self)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.manager.close()
        self.hook.remove()
        unmark(self.model, self)

    def __enter__(self) -> "AdaptiveMemory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # ------------------------------------------------------------------ step boundaries
    @torch.compiler.disable
    def pick(self, args: tuple, kwargs: dict) -> None:
        """The step's start, before the model's call runs its hooks: its bucket, and that bucket's plan put in
        force (Note: [each bucket its own plan]); the warm-up's profile is left to the forward pre-hook."""
        self._started = False
        if self.profiler.busy or self._depth > 0 or not torch.is_grad_enabled():
            return
        self._begin(args, kwargs, before_call=True)
        self._started = True

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        if self.profiler.busy or self._depth > 1 or not torch.is_grad_enabled():
            return
        started, self._started = self._started, False
        if not started:  # called without the model's own call (a copy of its hooks): plans change at the end
            self._begin(args, kwargs, before_call=False)
        if self._in_step:  # the previous forward never got its backward (or failed): not a step
            self._abandon()
        self._in_step = True
        self.hook.begin_step()
        self.hook.enter()
        earlier = hooks_before(module, self._handles[0])
        profiles = self.profiles_run
        try:
            if self.state.needs_profile and self._handle is None:
                self._plan_from_profile(args, kwargs)
            self._bucket.longest = max(self._bucket.longest, self._shape.group_len or 0)
        except BaseException:
            self._forget_bucket()
            self._abandon()
            raise  # the always-called forward hook still runs: it balances the depth
        self.meter.start()
        if earlier and self.profiles_run > profiles:  # Note: [hooks before the loop's]
            self._handles[0] = run_again_then_first(module, earlier, self._handles[0], self._pre, args, kwargs)

    def _abandon(self) -> None:
        self._in_step = False
        self.hook.exit()

    def _forget_bucket(self) -> None:
        if self._bucket is not None:  # plan again next time
            self.buckets.drop(self._bucket)
            self._bucket = None

    def _begin(self, args: tuple, kwargs: dict, *, before_call: bool) -> None:
        """Decide the step's bucket and put its plan in force: now where ``before_call`` allows it and no earlier
        forward still awaits its backward (its saved tensors need the plan they were saved under), else at the
        step's end (Note: [each bucket its own plan])."""
        if self.budget is None:
            self.budget = default_budget(self.hook, self.device)
        self.manager.prefetch_reserve = int(self.prefetch_reserve * self.budget)
        tensors = tensor_leaves((args, kwargs))
        try:
            shape = self._shape = self.buckets.shape(tensors, self.ranks)
            self.state.kind = "steady" if self.converged else "adapt"
            own = self.buckets.own(shape)
            if own is None or own is not self._bucket:
                self._start_shape(tensors, shape, own)
                self._in_force(shape, now=before_call and not self._in_step, known=own is not None)
        except BaseException:
            self._forget_bucket()
            raise

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self.profiler.busy or self._depth > 0 or not self._in_step:
            return
        if output is None:  # the forward raised
            self._abandon()
            return
        t = next((x for x in tensor_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
                  if x.requires_grad), None)
        if t is None:
            self._end_step()
            return
        t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._end_step)

    def _end_step(self) -> None:
        if not self._in_step:
            return
        self._in_step = False
        self.hook.exit()
        state = self.state
        record = self.meter.record(step=len(self.history) + 1, kind=state.kind, target=self.target)
        self.history.append(record)
        self.ranks.reduce_record(record)
        warmup = state.kind in ("warmup", "cached", "bucket")
        deciding = warmup or (state.search is not None and (not state.converged or record.rescues > 0)
                              and self.buckets.informs(self._shape, self._bucket, record.rescues > 0))
        if deciding and self.ranks.decides:
            record.decision = describe_pending(state) if warmup else decide(
                state, self.planner, record, current=self.plan.decisions if self.plan is not None else {},
                budget=self.budget, save=self._save_cache)
        if deciding and self.ranks.active:
            share_decision(self.ranks, state, record)
        if state.pending is not False:
            self._apply(state.pending)
            state.pending = False
        if record.decision:
            log.info("adaptive memory: step %d: %s", record.step, record.decision)

    def _save_cache(self, target: int, plan: Plan) -> None:
        path = self.cache_entry.save(target, plan)
        if path is not None:
            log.info("adaptive memory: plan cached at %s", path)

    # ------------------------------------------------------------------ applying plans
    def _apply(self, plan: Plan | None, of: Bucket | None = None) -> None:
        """Put ``plan`` in force as the plan of ``of`` (default the step's bucket; another one lends its plan)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        bucket = of or self._bucket
        self.plan = bucket.plan = plan
        if plan is not None and plan.decisions:
            # The loop itself ties plans to input shapes (a new shape replans), so the executor's one-shot
            # first-forward shape check is left out: a plan still runs correctly on the step that changed shape.
            unchecked = Plan(decisions=dict(plan.decisions), groups=[list(g) for g in plan.groups],
                             meta=dict(plan.meta), distribute_saved_activations=plan.distribute_saved_activations)
            self._handle = apply_plan(self.model, plan=unchecked, profile=bucket.profile,
                                      host_memory_budget=self.host_budget, structure=self.structure)
            for engine in self._plan_engines():  # Note: [budget-aware prefetch]
                engine.headroom = self._headroom
                engine.prefetch_reserve = self.manager.prefetch_reserve
        self.manager.attach()  # innermost again, after the executor's hooks

    # ------------------------------------------------------------------ what the device leaves free
    def _plan_engines(self) -> list[Any]:
        executor = getattr(self._handle, "_executor", None)
        engine = getattr(executor, "engine", None)
        return [engine] if engine is not None else []

    def _headroom(self) -> int | None:
        return headroom(self.hook, self.budget)

    def _exhausted(self, needed: int, budget: int | None) -> BaseException | None:
        if self.manager.prefetching:
            return None  # a prefetch that does not fit: it waits for its use
        if self.profiler.past_budget(needed):  # Note: [profile past the budget]
            return None
        return self.manager.exhausted(needed, budget if budget is not None else self.budget)


def adaptive_optimize(model: nn.Module, *, budget: int | str | None = None, optimizer: Any = None,
                      cache_dir: Any = None, cache: bool = True, solver: str = "milp",
                      parallel: dict[str, int] | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                      tolerance: float = 0.02, pluggable_allocator: bool = False,
                      batch: AdaptiveBatch | None = None,
                      host_memory_budget: int | str | None = None, dp_group: Any = None,
                      seq_len_buckets: Any = None, max_seq_len: int | None = None) -> AdaptiveMemory:
    """Keep ``model`` under ``budget`` device bytes with the fastest plan that fits, found while training.

    ``budget``: bytes or a size string (``"12GiB"``); default the device capacity (on CPU the ``cap`` of
    the active :class:`DeviceMemory`). ``optimizer``: the torch optimizer (or its name) whose state counts
    in the budget. ``cache_dir``: where converged plans are kept (default ``~/.cache/adaptive-mem/plans``);
    ``cache=False`` disables the cache. ``loss_fn``: ``output -> scalar`` used when profiling (default: the
    sum of the first floating output). ``tolerance``: the target search stops when its interval is this
    fraction of the budget. ``pluggable_allocator``: on CUDA, intercept out-of-memory in the caching allocator's observer
    (then retry the op). ``host_memory_budget``: RAM the swap stores may hold (bytes or a size; default half
    the free RAM); beyond it swapped activations spill to memory-mapped files, and the planner knows it.
    ``batch``: an :class:`AdaptiveBatch` whose micro-batch the first profile chooses (``--adaptive-batch-size``).
    ``dp_group``: under ``torch.distributed``, the data-parallel ranks that agree on one plan (default the world
    group; a pipeline stage passes the group of the ranks holding it): the first decides on the group's measured
    maxima and broadcasts, and a rescue on any rank re-plans all of them at the same step.
    ``seq_len_buckets``: the sequence lengths plans are kept for (``"128,256,512"`` or ints; default powers of two);
    ``max_seq_len``: the longest length the data has: one plan for it from the first step on (a longer step is an
    error). See ``_buckets`` (Note: [each bucket its own plan]).
    """
    budget = check_arguments(model, budget=budget, solver=solver, tolerance=tolerance)
    lengths, max_seq_len = check_seq_lens(seq_len_buckets, max_seq_len)
    store = PlanCache(cache_dir) if cache else None
    ranks = RankGroup.resolve(dp_group)
    handle = AdaptiveMemory(model, budget=budget, optimizer=optimizer, cache=store, solver=solver, parallel=parallel,
                            loss_fn=loss_fn, tolerance=tolerance, pluggable_allocator=pluggable_allocator,
                            host_budget=as_host_budget(host_memory_budget, flag="--host-memory-budget"), ranks=ranks,
                            buckets=ShapeBuckets(lengths, max_seq_len))
    handle.batch = batch
    if budget is not None and not (ranks.active and not is_laid_out(model)):  # else a layout may still shard it
        try:  # a budget below what never leaves the device is refused now, before any step or batch
            handle.refusals.check_static(budget)
        except AdaptiveBudgetError:
            handle.remove()
            raise
    return handle
