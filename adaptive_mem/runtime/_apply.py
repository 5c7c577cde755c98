"""``apply_plan``: validate a plan against a model, then apply all of it or nothing (``adaptive_mem.optimize``'s
plan=/config= path, and the adaptive loop's)."""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from profiler.naming import input_fingerprint, split_fingerprint
from profiler.naming import ModelStructure, is_data_parallel
from profiler.naming import UnitNamer
from search import Plan, PlanError

from adaptive_mem.runtime._executor import Executor
from adaptive_mem.runtime._resolve import LayerMode, Resolution, is_collective_unit, log_plan, resolve_plan
from adaptive_mem.runtime._summary import PlanSummary, summarize
from adaptive_mem.runtime._spill import as_host_budget
from adaptive_mem.runtime._swap_engine import SwapStats

__all__ = ["apply_plan", "OptimizeHandle", "PlanSummary", "trace_units"]

log = logging.getLogger(__name__)

_APPLIED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


class OptimizeHandle:
    """What :func:`optimize` returns: a context manager whose exit (or :meth:`remove`) restores the model."""

    def __init__(self, model: nn.Module, plan: Plan, executor: Executor, res: Resolution, *,
                 summary: PlanSummary | None = None) -> None:
        self.model = model
        self.plan = plan
        self.resolution = res
        self._summary = summary if summary is not None else summarize(plan, res)
        self._executor: Executor | None = executor
        self._check: Any = None
        self.compiled: Any = None  # the CompiledLayers of optimize(compile=...), made plain again by remove()

    @property
    def swap_stats(self) -> SwapStats | None:
        engine = self._executor.engine if self._executor is not None else None
        return engine.stats if engine is not None else None

    @property
    def host_bytes(self) -> int:
        """Host bytes held by the swap pool (0 without swaps)."""
        engine = self._executor.engine if self._executor is not None else None
        return engine.host_bytes if engine is not None else 0

    @property
    def active(self) -> bool:
        return self._executor is not None

    def summary(self) -> PlanSummary:
        """What took effect when the plan was applied (``str()`` of it is the line ``optimize`` logged)."""
        return self._summary

    def remove(self) -> None:
        """Take every wrapper and hook off the model; safe to call twice."""
        if self._check is not None:
            self._check.remove()
            self._check = None
        if self._executor is not None:
            self._executor.remove()
            self._executor = None
            ref = _APPLIED.get(self.model)
            if ref is not None and ref() is self:
                del _APPLIED[self.model]
        if self.compiled is not None:
            self.compiled.remove()
            self.compiled = None

    def __enter__(self) -> "OptimizeHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _load_plan(plan: Any, config: Any, model: nn.Module) -> Plan:
    if plan is not None and config is not None:
        raise ValueError("optimize: plan= and config= both given; expected one of them")
    if config is not None:
        try:
            from adaptive_mem.config import plan_from_config
        except ImportError as exc:
            raise ValueError(f"optimize: config= needs the config front-ends (adaptive_mem.config): {exc}") from None
        plan = plan_from_config(config, model=model)
    if plan is None:
        raise ValueError("optimize: no plan; expected plan=Plan|path or config=<MindFormers/Megatron config>")
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if not isinstance(plan, Plan):
        raise ValueError(f"optimize: plan={type(plan).__name__}: expected a Plan, a dict or a path to a plan file")
    return plan


def _dtype_name(model: nn.Module) -> str:
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return str(param.dtype).removeprefix("torch.") if param is not None else "float32"


def _check_structure(plan: Plan, structure: ModelStructure) -> None:
    if not plan.fingerprint:
        return
    want, _ = split_fingerprint(plan.fingerprint)
    have = structure.fingerprint
    if want != have:
        described = ", ".join(f"{k}={v}" for k, v in plan.model.items()) or "another model"
        raise PlanError(f"plan.fingerprint: model structure mismatch: the plan was made for {described} "
                        f"(structure {want}), this model's structure is {have}")


def check_inputs(plan: Plan, model: nn.Module, args: tuple, kwargs: dict) -> None:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    shapes = [list(t.shape) for t in tensors]
    dtype = _dtype_name(model)
    info = plan.model
    if "dtype" in info and str(info["dtype"]).removeprefix("torch.") != dtype:
        raise PlanError(f"plan.model.dtype={info['dtype']!r}: input dtype mismatch: the model runs in {dtype}")
    if "batch_size" in info and "seq_len" in info and shapes and len(shapes[0]) >= 2:
        want = [info["batch_size"], info["seq_len"]]
        if shapes[0][:2] != want:
            raise PlanError(f"plan.model: input shape mismatch: the plan was made for batch_size={want[0]}, "
                            f"seq_len={want[1]}; the model got an input of shape {tuple(shapes[0])}")
        return
    _, want_inputs = split_fingerprint(plan.fingerprint or "")
    if want_inputs is None:
        return
    candidates = {input_fingerprint(shapes, dtype)}
    if shapes:
        candidates.add(input_fingerprint(shapes + [shapes[0]], dtype))  # (inputs, labels) convention
    if want_inputs not in candidates:
        raise PlanError(f"plan.fingerprint: input shape mismatch: the plan was made for other inputs "
                        f"(inputs {want_inputs}); the model got shapes {shapes} in {dtype}")


def trace_units(model: nn.Module, args: tuple, kwargs: dict | None = None, *,
                structure: ModelStructure | None = None) -> list[str]:
    """Unit names of one forward of ``model`` on fake tensors (nothing allocated, no RNG consumed), run on a
    fake clone of it (Note: [throw-away clone]; the clone has the paths of ``model``'s ``structure``)."""
    from torch._subclasses.fake_tensor import maybe_get_fake_mode
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_map

    from adaptive_mem.config._clone import fake_clone, fake_mode_of

    names: dict[str, None] = {}

    class _Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), k=None):
            unit = namer.name(func, a)
            if unit is not None:
                names.setdefault(unit)
            return func(*a, **(k or {}))

    with _disable_current_modes(), torch.random.fork_rng(devices=[]):
        fake = fake_mode_of(model)
        clone, _ = fake_clone(model, fake)
        namer = UnitNamer(clone, layers=(structure.of_model(model) if structure is not None
                                         else ModelStructure.of(model)).layers)
        for module in clone.modules():
            module.register_forward_pre_hook(lambda m, a: namer.enter(m))
            module.register_forward_hook(lambda m, a, o: namer.exit(m), always_call=True)
        fa, fk = tree_map(lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor)
                          and maybe_get_fake_mode(x) is not fake else x, (tuple(args), dict(kwargs or {})))
        with fake, _Names(), torch.enable_grad():  # a training step's kernels (SDPA picks by requires_grad)
            clone(*fa, **fk)
    return list(names)


def _unwrap_data_parallel(model: nn.Module, plan: Plan) -> nn.Module:
    """The model a ``DistributedDataParallel`` / ``DataParallel`` wrapper runs, unless the plan names the wrapper's
    paths (``module.``...): a plan of the bare model applies before or after wrapping (Note: [data-parallel
    wrapper], guarded by tests/test_parallel_exec.py); the wrapper's forward calls it, so its hooks run."""
    if not is_data_parallel(model):
        return model
    return model if any(t == "module" or t.startswith("module.") for t in plan.decisions) else model.module


def apply_plan(model: nn.Module, *, plan: Plan | str | Path | dict | None = None, config: Any = None,
               profile: Any = None, example_inputs: tuple | None = None, host_store: str = "memory",
               host_dir: str | None = None, host_memory_budget: Any = None,
               structure: ModelStructure | None = None, units: list[str] | None = None) -> OptimizeHandle:
    """Apply a keep/recompute/swap plan to ``model`` until the returned handle is removed (the arguments
    are :func:`adaptive_mem.optimize`'s without ``budget``; ``structure``: ``model``'s, when found already;
    ``units``: the step's unit names, when traced already)."""
    if host_store not in ("memory", "file"):
        raise ValueError(f"optimize: host_store={host_store!r}: expected 'memory' or 'file'")
    host_budget = as_host_budget(host_memory_budget)
    plan = _load_plan(plan, config, model)
    model = _unwrap_data_parallel(model, plan)
    previous = _APPLIED.get(model)
    if previous is not None and previous() is not None and previous().active:
        raise ValueError("optimize: this model already has a plan applied; remove() its handle first")
    structure = structure.of_model(model) if structure is not None else ModelStructure.of(model)
    _check_structure(plan, structure)
    if profile is not None:
        if isinstance(profile, (str, Path)):
            from profiler import Profile

            profile = Profile.load(profile)
        units = [u.name for u in profile.units]
    elif example_inputs is not None:
        check_inputs(plan, model, tuple(example_inputs), {})
        units = trace_units(model, tuple(example_inputs), structure=structure)
    res = resolve_plan(plan, model, units=units, structure=structure)
    summary = summarize(plan, res, units=units, profile=profile)
    if plan.distribute_saved_activations and any(m is LayerMode.WHOLE for m in res.modes):
        try:
            from adaptive_mem.runtime._distributed_checkpoint import distributed_checkpoint  # noqa: F401
        except ImportError as exc:
            raise PlanError(f"plan.distribute_saved_activations=true: not available here ({exc})") from None
    executor = Executor(model, plan, res, structure=structure, host_store=host_store, host_dir=host_dir,
                        host_budget=host_budget)
    handle = OptimizeHandle(model, plan, executor, res, summary=summary)
    if bool(plan.fingerprint or plan.model or res.provisional) and example_inputs is None:
        _check_first_forward(handle, executor, structure)
    executor.install()
    _APPLIED[model] = weakref.ref(handle)
    if config is None:  # the config front-ends log the seeds' lines themselves
        log_plan(plan, res)
    log.info("%s", summary)
    if summary.requested and not summary.takes_effect:
        log.warning("optimize: the plan asks for recompute/swap but nothing takes effect: %s", summary.causes())
    return handle


def _check_first_forward(handle: OptimizeHandle, executor: Executor, structure: ModelStructure) -> None:
    """Check the first forward's inputs against the plan, and its provisional targets against a trace of it; a
    refusal removes the plan."""
    plan, model, res = handle.plan, handle.model, handle.resolution

    # Note: [first forward outside dynamo]: under torch.compile(model) the pre-hook runs from the wrapper's
    # eager __call__, but dynamo would compile the hook's own frames (fake-tensor trace: graph breaks).
    @torch.compiler.disable
    def first_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
        handle._check.remove()
        handle._check = None
        try:
            check_inputs(plan, model, args, kwargs)
            if res.provisional:
                _verify_provisional(structure, res.provisional, args, kwargs)
        except PlanError:
            handle.remove()
            raise
    handle._check = model.register_forward_pre_hook(first_forward, prepend=True, with_kwargs=True)
    executor.own(handle._check)  # Note: [copy drops the plan]


def _verify_provisional(structure: ModelStructure, targets: list[str], args: tuple, kwargs: dict) -> None:
    targets = [t for t in targets if not is_collective_unit(t)]  # Note: [collective units]: checked when traced
    if not targets:
        return
    try:
        units = trace_units(structure.model, args, kwargs, structure=structure)
    except Exception as exc:  # a model fake tensors cannot run: the names stay unverified
        log.warning("could not trace unit names on fake tensors (%s); plan targets %s are unverified",
                    type(exc).__name__, ", ".join(targets))
        return
    known = set(units)
    for target in targets:
        if target not in known and not any(u.startswith(target + ".") for u in known):
            hint = ", ".join(sorted(known)[:6])
            raise PlanError(f"plan.decisions.{target!r}: no such unit in this model; expected a unit name such as {hint}")
