"""The adaptive loop's warm-up for an input shape: the plan of the bucket a step falls in, from the bucket itself,
the plan cache, a profile taken at another sequence length and scaled to the bucket's, or a profile of the step.

:class:`BucketWarmup` is a part of :class:`~adaptive_mem.adaptive._loop.AdaptiveMemory` (its base): these methods
work on the loop's collaborators (profiler, planner, refusals, buckets) and its search state.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from search import fmt_bytes
from search.planning import scale_to_seq_len

from adaptive_mem.runtime._spill import HostBudget
from ._adapt import describe_pending
from ._buckets import Bucket, Shape
from ._measure import AdaptiveBudgetError
from ._plan_cache import CacheEntry, layout_sizes
from ._planner import Planner
from ._target_search import TargetSearch

__all__ = ["BucketWarmup"]

log = logging.getLogger("adaptive_mem.adaptive._loop")  # Note: [the loop's logger]


class BucketWarmup:
    """The warm-up half of the adaptive loop (Note: [each bucket its own plan])."""

    def _start_shape(self, tensors: list[torch.Tensor], shape: Shape, own: Bucket | None) -> None:
        """Make ``own`` (the step's bucket) or a new bucket the one in force, its plan pending: its own, the cache's,
        one searched on a profile scaled to its length, or (``state.needs_profile``) one searched on a profile of
        a step, taken by the forward pre-hook (Note: [each bucket its own plan])."""
        if self._bucket is not None:
            log.info("adaptive memory: input shapes changed to %s%s: %s", [list(t.shape) for t in tensors],
                     f" ({shape.bucket} tokens planned)" if shape.bucket else "", "its plan" if own else "planning")
        self._bucket = own or self.buckets.add(shape, Planner(self.solver), CacheEntry(self.cache, self.ranks))
        state = self.state = self._bucket.state
        self.planner, self.cache_entry = self._bucket.planner, self._bucket.cache_entry
        if own is not None:
            state.pending, state.kind = own.plan if own.plan is not self.plan else False, "bucket"
            return
        self.cache_entry.select(self.model, inputs=tensors, budget=self.budget, structure=self._structure,
                                parallel=layout_sizes(self.parallel, self.ranks, self.model), bucket=shape.bucket)
        cached = self.cache_entry.load()
        refs = self.buckets.references(shape)
        if cached is not None:
            self.cache_hits += 1
            state.kind = "cached"
            state.search = TargetSearch(lo=cached.target, hi=cached.target, target=cached.target, tolerance=0)
            state.converged_at = len(self.history) + 1
            state.pending = cached.plan
            log.info("adaptive memory: reusing the cached plan %s (target %s): no profiling",
                     self.cache_entry.path(), fmt_bytes(cached.target, exact=True))
        elif refs and self._search_scaled(shape, refs):  # a new bucket costs a search, not a profile
            state.kind = "bucket"
        else:  # profiled by the pre-hook, on the plain model (Note: [each bucket its own plan])
            state.pending = None
            state.needs_profile = True
            state.kind = "warmup"

    def _search_scaled(self, shape: Shape, refs: tuple[Any, ...]) -> bool:
        """Start the bucket's search on ``refs`` scaled to its length; False where one reference scaled refuses
        the budget: extrapolated from one length it may overstate the step (Note: [one reference refusing])."""
        try:
            self._search_on(scale_to_seq_len(refs, shape.bucket), overshoot=None)
        except AdaptiveBudgetError as exc:  # the steps so far fitted: name the length that does not
            taken = ", ".join(str(r.model["seq_len"]) for r in refs)
            if len(refs) == 1 and shape.seq_len is not None:
                log.info("adaptive memory: at %d tokens the profile at %s tokens scaled refuses the budget (%s): "
                         "profiling the step", shape.bucket, taken, exc)
                return False
            raise AdaptiveBudgetError(f"{exc}; at {shape.bucket} tokens (the profiles at {taken} tokens scaled): "
                                      f"expected a larger budget or shorter sequences") from None
        return True

    def _in_force(self, shape: Shape, *, now: bool, known: bool) -> None:
        """Apply the pending plan of the bucket just made the one in force, for this step, where ``now`` allows:
        the step then judges it. Under data parallelism a new bucket's plan, decided by one rank, comes at the
        step's end; until then the plan of the longest known bucket covering the step is in force."""
        state = self.state
        if now and state.needs_profile and self._handle is not None:
            self._apply(None)  # the plain model, profiled by the pre-hook at this step
        if not now or state.kind not in ("bucket", "cached") or state.pending is False:
            return
        if known or not self.ranks.active:
            log.info("adaptive memory: %s", describe_pending(state))
            self._apply(state.pending)
            state.pending = False
            if state.kind == "bucket":  # the step judges the bucket's plan; a cached plan's step stays "cached"
                state.kind = "steady" if state.converged else "adapt"
            return
        cover = self.buckets.covering(shape)
        if cover is not None and cover.plan is not self.plan:
            self._apply(cover.plan, of=cover)

    def _plan_from_profile(self, args: tuple, kwargs: dict) -> None:
        state = self.state
        state.needs_profile = False
        state.kind = "warmup"
        self.refusals.check_static(self.budget)
        start = time.perf_counter()
        prof = self.profiler.take(args, kwargs, self.budget)
        self.manager.set_profile(prof)
        if self.batch is not None:  # --adaptive-batch-size: the next global batch's micro-batch
            self.batch.observe(prof, self.budget - self.manager.prefetch_reserve)
        shape = self._shape
        self.buckets.measure(shape, prof)
        scaled = shape.bucket not in (None, shape.seq_len)  # the bucket's plans are for its longest length
        try:
            needed = self._search_on(scale_to_seq_len(prof, shape.bucket) if scaled else prof,
                                     overshoot=self.profiler.overshoot)
        except AdaptiveBudgetError as exc:
            if shape.bucket is None or len(self.buckets.buckets) == 1:
                raise
            raise AdaptiveBudgetError(f"{exc}; at {shape.bucket} tokens (profiled at {shape.seq_len} tokens): "
                                      "expected a larger budget or shorter sequences") from None
        log.info("adaptive memory: profiled the model in %.1f s: unoptimized peak %s, minimum feasible %s%s, "
                 "budget %s", time.perf_counter() - start, fmt_bytes(prof.peak_memory, exact=True),
                 fmt_bytes(needed, exact=True), f" at {shape.bucket} tokens" if scaled else "",
                 fmt_bytes(self.budget, exact=True))

    def _search_on(self, prof: Any, *, overshoot: Any) -> int:
        """Start the target search on ``prof`` (the profile its plans are for); the minimum feasible target."""
        from search import StepModel

        state = self.state
        host = self.host_budget or HostBudget.default()  # the planner knows where swaps spill to disk
        step_model = StepModel.build(prof, host_budget=host.limit)
        needed = self.refusals.check_minimum(step_model, self.budget, overshoot)
        self.planner.use(step_model, min_needed=needed)
        self._bucket.profile = prof
        tol = max(1, int(self.tolerance * self.budget))
        state.search = TargetSearch(lo=needed, hi=self.budget + 1, target=self.budget, tolerance=tol)
        # Note: [one decision per DP group]: the other ranks take the deciding rank's plan at the step's end
        state.pending = self.planner.solve(state.search.target) if self.ranks.decides else False
        return needed
