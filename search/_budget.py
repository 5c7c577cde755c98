"""Memory budgets: absolute (``40GiB``) or a fraction of the unoptimized activation peak.

Also the minimum feasible budget and what dominates it, for the error a too-small budget gets, and
the device-memory check: a peak (or static memory) over the memory of the named device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from profiler import HardwareSpec

from ._model import StepModel
from ._plan import Action
from ._simulator import Assignment, segments, simulate_assignment
from ._sizes import BudgetError, fmt_bytes, parse_bytes
from ._solver import InfeasibleBudgetError, Problem

__all__ = ["Budget", "BudgetError", "DeviceMemoryError", "activation_model", "activation_peak", "check_feasible",
           "device_capacity", "device_shortfall", "keep_all", "minimum_budget", "parse_bytes"]


class DeviceMemoryError(BudgetError):
    """A budget or a step that cannot fit the memory of the device it is for."""


@dataclass(frozen=True)
class Budget:
    total: int | None = None
    """Peak device bytes, parameters, gradients and optimizer state included."""
    activation_fraction: float | None = None
    """Fraction F of the keep-all plan's activation peak: the plan's activation peak (the most activation
    bytes on the device at any time of the step: saved, reloaded and recomputed bytes, loss workspace,
    every micro-batch in flight) is at most F times the keep-all plan's (Note: [activation budget])."""

    def __post_init__(self) -> None:
        if (self.total is None) == (self.activation_fraction is None):
            raise BudgetError("budget: give exactly one of --budget or --activation-budget")
        f = self.activation_fraction
        if f is not None and (isinstance(f, bool) or not 0 < f <= 1):
            raise BudgetError(f"--activation-budget={f!r}: expected a fraction in (0, 1]")

    @classmethod
    def parse(cls, *, budget: str | None = None, activation_budget: str | float | None = None) -> "Budget":
        if activation_budget is not None:
            try:
                fraction = float(activation_budget)
            except (TypeError, ValueError):
                raise BudgetError(f"--activation-budget={activation_budget!r}: expected a fraction in (0, 1]") from None
            if budget is not None:
                raise BudgetError("budget: give exactly one of --budget or --activation-budget, not both")
            return cls(activation_fraction=fraction)
        return cls(total=None if budget is None else parse_bytes(budget))

    def resolve(self, model: StepModel, *, in_flight: int = 1) -> int:
        """Absolute peak bytes: on ``model`` for ``--budget``; for a fraction, on ``activation_model(model)``,
        where it is static memory + F x the keep-all activation peak. Solve :meth:`problem`, which pairs
        each limit with its model: a fraction's limit on ``model`` itself lets gradients, not yet
        allocated at the activation peak, pass as activations."""
        if self.total is not None:
            return self.total
        assert self.activation_fraction is not None
        act = activation_model(model)
        return act.base + int(self.activation_fraction * activation_peak(act, keep_all(act), in_flight=in_flight))

    def problem(self, model: StepModel, *, in_flight: int = 1, progress: bool = False) -> Problem:
        """The solvers' problem for this budget; a plan within it fits the budget on ``model`` as well."""
        target = model if self.total is not None else activation_model(model)
        return Problem(target, self.resolve(model, in_flight=in_flight), in_flight=in_flight, progress=progress)

    def describe(self) -> str:
        if self.total is not None:
            return fmt_bytes(self.total)
        return f"{self.activation_fraction:g} of the activation peak"


def activation_model(model: StepModel) -> StepModel:
    """``model`` with its gradients resident all step, as ``StepModel.build(gradients="persistent")``.

    Note: [activation budget] its peak minus its static memory is the activation peak: gradients
    are allocated during backward, so on ``model`` a peak limit of static + F x activations leaves
    the not-yet-allocated gradients' room to activations (any F keeps every activation of a model
    whose gradients are as large as them). With gradients resident from the start, the same limit
    bounds the activations alone at every moment; the plan's peak on ``model`` is no higher.
    """
    if not any(model.grads):
        return model
    return replace(model, base=model.static_bytes, grads=[0] * len(model.grads))


def keep_all(model: StepModel) -> Assignment:
    """The plan that keeps every activation (no decisions)."""
    n = len(model.units)
    return Assignment(tuple([Action.KEEP] * n), tuple([1] * n))


def activation_peak(model: StepModel, asg: Assignment, *, in_flight: int = 1) -> int:
    """The most activation bytes ``asg`` holds on the device at any time of the step (gradients excluded)."""
    return simulate_assignment(activation_model(model), asg, in_flight=in_flight).activation_peak


def device_capacity(hardware: HardwareSpec) -> int | None:
    """Memory of a named device (a datasheet entry or a measured accelerator); None for ``cpu`` or unknown."""
    return hardware.device_memory if hardware.device_memory > 0 and hardware.name != "cpu" else None


def device_shortfall(hardware: HardwareSpec, *, static: int, peak: int | None = None) -> str | None:
    """One line when ``peak`` (without it: ``static``) exceeds the memory of ``hardware``, a named device.

    ``static``: parameters, gradients and optimizer state; the line says which part does not fit.
    """
    cap = device_capacity(hardware)
    if cap is None or (static if peak is None else peak) <= cap:
        return None
    device = f"the {hardware.name}'s {fmt_bytes(cap)} of device memory"
    shard = "shard them (ZeRO/FSDP, tensor or pipeline parallel) or use a device with more memory"
    if peak is None:
        return (f"parameters, gradients and optimizer state ({fmt_bytes(static)}) exceed {device} "
                f"by {fmt_bytes(static - cap)}: {shard}")
    if static > cap:
        return (f"predicted peak {fmt_bytes(peak)} exceeds {device}: parameters, gradients and optimizer state "
                f"alone need {fmt_bytes(static)} ({fmt_bytes(static - cap)} over): {shard}")
    return (f"predicted peak {fmt_bytes(peak)} exceeds {device} by {fmt_bytes(peak - cap)}: parameters, gradients "
            f"and optimizer state ({fmt_bytes(static)}) fit, activations and workspace ({fmt_bytes(peak - static)}) "
            f"on top do not; search with --budget {cap >> 20}MiB or less")


def min_candidates(model: StepModel) -> list[Assignment]:
    n = len(model.units)
    full = Assignment(tuple(Action.RECOMPUTE if model.layer_of(u.position) is not None else Action.KEEP
                            for u in model.units), tuple([1] * n))
    swap = Assignment(tuple(Action.SWAP for _ in model.units), tuple([0] * n))
    mixed = Assignment(tuple(Action.RECOMPUTE if model.layer_of(u.position) is not None else Action.SWAP
                             for u in model.units), tuple([0] * n))
    return [full, swap, mixed]


def minimum_budget(model: StepModel, *, in_flight: int = 1) -> tuple[int, str]:
    """Smallest peak of the most memory-saving plans, and what dominates it (one line)."""
    best = None
    for asg in min_candidates(model):
        sim = simulate_assignment(model, asg, in_flight=in_flight)
        if best is None or sim.peak_bytes < best[0]:
            best = (sim.peak_bytes, asg)
    assert best is not None
    peak, asg = best
    static = model.profile.static
    parts = [("optimizer state", static.optimizer_state), ("parameters", static.parameters),
             ("gradients", static.gradients), ("activations left on the device", peak - static.total)]
    if static.master:
        parts.append(("master weights", static.master))
    if static.other:  # Note: [other device memory]
        parts.append(("beside the step on the device (a parallel wrapper's buffers, other tensors)", static.other))
    parts.sort(key=lambda kv: -kv[1])
    largest = max(((model.units[i].saved, model.units[i].name) for s in segments(model, asg)
                   for i, b in s.hold.items() if b), default=None)
    what = ", ".join(f"{name} {fmt_bytes(value)}" for name, value in parts)
    if largest:
        what += f"; largest unswappable tensor {largest[1]} {fmt_bytes(largest[0])}"
    return peak, what


def check_feasible(model: StepModel, budget: int, *, in_flight: int = 1) -> None:
    """Raise :class:`InfeasibleBudgetError` naming the minimum feasible budget when ``budget`` is below it."""
    minimum, what = minimum_budget(model, in_flight=in_flight)
    if budget < minimum:
        raise InfeasibleBudgetError(f"budget {fmt_bytes(budget)} is below the minimum feasible "
                                    f"{fmt_bytes(minimum)} ({minimum} bytes): {what}")
