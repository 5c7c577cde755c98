"""The adaptive loop across data-parallel ranks: one decision per DP group, taken on its first rank and
broadcast, on what the whole group measured.

Every rank of a DP group runs the same step, so it must run the same plan: DDP and FSDP reduce
gradients per bucket or layer, and a plan that swaps on one rank and keeps on the other changes only
speed, but a plan switch on one rank alone lets the ranks' steps drift apart in time and memory.
:class:`RankGroup` holds the group and the three collectives the loop issues at a step boundary, in
the same order on every rank (Note: [one decision per DP group], guarded by
tests/test_parallel_adaptive.py::test_rescue_on_one_rank_replans_both_at_the_same_step):

1. at the first step of an input shape, the plan cache is read on the deciding rank and its entry
   (or the miss) broadcast, so either all ranks profile or none does;
2. after every step, :meth:`RankGroup.reduce_max` of (peak, rescues, retries): a rescue on one rank is
   a rescue of the group;
3. then the deciding rank's decision (the plan to apply, the search state, the log line) is broadcast
   with ``broadcast_object_list``; every rank applies it before its next forward.

Pipeline stages pass the DP group of their stage (``dp_group=``): each stage decides for itself.
Without ``torch.distributed`` initialised, or with a group of one rank, nothing is exchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from adaptive_mem.runtime._accounting import host_allocations

if TYPE_CHECKING:
    from ._plan_cache import CachedPlan, PlanCache
    from ._target_search import SearchState, StepRecord

__all__ = ["RankGroup", "share_decision"]


class RankGroup:
    """The data-parallel group the adaptive loop agrees over (``group`` None: this process alone)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.size = 1
        self.rank = 0
        self.decider = 0
        """Global rank of the group's first rank: the one that decides and writes the plan cache."""
        self.members: list[int] = []
        if group is not None:
            import torch.distributed as dist

            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            self.members = sorted(dist.get_process_group_ranks(group))
            self.decider = self.members[0]

    @classmethod
    def resolve(cls, dp_group: Any) -> "RankGroup":
        """``dp_group`` or, under an initialised ``torch.distributed``, the world group."""
        dist = torch.distributed
        ready = dist.is_available() and dist.is_initialized()
        if dp_group is not None and not ready:
            raise ValueError(f"dp_group={dp_group!r}: torch.distributed is not initialised; expected "
                             "init_process_group() before adaptive_optimize, or dp_group=None")
        if not ready:
            return cls(None)
        return cls(dp_group if dp_group is not None else dist.group.WORLD)

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def decides(self) -> bool:
        return self.rank == 0

    def layout(self) -> dict[str, Any]:
        """What the plan cache key adds for this rank's layout: world size, DP size and which DP group."""
        dist = torch.distributed
        if self.group is None:
            return {}
        return {"world": dist.get_world_size(), "dp": self.size, "dp_ranks": self.members}

    def _device(self) -> torch.device:
        backend = torch.distributed.get_backend(self.group)
        if "nccl" in str(backend):  # unverified on GPU
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def reduce_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the group."""
        if not self.active:
            return list(values)
        with host_allocations():  # the exchange's buffers are no device memory of the step
            t = torch.tensor(values, dtype=torch.int64, device=self._device())
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
            return [int(v) for v in t.tolist()]

    def broadcast(self, obj: Any) -> Any:
        """The deciding rank's ``obj`` on every rank of the group."""
        if not self.active:
            return obj
        box = [obj if self.decides else None]
        with host_allocations():
            torch.distributed.broadcast_object_list(box, src=self.decider, group=self.group,
                                                    device=self._device())
        return box[0]

    def reduce_record(self, record: "StepRecord") -> None:
        """Turn ``record``'s peak, rescues and retries into the group's maxima, keeping this rank's own."""
        if not self.active:
            return
        record.local_peak, record.local_rescues = record.peak, record.rescues
        peak, record.rescues, record.retries = self.reduce_max(
            [record.peak if record.peak is not None else -1, record.rescues, record.retries])
        record.peak = peak if peak >= 0 else None

    def agree_on_cache(self, cache: "PlanCache | None", key: str) -> "CachedPlan | None":
        """The deciding rank's cache entry for ``key`` (or its miss); refuses a group whose ranks differ in key."""
        if not self.active:
            return cache.load(key) if cache is not None else None
        keys: list[Any] = [None] * self.size
        with host_allocations():
            torch.distributed.all_gather_object(keys, key, group=self.group)
        if len(set(keys)) > 1:
            raise ValueError(f"dp_group={self.members}: its ranks step different models or input shapes (plan cache "
                             f"keys {keys}); expected the ranks holding the same pipeline stage with the same inputs "
                             "(dp_group= per stage)")
        return self.broadcast(cache.load(key) if cache is not None and self.decides else None)


def share_decision(ranks: RankGroup, state: "SearchState", record: "StepRecord") -> None:
    """Give every rank of ``ranks`` the deciding rank's decision after ``record``'s step: its ``state``
    (what to apply, the search, whether the next step profiles) and the decision's log line."""
    search = state.search
    shared = ranks.broadcast({
        "pending": state.pending, "decision": record.decision, "converged_at": state.converged_at,
        "needs_profile": state.needs_profile,
        "search": None if search is None else (search.lo, search.hi, search.target, search.tolerance)})
    if ranks.decides:
        return
    state.pending, record.decision = shared["pending"], shared["decision"]
    state.converged_at, state.needs_profile = shared["converged_at"], shared["needs_profile"]
    if shared["search"] is not None:
        from ._target_search import TargetSearch

        lo, hi, target, tolerance = shared["search"]
        state.search = TargetSearch(lo=lo, hi=hi, target=target, tolerance=tolerance)
