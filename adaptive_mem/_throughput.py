"""``adaptive_mem.maximize_throughput``: the micro-batch size and the plan chosen together, from Python.

``adaptive-mem search --maximize throughput`` is this function plus argument parsing and printing.
Profiles are one model at one or more batch sizes; with ``model=SPEC`` every other requested batch
size is profiled the way the first profile was made (measured on this CPU, or on fake tensors for its
hardware); a batch size with no profile is scaled from the two nearest (Note: [batch scaling] in
``search/_scaling.py``) and its row says "extrapolated". With three or more profiles, the scaling rule
is checked against each beyond the two smallest.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from profiler import HardwareSpec, Profile, hardware_spec
from search import (Budget, DeviceMemoryError, Plan, ScalingCheck, ThroughputResult, fmt_bytes, get_solver,
                    scaling_error)
from search import maximize_throughput as _maximize
from search.planning import device_capacity, parse_batch_sizes, profiles_by, structure_of

__all__ = ["ThroughputSearchResult", "check_model_args", "maximize_throughput"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThroughputSearchResult:
    """What :func:`maximize_throughput` found: the best batch size, its plan, every batch size's row."""

    batch_size: int
    plan: Plan
    """The best batch size's plan (``meta``: ``budget_spec``, ``maximize``)."""
    table: ThroughputResult
    """Every batch size's row (``table.table()`` is the command's table)."""
    checks: tuple[ScalingCheck, ...]
    """The scaling rule against each profile past the two smallest batch sizes."""
    profiles: dict[int, Profile] = field(repr=False, compare=False)

    @property
    def tokens_per_second(self) -> float:
        return self.table.best_row.tokens_per_second

    @property
    def step_time(self) -> float:
        return self.table.best[1].cost.step_time

    @property
    def peak_bytes(self) -> int:
        return self.table.best_row.peak_bytes


def _profile_more(model: str, model_args: str | dict | None, profiles: dict[int, Profile], sizes: list[int]) -> None:
    """Profile the requested batch sizes no profile covers, as the first profile was made."""
    import profiler

    from adaptive_mem._model_spec import build_model

    ref = next(iter(profiles.values()))
    device = "cpu" if ref.measured else "meta"
    for b in sizes:
        if b in profiles:
            continue
        log.info("profiling %s at batch size %d on %s", model, b, device)
        bundle = build_model(model, model_args=model_args, batch_size=b, seq_len=ref.model.get("seq_len"),
                             dtype=ref.model.get("dtype", "float32"), device=device)
        prof = profiler.profile_step(bundle, hardware=None if ref.measured else ref.hardware,
                                     optimizer=ref.static.optimizer)
        if structure_of(prof) != structure_of(ref):
            raise ValueError(f"--model={model!r}: another model than the profile's (structure fingerprint "
                             f"{structure_of(prof)} vs {structure_of(ref)}); expected the spec the profile was made from")
        if ref.measured:  # the calibrated costs of swaps and SAC policies carry over
            prof = dataclasses.replace(prof, hardware=ref.hardware)
        profiles[b] = prof


def check_model_args(model: str | None, model_args: str | dict | None) -> None:
    if model_args is not None and model is None:
        raise ValueError(f"--model-args={model_args!r} without --model: expected both")


def maximize_throughput(profiles: Profile | str | Path | Iterable[Profile | str | Path], *, budget: int | str,
                        batch_sizes: str | Iterable[int], solver: str = "milp",
                        hardware: str | HardwareSpec | None = None, model: str | None = None,
                        model_args: str | dict | None = None,
                        on_check: Callable[[ScalingCheck], None] | None = None) -> ThroughputSearchResult:
    """The micro-batch size among ``batch_sizes`` (``"1,2,4,8"``, ``"1-16"`` or ints) and its plan with the most
    tokens per second under ``budget`` peak device bytes (an int or a size such as ``"40GiB"``), as
    ``adaptive-mem search --maximize throughput`` finds them. ``profiles``: profiles (or their JSON files)
    of one model at different batch sizes; ``model``/``model_args``: the spec to profile the other batch
    sizes with. ``on_check``: called with each scaling check as soon as it is made (the command prints it).
    Raises :class:`search.InfeasibleBudgetError` when no batch size fits, :class:`search.DeviceMemoryError`
    for a budget beyond the named device's memory.
    """
    sizes = parse_batch_sizes(batch_sizes if isinstance(batch_sizes, str) else ",".join(map(str, batch_sizes)))
    check_model_args(model, model_args)
    get_solver(solver)
    parsed = Budget(total=budget) if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 \
        else Budget.parse(budget=budget)
    spec = hardware_spec(hardware) if isinstance(hardware, str) else hardware
    loaded = profiles_by(profiles, "batch_size", why="throughput mode scales by it")
    ref = next(iter(loaded.values()))
    cap = device_capacity(spec or ref.hardware)
    if cap is not None and parsed.total is not None and parsed.total > cap:
        raise DeviceMemoryError(f"--budget={budget!r}: {fmt_bytes(parsed.total)} is more than the device's "
                                f"{fmt_bytes(cap)}; expected at most {cap >> 20}MiB")
    if model is not None:
        _profile_more(model, model_args, loaded, sizes)
    checks = tuple(scaling_error(loaded))
    for check in checks:
        if on_check is not None:
            on_check(check)
    table = _maximize(profiles=loaded, batch_sizes=sizes, budget=parsed, solver=solver, hardware=spec)
    batch, best = table.best
    best.plan.meta["budget_spec"] = parsed.describe()
    best.plan.meta["maximize"] = "throughput"
    return ThroughputSearchResult(batch_size=batch, plan=best.plan, table=table, checks=checks, profiles=loaded)
