"""``calibrate``: what the executor's mechanisms cost in compute here, measured from real steps.

The simulator charges a swap its copies on the copy stream and an op-level recompute its replayed
ops. Two costs come on top where the device does not hide them (Note: [swap compute] in
docs/plan-format.md): on CPU the copy thread shares the cores and the memory bus with compute
(``hardware.swap_compute_bandwidth``), and a selective-checkpoint policy dispatches every op of
its layer in Python, in forward and replay (``hardware.sac_op_overhead``). This module measures
both: forward+backward steps of the plain model, of every layer swapped, and of one cheap unit
per layer recomputed op-level, interleaved; the slowdown beyond what the simulator already
charges is the cost. It also measures the swap store's disk tier (``hardware.disk_bandwidth``, the
file write/read bandwidth where spill files go: ``profiler.measure_disk``), and what one Python call of the
machinery costs (``hardware.dispatch_call_time``, ``hardware.hook_call_time``: Note: [machinery calls] in
``search/_machinery.py``): a chain of tiny ops under a pass-through dispatch mode, or pass-through saved-tensor
hooks, against the plain chain, the slowdown divided by the calls counted (``FOOTPRINT``). The swap and op-level
recompute costs are what remains of their slowdowns beyond those calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from profiler import Profile, measure_disk
from profiler.tracing import timed
from search import Action, Decision, Plan, machinery_calls, simulate

from adaptive_mem.runtime._apply import apply_plan
from adaptive_mem.runtime._footprint import FOOTPRINT

__all__ = ["calibrate"]

log = logging.getLogger(__name__)


def _step_seconds(bundle: Any, seed: int, device: torch.device) -> float:
    batch = bundle.batch(seed=seed)
    seconds = timed(lambda: bundle.loss(batch).backward(), device)
    for p in bundle.model.parameters():
        p.grad = None
    return seconds


def _cheapest_unit(profile: Profile, layer: int) -> str | None:
    """Name of the unit of ``layer`` with saved bytes whose recompute replays the least (each layer its own: the
    layers of a hybrid stack have different units, Note: [layer kinds])."""
    units = [u for u in profile.layer_units(layer) if u.saved_bytes > 0 and u.consumers
             and all(c.startswith(f"{profile.layer_path(layer)}.") for c in u.consumers)]
    return min(units, key=lambda u: u.fwd_time).name if units else None


def _plans(profile: Profile) -> dict[str, Plan]:
    layers = [profile.layer_path(i) for i in range(profile.num_layers)]
    plans = {"swap": Plan(decisions={name: Decision(Action.SWAP, backward_prefetch=1) for name in layers})}
    units = [_cheapest_unit(profile, i) for i in range(profile.num_layers)]
    if all(u is not None for u in units):
        plans["sac"] = Plan(decisions={unit: Decision(Action.RECOMPUTE) for unit in units})
    return plans


def _time_rounds(bundle: Any, plans: dict[str, Plan], pairs: int) -> tuple[dict[str, list[float]], list[int]]:
    """Step seconds of the plain model and of each of ``plans`` in ``pairs`` interleaved rounds, and the bytes each
    swapping step moved; the parameters' ``.grad`` restored afterwards."""
    device = next(bundle.model.parameters()).device
    grads = [(p, p.grad) for p in bundle.model.parameters()]
    times: dict[str, list[float]] = {"plain": [], **{name: [] for name in plans}}
    moved: list[int] = []
    # the plans' "Set ..." and "optimize: ..." lines, once per apply: calibration's own plans, not the user's
    quiet = [logging.getLogger(f"adaptive_mem.runtime.{name}") for name in ("_resolve", "_apply")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.WARNING)
    try:
        _step_seconds(bundle, 0, device)
        for k in range(1, pairs + 1):
            times["plain"].append(_step_seconds(bundle, k, device))
            for name, plan in plans.items():
                with apply_plan(bundle.model, plan=plan) as handle:
                    _step_seconds(bundle, k, device)  # untimed: the host pool, the layers' SAC traces
                    stats = handle.swap_stats
                    before = stats.offloaded_bytes if stats is not None else 0
                    times[name].append(_step_seconds(bundle, k, device))
                    if stats is not None:
                        moved.append(stats.offloaded_bytes - before)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        for p, g in grads:
            p.grad = g
    return times, moved


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that only counts: the least a runtime dispatch mode costs per op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        FOOTPRINT.dispatch += 1
        return func(*args, **(kwargs or {}))


def _pack(t: torch.Tensor) -> torch.Tensor:
    FOOTPRINT.pack += 1
    return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    FOOTPRINT.unpack += 1
    return t


def _chain(x: torch.Tensor, w: torch.Tensor, ops: int) -> torch.Tensor:
    y = x
    for _ in range(ops):
        y = y * w
    return y.sum()


def _timed_chain(x: torch.Tensor, w: torch.Tensor, ops: int, around: Any, backward: bool) -> tuple[float, int]:
    """Seconds of a chain of ``ops`` small multiplies (forward, or forward+backward) run inside ``around()`` (None:
    plain), and the machinery calls it counted."""
    def run() -> None:
        with contextlib.ExitStack() as stack:
            if not backward:
                stack.enter_context(torch.no_grad())
            if around is not None:
                stack.enter_context(around())
            loss = _chain(x, w, ops)
        if backward:
            loss.backward()
            w.grad = None
    FOOTPRINT.reset()
    seconds = timed(run, x.device)
    calls = FOOTPRINT.snapshot()
    return seconds, calls["dispatch"] + calls["pack"] + calls["unpack"]


def _call_costs(device: torch.device, rounds: int, ops: int = 2000) -> tuple[float, float]:
    """Seconds of one dispatch call and of one pack or unpack hook call (Note: [machinery calls]): a chain of
    ``ops`` multiplies of 16 numbers (the op itself next to nothing) timed plain and under a pass-through dispatch
    mode (forward), plain and under pass-through saved-tensor hooks (forward and backward); the least of ``rounds``
    interleaved runs of each (a busy machine only adds), the difference over the calls counted; 0 within noise."""
    x = torch.randn(16, device=device)
    w = torch.randn(16, device=device, requires_grad=True)
    hooks = lambda: torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)  # noqa: E731
    variants = {"plain": (None, False), "dispatch": (_PassThrough, False), "plain-bw": (None, True),
                "hooks": (hooks, True)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    calls: dict[str, int] = {}
    for _ in range(rounds + 1):  # the first round warms up
        for name, (around, backward) in variants.items():
            seconds, calls[name] = _timed_chain(x, w, ops, around, backward)
            times[name].append(seconds)
    least = {name: min(ts[1:]) for name, ts in times.items()}
    per_dispatch = max(0.0, least["dispatch"] - least["plain"]) / max(1, calls["dispatch"])
    per_hook = max(0.0, least["hooks"] - least["plain-bw"]) / max(1, calls["hooks"])
    log.info("calibrate: %.2f us per dispatch call, %.2f us per pack/unpack hook call", per_dispatch * 1e6,
             per_hook * 1e6)
    return per_dispatch, per_hook


def _swap_bandwidth(profile: Profile, plan: Plan, plain: float, times: list[float], moved: list[int]) -> float:
    """Bytes/s of swapped activations at which swapping takes compute time beyond its machinery's calls, 0 when
    free (``hardware.swap_compute_bandwidth``)."""
    calls = machinery_calls(profile, plan)
    hw = profile.hardware
    machinery = calls.dispatch * hw.dispatch_call_time + (calls.pack + calls.unpack) * hw.hook_call_time
    nbytes = statistics.median(moved) if moved else 0
    delta = statistics.median(times) - plain - machinery
    swap_bw = nbytes / delta if delta > 0 and nbytes > 0 else 0.0
    log.info("calibrate: swapping %.1f MiB per step took %+.4f s over a plain %.4f s step beyond %.4f s of calls: "
             "%s", nbytes / 2**20, delta, plain, machinery,
             f"{swap_bw / 1e9:.2f} GB/s charged to compute" if swap_bw else "free for compute")
    return float(swap_bw)


def calibrate(bundle: Any, profile: Profile, *, pairs: int = 3) -> Profile:
    """``profile`` with ``hardware.disk_bandwidth``, ``hardware.dispatch_call_time``, ``hardware.hook_call_time``,
    ``hardware.swap_compute_bandwidth`` and ``hardware.sac_op_overhead`` measured on ``bundle`` (a ModelBundle on a
    real device): medians of ``pairs`` interleaved rounds (the per-call costs: the least of twice as many, at least
    5); each plan is timed on its second step after being applied (the first fills the host pool and traces the
    layers). A profile without repeated layers keeps the swap and recompute costs at 0; a slowdown within noise
    (<= 0) gives 0."""
    if pairs < 1:
        raise ValueError(f"pairs={pairs}: expected an integer >= 1")
    if not profile.measured:
        return profile
    disk = measure_disk()
    log.info("calibrate: the swap store's disk tier writes and reads back at %.2f GB/s", disk / 1e9)
    device = next(bundle.model.parameters()).device
    per_dispatch, per_hook = _call_costs(device, max(5, 2 * pairs))
    profile = dataclasses.replace(profile, hardware=dataclasses.replace(
        profile.hardware, disk_bandwidth=disk, dispatch_call_time=per_dispatch, hook_call_time=per_hook))
    if profile.layer_container is None or profile.num_layers == 0:
        return profile
    plans = _plans(profile)
    times, moved = _time_rounds(bundle, plans, pairs)
    plain = statistics.median(times["plain"])
    hardware = dataclasses.replace(profile.hardware, swap_compute_bandwidth=0.0, sac_op_overhead=0.0)
    uncalibrated = dataclasses.replace(profile, hardware=hardware)
    base = simulate(uncalibrated, Plan()).step_time
    swap_bw = _swap_bandwidth(uncalibrated, plans["swap"], plain, times["swap"], moved)
    hardware = dataclasses.replace(hardware, swap_compute_bandwidth=swap_bw)
    overhead = 0.0
    if "sac" in plans:
        # what the simulator charges already: the replay and the machinery's calls
        replay = simulate(uncalibrated, plans["sac"]).step_time - base
        ops = sum(len(u.ops) for u in profile.units if u.layer is not None)
        extra = statistics.median(times["sac"]) - plain - replay
        overhead = max(0.0, extra / ops) if ops else 0.0
        log.info("calibrate: op-level recompute in every layer took %+.4f s beyond its replay and calls (%.4f s): "
                 "%.1f us per op under the selective-checkpoint policy", extra, replay, overhead * 1e6)
    hardware = dataclasses.replace(hardware, sac_op_overhead=float(overhead))
    return dataclasses.replace(profile, hardware=hardware)
