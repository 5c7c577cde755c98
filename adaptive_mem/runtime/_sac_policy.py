"""Op-level recompute: the selective-checkpoint policy and the fake-tensor pass it needs.

Note: [SAC policy] (docs/plan-format.md). Inside a layer run under
``create_selective_checkpoint_contexts`` each aten op gets

* ``PREFER_RECOMPUTE`` when its unit is decided ``recompute``, or an in-place op of the
  same layer call later writes its output (a cached tensor must not change);
* ``MUST_SAVE`` when its unit is decided ``swap`` (the cached outputs are what is swapped);
* ``MUST_SAVE`` when autograd saves its output;
* ``PREFER_RECOMPUTE`` otherwise: nothing is cached that autograd would not have saved,
  so op-level recompute never holds more than keeping. The replay stops before the
  kernel of the layer's last op that saves a tensor (PyTorch's early stop), so such
  ops cost replay time only when they run before that point.

Which op outputs autograd saves is learnt once per layer by running a fake
clone of the layer (:func:`trace_layer`): shapes only, nothing allocated.
An op is identified by ``(unit, ordinal)``: its unit name and how many
non-view ops of that unit ran before it in the same layer call.

Note: [swap slots without op_output]. The forward policy finds a swap unit's output to hand its cache slot to the
swap engine. PyTorch versions whose ``SelectiveCheckpointContext`` carries the op's output (``op_output``, the
policy called after the op) name the slot by the output's storage. Older ones (2.11 among them) call the policy
before the op and keep the cache as ``storage[func]``, a list appended once per saved call after the policy
returns: there the slot is ``(func, len(storage[func]))`` at the policy call. Guarded by tests/test_sac_slots.py.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import CheckpointPolicy

from profiler.naming import OpCounter, UnitNamer
from profiler.tracing import install_fake_fallbacks, tensor_leaves

from ._footprint import FOOTPRINT
from ._swap_engine import no_cycle

__all__ = ["LayerTrace", "OpCounter", "SacPolicy", "TablePolicy", "is_dtensor", "region_path", "trace_layer",
           "under"]

log = logging.getLogger(__name__)


@dataclass
class LayerTrace:
    units: list[str] = field(default_factory=list)
    """Units of the layer call, in order of first appearance."""
    saved_ops: set[tuple[str, int]] = field(default_factory=set)
    """Ops whose outputs autograd saves for backward."""
    consumers: dict[str, set[str]] = field(default_factory=dict)
    """Unit -> units of the same call that read its outputs."""
    mutated_ops: set[tuple[str, int]] = field(default_factory=set)
    """Ops whose output storage an in-place op of the same call writes: SAC cannot cache them."""
    reads: dict[str, set[int]] = field(default_factory=dict)
    """Unit -> the storages its ops read (ids, unique for the pass)."""
    producers: dict[int, str] = field(default_factory=dict)
    """Storage -> the unit whose op allocated it; storages of the call's inputs and parameters have none."""
    mutated: set[int] = field(default_factory=set)
    """Storages an in-place op of the call writes."""
    ops: list[tuple[str, int]] = field(default_factory=list)
    """The keys of the call's ops, in order."""
    saved: set[int] = field(default_factory=set)
    """Storages autograd saves."""
    random: set[str] = field(default_factory=set)
    """Units running an op that draws random numbers."""
    self_saved: set[str] = field(default_factory=set)
    """Units one of whose ops saves a tensor the unit produced, as far as the pass tells (Note: [recompute at
    pack] in ``_pack_recompute.py``): a unit whose last op saves its input also counts."""
    calls: dict[tuple[str, int], tuple[Any, tuple[int | None, ...]]] = field(default_factory=dict)
    """Op -> its function and the storage of each positional argument (None: no tensor); ops with keyword
    arguments are left out (Note: [single-op recompute at pack] in ``_pack_recompute.py``)."""


def _storages(out: Any) -> list[int]:
    return [t.untyped_storage()._cdata for t in tensor_leaves(out)]


class _Recorder(TorchDispatchMode):
    def __init__(self, counter: OpCounter, trace: LayerTrace) -> None:
        super().__init__()
        self.counter = counter
        self.trace = trace
        self.producer: dict[int, str] = {}
        self.outputs: dict[tuple[str, int], list[int]] = {}
        self.mutated: set[int] = set()
        self.first: dict[int, str] = {}
        self.keep: list[Any] = []  # storage ids must stay unique while the pass runs
        self.last: str | None = None
        """The unit of the op dispatched last (None: an op of no unit)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = self.counter.op_key(func, args)
        self.last = None
        out = func(*args, **kwargs)
        if key is None:
            return out
        unit = self.last = key[0]
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.trace.random.add(unit)
        if unit not in self.trace.consumers:
            self.trace.units.append(unit)
            self.trace.consumers[unit] = set()
        reads = self.trace.reads.setdefault(unit, set())
        for cdata in _storages((args, kwargs)):
            reads.add(cdata)
            producer = self.producer.get(cdata)
            if producer is not None and producer != unit:
                self.trace.consumers[producer].add(unit)
        for arg, value in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                     func._schema.arguments[len(args):]]):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                self.mutated.add(value.untyped_storage()._cdata)
        if not kwargs:
            self.trace.calls[key] = (func, tuple(a.untyped_storage()._cdata if isinstance(a, torch.Tensor) else None
                                                 for a in args))
        cdatas = _storages(out)
        self.keep.append(out)
        self.outputs[key] = cdatas
        for cdata in cdatas:
            self.producer[cdata] = unit
            self.first.setdefault(cdata, unit)
        return out


def _devices(tensors: list[Any]) -> list[int]:
    return sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"})


class _RealPass(Exception):
    """The layer is traced on real tensors at once."""


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def trace_layer(layer: nn.Module, forward: Callable[..., Any], counter: OpCounter, args: tuple,
                kwargs: dict) -> LayerTrace:
    """Run the layer call ``forward(*args, **kwargs)`` (``forward``: ``layer``'s own forward) once on a
    throw-away clone of ``layer`` (Note: [throw-away clone]) and record units, consumers and which op
    outputs autograd saves: on fake tensors, else (data-dependent ops) on real ones, parameters aliased
    read-only, buffers copied, RNG state restored.

    Note: [tensor-parallel trace] a layer with DTensor parameters (``parallelize_module``) is traced on real
    tensors with its layout hooks (``clone_module(layout_hooks=True)``), so the pass sees the ops the policy
    sees: DTensor-level ops and the layout's collectives. The pass runs those collectives once, on every rank
    of the group at the same layer call (each rank prepares the layer at its first call with grad), so the
    ranks stay in step (tests/test_parallel_exec.py)."""
    tensors = tree_flatten((args, kwargs))[0] + list(layer.parameters())
    with _disable_current_modes(), torch.random.fork_rng(devices=_devices(tensors)):
        try:
            recorder, saved = _fake_pass(layer, forward, counter, args, kwargs)
        except Exception as exc:  # data-dependent ops: learn the same facts from one real forward, discarded
            log.info("fake-tensor pass of the layer failed (%s: %s); tracing it on real tensors once",
                     type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
            recorder, saved = _real_pass(layer, forward, counter, args, kwargs)
    trace = recorder.trace
    trace.saved_ops = {key for key, cdatas in recorder.outputs.items() if any(c in saved for c in cdatas)}
    trace.mutated_ops = {key for key, cdatas in recorder.outputs.items() if any(c in recorder.mutated for c in cdatas)}
    trace.producers, trace.mutated, trace.ops = recorder.first, recorder.mutated, list(recorder.outputs)
    trace.saved = saved
    return trace


def _fake_pass(layer: nn.Module, forward: Callable[..., Any], counter: OpCounter, args: tuple,
               kwargs: dict) -> tuple[_Recorder, set[int]]:
    """The pass on a fake clone; raises for a layer that needs real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from adaptive_mem.config._clone import fake_clone

    if any(is_dtensor(p) for p in layer.parameters()):  # Note: [tensor-parallel trace]
        raise _RealPass("DTensor parameters (tensor parallel)")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    clone, originals = fake_clone(layer, fake)
    fargs, fkwargs = tree_map(lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    install_fake_fallbacks()  # Note: [fake op fallbacks]
    with fake:
        return _run_on(layer, forward, counter, clone, originals, fargs, fkwargs)


def _real_pass(layer: nn.Module, forward: Callable[..., Any], counter: OpCounter, args: tuple,
               kwargs: dict) -> tuple[_Recorder, set[int]]:
    """The pass on a real clone (parameters aliased read-only, buffers copied); its graph is discarded."""
    from adaptive_mem.config._clone import clone_module

    versions = [(p, p._version) for p in layer.parameters()]
    clone, originals = clone_module(layer, lambda t, is_param: nn.Parameter(
        t.detach(), requires_grad=t.requires_grad) if is_param else t.detach().clone(), layout_hooks=True)
    rargs, rkwargs = tree_map(lambda x: x.detach().requires_grad_(x.requires_grad)
                              if isinstance(x, torch.Tensor) and x.is_floating_point() else x, (args, kwargs))
    out = _run_on(layer, forward, counter, clone, originals, rargs, rkwargs)
    changed = [p for p, v in versions if p._version != v]
    if changed:
        raise RuntimeError(f"selective checkpoint: the layer's forward wrote to {len(changed)} of its "
                           "parameters in place; op-level plans need a forward that leaves them unchanged")
    return out


def _run_on(layer: nn.Module, forward: Callable[..., Any], counter: OpCounter, clone: nn.Module,
            originals: dict[int, nn.Module], cargs: tuple, ckwargs: dict) -> tuple[_Recorder, set[int]]:
    """One layer call on ``clone``, named as ``layer``: the recorder, and the storages autograd saved."""
    from adaptive_mem.config._clone import rebind

    call = rebind(forward, layer, clone) or type(clone).forward.__get__(clone)
    saved: set[int] = set()
    recorder = _Recorder(counter, LayerTrace())

    def pack(t: torch.Tensor) -> torch.Tensor:
        cdata = t.untyped_storage()._cdata
        saved.add(cdata)
        if recorder.last is not None and recorder.producer.get(cdata) == recorder.last:
            recorder.trace.self_saved.add(recorder.last)
        return no_cycle(t)  # the clone's graph is dropped without backward

    with _named_as_originals(counter.namer, clone, originals):
        counter.reset()
        with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
            call(*cargs, **ckwargs)
    return recorder, saved


@contextlib.contextmanager
def _named_as_originals(namer: UnitNamer, clone: nn.Module, originals: dict[int, nn.Module]) -> Iterator[None]:
    """For one pass: the clone's modules named by ``namer`` as the originals they copy, the namer's hooks on them,
    and the namer's stack starting at the clone."""
    aliased = [id(c) for c in clone.modules() if id(originals[id(c)]) in namer.paths]
    for c in clone.modules():
        o = id(originals[id(c)])
        if o in namer.paths:
            namer.paths[id(c)] = namer.paths[o]
            if o in namer.leaves:
                namer.leaves.add(id(c))
                namer.labels[id(c)] = namer.labels[o]
        c.register_forward_pre_hook(lambda m, a: namer.enter(m), prepend=True)  # Note: [collective units]
        c.register_forward_hook(lambda m, a, o: namer.exit(m), always_call=True)
    stack, namer._stack = namer._stack, [(clone, {})]
    try:
        yield
    finally:
        namer._stack = stack
        for key in aliased:
            namer.paths.pop(key, None)
            namer.leaves.discard(key)
            namer.labels.pop(key, None)


def under(unit: str, path: str) -> bool:
    """``unit`` is named inside the module at ``path``."""
    return unit == path or unit.startswith(path + ".")


def region_path(trace: LayerTrace, actions: dict[str, str], paths: Iterable[str]) -> str | None:
    """Note: [narrowed select recompute]. A layer whose select recompute decides units of one module alone needs
    no checkpoint of the whole layer: checkpointing that module (the innermost of ``paths``, the layer's modules,
    holding every recomputed unit and every reader of its outputs: a reader outside would save the output, freeing
    nothing) under the same policy frees and recomputes the same outputs, and the dispatch modes of the checkpoint,
    its policy and its replay cover that module's ops only, not the layer's. The layer's other ops save what
    autograd saves, as the layer's policy would have cached. The region's inputs must not be written in place by
    the layer (the replay reads them in backward). None: no such module but the layer itself. The executor
    checks at the region's first call that it runs once per layer call and runs the traced ops
    (``SelectiveLayers._region_call``). Guarded by tests/test_footprint_sac.py."""
    recomputed = [u for u in trace.units if actions.get(u) == "recompute"]
    if not recomputed:
        return None
    paths = sorted(paths, key=len, reverse=True)
    held = recomputed + [c for u in recomputed for c in trace.consumers.get(u, ())]
    owners = [next((p for p in paths if under(u, p)), "") for u in held]
    parts = owners[0].split(".")
    for owner in owners[1:]:
        other = owner.split(".")
        n = next((k for k, (a, b) in enumerate(zip(parts, other)) if a != b), min(len(parts), len(other)))
        parts = parts[:n]
    path = ".".join(parts)
    while path and path not in paths:
        path = path.rpartition(".")[0]
    if not path:
        return None
    inputs = {s for u in trace.units if under(u, path) for s in trace.reads.get(u, ())
              if not under(trace.producers.get(s, ""), path)}
    return None if inputs & trace.mutated else path


class SacPolicy:
    """The policy function of one layer call, naming each op; ``action(unit)`` gives the unit's resolved action.
    It records what it answers (:attr:`funcs`, :attr:`policies`, :attr:`keys`): the table of :class:`TablePolicy`."""

    def __init__(self, counter: OpCounter, trace: LayerTrace, action: Callable[[str], str],
                 on_swap_output: Callable[[Any, str], None], cached: frozenset[str] = frozenset()) -> None:
        self.cached = cached
        """Collective units a plan keeps by name: their outputs are cached, the replay does not re-issue them."""
        self.counter = counter
        self.trace = trace
        self.action = action
        self.on_swap_output = on_swap_output
        self.on_swap_slot: Callable[[Any, int, str], None] | None = None
        self.storage: Any = None
        """The forward context's cache (set per forward): its slots name swaps without ``op_output``."""
        self.funcs: list[Any] = []
        self.policies: list[CheckpointPolicy] = []
        self.keys: list[tuple[str, int] | None] = []

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        FOOTPRINT.dispatch += 1
        key = self.counter.op_key(func, args)
        policy = self._decide(ctx, key, func)
        self.funcs.append(func)
        self.policies.append(policy)
        self.keys.append(key)
        return policy

    def _decide(self, ctx: Any, key: tuple[str, int] | None, func: Any) -> CheckpointPolicy:
        if key is None:
            return CheckpointPolicy.PREFER_RECOMPUTE
        action = self.action(key[0])
        if action == "recompute" or key in self.trace.mutated_ops:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if action == "swap":
            if not ctx.is_recompute:
                if hasattr(ctx, "op_output"):
                    self.on_swap_output(ctx.op_output, key[0])
                else:  # Note: [swap slots without op_output]
                    self.on_swap_slot(func, len(self.storage[func]), key[0])
            return CheckpointPolicy.MUST_SAVE
        if key in self.trace.saved_ops or key[0] in self.cached:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


class TablePolicy:
    """Note: [SAC table]. The policy of a checkpointed region's later calls: the answers :class:`SacPolicy` gave at
    a learning call, by op index within the call, each checked against the op it was given for. No names, no
    namer hooks: one index and one identity test per op. An op that is not the one learnt at its index (another
    control flow, more or fewer ops) marks the call :attr:`diverged`: it and every later op of the call are
    recomputed, which is exact whatever was cached before (only the memory and the time differ), and the region
    learns again at its next call. Guarded by tests/test_footprint_sac.py."""

    __slots__ = ("funcs", "policies", "i", "diverged")

    def __init__(self, funcs: tuple[Any, ...], policies: tuple[CheckpointPolicy, ...]) -> None:
        self.funcs = funcs
        self.policies = policies
        self.i = 0
        self.diverged = False

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        FOOTPRINT.dispatch += 1
        i = self.i
        self.i = i + 1
        if not self.diverged and i < len(self.funcs) and self.funcs[i] is func:
            return self.policies[i]
        self.diverged = True
        return CheckpointPolicy.PREFER_RECOMPUTE

    def finished(self) -> bool:
        """The call ran exactly the ops learnt (else it counts as diverged)."""
        if self.i != len(self.funcs):
            self.diverged = True
        return not self.diverged
