"""The adaptive loop's plans per sequence-length bucket: which bucket a step's inputs fall in, which bucket's plan
it runs under, and what the loop keeps for each bucket (its target search, planner, cache entry and profile).

A step's length is ``runtime._buckets.seq_len_of`` of its inputs (dim 1 of ``input_ids`` ``[batch, seq]``; packed
sequences: the total tokens). Its bucket is ``search.planning.seq_len_bucket`` of the length (powers of
two, or the lengths given); with a maximum length there is one bucket, the maximum. A bucket's plans are searched
for the bucket's length, the longest it holds. Inputs without a length are a bucket of their exact shapes.

Note: [each bucket its own plan] a step runs under its own bucket's plan. The loop decides the step's bucket
before the model's call runs any hook (``AdaptiveMemory.pick``, called by the model's class ``__call__`` as
``runtime._buckets`` does for plan files): a forward runs the pre-hooks its module had when the call began, so a plan
switched in from a forward pre-hook would miss its own root pre-hooks (the swap engine's begin-forward) and run the
removed plan's. A bucket's plan, once it has one, is switched in at the step where the bucket changes, and only
then; a new bucket's plan (the cache's, or searched on a profile already taken scaled to its length) is applied for
its first step, which then judges it: at most one rescued step per new bucket (the scaled plan's own error), none
with a maximum length, planned from the first step on. Memory is monotone in sequence length, so a shorter bucket's
plan keeps more and runs faster than a longer one's under the same budget. Plans are never switched while an
earlier forward still awaits its backward (its saved tensors need the plan they were saved under): that step keeps
the plan in force and its bucket's comes at the step's end. Under data parallelism a new bucket's plan is decided
by one rank and shared at the step's end (Note: [one decision per DP group]); that step runs under the plan of the
longest known bucket covering it. A new shape that no profile scales to (another batch size) is profiled on the
plain model, the plan in force taken off before its call (where a forward awaits its backward, at its next step).

Note: [one reference refusing] a profile scaled from one shorter length can overstate what a much longer step holds
at its peak: one length cannot tell every part of the workspace apart (Note: [workspace parts]: a workspace of up
to 1.5 times the loss's estimate is scaled whole, a part of it constant), and a budget the step fits may be
refused. Where one reference scaled refuses the budget, the step is profiled instead (its own length, nearer); two
references scaled refusing it, or the step's own profile, refuse it, naming the length. Guarded by
tests/test_adaptive_shapes.py.

Note: [longer than the maximum] a step longer than ``--max-seq-len`` (or the largest of ``--seq-len-buckets``) is an
error before its forward, not a warning: the one plan was searched for the maximum, a longer step could run out of
memory or be rescued every time, and a length past the declared maximum is most often a data bug (no truncation).

Note: [one bucket per DP group] the data-parallel ranks run one plan (Note: [one decision per DP group]) and decide
together after each step, yet dynamic padding gives each rank its own length: the bucket and the search moves
follow the group's longest length of the step (one all-reduce of it per step), so every rank takes the same
bucket and the same decision; a rank's own length only names its inputs' shapes and its profiles.

Note: [clean steps below the longest] a step without rescues shows that its plan fits at the step's length, not at
a longer one: only a clean step at the longest length its bucket has run moves (relaxes or converges) the bucket's
target search; a rescue at any length tightens it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from adaptive_mem.runtime._buckets import seq_len_of
from ._planner import Planner
from ._target_search import SearchState

__all__ = ["Shape", "Bucket", "ShapeBuckets", "bucketed_shape", "check_seq_lens"]


def bucketed_shape(shape: Sequence[int], seq_len: int | None, bucket: int | None) -> list[int]:
    """``shape`` with each dim past the batch that equals ``seq_len`` made ``bucket`` (the shape the plan is for)."""
    if seq_len is None or bucket is None:
        return [int(d) for d in shape]
    return [bucket if i > 0 and d == seq_len else int(d) for i, d in enumerate(shape)]


def check_seq_lens(seq_len_buckets: Any, max_seq_len: Any) -> tuple[tuple[int, ...] | None, int | None]:
    """``--seq-len-buckets`` (``"128,256"`` or ints) and ``--max-seq-len`` checked; ValueError for bad ones."""
    if seq_len_buckets is not None and max_seq_len is not None:
        raise ValueError(f"--seq-len-buckets={seq_len_buckets!r} with --max-seq-len={max_seq_len!r}: expected one "
                         "of them (a maximum length plans one bucket)")
    if max_seq_len is not None:
        if isinstance(max_seq_len, str) and max_seq_len.strip().isdigit():
            max_seq_len = int(max_seq_len)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
            raise ValueError(f"--max-seq-len={max_seq_len!r}: expected a positive number of tokens")
    if seq_len_buckets is None:
        return None, max_seq_len
    from search.planning import parse_seq_lens

    return parse_seq_lens(seq_len_buckets, key="--seq-len-buckets"), None


@dataclass(frozen=True)
class Shape:
    """What a step's inputs are planned as."""

    key: tuple
    """The inputs' shapes (their length made the bucket's) and dtypes: the steps of one bucket share it."""
    form: tuple
    """The inputs' shapes with their length left out: buckets of one form differ in length only."""
    seq_len: int | None
    """The step's sequence length (None: no integer input of two dims)."""
    group_len: int | None
    """The longest of the step's lengths over the data-parallel group (Note: [one bucket per DP group])."""
    bucket: int | None
    """The length the bucket's plans are for (None: the exact shapes)."""


@dataclass
class Bucket:
    """What the loop keeps for one bucket."""

    shape: Shape
    """The shape of its first step."""
    state: SearchState
    planner: Planner
    cache_entry: Any
    """Its ``_plan_cache.CacheEntry``."""
    profile: Any = None
    """The profile its plans are searched on (taken, or scaled from another length; None before it)."""
    plan: Any = False
    """The plan applied for it last (None: the plain model; False: none yet)."""
    longest: int = 0
    """The longest sequence length run under its plan (Note: [clean steps below the longest])."""


@dataclass
class ShapeBuckets:
    """The buckets seen so far, bounded by ``lengths`` (None: powers of two) or one ``max_seq_len``."""

    lengths: tuple[int, ...] | None = None
    max_seq_len: int | None = None
    buckets: dict[tuple, Bucket] = field(default_factory=dict)
    measured: dict[tuple, dict[int, Any]] = field(default_factory=dict)
    """Profiles taken, per form, by the sequence length they were taken at."""

    def shape(self, tensors: Sequence[torch.Tensor], ranks: Any) -> Shape:
        """The :class:`Shape` of a step on ``tensors`` (its inputs flattened) in the group of ``ranks`` (a
        ``_ranks.RankGroup``); a length past the largest bucket raises a ValueError."""
        from search.planning import SeqLenBucketError, seq_len_bucket

        seq_len = group_len = seq_len_of(tuple(tensors))
        bucket = None
        if seq_len is not None and ranks.active:  # Note: [one bucket per DP group]
            group_len = ranks.reduce_max([seq_len])[0]
        if seq_len is not None:
            lengths = (self.max_seq_len,) if self.max_seq_len is not None else self.lengths
            try:
                bucket = seq_len_bucket(group_len, lengths)
            except SeqLenBucketError:  # Note: [longer than the maximum]
                if lengths is None or group_len <= 0:
                    raise
                flag = "--max-seq-len" if self.max_seq_len is not None else "--seq-len-buckets"
                raise SeqLenBucketError(f"{flag}={','.join(map(str, lengths))}: a step of {group_len} tokens; expected "
                                        f"at most {lengths[-1]} (a larger {flag}, or shorter inputs)") from None
        key = tuple((tuple(bucketed_shape(t.shape, seq_len, bucket)), t.dtype) for t in tensors)
        form = tuple((tuple(bucketed_shape(t.shape, seq_len, -1)), t.dtype) for t in tensors)
        return Shape(key=key, form=form, seq_len=seq_len, group_len=group_len, bucket=bucket)

    def own(self, shape: Shape) -> Bucket | None:
        """The bucket of a step of ``shape`` (None: a new one) (Note: [each bucket its own plan])."""
        return self.buckets.get(shape.key)

    def covering(self, shape: Shape) -> Bucket | None:
        """The longest bucket with a plan whose plan fits a step of ``shape`` (its form, at least its length)."""
        return max((b for b in self.buckets.values() if b.plan is not False and self._covers(b, shape)),
                   key=lambda b: b.shape.bucket or 0, default=None)

    @staticmethod
    def _covers(bucket: Bucket, shape: Shape) -> bool:
        if shape.bucket is None or bucket.shape.bucket is None:
            return bucket.shape.key == shape.key
        return bucket.shape.form == shape.form and bucket.shape.bucket >= shape.bucket

    def add(self, shape: Shape, planner: Planner, cache_entry: Any) -> Bucket:
        """A new bucket for ``shape``, planned with ``planner``, cached in ``cache_entry``."""
        bucket = self.buckets[shape.key] = Bucket(shape, SearchState(), planner, cache_entry)
        return bucket

    def drop(self, bucket: Bucket) -> None:
        """Forget ``bucket`` where it never got a plan (its first step failed)."""
        if bucket.state.search is None and self.buckets.get(bucket.shape.key) is bucket:
            del self.buckets[bucket.shape.key]

    def measure(self, shape: Shape, profile: Any) -> None:
        """Keep ``profile``, taken on a step of ``shape``, to scale to other lengths."""
        if shape.seq_len is not None:
            profile.model["seq_len"] = shape.seq_len  # the live model records no length: scaling starts from it
            self.measured.setdefault(shape.form, {})[shape.seq_len] = profile

    def references(self, shape: Shape) -> tuple[Any, ...]:
        """Up to two profiles of ``shape``'s form to scale to its bucket: the longest ones (() for none)."""
        taken = self.measured.get(shape.form, {}) if shape.bucket is not None else {}
        return tuple(taken[n] for n in sorted(taken, reverse=True)[:2])

    def informs(self, shape: Shape, bucket: Bucket, rescued: bool) -> bool:
        """Whether a step of ``shape`` moves ``bucket``'s target search (Note: [clean steps below the longest])."""
        return rescued or shape.group_len is None or shape.group_len >= bucket.longest

    def converged_at(self) -> int | None:
        """The step after which every bucket's target stopped moving (None while one is searching)."""
        steps = [b.state.converged_at for b in self.buckets.values()]
        return max(steps) if steps and None not in steps else None
