"""``optuna``: black-box search over the plan space plus knobs the MILP does not model.

Search space (shared by identical layers, so it stays small on an 80-layer model):
an action per unit *local name* (keep / recompute / swap), the number of leading layers
recomputed whole, the prefetch distance, and a safety margin that shrinks the budget a
plan must fit (useful when scoring by measurement). Scored by the simulator, or by a
``measure(plan) -> seconds`` callback when given. Seeded TPE: reproducible.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ._plan import Action, Plan
from ._simulator import Assignment, simulate_assignment
from ._solver import Problem, Solver, plan_from_assignment

__all__ = ["OptunaSolver"]

log = logging.getLogger(__name__)


class OptunaSolver(Solver):
    name = "optuna"

    def __init__(self, *, trials: int = 150, seed: int = 0, max_prefetch: int = 3, max_margin: float = 0.1,
                 measure: Callable[[Plan], float] | None = None) -> None:
        self.trials = trials
        self.seed = seed
        self.max_prefetch = max_prefetch
        self.max_margin = max_margin
        self.measure = measure

    def choose(self, problem: Problem) -> tuple[Assignment, dict[str, Any]]:
        import optuna

        model = problem.model
        layer_units = [u for u in model.units if model.layer_of(u.position) is not None]
        local_names = sorted({u.local_name for u in layer_units if u.saved},
                             key=lambda n: min(u.index for u in layer_units if u.local_name == n))
        pinned = {u.local_name for u in layer_units if u.pinned}
        n = model.num_layers
        best: dict[str, Any] = {}

        def build(trial: "optuna.Trial") -> tuple[Assignment, float]:
            choice = {}
            for name in local_names:
                options = ["keep", "recompute"] if name in pinned else ["keep", "recompute", "swap"]
                choice[name] = Action(trial.suggest_categorical(f"unit:{name}", options))
            whole = trial.suggest_int("whole_layers", 0, n)
            d = trial.suggest_int("prefetch", 0, self.max_prefetch)
            margin = trial.suggest_float("margin", 0.0, self.max_margin)
            actions = []
            for u in model.units:
                layer = model.layer_of(u.position)
                if layer is None:
                    actions.append(Action.KEEP)
                elif layer < whole:
                    actions.append(Action.RECOMPUTE)
                else:
                    actions.append(choice.get(u.local_name, Action.KEEP))
            return Assignment(tuple(actions), tuple([d] * len(actions))), margin

        def objective(trial: "optuna.Trial") -> float:
            asg, margin = build(trial)
            sim = simulate_assignment(model, asg, in_flight=problem.in_flight)
            limit = problem.budget * (1.0 - margin) if self.measure else problem.budget
            if sim.peak_bytes > limit:
                return 1e6 + (sim.peak_bytes - limit) / 2**30  # infeasible: rank by overshoot
            cost = self.measure(plan_from_assignment(model, asg)) if self.measure else sim.step_time
            if not best or cost < best["cost"]:
                best.update(cost=cost, asg=asg)
            return cost

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=self.seed), direction="minimize")
        # Start from the two corners of the space so a feasible point is known early.
        study.enqueue_trial({"whole_layers": 0, "prefetch": 1, "margin": 0.0,
                             **{f"unit:{k}": "keep" for k in local_names}})
        study.enqueue_trial({"whole_layers": n, "prefetch": 1, "margin": 0.0,
                             **{f"unit:{k}": "keep" for k in local_names}})
        study.optimize(objective, n_trials=self.trials, show_progress_bar=problem.progress)
        if not best:
            # nothing fitted: hand back the most memory-saving corner; the contract reports the overshoot
            asg, _ = build(optuna.trial.FixedTrial({"whole_layers": n, "prefetch": 0, "margin": 0.0,
                                                    **{f"unit:{k}": "keep" for k in local_names}}))
            return asg, {"iterations": self.trials}
        return best["asg"], {"iterations": self.trials, "extra": {"best_params": study.best_params}}
