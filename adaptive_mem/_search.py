"""``adaptive_mem.search``: the fastest plan for a profile under a memory budget, from Python.

``adaptive-mem search`` is this function plus argument parsing and printing: the budget forms, the
device and feasibility checks, the pipeline stages and their refusals live here, once. Keyword
arguments are the command's flags in snake_case; refusals are the command's (``ValueError``
subclasses whose one-line messages name the flag, e.g. ``--budget='1MiB'``).
"""

from __future__ import annotations

import math
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from profiler import HardwareSpec, Layout, Profile, hardware_spec, is_cuda_hardware
from search import (Budget, BudgetError, InfeasibleBudgetError, Plan, Problem, SolveResult, StepModel, fmt_bytes, get_solver, merge_plans, minimum_budget)
from search.planning import (Stage, check_feasible, in_flight, pipeline_step_time, rank_peak, simulate_assignment,
                             split_layout)
from search import DeviceMemoryError
from search.planning import activation_peak, device_capacity, device_shortfall, keep_all
from search.planning import data_parallel_comm
from search.planning import bucketed_plan, seq_len_profiles, structure_of

from adaptive_mem.config._layout import merge_layout, positive_int

log = logging.getLogger(__name__)

__all__ = ["SearchResult", "StageResult", "check_arguments", "chunk_budgets", "rank_figures", "search", "stages_of"]


@dataclass(frozen=True)
class StageResult:
    """One stage model's search (the whole model when there is no pipeline)."""

    index: int
    chunk: int
    in_flight: int
    """Micro-batches of activations this stage holds at its peak."""
    where: str
    """``stage 0 (2 micro-batches in flight): `` under a pipeline, else empty: the prefix of its lines."""
    budget: Budget
    """The stage's budget: ``budget=`` (split over a rank's chunks) or the activation fraction."""
    peak_bytes: int
    """The plan's simulated peak on the stage model (static memory included)."""
    activation_peak: int
    keep_all_peak: int
    """The keep-all plan's peak on the problem's model (gradients resident for a fraction)."""
    keep_all_activation_peak: int
    keep_all_fits: bool
    """The keep-all plan already meets the budget: the plan needs no decisions."""
    minimum_budget: int
    """The smallest peak of the most memory-saving plans on the problem's model."""
    step_time: float
    stall_time: float
    solve_time: float
    lower_bound: float | None
    """The solver's lower bound on the step time (milp), else None."""
    gap: float | None
    shortfall: str | None
    """One line when the predicted peak exceeds the named device's memory, else None."""
    solve: SolveResult
    peak_reserved_bytes: int | None = None
    """On a CUDA target, what the caching allocator reserves at the plan's peak (``Simulation.peak_reserved_bytes``);
    None elsewhere."""


@dataclass(frozen=True)
class SearchResult:
    """What :func:`search` found: the plan, its predicted figures and the per-stage ones."""

    plan: Plan
    solver: str
    budget: Budget
    layout: Layout
    stages: tuple[StageResult, ...]
    ranks: tuple[dict, ...]
    """Per pipeline rank (a layout other than the default): ``stage``, ``predicted_peak_bytes``,
    ``micro_batch_time``, ``optimizer_time``, ``comm_time``, ``exposed_comm_time``; else empty."""
    peak_bytes: int
    """Predicted peak device bytes: the stage's, or the largest rank's under a layout."""
    step_time: float
    """Predicted step seconds: the stage's, or the pipelined step under a layout."""
    minimum_budget: int
    """The largest of the stages' minimum feasible peaks (bytes)."""
    lower_bound: float | None
    """The solver's step-time lower bound for a single stage, else None."""
    profile: Profile = field(repr=False, compare=False)
    """The profile searched."""
    buckets: tuple[tuple[int, "SearchResult"], ...] = ()
    """With ``seq_lens``: ``(seq_len, result)`` per bucket, ascending; this result is the longest's, its plan holds
    every bucket's (Note: [plan buckets]). Empty otherwise."""

    @property
    def fits_device(self) -> bool:
        """No stage's predicted peak exceeds the named device's memory (an infeasible budget raises)."""
        return not any(st.shortfall for st in self.stages)


@dataclass(frozen=True)
class _BudgetSpec:
    budget: Budget
    key: str
    """The flag the budget came from, for messages: ``--budget`` or ``--activation-budget``."""
    value: Any


def _budget_spec(budget: int | str | None, activation_budget: float | str | None) -> _BudgetSpec:
    """Note: [budget forms] ``budget`` is bytes (an int), a size (``"8GiB"``) or a percentage (``"60%"``) of
    the keep-all activation peak, the same as ``activation_budget=0.6``; sizes and fractions are
    ``Budget.parse``'s."""
    if budget is not None and activation_budget is not None:
        Budget.parse(budget=str(budget), activation_budget=activation_budget)  # refuses the two together
    if isinstance(budget, str) and budget.strip().endswith("%"):
        try:
            fraction = float(budget.strip()[:-1]) / 100
        except ValueError:
            fraction = math.nan
        if not 0 < fraction <= 1:
            raise BudgetError(f"--budget={budget!r}: expected a size like 40GiB or a percentage in (0%, 100%]")
        return _BudgetSpec(Budget(activation_fraction=fraction), "--budget", budget)
    if isinstance(budget, int) and not isinstance(budget, bool):
        if budget <= 0:
            raise BudgetError(f"--budget={budget!r}: expected a size > 0")
        return _BudgetSpec(Budget(total=budget), "--budget", budget)
    parsed = Budget.parse(budget=budget, activation_budget=activation_budget)
    if parsed.total is not None:
        return _BudgetSpec(parsed, "--budget", budget)
    return _BudgetSpec(parsed, "--activation-budget", activation_budget)


def _check_device(model: StepModel, budget: Budget, spec: _BudgetSpec, where: str) -> None:
    """Refuse a step whose static memory, or a budget that exceeds the named device's memory."""
    shortfall = device_shortfall(model.hardware, static=model.static_bytes)
    if shortfall:
        raise DeviceMemoryError(f"{where}{shortfall}")
    cap = device_capacity(model.hardware)
    if cap is not None and budget.total is not None and budget.total > cap:
        raise DeviceMemoryError(f"--budget={spec.value!r}: {fmt_bytes(budget.total)} is more than the "
                                f"{model.hardware.name}'s {fmt_bytes(cap)} of device memory; expected at most "
                                f"{cap >> 20}MiB, or --hardware naming the device the plan is for")


def _minimum(problem: Problem, budget: Budget, spec: _BudgetSpec, keep: int, where: str) -> int:
    """The problem's minimum feasible peak; below it, ``check_feasible``'s refusal (for a fraction: naming
    the smallest feasible fraction)."""
    try:
        check_feasible(problem.model, problem.budget, in_flight=problem.in_flight)
    except InfeasibleBudgetError as exc:
        if budget.total is not None:
            raise InfeasibleBudgetError(f"{where}{exc}") from None
        least, what = minimum_budget(problem.model, in_flight=problem.in_flight)
        fraction = math.ceil((least - problem.model.base) / keep * 1000) / 1000
        raise InfeasibleBudgetError(f"{where}{spec.key}={spec.value!r}: below the minimum feasible {fraction:g} of "
                                    f"the keep-all activation peak {fmt_bytes(keep)}: {what}") from None
    return minimum_budget(problem.model, in_flight=problem.in_flight)[0]


def _where(st: Stage, layout: Layout) -> str:
    if layout.chunks == 1:
        return ""
    chunk = f", chunk {st.chunk}" if layout.virtual_pipeline_stages > 1 else ""
    return f"stage {st.index}{chunk} ({st.in_flight} micro-batches in flight): "


def _solve_stage(st: Stage, budget: Budget, spec: _BudgetSpec, layout: Layout, solver: str,
                 options: Mapping[str, Any], progress: bool) -> StageResult:
    where = _where(st, layout)
    _check_device(st.model, budget, spec, where)
    problem = budget.problem(st.model, in_flight=st.in_flight, progress=progress)
    keep = activation_peak(st.model, keep_all(st.model), in_flight=st.in_flight)
    least = _minimum(problem, budget, spec, keep, where)
    keep_sim = simulate_assignment(problem.model, keep_all(problem.model), in_flight=problem.in_flight)
    result = get_solver(solver, **options).solve(problem)
    sim = simulate_assignment(st.model, result.assignment, in_flight=st.in_flight)
    result.plan.meta["predicted_peak_bytes"] = sim.peak_bytes  # the activation model's is an upper bound
    return StageResult(
        index=st.index, chunk=st.chunk, in_flight=st.in_flight, where=where, budget=budget, peak_bytes=sim.peak_bytes,
        activation_peak=activation_peak(st.model, result.assignment, in_flight=st.in_flight),
        keep_all_peak=keep_sim.peak_bytes, keep_all_activation_peak=keep,
        keep_all_fits=keep_sim.peak_bytes <= problem.budget, minimum_budget=least, step_time=result.cost.step_time,
        stall_time=result.cost.stall_time, solve_time=result.stats.solve_time, lower_bound=result.stats.lower_bound,
        gap=result.stats.gap,
        shortfall=device_shortfall(st.model.hardware, static=st.model.static_bytes, peak=sim.peak_bytes), solve=result,
        peak_reserved_bytes=sim.peak_reserved_bytes if is_cuda_hardware(st.model.hardware.name) else None)


def chunk_budgets(stages: list[Stage], budget: Budget, layout: Layout) -> list[Budget]:
    """One budget per stage model. ``--budget`` is a rank's: with ``V`` chunks per rank it is split over the
    rank's chunks (Note: [chunk budgets]); fractions apply to each chunk as they are."""
    if budget.total is None or layout.virtual_pipeline_stages == 1:
        return [budget] * len(stages)
    out: list[Budget] = []
    for s in range(layout.pipeline_stages):
        out += _rank_budgets(s, [st for st in stages if st.index == s], budget.total)
    return out


def _rank_budgets(s: int, mine: list[Stage], total: int) -> list[Budget]:
    """Note: [chunk budgets] a rank's predicted peak is its chunks' peaks as ``rank_peak`` adds them (Note: [rank
    peak]), so chunk budgets whose ``rank_peak`` is the rank's budget keep the rank within it. Each chunk gets its
    minimum feasible peak and the rest is shared in proportion to what each chunk's keep-all peak needs beyond its
    minimum; a budget below the chunks' minimums together is refused."""
    static = rank_peak(mine, [st.model.static_bytes for st in mine])
    if total <= static:
        raise DeviceMemoryError(f"stage {s}: static memory {fmt_bytes(static)} (parameters, gradients, optimizer "
                                f"state of its {len(mine)} chunks) exceeds the budget {fmt_bytes(total)}; "
                                "expected a larger --budget or more sharding (--zero, --tensor-parallel)")
    least = [minimum_budget(st.model, in_flight=st.in_flight)[0] for st in mine]
    together = rank_peak(mine, least)
    room = total - together
    if room < 0:
        raise InfeasibleBudgetError(f"stage {s}: --budget {fmt_bytes(total)} is below the minimum feasible "
                                    f"{fmt_bytes(together)} ({together} bytes) of its {len(mine)} chunks together; "
                                    "expected a larger --budget or more sharding (--zero, --tensor-parallel)")
    keep = [simulate_assignment(st.model, keep_all(st.model), in_flight=st.in_flight).peak_bytes for st in mine]
    need = [max(0, k - m) for k, m in zip(keep, least)]
    weights = need if sum(need) else [1] * len(mine)
    return [Budget(total=m + room * w // sum(weights)) for m, w in zip(least, weights)]


def _rank(s: int, mine: list[tuple[Stage, SolveResult]], layout: Layout, num_layers: int) -> dict:
    """One pipeline rank's predicted peak (its chunks together), seconds per micro-batch and communication."""
    peak = rank_peak([st for st, _ in mine], [r.plan.meta.get("predicted_peak_bytes", r.cost.peak_bytes) for _, r in mine])
    busy = sum(r.cost.step_time - st.model.other_time for st, r in mine)
    share = sum(len(st.layers) for st, _ in mine) / max(num_layers, 1)
    models = [st.model for st, _ in mine]
    d, z = layout.data_parallel, layout.zero
    comm = data_parallel_comm(
        layout, gradient_bytes=sum(m.profile.static.gradients for m in models) * (d if z >= 2 else 1),
        parameter_bytes=sum(m.profile.static.parameters for m in models) * (d if z >= 3 else 1),
        layers=sum(len(st.layers) for st, _ in mine), forward_time=sum(m.forward_time for m in models),
        backward_time=sum(m.backward_time for m in models),
        bandwidth=float(models[0].profile.model.get("data_parallel_bandwidth")
                        or models[0].profile.model.get("interconnect_bandwidth") or 0.0),
        precision=models[0].profile.model.get("precision"),
        slowdown=models[0].profile.hardware.comm_compute_slowdown)
    return {"stage": s, "predicted_peak_bytes": int(peak), "micro_batch_time": busy,
            "optimizer_time": mine[0][0].model.profile.optimizer_time * share,
            "comm_time": comm.total, "exposed_comm_time": comm.exposed}


def rank_figures(plan: Plan, stages: list[Stage], results: list[SolveResult],
                 layout: Layout) -> tuple[list[dict], float]:
    """Per rank figures and the pipelined step time, also recorded in ``plan.meta["pipeline"]``."""
    num_layers = stages[0].model.profile.num_layers
    ranks = [_rank(s, [(st, r) for st, r in zip(stages, results) if st.index == s], layout, num_layers)
             for s in range(layout.pipeline_stages)]
    step = pipeline_step_time([r["micro_batch_time"] for r in ranks], layout,
                              other=max(r["optimizer_time"] for r in ranks),
                              exposed_comm=max(r["exposed_comm_time"] for r in ranks))
    meta = plan.meta.setdefault("pipeline", {"stages": layout.pipeline_stages, "micro_batches": layout.micro_batches})
    meta.update(stages=layout.pipeline_stages, schedule=layout.schedule, virtual_stages=layout.virtual_pipeline_stages,
                per_rank=ranks, predicted_step_time=step)
    return ranks, step


def stages_of(profile: Profile, layout: Layout, hardware: HardwareSpec | None) -> list[Stage]:
    if layout.chunks == 1:
        model = StepModel.build(profile, hardware=hardware)
        return [Stage(0, range(profile.num_layers), in_flight(layout)[0][0], model)]
    return split_layout(profile, layout=layout, hardware=hardware)


def _load(profile: Profile | str | Path, hardware: str | HardwareSpec | None) -> tuple[Profile, HardwareSpec | None]:
    """The hardware override (validated before any loading work) and the profile."""
    spec = hardware_spec(hardware) if isinstance(hardware, str) else hardware
    return (profile if isinstance(profile, Profile) else Profile.load(profile)), spec


def check_arguments(*, solver: str, solver_options: Mapping[str, Any], pipeline_stages: int | None,
                    micro_batches: int | None, budget: int | str | None,
                    activation_budget: float | str | None) -> _BudgetSpec:
    """:func:`search`'s checks that need no profile, in the order the command refuses them."""
    try:
        get_solver(solver, **solver_options)
    except TypeError as exc:  # a keyword the solver's constructor does not take
        raise ValueError(f"solver_options={dict(solver_options)!r}: {exc}; expected keywords of the {solver!r} "
                         "solver's constructor") from None
    positive_int("--pipeline-stages", pipeline_stages)
    positive_int("--micro-batches", micro_batches)
    return _budget_spec(budget, activation_budget)


def _profile_at(model: str, model_args: str | dict | None) -> Callable[[Profile, int], Profile]:
    """A function profiling ``model`` at a sequence length as a reference profile was made (fake or CPU)."""
    import dataclasses

    import profiler

    from adaptive_mem._model_spec import build_model

    def profile_at(ref: Profile, seq_len: int) -> Profile:
        device = "cpu" if ref.measured else "meta"
        log.info("profiling %s at sequence length %d on %s", model, seq_len, device)
        bundle = build_model(model, model_args=model_args, batch_size=ref.model.get("batch_size"), seq_len=seq_len,
                             dtype=ref.model.get("dtype", "float32"), device=device)
        prof = profiler.profile_step(bundle, hardware=None if ref.measured else ref.hardware,
                                     optimizer=ref.static.optimizer)
        if structure_of(prof) != structure_of(ref):
            raise ValueError(f"--model={model!r}: another model than the profile's (structure fingerprint "
                             f"{structure_of(prof)} vs {structure_of(ref)}); expected the spec the profile was made "
                             "from")
        return dataclasses.replace(prof, hardware=ref.hardware) if ref.measured else prof
    return profile_at


def _search_buckets(profile: Any, seq_lens: str | Iterable[int], model: str | None, model_args: str | dict | None,
                    on_bucket: Callable[[int, Profile], None] | None, **kwargs: Any) -> SearchResult:
    """:func:`search` on each bucket's profile under the same budget (Note: [plan buckets])."""
    check_arguments(solver=kwargs["solver"], solver_options=dict(kwargs["solver_options"] or {}),
                    pipeline_stages=kwargs["pipeline_stages"], micro_batches=kwargs["micro_batches"],
                    budget=kwargs["budget"], activation_budget=kwargs["activation_budget"])
    if model_args is not None and model is None:
        raise ValueError(f"--model-args={model_args!r} without --model: expected both")
    profiles = seq_len_profiles(profile, seq_lens, None if model is None else _profile_at(model, model_args))
    results = []
    for s, prof in profiles.items():
        if on_bucket is not None:
            on_bucket(s, prof)
        try:
            results.append((s, search(prof, **kwargs)))
        except BudgetError as exc:  # the bucket it failed for, in the same one line
            raise type(exc)(f"sequence length {s}: {exc}") from None
    plan = bucketed_plan({s: r.plan for s, r in results})
    return replace(results[-1][1], plan=plan, buckets=tuple(results))


def search(profile: Profile | str | Path | Iterable[Profile | str | Path], *, budget: int | str | None = None,
           activation_budget: float | str | None = None, solver: str = "milp",
           solver_options: Mapping[str, Any] | None = None, hardware: str | HardwareSpec | None = None,
           pipeline_stages: int | None = None, micro_batches: int | None = None, tensor_parallel: int | None = None,
           virtual_pipeline_stages: int | None = None, data_parallel: int | None = None,
           sequence_parallel: bool | None = None, zero: int | None = None, schedule: str | None = None,
           progress: bool = False, on_stage: Callable[[StageResult], None] | None = None,
           seq_lens: str | Iterable[int] | None = None, model: str | None = None, model_args: str | dict | None = None,
           on_bucket: Callable[[int, Profile], None] | None = None) -> SearchResult:
    """The fastest keep/recompute/swap plan for ``profile`` (a :class:`profiler.Profile` or its JSON file)
    under a memory budget, as ``adaptive-mem search`` finds it.

    ``budget``: peak device bytes, parameters, gradients and optimizer state included: an int, a size
    (``"40GiB"``, ``"80GB"``) or a percentage of the keep-all activation peak (``"60%"``, the same as
    ``activation_budget=0.6``: Note: [budget forms]). ``solver``: a name of ``search.solver_names()``;
    ``solver_options``: its constructor's keywords (``time_limit`` for milp, ``seed``/``trials`` for optuna).
    ``hardware``: a spec name or :class:`profiler.HardwareSpec` instead of the profile's. The parallel
    layout (``pipeline_stages``, ``micro_batches``, ``tensor_parallel``, ...: the command's layout flags)
    goes on top of the profile's recorded one. ``progress``: solver progress on stderr. ``on_stage``: called
    with each stage's result as soon as it is solved (the command prints it).

    A budget below the minimum feasible raises :class:`search.InfeasibleBudgetError`; a budget or static
    memory beyond the named device's raises :class:`search.DeviceMemoryError` (both ``ValueError``).

    ``seq_lens`` (``"512,1024,2048"`` or ints): a plan per sequence-length bucket in one plan (Note: [plan
    buckets]), each under the same budget on ``profile`` (one, or several at different lengths) scaled to that
    length, or on ``model`` (a spec; ``model_args``) profiled there as the profile was made; ``on_bucket(seq_len,
    profile)`` before each search. The result is the longest bucket's, every bucket's in ``buckets``.
    """
    if seq_lens is not None:
        return _search_buckets(**locals())
    if model is not None or model_args is not None:
        raise ValueError(f"model={model!r}, model_args={model_args!r} without seq_lens: expected seq_lens too")
    options = dict(solver_options or {})
    spec = check_arguments(solver=solver, solver_options=options, pipeline_stages=pipeline_stages,
                           micro_batches=micro_batches, budget=budget, activation_budget=activation_budget)
    profile, hw = _load(profile, hardware)
    given = dict(pipeline_stages=pipeline_stages, micro_batches=micro_batches, zero=zero,
                 tensor_parallel=tensor_parallel, virtual_pipeline_stages=virtual_pipeline_stages,
                 data_parallel=data_parallel, sequence_parallel=sequence_parallel, schedule=schedule)
    lay = merge_layout(profile.model.get("layout"), given)
    stages = stages_of(profile, lay, hw)
    results: list[StageResult] = []
    for st, stage_budget in zip(stages, chunk_budgets(stages, spec.budget, lay)):
        results.append(_solve_stage(st, stage_budget, spec, lay, solver, options, progress))
        if on_stage is not None:
            on_stage(results[-1])
    plan = results[0].solve.plan if lay.chunks == 1 else \
        merge_plans([r.solve.plan for r in results], stages, micro_batches=lay.micro_batches)
    plan.meta["budget_spec"] = spec.budget.describe()
    ranks: list[dict] = []
    peak, step = results[0].peak_bytes, results[0].step_time
    if lay != Layout():
        plan.meta["layout"] = lay.to_dict()
        ranks, step = rank_figures(plan, stages, [r.solve for r in results], lay)
        peak = max(r["predicted_peak_bytes"] for r in ranks)
    return SearchResult(plan=plan, solver=solver, budget=spec.budget, layout=lay, stages=tuple(results),
                        ranks=tuple(ranks), peak_bytes=peak, step_time=step,
                        minimum_budget=max(r.minimum_budget for r in results),
                        lower_bound=results[0].lower_bound if len(results) == 1 else None, profile=profile)
