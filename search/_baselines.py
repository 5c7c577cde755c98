"""Baseline policies, expressed as plans and judged by the same simulator as the solvers.

Each baseline is one small class; the ones with a knob (Megatron block N, uniform N, greedy,
swap-only) take the cheapest setting that fits the budget.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ._model import StepModel
from ._plan import Action
from ._simulator import Assignment, simulate_assignment
from ._solver import Problem, Solver

__all__ = ["BASELINES"]

K, R, S = Action.KEEP, Action.RECOMPUTE, Action.SWAP
ATTENTION_CORE = ("flash_attention", "core_attention", "core_attn", "attention.sdpa")


def _is_core(name: str) -> bool:
    return any(part in name for part in ATTENTION_CORE)


def _assign(model: StepModel, action: Callable[[int], Action], *, prefetch: int = 1,
            groups: tuple[tuple[int, int], ...] = ()) -> Assignment:
    return Assignment(tuple(action(u.index) for u in model.units), tuple([prefetch] * len(model.units)), groups)


def _in_layer(model: StepModel, i: int) -> bool:
    return model.layer_of(model.units[i].position) is not None


def _fits(problem: Problem, asg: Assignment) -> bool:
    return simulate_assignment(problem.model, asg, in_flight=problem.in_flight).peak_bytes <= problem.budget


def _first_fit(problem: Problem, candidates: list[Assignment]) -> tuple[Assignment, int]:
    """First candidate (cheapest first) that fits; the last one when none does (the contract reports it)."""
    for k, asg in enumerate(candidates):
        if _fits(problem, asg):
            return asg, k
    return candidates[-1], len(candidates) - 1


class NoneBaseline(Solver):
    """Keep everything."""
    name = "none"

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        return _assign(problem.model, lambda i: K), {"iterations": 1}


class FullRecompute(Solver):
    """Whole-layer recompute of every layer (Megatron ``full``/``uniform`` with N=1)."""
    name = "full"

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        m = problem.model
        return _assign(m, lambda i: R if _in_layer(m, i) else K), {"iterations": 1}


class MegatronSelective(Solver):
    """Megatron ``--recompute-granularity selective``: the attention core of every layer."""
    name = "selective"

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        m = problem.model
        return _assign(m, lambda i: R if _in_layer(m, i) and _is_core(m.units[i].name) else K), {"iterations": 1}


class MegatronUniform(Solver):
    """Megatron ``uniform``: groups of N consecutive layers checkpointed together (smallest N that fits)."""
    name = "uniform"

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        m = problem.model
        n = m.num_layers
        cands = [self._groups(m, size) for size in range(1, max(1, n) + 1)]
        asg, k = _first_fit(problem, cands)
        return asg, {"iterations": k + 1, "extra": {"recompute_num_layers": k + 1}}

    @staticmethod
    def _groups(m: StepModel, size: int) -> Assignment:
        groups = tuple((a, min(a + size - 1, last)) for first, last in m.stack_ranges()
                       for a in range(first, last + 1, size) if size > 1 and min(a + size - 1, last) > a)
        return _assign(m, lambda i: R if _in_layer(m, i) else K, groups=groups)


class MegatronBlock(Solver):
    """Megatron ``block``: whole-layer recompute of the first N layers (smallest N that fits)."""
    name = "block"

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        m = problem.model
        cands = [_assign(m, lambda i, n=n: R if _in_layer(m, i) and m.units[i].position <= n else K)
                 for n in range(0, m.num_layers + 1)]
        asg, k = _first_fit(problem, cands)
        return asg, {"iterations": k + 1, "extra": {"recompute_num_layers": k}}


class ChenSqrt(Solver):
    """Chen et al.'s sqrt(n) checkpointing: segments of ceil(sqrt(n)) layers, one checkpoint each."""
    name = "sqrt"

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        m = problem.model
        return MegatronUniform._groups(m, max(1, math.ceil(math.sqrt(m.num_layers)))), {"iterations": 1}


def _prefix_search(problem: Problem, make: Callable[[int], Assignment], count: int) -> tuple[Assignment, int]:
    """Smallest prefix length whose assignment fits (memory falls as the prefix grows)."""
    lo, hi = 0, count
    if not _fits(problem, make(hi)):
        return make(hi), hi
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(problem, make(mid)):
            hi = mid
        else:
            lo = mid + 1
    return make(lo), lo


class GreedyKnapsack(Solver):
    """Recompute units in order of saved bytes per recompute second (PyTorch partitioner-style) until it fits."""
    name = "greedy"

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        m = problem.model
        ranked = sorted((u for u in m.units if _in_layer(m, u.index) and u.saved and not u.pinned),
                        key=lambda u: (-u.saved / max(u.fwd, 1e-12), u.index))

        def make(k: int) -> Assignment:
            chosen = {u.index for u in ranked[:k]}
            return _assign(m, lambda i: R if i in chosen else K)
        asg, k = _prefix_search(problem, make, len(ranked))
        return asg, {"iterations": k}


class MindFormersSwap(Solver):
    """MindFormers default swap: the attention core of every layer, prefetched one layer ahead."""
    name = "mindformers-swap"

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        m = problem.model
        return _assign(m, lambda i: S if _in_layer(m, i) and _is_core(m.units[i].name) else K), {"iterations": 1}


class SwapOnly(Solver):
    """Swap the largest tensors (prefetch one layer ahead) until it fits; no recompute."""
    name = "swap-only"

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        m = problem.model
        ranked = sorted((u for u in m.units if _in_layer(m, u.index) and u.saved and not u.pinned),
                        key=lambda u: (-u.saved, u.index))

        def make(k: int) -> Assignment:
            chosen = {u.index for u in ranked[:k]}
            return _assign(m, lambda i: S if i in chosen else K)
        asg, k = _prefix_search(problem, make, len(ranked))
        return asg, {"iterations": k}


BASELINES: tuple[type[Solver], ...] = (NoneBaseline, FullRecompute, MegatronSelective, MegatronUniform,
                                       MegatronBlock, ChenSqrt, GreedyKnapsack, MindFormersSwap, SwapOnly)
