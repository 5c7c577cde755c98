"""A plan per sequence-length bucket, picked per step (Note: [plan buckets]): ``optimize(model, plan=<file with
buckets>)`` and ``adaptive-mem run --plan`` apply the plan of the bucket each forward's inputs fall in.

Note: [plan per step] each call of the model first reads the step's length (:func:`seq_len_of`) and, when its
bucket is not the applied plan's, removes that plan and applies the bucket's: a switch happens between steps (the
previous step's backward has finished), and only when the bucket changes. It happens before ``Module.__call__``
(the model's class is a subclass whose ``__call__`` picks first, until the handle is removed), not in a forward
pre-hook: a call runs the hooks registered when it began, so a plan applied from a hook would miss its own root
hooks (the swap engine's begin-forward) and run the removed plan's. The plans applied are the buckets' without
their input shapes (``model.seq_len``, the fingerprint's input half: a step shorter than its bucket is what the
bucket is for); the model's structure and dtype are still checked. The step's unit names are traced once, at the
first forward, so later plans apply without a trace each.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from profiler.naming import ModelStructure, split_fingerprint
from profiler.tracing import tensor_leaves
from search import Plan, PlanError, seq_len_bucket

from adaptive_mem.runtime._apply import OptimizeHandle, apply_plan, trace_units
from adaptive_mem.runtime._resolve import resolve_plan
from adaptive_mem.runtime._summary import PlanSummary

__all__ = ["BucketedHandle", "apply_any_plan", "pick_before_call", "plan_for_inputs", "plan_for_seq_len", "seq_len_of",
           "stop_picking"]

log = logging.getLogger(__name__)


def seq_len_of(args: tuple, kwargs: dict | None = None) -> int | None:
    """The step's sequence length: dim 1 of its first integer tensor of two or more dims (``input_ids`` [batch,
    seq]; packed, batch 1: the total tokens), else of its first tensor of two or more dims; None without one."""
    tensors = [t for t in tensor_leaves((tuple(args), dict(kwargs or {}))) if t.dim() >= 2]
    ints = [t for t in tensors if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)]
    pick = ints[0] if ints else (tensors[0] if tensors else None)
    return None if pick is None else int(pick.shape[1])


def _shapeless(plan: Plan) -> Plan:
    """``plan`` without its input length (Note: [plan per step])."""
    structure, _ = split_fingerprint(plan.fingerprint) if plan.fingerprint else (None, None)
    return Plan(decisions=dict(plan.decisions), fingerprint=structure,
                model={k: v for k, v in plan.model.items() if k != "seq_len"}, meta=dict(plan.meta),
                groups=[list(g) for g in plan.groups], distribute_saved_activations=plan.distribute_saved_activations)


def plan_for_seq_len(plan: Plan, seq_len: int | None) -> Plan:
    """The plan for steps of ``seq_len`` tokens: ``plan`` itself without buckets, else its bucket's (without the
    input length; None: the longest bucket's); a length above every bucket raises :class:`search.SeqLenBucketError`."""
    if not plan.buckets:
        return plan
    return _shapeless(plan.buckets[-1][1] if seq_len is None else plan.for_seq_len(seq_len))


def plan_for_inputs(plan: Plan, args: tuple, kwargs: dict | None = None) -> Plan:
    """The plan that applies to a step on these inputs (:func:`plan_for_seq_len` of their length)."""
    return plan_for_seq_len(plan, seq_len_of(args, kwargs) if plan.buckets else None)


class BucketedHandle(OptimizeHandle):
    """:class:`OptimizeHandle` of a plan with buckets: the bucket's plan applied per step (Note: [plan per step])."""

    def __init__(self, model: nn.Module, plan: Plan, apply: Callable[..., OptimizeHandle]) -> None:
        self.model = model
        self.plan = plan
        self.compiled = None
        self._apply = apply
        self._plans = {s: _shapeless(p) for s, p in plan.buckets}
        self._lengths = tuple(self._plans)
        self._units: list[str] | None = None
        self._traced = False
        self.bucket = self._lengths[-1]
        """The sequence-length bucket whose plan is applied."""
        self.switches = 0
        """Plan switches made at a forward (the first plan, applied by ``optimize``, not counted)."""
        self._inner: OptimizeHandle | None = apply(self._plans[self.bucket])
        pick_before_call(model, self)

    @torch.compiler.disable
    def pick(self, args: tuple, kwargs: dict) -> None:
        """Apply the plan of the bucket these inputs fall in, unless it is applied (Note: [plan per step])."""
        s = seq_len_of(args, kwargs)
        if not self._traced:
            self._traced = True
            try:  # Note: [plan per step]: once, so that later plans apply without a trace each
                self._units = trace_units(self.model, args, kwargs)
            except Exception as exc:  # a model fake tensors cannot run: each plan checks its own first forward
                log.warning("plan buckets: the unit names were not traced once on fake tensors (%s: %s); each "
                            "bucket's plan traces them at its own first forward", type(exc).__name__, exc)
        bucket = self._lengths[-1] if s is None else seq_len_bucket(s, self._lengths)
        if bucket == self.bucket or self._inner is None:
            return
        self._inner.remove()
        self._inner = None
        try:
            self._inner = self._apply(self._plans[bucket], units=self._units)
        except Exception:  # the model is left plain and says so, not half planned
            self.remove()
            raise
        log.info("plan buckets: sequence length %d, the plan of bucket %d (was %d)", s, bucket, self.bucket)
        self.bucket = bucket
        self.switches += 1

    @property
    def resolution(self) -> Any:
        return self._inner.resolution if self._inner is not None else None

    @property
    def swap_stats(self) -> Any:
        return self._inner.swap_stats if self._inner is not None else None

    @property
    def host_bytes(self) -> int:
        return self._inner.host_bytes if self._inner is not None else 0

    @property
    def active(self) -> bool:
        return self._inner is not None

    def summary(self) -> PlanSummary:
        """What the applied bucket's plan changes (its line was logged when it was applied)."""
        return self._inner.summary() if self._inner is not None else None

    def remove(self) -> None:
        stop_picking(self.model, self)
        if self._inner is not None:
            self._inner.remove()
            self._inner = None


_PICKERS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
_CLASSES: dict[type, type] = {}


def pick_before_call(model: nn.Module, picker: Any) -> None:
    """Call ``picker.pick(args, kwargs)`` at each call of ``model``, before ``Module.__call__`` runs its hooks
    (Note: [plan per step]), until :func:`stop_picking`; one picker per model (ValueError for a second)."""
    if _PICKERS.get(model) is not None:
        raise ValueError(f"model={type(model).__name__}: already picks a plan per call (a bucketed plan or the "
                         "adaptive loop); expected one of them, remove() the other first")
    _PICKERS[model] = picker
    if type(model) not in _CLASSES.values():
        model.__class__ = _picking_class(type(model))


def stop_picking(model: nn.Module, picker: Any) -> None:
    """Undo :func:`pick_before_call` of ``picker``; the model's class is restored unless a wrapper applied since
    (FSDP2's ``fully_shard``) made a class of its own on top, which then calls the model plain."""
    if _PICKERS.get(model) is not picker:
        return
    del _PICKERS[model]
    cls = type(model)
    if cls in _CLASSES.values():
        model.__class__ = cls.__bases__[0]


def _picking_class(cls: type) -> type:
    """``cls`` with a ``__call__`` that picks the step's plan first (Note: [plan per step]); a copy of the model
    keeps the class but has no picker, and runs plain."""
    if cls not in _CLASSES:
        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            picker = _PICKERS.get(self)
            if picker is not None:
                picker.pick(args, kwargs)
            return super(sub, self).__call__(*args, **kwargs)
        sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _CLASSES[cls] = sub
    return _CLASSES[cls]


def _load(plan: Any) -> Any:
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    return Plan.from_dict(plan) if isinstance(plan, dict) else plan


def apply_any_plan(model: nn.Module, *, plan: Any = None, compile_options: Any = None,
                   **kwargs: Any) -> OptimizeHandle:
    """``apply_plan``, or for a plan with buckets (Note: [plan buckets]) a :class:`BucketedHandle`: every bucket's
    plan checked against ``model`` first, the longest's applied until the first forward picks."""
    plan = _load(plan)
    if not isinstance(plan, Plan) or not plan.buckets:
        return apply_plan(model, plan=plan, **kwargs)
    if compile_options is not None:
        raise PlanError("optimize: compile= with a plan per sequence-length bucket: expected one of them (compile "
                        "per block yourself before optimize)")
    if kwargs.get("config") is not None:
        raise ValueError("optimize: plan= and config= both given; expected one of them")
    structure = kwargs.pop("structure", None) or ModelStructure.of(model)
    for s, bucket in plan.buckets:
        try:
            resolve_plan(_shapeless(bucket), model, structure=structure)
        except PlanError as exc:
            raise PlanError(f"plan.buckets seq_len={s}: {exc}") from None

    def apply(one: Plan, units: list[str] | None = None) -> OptimizeHandle:
        return apply_plan(model, plan=one, structure=structure, units=units, **kwargs)
    return BucketedHandle(model, plan, apply)
