"""``milp``: the cross-layer mixed-integer program over per-layer menus, on scipy's HiGHS.

Each layer picks one option of its menu (``_menu.py``: keep / recompute / swap per unit plus a
prefetch distance). Memory rows are the simulator's segment-end events, exactly; the time rows
bound the stalls of the single copy stream from below (a relaxation: exact where copies do not
queue behind each other). Every candidate the program returns is simulated; a candidate whose
simulated cost differs from the program's is cut off (no-good cut) and the program re-solved,
until the best simulated plan is within ``rel_gap`` of the program's bound. So the result is the
simulator's optimum over the menu space, with a proven bound and gap.

Repeated layers (heuristic menus, the layers between the first and the last alike) go to the
counts program first (``_counts.py``: option counts instead of per-layer binaries, a bound valid
for every order of the layers); this per-layer program decides only when that finds no plan.

Files: the program's variables and constraint groups (``_milp_model.py``), one HiGHS solve and the
plan read back (``_milp_solve.py``), the bound and gap (``_milp_bound.py``); this file runs the rounds.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ._counts import identical_layers, solve_counts
from ._compiled_space import project
from ._menu import exact_menus, layer_menu
from ._milp_bound import certified, gap, lp_support, polish, round_bound
from ._milp_model import MIB, MS, Program, build_program
from ._milp_solve import extract, full_ub, run_highs
from ._plan import Action
from ._simulator import Assignment, simulate_assignment
from ._sizes import fmt_bytes
from ._solver import InfeasibleBudgetError, Problem, Solver

__all__ = ["MilpSolver"]

log = logging.getLogger(__name__)


class MilpSolver(Solver):
    """Exact (over its menus) step-time minimisation under the peak budget; see the module docstring."""

    name = "milp"

    def __init__(self, *, prefetch: tuple[int, ...] = (0, 1, 2), menu_limit: int = 40, rel_gap: float | None = None,
                 time_limit: float = 30.0, max_rounds: int = 200, polish_time: float = 1.0,
                 large_rounds: int = 6, round_time: float = 1.5, counts: bool = True,
                 counts_time: float = 1.6, counts_gap: float = 0.01) -> None:
        self.prefetch = tuple(prefetch)
        self.menu_limit = menu_limit
        self.rel_gap = rel_gap
        self.time_limit = time_limit
        self.max_rounds = max_rounds
        self.polish_time = polish_time
        self.large_rounds = large_rounds
        self.round_time = round_time
        self.counts = counts
        self.counts_time = counts_time
        self.counts_gap = counts_gap  # above it, the per-layer program goes on from the counts plan and bound

    def choose(self, problem: Problem) -> tuple[Assignment, dict]:
        start = time.perf_counter()
        model = problem.model
        exact = exact_menus(model, self.prefetch)
        rel_gap = self.rel_gap if self.rel_gap is not None else (1e-7 if exact else 2e-3)
        counted = None
        if not exact and self.counts:
            counted = self._counts(problem, rel_gap, start)
            if counted is not None and counted[1]["extra"]["gap"] <= self.counts_gap:
                return counted[0], counted[1]
        prog = build_program(problem, self.prefetch, self.menu_limit)
        layers = list(model.layer_positions)
        build_time = time.perf_counter() - start
        ub = full_ub(prog)
        lp_bound = -np.inf
        mode = "exact"
        if not exact:
            # Large menus: the LP relaxation gives the bound (it is tight here: repeated layers make the
            # program nearly totally unimodular); the integer program then runs on the LP's support only.
            mode = "lp-support"
            relaxed = lp_support(prog)
            if relaxed is None:
                raise InfeasibleBudgetError(f"milp: no plan in its space fits the budget {fmt_bytes(problem.budget)}")
            lp_bound, ub = relaxed
        seeds = _seeds(problem) if mode == "lp-support" else []
        if counted is not None:  # the counts program's plan competes; its bound holds for this menu space too
            seeds.append((simulate_assignment(model, counted[0], in_flight=problem.in_flight).step_time, counted[0]))
        for _, asg in seeds:  # baseline plans join the support where the menus hold them
            swapped_in = dict(asg.inputs)
            for p in layers:
                key = tuple(asg.actions[i] for i in model.positions[p])
                d = next((asg.prefetch[i] for i in model.positions[p] if asg.actions[i] is Action.SWAP),
                         swapped_in.get(p, 0))
                for k, o in enumerate(prog.menus[p]):
                    if o.acts == key and o.d == d and o.input_swap == (p in swapped_in):
                        ub[prog.zcol[p] + k] = 1.0
        incumbent = min(seeds, key=lambda sd: sd[0]) if seeds else None
        best, bound, rounds, status = self._rounds(problem, prog, ub, rel_gap, start, lp_bound, incumbent)
        if best is None and mode == "lp-support" and status == "optimal":  # support infeasible
            mode = "full"  # the support held no plan the simulator accepts: search the whole menu
            ub = full_ub(prog)
            best, bound, more, status = self._rounds(problem, prog, ub, rel_gap, start, lp_bound, incumbent)
            rounds += more
        if best is None:
            raise InfeasibleBudgetError(f"milp: no plan in its space fits the budget {fmt_bytes(problem.budget)}"
                                        + ("" if status == "optimal" else f" ({status})"))
        if mode == "lp-support":
            bound = lp_bound  # the restricted program's bound covers the support only
            if best[0] > bound * (1 + rel_gap) and self.polish_time > 0:
                best, bound = polish(problem, prog, best, bound, rel_gap=rel_gap, time_limit=self.polish_time)
                rounds += 1
                mode = "lp-support+polish"
        if counted is not None:
            mode += "+counts"
        lower = certified(best[0], bound, None if counted is None else counted[2])
        return best[1], {"lower_bound": lower, "iterations": rounds,
                         "extra": {"status": status, "mode": mode, "build_time": round(build_time, 3),
                                   "rel_gap": rel_gap, "menu_sizes": sorted({len(m) for m in prog.menus.values()}),
                                   "rows": dict(prog.rows.groups)}}

    def _counts(self, problem: Problem, rel_gap: float, start: float) -> tuple[Assignment, dict, float] | None:
        """Repeated layers: the counts program (``_counts.py``) -> (plan, stats, bound); None when it does
        not apply or finds no plan."""
        model = problem.model
        cache: dict = {}
        menus = {p: layer_menu(model, p, prefetch=self.prefetch, limit=self.menu_limit, cache=cache, exact=False)
                 for p in model.layer_positions}
        if not identical_layers(model, menus):
            return None
        seeds = _seeds(problem, cheap=True)
        incumbent = min(seeds, key=lambda sd: sd[0]) if seeds else None
        layers = list(model.layer_positions)
        menu = menus[layers[1]]
        out = solve_counts(problem, (menu, menus[layers[-1]], menus[layers[0]]), rel_gap=rel_gap, incumbent=incumbent,
                           time_limit=max(0.1, self.counts_time - (time.perf_counter() - start)))
        if out.bound == np.inf:
            raise InfeasibleBudgetError(f"milp: no plan in its space fits the budget {fmt_bytes(problem.budget)}")
        if out.best is None:
            return None  # the relaxation admits plans the simulator rejects: the per-layer program decides
        lower = min(out.best[0], out.bound)
        return out.best[1], {"lower_bound": lower, "iterations": out.rounds,
                             "extra": {"status": "optimal" if out.best[0] <= out.bound * (1 + rel_gap) else "gap",
                                       "mode": "lp-support+counts", "rel_gap": rel_gap, "menu_sizes": [len(menu)],
                                       "gap": gap(out.best[0], lower),
                                       "build_time": round(time.perf_counter() - start, 3)}}, out.bound

    def _rounds(self, problem: Problem, prog: Program, ub: np.ndarray, rel_gap: float, start: float,
                lp_bound: float, incumbent: tuple[float, Assignment] | None = None,
                ) -> tuple[tuple[float, Assignment] | None, float, int, str]:
        """Solve, simulate, cut off candidates the simulator disagrees with, until the gap closes."""
        model = problem.model
        layers = list(model.layer_positions)
        best = incumbent
        if best is not None and np.isfinite(lp_bound) and best[0] <= lp_bound * (1 + rel_gap):
            return best, lp_bound, 0, "optimal"  # a baseline already meets the LP bound
        bound = -np.inf
        rounds = 0
        bar = _progress(problem.progress, self.max_rounds)
        status = "optimal"
        limit = self.max_rounds if not np.isfinite(lp_bound) else min(self.max_rounds, self.large_rounds)
        while rounds < limit:
            remaining = self.time_limit - (time.perf_counter() - start)
            if remaining <= 0:
                status = "time limit"
                break
            if np.isfinite(lp_bound):
                remaining = min(remaining, self.round_time)  # repeated-layer path: short rounds, LP bound
            res = run_highs(prog, ub, time_limit=remaining, mip_rel_gap=rel_gap / 2, presolve=True)
            rounds += 1
            if bar is not None:
                bar.update(1)
            if res.x is None:
                if res.status == 2 or "infeasible" in str(res.message).lower():
                    bound = np.inf  # nothing left under the budget
                else:
                    status = str(res.message)
                break
            value = prog.const + res.fun / MS
            bound = round_bound(prog, res)
            choice, asg, sim = extract(problem, prog, res.x)
            if sim.peak_bytes <= problem.budget and (best is None or sim.step_time < best[0]):
                best = (sim.step_time, asg)
            if sim.peak_bytes > problem.budget and np.isfinite(lp_bound):
                # repeated-layer path: memory the program does not see (copies queued across layers);
                # leave that much room and go on (the LP bound stays a valid bound)
                prog.rows.tighten_memory((sim.peak_bytes - problem.budget) / MIB)
            target = max(bound, lp_bound) if np.isfinite(lp_bound) else bound
            if best is not None and best[0] <= target * (1 + rel_gap) + 1e-12:
                break
            log.debug("milp round %d: program %.6f s, simulated %.6f s, peak %s", rounds, value, sim.step_time,
                      fmt_bytes(sim.peak_bytes))
            # no_good:  sum_p z[p, choice_p] <= |layers| - 1   (this exact combination is known)
            prog.rows.add("no_good", {prog.zcol[p] + k: 1.0 for p, k in choice.items()}, -np.inf, len(layers) - 1)
        else:
            status = "round limit"
        if bar is not None:
            bar.close()
        return best, bound, rounds, status


def _seeds(problem: Problem, *, cheap: bool = False) -> list[tuple[float, Assignment]]:
    """Feasible plans of the cheap baselines, simulated: incumbents for the repeated-layer path
    (``cheap``: only those that take one simulation each)."""
    from ._baselines import FullRecompute, GreedyKnapsack, MegatronBlock, NoneBaseline, SwapOnly
    out = []
    for cls in (NoneBaseline, FullRecompute) if cheap else (NoneBaseline, GreedyKnapsack, SwapOnly, MegatronBlock,
                                                            FullRecompute):
        asg = project(problem.model, cls().choose(problem)[0])  # Note: [compiled search space]
        sim = simulate_assignment(problem.model, asg, in_flight=problem.in_flight)
        if sim.peak_bytes <= problem.budget:
            out.append((sim.step_time, asg))
    return out


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="milp rounds", unit="solve", leave=False)

