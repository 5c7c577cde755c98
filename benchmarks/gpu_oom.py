"""The GPU check's ``oom`` section: the adaptive loop under a per-process memory fraction with the caching
allocator's out-of-memory observer (``pluggable_allocator=True``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from _gpu_common import RUN, _cuda, compare, section, seeded_step
from adaptive_mem import DeviceMemory, adaptive_optimize, build_model


@contextlib.contextmanager
def capped(cap: int):
    """Device memory capped at ``cap`` bytes: a per-process fraction on CUDA, a ``DeviceMemory`` cap on a CPU smoke run."""
    if RUN.device != "cuda":
        with DeviceMemory(cap=cap):
            yield
        return
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _peaks(bundle, batch) -> tuple[int, int]:
    """(plain peak, live bytes between steps) of one step."""
    if RUN.device != "cuda":
        with DeviceMemory() as mem:
            seeded_step(bundle, batch)
            return mem.peak, mem.live
    _cuda("synchronize")
    _cuda("reset_peak_memory_stats")
    seeded_step(bundle, batch)
    return _cuda("max_memory_allocated"), _cuda("memory_allocated")


@section("oom")
def check_oom() -> dict:
    spec, sizes = ("llama-small", dict(batch_size=2, seq_len=2048)) if RUN.device == "cuda" else ("llama-tiny", {})
    bundle = build_model(spec, device=RUN.device, seed=0, **sizes)
    batch = bundle.batch(seed=0)
    ref = seeded_step(bundle, batch)
    plain_peak, static = _peaks(bundle, batch)
    copies = sum(p.numel() * p.element_size() for p in bundle.model.parameters()) if RUN.device != "cuda" else 0
    out = RUN.results["oom"] = {"plain_peak_MiB": plain_peak / 2**20, "static_MiB": static / 2**20}
    torch.use_deterministic_algorithms(True, warn_only=True)  # gradients compared bit for bit
    for share in (0.8, 0.6):
        cap = static + copies + int(share * (plain_peak - static))  # on a CPU smoke run the gradients' copies count
        try:
            out[f"cap {share:.0%}"] = _loop_under(bundle, batch, ref, cap)
        except Exception as exc:
            out[f"cap {share:.0%}"] = {"cap_MiB": cap / 2**20, "error": f"{type(exc).__name__}: {exc}"[:800]}
    torch.use_deterministic_algorithms(False)
    return out


def _loop_under(bundle, batch, ref, cap: int) -> dict:
    """The plain step, then 8 steps of the adaptive loop, under ``cap`` device bytes."""
    out: dict[str, Any] = {"cap_MiB": cap / 2**20}
    with capped(cap):
        try:
            seeded_step(bundle, batch)
            out["plain_under_cap"] = "no OOM (cap not binding)"
        except torch.OutOfMemoryError:
            out["plain_under_cap"] = "OOM as expected"
    rows = out["steps"] = []
    with capped(cap), adaptive_optimize(bundle.model, budget=cap, optimizer="sgd", pluggable_allocator=True,
                                        cache=False) as mem:
        seen = out["at_exhausted"] = []
        exhausted = mem.manager.exhausted

        def spy(needed: int, budget: Any) -> Any:  # the manager's view where it gives up
            groups = mem.manager.groups()
            seen.append({"needed": needed, "groups": len(groups), "candidates": len(mem.manager.policy.candidates(groups)),
                         "on_device_MiB": sum(g.nbytes for g in groups if g.record is None) / 2**20,
                         "positions": sorted({g.layer for g in groups})[:12]})
            return exhausted(needed, budget)
        mem.manager.exhausted = spy
        try:
            for step in range(8):
                _cuda("reset_peak_memory_stats")
                row = compare(seeded_step(bundle, batch), ref, exact=False)
                rows.append({"step": step, "ok": row["ok"], "equal": row["equal"], "diff": row["max_abs_diff"],
                             "peak_MiB": _cuda("max_memory_allocated") / 2**20})
            out["summary"] = mem.summary()
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"[:600]
        manager = mem.manager
        groups = manager.groups()
        out["manager"] = {"stats": repr(manager.stats)[:600], "hook": type(mem.hook).__name__,
                          "groups": len(groups), "group_MiB": sum(g.nbytes for g in groups) / 2**20,
                          "candidates": len(manager.policy.candidates(groups)),
                          "copier": type(manager.engine.copier).__name__}
    return out
