"""The adaptive closed loop behind ``--adaptive-memory-optimization``.

``adaptive_optimize(model, budget=...)`` hooks the model; the user's training
loop stays as it is. Each step (one forward + its backward):

1. Warm-up: the first step of an input shape runs the plain model under the
   SwapManager's protection (out-of-memory becomes a swap-out, not a crash)
   and profiles the real model on the step's inputs (or finds the plan cache).
2. The search (``milp``) picks the fastest plan whose simulated peak fits the
   memory *target*; it is applied between steps (at the end of backward).
3. Every step is watched: peak, time, SwapManager rescues, allocator retries.
   A rescue means the target was too optimistic: binary search tightens it;
   a clean step relaxes it toward the budget (MindSpeed's binary search on the
   memory target). When the interval is closed the plan is cached and the loop
   stops solving; a rescue after that reopens the search.

Plans change only between steps: hooks are never added while a forward runs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from profiler._fingerprint import structure_fingerprint
from search._plan import Plan

from adaptive_mem.memory._oom import OomHook, make_hook
from adaptive_mem.memory._swap_manager import SwapManager
from adaptive_mem.runtime._apply import _APPLIED, apply_plan
from ._batch import AdaptiveBatch
from ._entry import hooks_before, run_again_then_first
from adaptive_mem.runtime._spill import HostBudget, as_host_budget
from ._measure import AdaptiveBudgetError, StepMeasurement, _fmt
from ._plan_cache import CachedPlan, PlanCache, plan_key
from ._planner import Planner
from ._ranks import RankGroup, share_decision
from ._target_search import Move, StepRecord, TargetSearch
from ._wrappers import is_laid_out, warn_untested

__all__ = ["adaptive_optimize", "AdaptiveMemory", "AdaptiveBudgetError", "StepRecord", "TargetSearch", "Move"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the handle
class AdaptiveMemory(StepMeasurement, Planner):
    """What :func:`adaptive_optimize` returns; a context manager whose exit (or :meth:`remove`) restores the model."""

    def __init__(self, model: nn.Module, *, budget: int | None, optimizer: Any, cache: PlanCache | None,
                 solver: str, parallel: dict[str, int] | None, loss_fn: Callable[[Any], torch.Tensor] | None,
                 tolerance: float, pluggable_allocator: bool, host_budget: HostBudget | None = None,
                 ranks: RankGroup | None = None) -> None:
        self.model = model
        self.ranks = ranks or RankGroup()
        """The data-parallel group that agrees on one plan (Note: [one decision per DP group])."""
        self.host_budget = host_budget
        """RAM the swap stores may hold (the plan's and the SwapManager's together); None: the process default."""
        self.budget = budget
        self.optimizer = optimizer
        self.cache = cache
        self.solver = solver
        self.parallel = dict(parallel or {})
        self.loss_fn = loss_fn
        self.tolerance = tolerance
        self.prefetch_reserve = 0.1
        """Fraction of the budget a SwapManager prefetch leaves free for backward's own allocations."""
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        warn_untested(model)
        self.manager = SwapManager(model, device=self.device, host_budget=host_budget)
        self.hook: OomHook = make_hook(self.manager.rescue, self.device, pluggable=pluggable_allocator)
        self.manager.headroom = self._headroom
        self.manager.engines = self._plan_engines
        self.hook.exhausted = self._exhausted
        if hasattr(self.hook, "mode"):
            self.hook.mode.exhausted = self._exhausted
        self.history: list[StepRecord] = []
        """One record per step."""
        self.plan: Plan | None = None
        """The plan applied now (None: the plain model)."""
        self.profiles_run = 0
        """Profiles taken (0 on a run served by the plan cache)."""
        self.cache_hits = 0
        self.converged_at: int | None = None
        """Step after which the target stopped moving (None while searching)."""
        self.search: TargetSearch | None = None
        self._structure = structure_fingerprint(model)
        self._handle: Any = None
        self._step_model: Any = None
        self._profile: Any = None
        self._inputs_key: Any = None
        self._cache_key: str | None = None
        self._cache_fields: dict[str, Any] = {}
        self._pending: Plan | None | bool = False  # False: no change; None: remove the plan
        self._needs_profile = False
        self._busy = 0
        self._in_step = False
        self._depth = 0
        self._step_start = 0.0
        self._rescues0 = 0
        self._retries0 = 0
        self._kind = "adapt"
        self._solved: dict[int, Any] = {}
        self._min_needed = 0
        self._overshoot: tuple[int, str] | None = None
        """Bytes the last profiled step went past the budget with every swappable activation swapped, and why."""
        self.batch: AdaptiveBatch | None = None
        """With ``--adaptive-batch-size``: the micro-batch size and accumulation steps the training loop uses."""
        self._handles = [model.register_forward_pre_hook(self._pre, prepend=True, with_kwargs=True),
                         model.register_forward_hook(self._post, always_call=True)]
        self.manager.attach()
        model._adaptive_memory = self

    # ------------------------------------------------------------------ public
    @property
    def converged(self) -> bool:
        return self.converged_at is not None

    @property
    def minimum(self) -> int | None:
        """The smallest budget the profiled step can run under (bytes, the group's largest under data parallelism),
        measured at the last profile; None before it."""
        return self._min_needed or None

    @property
    def target(self) -> int | None:
        return self.search.target if self.search is not None else None

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
        target = _fmt(self.target) if self.target is not None else "none"
        return (f"adaptive memory: {state}, target {target}, budget {_fmt(self.budget or 0)}, "
                f"{len(self.history)} steps, {rescues} rescues, {self.profiles_run} profiles, "
                f"{self.cache_hits} cache hits; {self._describe(self.plan)}")

    def remove(self) -> None:
        """Take the plan, the SwapManager and every hook off the model; safe to call twice."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.manager.close()
        self.hook.remove()
        if getattr(self.model, "_adaptive_memory", None) is self:
            del self.model._adaptive_memory

    def __enter__(self) -> "AdaptiveMemory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # ------------------------------------------------------------------ step boundaries
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        if self._busy or self._depth > 1 or not torch.is_grad_enabled():
            return
        if self._in_step:  # the previous forward never got its backward (or failed): not a step
            self._abandon()
        self._in_step = True
        self.hook.begin_step()
        self.hook.enter()
        earlier = hooks_before(module, self._handles[0])
        profiles = self.profiles_run
        try:
            self._begin(args, kwargs)
        except BaseException:
            self._inputs_key = None  # plan again next time
            self._abandon()
            raise  # the always-called forward hook still runs: it balances the depth
        if earlier and self.profiles_run > profiles:  # Note: [hooks before the loop's]
            self._handles[0] = run_again_then_first(module, earlier, self._handles[0], self._pre, args, kwargs)

    def _abandon(self) -> None:
        self._in_step = False
        self.hook.exit()

    def _begin(self, args: tuple, kwargs: dict) -> None:
        if self.budget is None:
            self.budget = self._default_budget()
        self.manager.prefetch_reserve = int(self.prefetch_reserve * self.budget)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        self._kind = "steady" if self.converged else "adapt"
        if key != self._inputs_key:
            first = self._inputs_key is None
            self._inputs_key = key
            self._start_shape(tensors, args, kwargs, first)
        elif self._needs_profile:
            self._plan_from_profile(args, kwargs)
        self._start_record()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._busy or self._depth > 0 or not self._in_step:
            return
        if output is None:  # the forward raised
            self._abandon()
            return
        t = next((x for x in tree_flatten(output.to_tuple() if hasattr(output, "to_tuple") else output)[0]
                  if isinstance(x, torch.Tensor) and x.requires_grad), None)
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
        record = self._record_step()
        self.history.append(record)
        self.ranks.reduce_record(record)
        deciding = self._kind in ("warmup", "cached") or (self.search is not None and
                                                          (not self.converged or record.rescues > 0))
        if deciding and self.ranks.decides:
            record.decision = self._describe_pending() if self._kind in ("warmup", "cached") else self._adapt(record)
        if deciding and self.ranks.active:
            share_decision(self, record)
        if self._pending is not False:
            self._apply(self._pending)
            self._pending = False
        if record.decision:
            log.info("adaptive memory: step %d: %s", record.step, record.decision)

    # ------------------------------------------------------------------ warm-up: cache or profile
    def _start_shape(self, tensors: list[torch.Tensor], args: tuple, kwargs: dict, first: bool) -> None:
        self.converged_at = None
        self.search = None
        self._solved.clear()
        self._cache_key, self._cache_fields = plan_key(self.model, inputs=tensors, budget=self.budget,
                                                       parallel=self._parallel(), structure=self._structure)
        if not first:
            log.info("adaptive memory: input shapes changed to %s: planning again",
                     [list(t.shape) for t in tensors])
        cached = self.ranks.agree_on_cache(self.cache, self._cache_key)
        if cached is not None:
            self.cache_hits += 1
            self._kind = "cached"
            self.search = TargetSearch(lo=cached.target, hi=cached.target, target=cached.target, tolerance=0)
            self.converged_at = len(self.history) + 1
            self._pending = cached.plan
            log.info("adaptive memory: reusing the cached plan %s (target %s): no profiling",
                     self.cache.path(self._cache_key), _fmt(cached.target))
            return
        if self._handle is not None:
            self._pending = None  # profile the plain model at the next step
            self._needs_profile = True
            self._kind = "warmup"
            return
        self._plan_from_profile(args, kwargs)

    # ------------------------------------------------------------------ the search
    def _adapt(self, record: StepRecord) -> str:
        search = self.search
        assert search is not None
        if self.converged:  # a rescue after convergence: reopen
            self.converged_at = None
            if self._step_model is None:  # a cached plan: no profile to search with yet
                self._needs_profile = True
                self._pending = None
                return (f"{record.rescues} rescues under the cached plan: profiling again at the next step "
                        "(plain model until then)")
            if search.target <= self._min_needed:
                self.converged_at = record.step
                return (f"{record.rescues} rescues at the most memory-saving target {_fmt(search.target)}: "
                        "nothing tighter to try; the SwapManager keeps the steps alive")
            search.lo = self._min_needed
        before = search.target
        why = (f"{record.rescues} rescues, {record.retries} allocator retries, peak {_fmt(record.peak or 0)}"
               if record.rescues else f"no rescues, peak {_fmt(record.peak or 0)} of budget {_fmt(self.budget)}")
        move = search.observe(rescued=record.rescues > 0)
        # A target whose plan is the one just measured has a known outcome: keep moving.
        while move is not Move.CONVERGED and self._solve(search.target).decisions == self._current_decisions():
            move = search.observe(rescued=record.rescues > 0)
        if move is Move.CONVERGED:
            self.converged_at = record.step
            plan = self._solve(search.target)
            if plan.decisions != self._current_decisions():
                self._pending = plan
            self._save_cache(search.target, plan)
            return (f"{why}: converged at target {_fmt(search.target)} after {record.step} steps "
                    f"({len(plan.decisions)} decisions)")
        self._pending = self._solve(search.target)
        verb = "tightening" if move is Move.TIGHTEN else "relaxing"
        return f"{why}: {verb} the target {_fmt(before)} -> {_fmt(search.target)}; {self._describe(self._pending)}"

    def _current_decisions(self) -> dict:
        return self.plan.decisions if self.plan is not None else {}

    def _describe_pending(self) -> str:
        if self._pending is False:
            return ""
        what = "cached " if self._kind == "cached" else ""
        target = f" for target {_fmt(self.target)}" if self.target is not None else ""
        return f"warm-up done: applying the {what}{self._describe(self._pending)}{target}"

    def _save_cache(self, target: int, plan: Plan) -> None:
        if self.cache is None or self._cache_key is None or not self.ranks.decides:
            return
        path = self.cache.save(self._cache_key, CachedPlan(plan, target, self._cache_fields))
        log.info("adaptive memory: plan cached at %s", path)

    # ------------------------------------------------------------------ applying plans
    def _apply(self, plan: Plan | None) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.plan = plan
        if plan is not None and plan.decisions:
            # The loop itself ties plans to input shapes (a new shape replans), so the executor's one-shot
            # first-forward shape check is left out: a plan still runs correctly on the step that changed shape.
            unchecked = Plan(decisions=dict(plan.decisions), groups=[list(g) for g in plan.groups],
                             meta=dict(plan.meta), distribute_saved_activations=plan.distribute_saved_activations)
            self._handle = apply_plan(self.model, plan=unchecked, profile=self._profile,
                                      host_memory_budget=self.host_budget)
            for engine in self._plan_engines():  # Note: [budget-aware prefetch]
                engine.headroom = self._headroom
                engine.prefetch_reserve = self.manager.prefetch_reserve
        self.manager.attach()  # innermost again, after the executor's hooks



def adaptive_optimize(model: nn.Module, *, budget: int | str | None = None, optimizer: Any = None,
                      cache_dir: Any = None, cache: bool = True, solver: str = "milp",
                      parallel: dict[str, int] | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                      tolerance: float = 0.02, pluggable_allocator: bool = False,
                      batch: AdaptiveBatch | None = None,
                      host_memory_budget: int | str | None = None,
                      dp_group: Any = None) -> AdaptiveMemory:
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
    """
    from search._budget import parse_bytes

    if isinstance(budget, str):
        budget = parse_bytes(budget, key="--memory-budget")
    elif budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"--memory-budget={budget!r}: expected a positive number of bytes or a size like 12GiB")
    if solver != "milp":
        from search import solver_names

        if solver not in solver_names():
            raise ValueError(f"solver={solver!r}: unknown; expected one of {', '.join(solver_names())}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r}: expected a fraction in (0, 1)")
    applied = _APPLIED.get(model)
    if applied is not None and applied() is not None and applied().active:
        raise ValueError("adaptive memory optimization: the model already has a plan applied (a manual recompute/"
                         "swap config); expected one of them: remove() its handle first")
    if getattr(model, "_adaptive_memory", None) is not None:
        raise ValueError("adaptive memory optimization: already applied to this model; remove() it first")
    store = PlanCache(cache_dir) if cache else None
    ranks = RankGroup.resolve(dp_group)
    handle = AdaptiveMemory(model, budget=budget, optimizer=optimizer, cache=store, solver=solver, parallel=parallel,
                            loss_fn=loss_fn, tolerance=tolerance, pluggable_allocator=pluggable_allocator,
                            host_budget=as_host_budget(host_memory_budget, flag="--host-memory-budget"), ranks=ranks)
    handle.batch = batch
    if budget is not None and not (ranks.active and not is_laid_out(model)):  # else a layout may still shard it
        try:  # a budget below what never leaves the device is refused now, before any step or batch
            handle._check_static()
        except AdaptiveBudgetError:
            handle.remove()
            raise
    return handle
