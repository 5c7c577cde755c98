"""Offload and reload as graph ops: the two custom ops a compiled graph calls to swap a saved activation.

``adaptive_mem::offload(t, key)`` copies ``t`` into host memory and returns the host copy; the graph drops
``t`` after it (it is the last forward use), so its device bytes are freed there. ``adaptive_mem::reload(h,
key, device, after)`` copies ``h`` back into new device memory; ``after`` lists graph values the reload
waits for, which is how the graph pass places it at the plan's prefetch distance (Note: [graph swap
placement] in ``_graph_swap.py``). Both are functional (no aliasing, no mutation), with fake
implementations, so AOT autograd, the partitioners and inductor treat them like any op; neither has an
autograd formula (they run inside the forward and backward graphs, never under autograd).

Note: [host side of graph swaps]. On CPU, where host and device are one RAM, the host copy is allocated
inside :func:`host_allocations` (marked host, never counted as device memory by ``DeviceMemory``), so the
bytes really leave the accounted memory, as the eager swap engine's host store does. On an accelerator the
host copy is pinned and both copies run on one side stream: the forward's default stream goes on while the
offload copies, and the backward's stream waits for a reload only at the reload (run on an H200, torch 2.11:
exact per block, within 2.1e-9 of the compiled plain step whole-model; the overlap itself not measured there).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.library import custom_op

from ._host_marks import host_allocations

__all__ = ["GraphSwapStats", "count_into", "graph_swap_stats", "offload", "reload"]


@dataclass
class GraphSwapStats:
    """Bytes the graph ops moved while this record was active (:func:`graph_swap_stats`)."""

    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    offloads: int = 0
    reloads: int = 0


_local = threading.local()
_streams: dict[torch.device, torch.Stream] = {}


@contextlib.contextmanager
def graph_swap_stats() -> Iterator[GraphSwapStats]:
    """Count what the graph ops move in this block (on this thread)."""
    previous = getattr(_local, "stats", None)
    _local.stats = stats = GraphSwapStats()
    try:
        yield stats
    finally:
        _local.stats = previous


_sinks: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
"""Per key suffix (``<unit>@<owner>``): the stats of the plan whose graphs carry those keys (weak: they go with
their engine)."""


def count_into(owner: str, stats: object | None) -> None:
    """Count the bytes of graph ops whose key ends in ``@owner`` into ``stats`` (anything with
    ``offloaded_bytes`` and ``reloaded_bytes``); None stops it."""
    if stats is None:
        _sinks.pop(owner, None)
    else:
        _sinks[owner] = stats


def _count(key: str, nbytes: int, *, out: bool) -> None:
    sink = _sinks.get(key.rpartition("@")[2]) if "@" in key else None
    if sink is not None:
        if out:
            sink.offloaded_bytes += nbytes
        else:
            sink.reloaded_bytes += nbytes
    stats = getattr(_local, "stats", None)
    if stats is None:
        return
    if out:
        stats.offloaded_bytes += nbytes
        stats.offloads += 1
    else:
        stats.reloaded_bytes += nbytes
        stats.reloads += 1


def _side_stream(device: torch.device) -> torch.Stream:
    if device not in _streams:
        _streams[device] = torch.Stream(device=device)
    return _streams[device]


@custom_op("adaptive_mem::offload", mutates_args=())
def offload(t: torch.Tensor, key: str) -> torch.Tensor:
    """A host copy of ``t`` (Note: [host side of graph swaps]); ``key`` names the saved activation."""
    if t.device.type == "cpu":
        with host_allocations():
            host = torch.empty_like(t)  # the same strides (a dense tensor: Note: [graph swap placement])
        host.copy_(t)
    else:  # an accelerator (run on an H200)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        stream = _side_stream(t.device)
        stream.wait_stream(torch.accelerator.current_stream(t.device))
        with torch.accelerator.stream(stream) if hasattr(torch.accelerator, "stream") else torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)
        stream.synchronize()  # the host copy is read only in backward, but must be whole before then
    _count(key, t.numel() * t.element_size(), out=True)
    return host


@offload.register_fake
def _offload_fake(t: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(t, device="cpu")


@custom_op("adaptive_mem::reload", mutates_args=())
def reload(host: torch.Tensor, key: str, device: torch.device, after: list[torch.Tensor]) -> torch.Tensor:
    """``host`` copied back into new memory on ``device``; ``after``: values this reload is ordered after."""
    device = torch.device(device)
    if device.type == "cpu":
        out = torch.empty_like(host)
        out.copy_(host)
    else:  # an accelerator (run on an H200)
        out = torch.empty_like(host, device=device)
        stream = _side_stream(device)
        stream.wait_stream(torch.accelerator.current_stream(device))
        with torch.cuda.stream(stream):
            out.copy_(host, non_blocking=True)
        torch.accelerator.current_stream(device).wait_stream(stream)
        out.record_stream(torch.accelerator.current_stream(device))
    _count(key, host.numel() * host.element_size(), out=False)
    return out


@reload.register_fake
def _reload_fake(host: torch.Tensor, key: str, device: torch.device, after: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(host, device=device)
