"""PyTorch's own memory tools as bench policies: ``torch.compile`` with an activation memory
budget, and the per-module SAC MILP of ``torch.distributed._tools.sac_ilp``."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

import torch

from ._policy_base import Applied, Policy, _checkpointed, _undo_all, _wrap_forward, compile_whole_model, layers_of

__all__ = ["CompileBudget", "FullCompiled", "SacIlp"]

log = logging.getLogger(__name__)


class CompileBudget(Policy):
    name = "compile"
    label = ("torch.compile ({backend} backend, whole model) with torch._functorch.config.activation_memory_budget "
             "at the budget fraction")
    budgeted = True
    eager = False

    def label_for(self, backend: str) -> str:
        return self.label.format(backend=backend)

    def prepare(self, ctx: Any, budget: float | None) -> dict[str, Any]:
        return {"budget_bytes": ctx.budget_bytes(budget)}

    def apply(self, bundle, optimizer, job):
        # inductor (the default) is what a user picks; aot_eager (--compile-backend) runs the same min-cut
        # partitioner, where the budget acts, without inductor's codegen: seconds to compile, eager kernels.
        backend = job.get("compile_backend", "inductor")
        compiled, undo = compile_whole_model(bundle.model, backend=backend, budget=job["budget"])
        return Applied(dataclasses.replace(bundle, model=compiled), undo, info={"backend": backend})


class FullCompiled(Policy):
    name = "full+compile"
    label = ("full recompute (torch.utils.checkpoint around every layer) under torch.compile ({backend} backend, "
             "whole model)")
    eager = False

    def label_for(self, backend: str) -> str:
        return self.label.format(backend=backend)

    def apply(self, bundle, optimizer, job):
        backend = job.get("compile_backend", "inductor")
        undos = [_wrap_forward(layer, _checkpointed) for layer in layers_of(bundle.model)]
        compiled, undo = compile_whole_model(bundle.model, backend=backend, budget=1.0)
        return Applied(dataclasses.replace(bundle, model=compiled), _undo_all([undo, *undos]),
                       info={"backend": backend})


def _sac_decisions(stats: Any, keep_fraction: float) -> dict[str, collections.deque]:
    """func name -> queue of save(1)/recompute(0), in the order the module's forward runs them."""
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    keep_fraction = min(1.0, max(0.0, keep_fraction))
    choice = get_optimal_checkpointing_policy_per_module(stats, memory_budget=keep_fraction)
    if not choice:
        choice = [0] * len(stats.func_names)
    for op, parent in stats.inplace_ops:
        # torch.utils.checkpoint refuses a cached tensor that a later in-place op mutates: both recompute.
        choice[op] = choice[parent] = 0
    per_name: dict[str, list[int]] = collections.defaultdict(list)
    for name, save in zip(stats.func_names, choice):
        per_name[name].append(int(save))
    return per_name


def _policy_factory(per_name: dict[str, list[int]], counters: dict[str, int]) -> Any:
    """A fresh SAC context per layer call: the k-th op named X gets the k-th decision for X."""
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def make():
        seen = {False: collections.Counter(), True: collections.Counter()}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if func in OPS_TO_ALWAYS_SKIP:
                return CheckpointPolicy.PREFER_RECOMPUTE
            name = func._overloadpacket.__name__
            k = seen[ctx.is_recompute][name]
            seen[ctx.is_recompute][name] += 1
            decisions = per_name.get(name, [])
            if k >= len(decisions):
                counters["unmatched"] += 1
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if decisions[k] else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)
    return make


class SacIlp(Policy):
    name = "sac-ilp"
    label = ("PyTorch sac_ilp: per-module SAC MILP (torch.distributed._tools: MemTracker, RuntimeEstimator, "
             "SACEstimator, sac_milp) over the layers")
    budgeted = True

    def unavailable(self, spec: str) -> str | None:
        try:
            import torch.distributed._tools.sac_ilp  # noqa: F401  (needs pulp)
        except ImportError as exc:
            return f"needs the pulp package ({str(exc).splitlines()[0]})"
        return None

    def prepare(self, ctx: Any, budget: float | None) -> dict[str, Any]:
        limit = ctx.budget_bytes(budget)
        # sac_milp's memory model has parameters, gradients and activations but no optimizer state.
        return {"budget_bytes": limit, "sac_budget_bytes": limit - ctx.profile.static.optimizer_state}

    def apply(self, bundle, optimizer, job):
        start = time.perf_counter()
        decisions, info = _solve(bundle, optimizer, job)
        info["solve_seconds"] = round(time.perf_counter() - start, 3)
        counters = {"unmatched": 0}
        undos = []
        model = bundle.model
        prefix = type(model).__name__ + "."
        names = {id(m): prefix + n for n, m in model.named_modules()}
        for layer in layers_of(model):
            fqn = names[id(layer)]
            if fqn not in decisions:
                continue
            per_name, _ = decisions[fqn]
            context = _policy_factory(per_name, counters)
            undos.append(_wrap_forward(layer, lambda f, c=context: _checkpointed(f, c)))
        info["checkpointed_layers"] = len(undos)
        info["counters"] = counters
        return Applied(bundle, _undo_all(undos), info=info)


def _cpu_estimate(func: Any, args: tuple, kwargs: dict) -> tuple[Any, float]:
    """Stand-in for RuntimeEstimator's benchmark mode, which times ops with CUDA events only: the fake
    result from the fake mode below, the time (ms) of the same op on real random tensors (wall clock)."""
    from torch.distributed._tools.runtime_estimator import _VIEW_OPS
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._pytree import tree_map

    res = func(*args, **kwargs)
    if func._overloadpacket in _VIEW_OPS or torch.Tag.inplace_view in func.tags:
        return res, 0.0

    def real(e: Any) -> Any:
        if not isinstance(e, torch.Tensor):
            return e
        shape, dtype = tuple(e.shape), e.dtype
        return torch.rand(shape, dtype=dtype) if dtype.is_floating_point else torch.ones(shape, dtype=dtype)
    try:
        with no_dispatch():
            ra, rk = tree_map(real, (args, kwargs))
            func(*ra, **rk)
            start = time.perf_counter()
            for _ in range(2):
                func(*ra, **rk)
            ms = (time.perf_counter() - start) / 2 * 1e3
    except Exception:  # noqa: BLE001 - ops that reject random inputs count as free
        ms = 0.0
    return res, ms



def _solve(bundle: Any, optimizer: torch.optim.Optimizer, job: dict[str, Any]) -> tuple[dict, dict]:
    """PyTorch's estimators on a fake-tensor copy of this model and step (their designed use), then
    sac_milp under the budget; op times are measured on this CPU by :func:`_cpu_estimate`."""
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline, parse_module_info
    from torch.distributed._tools.sac_ilp import sac_milp

    from adaptive_mem._model_spec import build_model

    fb = build_model(job["spec"], model_args=job.get("model_args"), batch_size=bundle.batch_size,
                     seq_len=bundle.seq_len, dtype=bundle.dtype, device="meta", seed=int(job.get("seed", 0)))
    model = fb.model
    module_info, sac = _estimate(fb)
    _dedupe_order(module_info)
    graph = parse_module_info(module_info)
    info_fixes = _sanitize(graph)
    baseline_peak, _ = get_peak_memory_runtime_baseline(graph)
    prefix = type(model).__name__ + "."
    names = {id(m): prefix + n for n, m in model.named_modules()}
    layers = [names[id(layer)] for layer in layers_of(model)]
    budget_gib = int(job["sac_budget_bytes"]) / 2**30
    ac, recompute_ms, peak = sac_milp(graph, memory_budget=budget_gib, world_size=1, ac_units=layers)
    info = {"sac_milp_budget_bytes": int(job["sac_budget_bytes"]), "sac_milp_baseline_peak_bytes": int(baseline_peak),
            "sac_milp_peak_bytes": int(peak), "sac_milp_recompute_ms": recompute_ms,
            "discard": {k: float(v) for k, v in ac.items()}, "feasible": peak != -1,
            "degenerate_tradeoff_curves": info_fixes}
    if peak == -1:
        log.warning("sac_milp found no solution under %.3f GiB; running without checkpointing", budget_gib)
    decisions = {fqn: (_sac_decisions(sac.sac_mod_stats[fqn], 1.0 - r), r) for fqn, r in ac.items()
                 if fqn in sac.sac_mod_stats}
    return decisions, info


def _estimate(fb: Any) -> tuple[dict, Any]:
    """Memory, runtime and SAC statistics of two fake training steps of ``fb``; the module info sac_milp
    reads and the SAC estimator."""
    import copy

    from torch.distributed._tools.ilp_utils import aggregate_stats
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    model = fb.model
    with fb.mode():
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        batch = fb.batch(seed=0)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        last = None
        with tracker as mt:
            for k in range(2):  # the first step creates the optimizer state
                fb.loss(batch).backward()
                if k == 1:
                    last = mt.get_tracker_snapshot("current")
                opt.step()
                opt.zero_grad()
                if k == 0:
                    mt.reset_mod_stats()
        for stats in tracker.memory_tracking.values():
            # ModTracker runs no backward hooks for modules whose inputs need no grad (HF's rotary
            # embedding): give them the last snapshot, as PyTorch's own sac_ilp test does for POST_BW.
            for state in (_ModState.PRE_BW, _ModState.POST_BW, _ModState.PEAK_BW):
                if state not in stats.snapshots:
                    stats.snapshots.setdefault(state, []).append(copy.deepcopy(last))
        runtime = RuntimeEstimator()
        with runtime(estimate_mode_type="operator-level-benchmark"):
            runtime._estimate = _cpu_estimate
            fb.loss(batch).backward()
            opt.step()
            opt.zero_grad()
        sac = SACEstimator()
        with sac(estimate_mode_type="operator-level-benchmark"):
            sac._estimate_runtime = _cpu_estimate
            loss = fb.loss(batch)
        loss.backward()
        module_info = aggregate_stats(model, tracker, runtime, sac, torch.device("cpu"))
    return module_info, sac


def _dedupe_order(module_info: dict) -> None:
    """sac_ilp's graph builder wants each module once in the forward order; a module called twice per
    layer (the reference Llama's rotary embedding, on q and on k) is listed twice. Keep its first
    pre-order entry and its last post-order entry (the span covering both calls)."""
    order = module_info["mod_order"]
    order["fw_pre_order"] = list(dict.fromkeys(order["fw_pre_order"]))
    order["fw_post_order"] = list(reversed(dict.fromkeys(reversed(order["fw_post_order"]))))


def _sanitize(graph: Any) -> int:
    """pwlf fits NaN segments to degenerate trade-off curves (modules whose ops take ~0 ms); pulp then
    refuses the model. Replace such a curve by the straight line "recompute share = discard share"."""
    import math

    fixed = 0
    for node in graph.nodes:
        values = list(node.get("slopes", [])) + list(node.get("intercepts", []))
        if any(not math.isfinite(float(v)) for v in values):
            node["n_segments"], node["slopes"], node["intercepts"] = 1, [1.0], [0.0]
            fixed += 1
    return fixed
