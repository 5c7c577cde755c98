"""``calibrate_swap``: how much compute a swap really costs here, measured from real steps.

The simulator charges a swap its copies on the copy stream; where copies are not free for
compute (on CPU the copy thread shares the cores and the memory bus, Note: [swap compute] in
docs/plan-format.md) it also charges bytes / ``hardware.swap_compute_bandwidth``. This module
measures that bandwidth: forward+backward steps of the plain model and of the model with every
layer swapped, interleaved, and the slowdown per swapped byte.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

import torch

from profiler import Profile
from search import Action, Decision, Plan

__all__ = ["calibrate_swap"]

log = logging.getLogger(__name__)


def _step_seconds(bundle: Any, seed: int, device: torch.device) -> float:
    batch = bundle.batch(seed=seed)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    start = time.perf_counter()
    bundle.loss(batch).backward()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    seconds = time.perf_counter() - start
    for p in bundle.model.parameters():
        p.grad = None
    return seconds


def calibrate_swap(bundle: Any, profile: Profile, *, pairs: int = 3) -> Profile:
    """``profile`` with ``hardware.swap_compute_bandwidth`` measured on ``bundle`` (a ModelBundle on a real
    device): the median of ``pairs`` interleaved plain / swap-every-layer steps, after one warm-up each.
    A profile without repeated layers, or a slowdown within noise (<= 0), keeps 0 (copies are free)."""
    from ._optimize import optimize

    if pairs < 1:
        raise ValueError(f"pairs={pairs}: expected an integer >= 1")
    if profile.layer_container is None or profile.num_layers == 0 or not profile.measured:
        return profile
    device = next(bundle.model.parameters()).device
    plan = Plan(decisions={f"{profile.layer_container}.{i}": Decision(Action.SWAP, backward_prefetch=1)
                           for i in range(profile.num_layers)})
    grads = [(p, p.grad) for p in bundle.model.parameters()]
    plain, swapped, moved = [], [], []
    quiet = logging.getLogger("adaptive_mem._resolve")  # the plan's "Set layer swap" lines, once per apply
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        _step_seconds(bundle, 0, device)
        for k in range(pairs + 1):
            if k:
                plain.append(_step_seconds(bundle, k, device))
            with optimize(bundle.model, plan=plan) as handle:
                before = handle.swap_stats.offloaded_bytes
                seconds = _step_seconds(bundle, k, device)
                if k:  # the first swapped step fills the host pool: warm-up
                    swapped.append(seconds)
                    moved.append(handle.swap_stats.offloaded_bytes - before)
    finally:
        quiet.setLevel(level)
        for p, g in grads:
            p.grad = g
    delta = statistics.median(swapped) - statistics.median(plain)
    nbytes = statistics.median(moved)
    bandwidth = nbytes / delta if delta > 0 and nbytes > 0 else 0.0
    log.info("swap compute: swapping %.1f MiB per step took %+.4f s over a plain %.4f s step: %s",
             nbytes / 2**20, delta, statistics.median(plain),
             f"{bandwidth / 1e9:.2f} GB/s charged to compute" if bandwidth else "free for compute")
    hardware = dataclasses.replace(profile.hardware, swap_compute_bandwidth=float(bandwidth))
    return dataclasses.replace(profile, hardware=hardware)
