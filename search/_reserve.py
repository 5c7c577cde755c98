"""The CUDA caching allocator's reserve over allocated bytes.

Note: [allocator reserve]. PyTorch's ``CUDACachingAllocator`` (``c10/cuda/CUDACachingAllocator.cpp``, its
constants in ``c10/core/AllocatorConfig.h``) never hands a freed block back to the driver during a step: it
caches it. Every request is rounded up to a multiple of 512 B (``round_size``, at least 512 B). Requests of at
most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the large pool, whose
segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB above
(``get_allocation_size``). A request takes the smallest cached free block of its pool that fits (best fit)
and splits off the remainder when it is at least 512 B (small pool) or more than 1 MiB (large pool)
(``should_split``); a freed block merges with its free neighbours of the same segment. What ``cudaMalloc``
mapped (``memory_reserved``) only grows: :func:`replay_reserved` replays a hand-made sequence this way.

The simulator has the step's bytes over time, not its single tensors, so a plan's reserve is modelled
(:func:`reserve_model`): the allocated peak rounded up to the 2 MiB granule, plus one segment of the largest
allocation (at the peak, a request that no cached free block fits maps a segment of its own while the
blocks that did not fit stay cached), plus one small-pool segment. With ``expandable_segments:True`` a
segment grows by 2 MiB pages and freed pages are reused, so the reserve is the rounded peak and one small
segment. Off CUDA the reserve is the allocated peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from profiler import is_cuda_hardware

if TYPE_CHECKING:
    from ._model import StepModel

__all__ = ["ReserveError", "replay_reserved", "reserve_model", "reserved_at_peak", "round_size", "segment_size"]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


class ReserveError(ValueError):
    """A malformed allocation sequence."""


def _ceil(n: int, step: int) -> int:
    return -(-n // step) * step


def round_size(nbytes: int) -> int:
    """Bytes the allocator gives a request of ``nbytes``: a multiple of 512, at least 512."""
    return max(MIN_BLOCK, _ceil(nbytes, MIN_BLOCK))


def segment_size(nbytes: int) -> int:
    """Bytes ``cudaMalloc`` maps when no cached block fits a (rounded) request of ``nbytes``."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return _ceil(nbytes, ROUND_LARGE)


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


class _Pool:
    """One pool's segments as ordered block lists: best fit, split, merge (Note: [allocator reserve])."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.segments: list[list[_Block]] = []

    def malloc(self, size: int) -> _Block:
        fits = [b for seg in self.segments for b in seg if b.free and b.size >= size]
        if not fits:
            self.segments.append([_Block(len(self.segments), 0, segment_size(size))])
            fits = self.segments[-1]
        block = min(fits, key=lambda b: (b.size, b.segment, b.offset))
        rest = block.size - size
        if rest >= MIN_BLOCK if self.small else rest > SMALL_SIZE:
            seg = self.segments[block.segment]
            seg.insert(seg.index(block) + 1, _Block(block.segment, block.offset + size, rest))
            block.size = size
        block.free = False
        return block

    def free(self, block: _Block) -> None:
        seg = self.segments[block.segment]
        block.free = True
        i = seg.index(block)
        if i + 1 < len(seg) and seg[i + 1].free:
            block.size += seg.pop(i + 1).size
        if i > 0 and seg[i - 1].free:
            seg[i - 1].size += seg.pop(i).size

    @property
    def reserved(self) -> int:
        return sum(b.size for seg in self.segments for b in seg)


def replay_reserved(sequence: Iterable[tuple[str, int]]) -> tuple[int, int]:
    """``(peak allocated, reserved)`` bytes after replaying ``sequence`` on the caching allocator's rules.

    ``sequence``: ``("malloc", nbytes)`` allocates (its handle is its position among the mallocs, from 0);
    ``("free", handle)`` frees that allocation. Allocated bytes are the rounded sizes (``allocated_bytes``).
    """
    pools = {True: _Pool(small=True), False: _Pool(small=False)}
    live: dict[int, tuple[_Pool, _Block]] = {}
    count = allocated = peak = 0
    for step, (what, value) in enumerate(sequence):
        if what == "malloc" and isinstance(value, int) and value > 0:
            size = round_size(value)
            pool = pools[size <= SMALL_SIZE]
            live[count] = (pool, pool.malloc(size))
            count += 1
            allocated += size
            peak = max(peak, allocated)
        elif what == "free" and value in live:
            pool, block = live.pop(value)
            allocated -= block.size
            pool.free(block)
        else:
            raise ReserveError(f"sequence[{step}]={(what, value)!r}: expected ('malloc', bytes > 0) or "
                               "('free', handle of a live malloc)")
    return peak, pools[True].reserved + pools[False].reserved


def reserve_model(peak: int, largest: int, *, expandable_segments: bool = False) -> int:
    """Modelled reserved bytes of a step whose allocated peak is ``peak`` and whose largest single allocation is
    ``largest`` bytes (Note: [allocator reserve]); at least ``peak``."""
    if peak < 0 or largest < 0:
        raise ReserveError(f"peak={peak}, largest={largest}: expected bytes >= 0")
    rounded = _ceil(peak, ROUND_LARGE)
    if expandable_segments or largest == 0:
        return rounded + SMALL_BUFFER
    return rounded + segment_size(round_size(largest)) + SMALL_BUFFER


def reserved_at_peak(model: "StepModel", peak: int) -> int:
    """Reserved bytes of a simulated step of ``model`` at its allocated ``peak``: :func:`reserve_model` with the
    profile's largest op output on a CUDA hardware target, ``peak`` elsewhere (Note: [allocator reserve])."""
    if not is_cuda_hardware(model.hardware.name):
        return peak
    return reserve_model(peak, model.largest_allocation)
