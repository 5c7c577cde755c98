"""``adaptive_mem.estimate``: will a training run fit on N GPUs, and how fast will it go, from a laptop.

``adaptive-mem estimate`` is this function plus argument parsing and printing. The model is built on fake
tensors (``device="meta"``) in the precision recipe's dtype and profiled for the named hardware
(``profiler.profile_step``), cut to one rank's share of the parallel layout (``profiler.shard_profile``), its
activation-checkpointing mode turned into a plan (``ac_plan``; ``ours``: :func:`adaptive_mem.search` under the
device's memory in reserved bytes, Note: [ours in reserved bytes]) and the plan simulated per pipeline stage as
:func:`adaptive_mem.search` does; with ``compile`` the profile is first rewritten to the model compiled per block
(``profiler.compiled_estimate``). Throughput is tokens per GPU per second; MFU is model FLOPs
(:func:`model_flops_per_token`) over the hardware's peak half-precision FLOPs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import profiler
import torch
from profiler import Layout, Profile
from profiler.tracing import precision_of, rank_share
from search import (DeviceMemoryError, InfeasibleBudgetError, Plan, PredictedCost, SolveResult, SolverStats, StepModel,
                    fmt_bytes)
from search.planning import reserved_at_peak, resolve, simulate_assignment

from ._model_spec import build_model, parse_model_args
from ._search import SearchResult, rank_figures, search, stages_of
from .config import AC_MODES, ConfigError, ac_plan
from .config._ac_modes import parse_ac_mode, titan_op_model
from .config._layout import layout_from_given

__all__ = ["ESTIMATE_AC_MODES", "EstimateError", "EstimateResult", "estimate", "model_flops_per_token",
           "reserved_bytes"]

ESTIMATE_AC_MODES = (*AC_MODES, "ours")
"""The ``ac=`` values: the AC modes of ``ac_plan`` and ``ours`` (the fastest plan under the device's memory)."""


class EstimateError(ValueError):
    """An estimate's arguments that do not fit together (GPUs against the layout, hardware, AC mode)."""


@dataclass(frozen=True)
class EstimateResult:
    """One rank's predicted memory and the run's predicted speed."""

    fits: bool
    """The reserved peak is at most the device's memory."""
    peak_allocated_bytes: int
    """Predicted peak bytes allocated on the busiest rank (static memory included)."""
    peak_reserved_bytes: int
    """The same as the caching allocator reserves it (:func:`reserved_bytes`)."""
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    """Model FLOPs utilisation, a fraction of the hardware's peak half-precision FLOPs."""
    headroom_bytes: int
    """Device memory minus the reserved peak: negative by as much as the run misses."""
    device_memory_bytes: int
    hardware: str
    gpus: int
    precision: str
    ac: str
    layout: Layout
    compile: bool = False
    """The blocks run compiled by inductor (modelled: ``profiler.compiled_estimate``)."""
    plan: Plan | None = field(default=None, repr=False)
    """The plan simulated (for ``ac="ours"`` the one searched; None when no plan fits)."""
    note: str | None = None
    """Why ``ours`` found no plan under the device's memory (its figures are then full recompute's)."""

    def to_dict(self) -> dict[str, Any]:
        """The figures as one JSON object (``adaptive-mem estimate --json``)."""
        out = {k: getattr(self, k) for k in ("fits", "peak_allocated_bytes", "peak_reserved_bytes", "step_time_s",
                                             "tokens_per_s_per_gpu", "mfu", "headroom_bytes", "device_memory_bytes",
                                             "hardware", "gpus", "precision", "ac")}
        out["layout"] = self.layout.to_dict()
        if self.ac == "ours":
            out["plan"] = self.plan.to_dict() if self.plan is not None else None
        if self.compile:
            out["compile"] = True
        if self.note:
            out["note"] = self.note
        return out


def reserved_bytes(allocated: int, profile: Profile) -> int:
    """Note: [reserved from allocated] the bytes the CUDA caching allocator holds for ``allocated`` live bytes of
    a step of ``profile``: the allocator reserve model of the simulator (``search.planning.reserved_at_peak``,
    docs/search.md "Reserved bytes"); equal to ``allocated`` off CUDA targets."""
    return int(reserved_at_peak(StepModel.build(profile), int(allocated)))


def model_flops_per_token(*, parameters: float, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Model FLOPs per trained token, forward and backward, recompute not counted: ``6 N + 12 L h s`` (the
    matmuls of ``N`` parameters, three times two FLOPs per multiply-add, and the attention scores and their
    weighted sum of ``L`` layers of width ``h`` over ``s`` positions; Narayanan et al. 2021, appendix)."""
    return 6.0 * parameters + 12.0 * num_layers * hidden_size * seq_len


def _positive(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit() or int(value) < 1:
        raise EstimateError(f"{key}={value!r}: expected an integer >= 1")
    return int(value)


def _check_ac(ac: Any) -> str:
    """``ac`` as given: ``ours`` or a mode ``ac_plan`` takes (its parser decides)."""
    if ac == "ours":
        return ac
    try:
        parse_ac_mode(ac)
    except ConfigError:
        raise EstimateError(f"--ac={ac!r}: expected one of {', '.join(ESTIMATE_AC_MODES)} (N an integer >= 1)") from None
    return ac


def _check_hardware(hardware: Any) -> str:
    name = str(hardware).lower() if isinstance(hardware, str) else None
    if name not in profiler.HARDWARE:
        raise EstimateError(f"--hardware={hardware!r}: expected one of {', '.join(profiler.HARDWARE)}")
    return name


def _layout(gpus: Any, given: dict[str, Any]) -> tuple[int, Layout]:
    """``gpus`` and the layout, data parallel filled in from ``gpus`` when not given (Note: [GPUs per layout])."""
    n = _positive("--gpus", gpus)
    if n is None:
        raise EstimateError("--gpus=None: expected an integer >= 1")
    # Note: [GPUs per layout] a run's GPUs are tensor parallel x pipeline stages x data parallel; the data-parallel
    # degree is what is left of the GPUs when it is not named.
    model = layout_from_given({k: v for k, v in given.items() if k in ("tensor_parallel", "pipeline_stages")})
    replica = model.tensor_parallel * model.pipeline_stages
    if given.get("data_parallel") is None:
        if n % replica:
            raise EstimateError(f"--gpus={n}: not a multiple of --tensor-parallel x --pipeline-stages = {replica}; "
                                "expected a multiple")
        given = {**given, "data_parallel": n // replica}
    lay = layout_from_given(given)
    if replica * lay.data_parallel != n:
        raise EstimateError(f"--gpus={n}: --tensor-parallel x --pipeline-stages x --data-parallel = "
                            f"{lay.tensor_parallel} x {lay.pipeline_stages} x {lay.data_parallel} = "
                            f"{replica * lay.data_parallel}; expected them equal")
    return n, lay


_HF_FILE_KEYS = ("model_type", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version",
                 "_name_or_path")
"""Keys of a Hugging Face config.json that describe the file or the checkpoint, not the model's shape."""


def _hf_config(spec: str, model_args: dict | str | None) -> tuple[str, dict[str, Any]]:
    """``hf:path/to/config.json`` (a local Hugging Face config) as ``(hf:<model_type>, model_args)``: the file's
    keys over the config class's own defaults, ``model_args`` over both."""
    from .models._hf import HF_FAMILIES, class_defaults

    path = Path(spec[3:])
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise EstimateError(f"--model={spec!r}: cannot read {str(path)!r} ({exc.strerror}); expected a local "
                            "Hugging Face config.json") from None
    except ValueError:
        raise EstimateError(f"--model={spec!r}: not JSON; expected a Hugging Face config.json") from None
    family = data.get("model_type") if isinstance(data, dict) else None
    if family not in HF_FAMILIES:
        raise EstimateError(f"--model={spec!r}: model_type={family!r}; expected one of {', '.join(HF_FAMILIES)}")
    try:
        import transformers
    except ImportError:
        raise EstimateError(f"--model={spec!r}: needs transformers (pip install 'adaptive-mem[hf]')") from None
    class_name, tiny = HF_FAMILIES[family]
    config_cls = getattr(transformers, class_name)
    default = config_cls()
    args = class_defaults(config_cls, tiny)  # not the family's tiny test shape; None: the class derives it
    args.update({k: v for k, v in data.items() if k not in _HF_FILE_KEYS and hasattr(default, k)})
    return f"hf:{family}", {**args, **parse_model_args(model_args)}


def _simulate(profile: Profile, plan: Plan, layout: Layout) -> tuple[int, float]:
    """Peak bytes of the busiest rank and the step's seconds of ``plan``, stage by stage as :func:`search`
    figures its own plans; an ``op`` plan holds what torchtitan's policy caches (Note: [torchtitan SAC cache])."""
    stages = stages_of(profile, layout, None)
    if plan.meta.get("ac_mode") == "op":
        stages = [replace(st, model=titan_op_model(st.model)) for st in stages]
    results = []
    for st in stages:
        asg = resolve(st.model, plan)
        sim = simulate_assignment(st.model, asg, in_flight=st.in_flight)
        results.append(SolveResult(solver=str(plan.meta.get("ac_mode")), plan=plan, cost=PredictedCost.of(sim),
                                   stats=SolverStats(solve_time=0.0), budget=0, assignment=asg))
    if layout == Layout():
        return results[0].cost.peak_bytes, results[0].cost.step_time
    ranks, step = rank_figures(plan, stages, results, layout)
    return max(r["predicted_peak_bytes"] for r in ranks), step


def _allocated_budget(profile: Profile) -> int:
    """Allocated bytes whose modelled reserve fills the device (Note: [reserved from allocated]): ``ours`` is searched
    under them, so its plan fits as ``fits`` judges it (on reserved bytes)."""
    capacity = int(profile.hardware.device_memory)
    return 2 * capacity - reserved_bytes(capacity, profile)


_SHRINKS = 2
"""How many times ``ours`` shrinks its budget by a reserved overshoot before it gives up (Note: [ours in
reserved bytes])."""


def _search_fitting(profile: Profile, solver: str) -> SearchResult:
    """:func:`search`'s plan for one rank whose reserved peak fits the device (Note: [ours in reserved bytes]).

    Note: [ours in reserved bytes] the search budgets allocated bytes while ``fits`` judges reserved ones
    (Note: [reserved from allocated]), so ours searches under the device's memory less the allocator reserve
    predicted at that memory (``_allocated_budget``); should the plan found still overshoot in reserved bytes (a
    rank's chunks together, a reserve that grows faster than the peak), the budget shrinks by the overshoot, at
    most ``_SHRINKS`` times.
    A plan ``ours`` returns fits by construction; none found raises ``InfeasibleBudgetError``."""
    capacity = int(profile.hardware.device_memory)
    budget = _allocated_budget(profile)
    for _ in range(1 + _SHRINKS):
        if budget <= 0:
            break
        found = search(profile, budget=budget, solver=solver)
        over = reserved_bytes(found.peak_bytes, profile) - capacity
        if over <= 0:
            return found
        budget -= over
    raise InfeasibleBudgetError(f"--ac='ours': no plan's reserved peak fits the {profile.hardware.name}'s "
                                f"{fmt_bytes(capacity)}; expected a larger device or more sharding")


def _figures(profile: Profile, ac: str, layout: Layout, solver: str) -> tuple[Plan | None, int, float, str | None]:
    """(plan, peak bytes, step seconds, note) of the AC mode on one rank's profile."""
    if ac != "ours":
        plan = ac_plan(ac, profile)
        return (plan, *_simulate(profile, plan, layout), None)
    try:
        found = _search_fitting(profile, solver)
    except (InfeasibleBudgetError, DeviceMemoryError) as exc:
        plan = ac_plan("full", profile)
        note = f"no plan fits the device's memory ({' '.join(str(exc).split())}); figures of full recompute"
        return (None, *_simulate(profile, plan, layout), note)
    return found.plan, found.peak_bytes, found.step_time, None


def estimate(model: str, *, hardware: str = "h100", gpus: int = 1, precision: str = "bf16",
             batch_size: int | None = None, seq_len: int | None = None, ac: str = "none",
             model_args: dict | str | None = None, tensor_parallel: int | None = None,
             pipeline_stages: int | None = None, virtual_pipeline_stages: int | None = None,
             data_parallel: int | None = None, micro_batches: int | None = None,
             sequence_parallel: bool | None = None, zero: int | None = None, schedule: str | None = None,
             solver: str = "milp", compile: bool = False) -> EstimateResult:
    """Predicted per-rank peak memory, step time, tokens/s per GPU and MFU of training ``model`` (a model spec
    as :func:`adaptive_mem.build_model` takes it, or ``hf:path/to/config.json``: a local Hugging Face config) on ``gpus`` devices of ``hardware`` (``h100``, ``h200``,
    ``a100``, ``ascend-910b``) under the precision recipe ``precision`` (``profiler.PRECISIONS``) with the AC
    mode ``ac`` (``ESTIMATE_AC_MODES``). ``batch_size`` is the micro-batch; the layout keys are
    :func:`adaptive_mem.search`'s, and ``gpus`` must equal their product (data parallel filled in when not
    given: Note: [GPUs per layout]). ``compile``: every block compiled by inductor, torchtitan's layout (its saved
    bytes and times modelled: ``profiler.compiled_estimate``, Note: [compile model]). Bad arguments raise a
    ``ValueError`` subclass naming the key."""
    ac, name = _check_ac(ac), _check_hardware(hardware)
    if not isinstance(compile, bool):
        raise EstimateError(f"compile={compile!r}: expected True or False")
    recipe = precision_of(precision, key="--precision", optional=False)
    given = dict(tensor_parallel=tensor_parallel, pipeline_stages=pipeline_stages, micro_batches=micro_batches,
                 virtual_pipeline_stages=virtual_pipeline_stages, data_parallel=data_parallel,
                 sequence_parallel=sequence_parallel, zero=zero, schedule=schedule)
    n, lay = _layout(gpus, {k: v for k, v in given.items() if v is not None})
    if isinstance(model, str) and model.startswith("hf:") and model.endswith(".json"):
        model, model_args = _hf_config(model, model_args)
    bundle = build_model(model, model_args=model_args, batch_size=_positive("--batch-size", batch_size),
                         seq_len=_positive("--seq-len", seq_len), device="meta", dtype=recipe.model_dtype)
    # the spec for the dtype matmuls compute in: under autocast the parameters are fp32, the matmuls not
    spec = profiler.hardware_spec(name, dtype=getattr(torch, recipe.compute))
    whole = profiler.profile_step(bundle, hardware=spec, optimizer="adam", precision=recipe.name)
    if compile:
        whole = profiler.compiled_estimate(whole)
    rank = whole if lay == Layout() else rank_share(whole, bundle.model, lay)  # as `adaptive-mem profile` cuts it
    lay = Layout.from_dict(rank.model["layout"]) if rank.model.get("layout") else lay
    plan, allocated, step, note = _figures(rank, ac, lay, solver)
    tokens = bundle.batch_size * bundle.seq_len * lay.micro_batches  # one data-parallel replica's step
    per_gpu = tokens / step / (lay.tensor_parallel * lay.pipeline_stages)
    flops = model_flops_per_token(parameters=int(whole.model.get("parameters") or 0), num_layers=whole.num_layers,
                                  hidden_size=int(getattr(getattr(bundle.model, "config", None), "hidden_size", 0)),
                                  seq_len=bundle.seq_len)
    reserved, capacity = reserved_bytes(allocated, rank), int(rank.hardware.device_memory)
    return EstimateResult(
        fits=reserved <= capacity, peak_allocated_bytes=int(allocated), peak_reserved_bytes=reserved,
        step_time_s=float(step), tokens_per_s_per_gpu=per_gpu, mfu=flops * per_gpu / profiler.HARDWARE[name].half_flops,
        headroom_bytes=capacity - reserved, device_memory_bytes=capacity, hardware=name, gpus=n,
        precision=recipe.name, ac=ac, layout=lay, compile=compile, plan=plan, note=note)
