"""What each block saves and costs when it runs compiled (``torch.compile`` per block, torchtitan's layout).

The recorder sees eager aten ops; a compiled block saves what its partitioner decided. Each block's call
is wrapped (an instance ``forward``, taken off afterwards) so that a
``torch.autograd.graph.saved_tensors_hooks`` context is entered around the compiled call: its pack hook
sees every tensor the compiled function saves for backward (the hook runs outside the traced region, so
the block compiles with 0 graph breaks). Parameters, buffers and their views are static and not counted;
each storage is counted once per block call. Gradient hooks on the block's input and output time its
backward; wall time around the call times its forward.

Three variants of every block, interleaved step by step: ``eager``, ``keep`` (compiled) and ``full``
(compiled around ``torch.utils.checkpoint``: full recompute). While ``keep`` compiles, a partition observer
(Note: [partitioner hook]) reads what each block's forward graph saves per unit (Note: [graph unit names]):
``units`` of a layer's row, names relative to the layer. :func:`apply_compiled` rewrites a profile's per-op
figures into the compiled model's (Note: [compiled profile]).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from typing import Any, Callable

import torch

from ._graph_names import saved_unit_bytes
from ._partitions import fresh_call, observe_partitions
from ._units import UnitNamer

__all__ = ["LAYOUTS", "VARIANTS", "CompileBackendError", "apply_compiled", "check_backend", "check_layout",
           "check_compiled", "measure_compiled"]

log = logging.getLogger(__name__)

VARIANTS = ("eager", "keep", "full")
LAYOUTS = ("per-block", "whole-model")
"""How the profiled model is compiled: each block on its own, or the whole model (Note: [whole-model compiled
profile])."""
_FIGURES = ("saved_bytes", "fwd_time", "bwd_time")


class CompileBackendError(ValueError):
    """``compile=`` names no ``torch.compile`` backend, or a profile that cannot be measured compiled."""


def check_backend(backend: Any) -> str:
    """``backend`` as a ``torch.compile`` backend name; a one-line ValueError otherwise."""
    import torch._dynamo

    names = sorted(torch._dynamo.list_backends(exclude_tags=()))
    if not isinstance(backend, str) or backend not in names:
        raise CompileBackendError(f"compile={backend!r}: not a torch.compile backend; expected one of {', '.join(names)}")
    return backend


def check_layout(layout: Any, key: str = "layout") -> str:
    """``layout`` as a compiled profile's layout; a one-line ValueError naming ``key`` otherwise."""
    if layout not in LAYOUTS:
        raise CompileBackendError(f"{key}={layout!r}: expected one of {', '.join(LAYOUTS)}")
    return layout


class _Block:
    """Per-step figures of one block: saved bytes, forward seconds, gradient arrival times."""

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple[int, float, float]]] = {v: [] for v in VARIANTS}
        self.saved = 0
        self.fwd = 0.0
        self.t_out: list[float] = []
        self.t_in: list[float] = []

    def close(self, variant: str) -> None:
        bwd = self.t_in[-1] - self.t_out[-1] if self.t_in and self.t_out else 0.0
        self.rows[variant].append((self.saved, self.fwd, max(0.0, bwd)))
        self.t_in.clear()
        self.t_out.clear()

    def medians(self, variant: str) -> dict[str, Any]:
        rows = self.rows[variant]
        return {"saved_bytes": int(statistics.median(r[0] for r in rows)),
                "fwd_time": float(statistics.median(r[1] for r in rows)),
                "bwd_time": float(statistics.median(r[2] for r in rows))}


def _stamp(times: list[float], sync: Callable[[], None]) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        sync()
        times.append(time.perf_counter())
    return hook


def _probe(forwards: dict[str, Callable], block: _Block, state: dict[str, Any], static: set[int],
           sync: Callable[[], None], index: int) -> Callable:
    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in static:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    seen: dict[int, int] = {}

    @functools.wraps(forwards["eager"])
    def run(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and first.requires_grad:
            first.register_hook(_stamp(block.t_in, sync))
        seen.clear()
        state["block"] = index
        sync()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forwards[state["variant"]](*args, **kwargs)
        sync()
        block.fwd = time.perf_counter() - start
        block.saved = sum(seen.values())
        head = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) and out else None
        if isinstance(head, torch.Tensor) and head.requires_grad:
            head.register_hook(_stamp(block.t_out, sync))
        return out
    return run


def _variants(forward: Callable, backend: str) -> dict[str, Callable]:
    from torch.utils.checkpoint import checkpoint

    def full(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return {"eager": forward, "keep": torch.compile(fresh_call(forward), backend=backend),
            "full": torch.compile(fresh_call(full), backend=backend)}


def measure_compiled(model: torch.nn.Module, loss: Callable[[], torch.Tensor], layers: list[torch.nn.Module], *,
                     backend: str, device: torch.device, repeat: int = 3) -> dict[str, Any]:
    """Per block and variant, the medians over ``repeat`` steps of saved bytes, forward and backward seconds;
    and the median step seconds (forward + backward) with every block compiled (``keep``).

    The blocks' ``forward`` are restored (and ``.grad`` cleared) before returning."""
    accel = device.type not in ("cpu", "meta")
    sync = torch.accelerator.synchronize if accel else (lambda: None)  # unverified on GPU
    static = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    state: dict[str, Any] = {"variant": "eager", "block": None}
    blocks = [_Block() for _ in layers]
    tables: list[dict[str, int] | None] = []
    saved_attrs = [layer.__dict__.get("forward") for layer in layers]
    step_times: list[float] = []

    def step(variant: str) -> float:
        state["variant"] = variant
        for p in model.parameters():
            p.grad = None
        sync()
        start = time.perf_counter()
        loss().backward()
        sync()
        seconds = time.perf_counter() - start
        for block in blocks:
            block.close(variant)
        return seconds

    try:
        for layer, block in zip(layers, blocks):
            layer.forward = _probe(_variants(layer.forward, backend), block, state, static, sync, len(tables))
            tables.append(None)
        with observe_partitions(_attribute(model, layers, state, tables)):
            for variant in VARIANTS[1:]:  # compiles; not counted
                step(variant)
        for block in blocks:
            block.rows = {v: [] for v in VARIANTS}
        for _ in range(max(1, repeat)):
            for variant in VARIANTS:
                seconds = step(variant)
                if variant == "keep":
                    step_times.append(seconds)
    finally:
        for layer, attr in zip(layers, saved_attrs):
            if attr is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = attr
        for p in model.parameters():
            p.grad = None
    units = _per_layer(tables)
    return {"backend": backend, "layout": "per-block", "step_time": float(statistics.median(step_times)),
            "layers": [{"layer": i, **{v: b.medians(v) for v in VARIANTS}, **({"units": units[i]} if units[i] is not None
                                                                           else {})} for i, b in enumerate(blocks)]}


def _attribute(model: torch.nn.Module, layers: list[torch.nn.Module], state: dict[str, Any],
               tables: list[dict[str, int] | None]) -> Callable:
    """The partition observer of :func:`measure_compiled`: the saved bytes per unit of the ``keep`` graph of the
    block being called, names relative to its layer (Note: [graph unit names])."""
    namer = UnitNamer(model)

    def observe(fw_module: Any, bw_module: Any, num_fwd_outputs: int) -> None:
        i = state["block"]
        if state["variant"] != "keep" or i is None or tables[i] is not None:
            return
        inside = {id(m) for m in layers[i].modules() if id(m) in namer.paths}
        path = namer.paths[id(layers[i])]
        saved = saved_unit_bytes(fw_module, num_fwd_outputs, namer, lambda mid: mid in inside, default_path=path)
        tables[i] = {name[len(path) + 1:]: n for name, n in saved.items() if name.startswith(path + ".")}
    return observe


def _per_layer(tables: list[dict[str, int] | None]) -> list[dict[str, int] | None]:
    """Each block's table; a block whose call reused another's compiled graph (dynamo compiles a block's code
    once for identical blocks) takes the table of the last block compiled before it."""
    out, last = [], None
    for table in tables:
        last = table if table is not None else last
        out.append(last)
    return out


def _rescale(ops: list, indices: list[int], key: str, target: float, integer: bool) -> None:
    """Scale ``ops[i].key`` over ``indices`` so that they sum to ``target`` (integers: floor, remainder on the largest)."""
    if not indices:
        return
    current = sum(getattr(ops[i], key) for i in indices)
    target = max(0, target)
    if current <= 0:
        value = getattr(ops[indices[0]], key) + target
        ops[indices[0]] = dataclasses.replace(ops[indices[0]], **{key: int(value) if integer else float(value)})
        return
    factor = target / current
    for i in indices:
        value = getattr(ops[i], key) * factor
        ops[i] = dataclasses.replace(ops[i], **{key: int(value) if integer else float(value)})
    if integer:
        largest = max(indices, key=lambda i: getattr(ops[i], key))
        rest = int(target) - sum(getattr(ops[i], key) for i in indices)
        ops[largest] = dataclasses.replace(ops[largest], **{key: getattr(ops[largest], key) + rest})


def apply_compiled(profile: Any, figures: dict[str, Any]) -> Any:
    """``profile`` (eager, recorded) rewritten to the per-block compiled model ``figures`` describe.

    Note: [compiled profile] per block, the units whose outputs stay inside the block get the compiled
    block's saved bytes (eager saved bytes of those units + compiled ``keep`` - eager, both measured by the
    same pack hook). With the row's ``units`` (what the block's partitioned forward graph saves per unit), each
    such unit gets its share of the graph's bytes (a unit the graph saves nothing of gets none), scaled to the
    measured total; without, the total is spread over their ops in proportion. The block's output (read by
    the next block, an input the partitioner cannot drop) keeps its figure. Op forward and backward times are
    scaled so the block sums to the compiled block's measured times. ``peak_memory`` moves by the change in
    saved bytes (the transient of the step is the eager one), ``step_time`` is the compiled step's. The
    measured figures stay under ``compiled``. With ``whole`` (``layout="whole-model"``), each unit the whole
    model's graph runs then gets what that graph saves of it (Note: [whole-model compiled profile]). Guarded by
    ``tests/test_profile_compiled.py``.
    """
    ops = list(profile.ops)
    layer_of = {u.name: u.layer for u in profile.units}
    delta_total = 0
    for row in figures["layers"]:
        i = row["layer"]
        units = [u for u in profile.units if u.layer == i]
        inner = [u for u in units if all(layer_of.get(c) == i for c in u.consumers)]
        internal = [oi for u in inner for oi in u.ops]
        every = [oi for u in units for oi in u.ops]
        delta = row["keep"]["saved_bytes"] - row["eager"]["saved_bytes"]
        before = sum(ops[oi].saved_bytes for oi in internal)
        _attribute_units(ops, inner, row.get("units"), profile.layer_path(i))
        _rescale(ops, internal, "saved_bytes", before + delta, integer=True)
        delta_total += sum(ops[oi].saved_bytes for oi in internal) - before
        _rescale(ops, every, "fwd_time", row["keep"]["fwd_time"], integer=False)
        _rescale(ops, every, "bwd_time", row["keep"]["bwd_time"], integer=False)
    if figures.get("whole") is not None:  # Note: [whole-model compiled profile]
        delta_total += _apply_whole(ops, profile, figures["whole"])
    units = [dataclasses.replace(u, saved_bytes=sum(ops[oi].saved_bytes for oi in u.ops),
                                 fwd_time=sum(ops[oi].fwd_time for oi in u.ops),
                                 bwd_time=sum(ops[oi].bwd_time for oi in u.ops)) for u in profile.units]
    compiled = {**figures, "eager_step_time": profile.step_time}
    return dataclasses.replace(profile, ops=ops, units=units, peak_memory=int(profile.peak_memory + delta_total),
                               step_time=figures["step_time"], compiled=compiled, layer_forward=[])  # eager


def _folded(profile: Any, table: dict[str, int]) -> dict[str, int]:
    """``table`` with the bytes of names the profile lacks (ops the compiler decomposed into others, e.g. the
    ``where`` of an attention mask) added to the unit of the nearest enclosing module that saves the most."""
    names = {u.name for u in profile.units}
    out = {k: v for k, v in table.items() if k in names}
    for name, n in table.items():
        if name in names or n <= 0:
            continue
        path = name
        while path:
            path = path.rpartition(".")[0]
            near = [k for k in out if k.startswith(path + ".")] if path else list(out)
            if near:
                host = max(near, key=lambda k: (out[k], k))
                out[host] += n
                break
    return out


def _apply_whole(ops: list, profile: Any, table: dict[str, int]) -> int:
    """Each unit ``table`` names given its bytes there, on its ops in proportion (bytes of names the profile lacks
    folded into a neighbour); returns the change in saved bytes."""
    folded, delta = _folded(profile, table), 0
    for u in profile.units:
        if u.name in folded:
            before = sum(ops[i].saved_bytes for i in u.ops)
            _rescale(ops, list(u.ops), "saved_bytes", folded[u.name], integer=True)
            delta += sum(ops[i].saved_bytes for i in u.ops) - before
    return delta


def _attribute_units(ops: list, inner: list, table: dict[str, int] | None, path: str) -> None:
    """Each unit of ``inner`` given the bytes ``table`` (names relative to the layer at ``path``) holds for it, on
    its ops in proportion; nothing when no unit is named there (the proportional spread stays)."""
    if not table:
        return
    names = {u.name: u for u in inner}
    if not any(names.get(f"{path}.{rel}") is not None and n > 0 for rel, n in table.items()):
        return
    for u in inner:
        _rescale(ops, list(u.ops), "saved_bytes", table.get(u.name[len(path) + 1:], 0), integer=True)


def check_compiled(value: Any, error: type[ValueError]) -> None:
    """Validate a profile's ``compiled`` object (None: an eager profile), raising ``error`` with one line."""
    if value is None:
        return
    where = "profile.compiled"
    if not isinstance(value, dict):
        raise error(f"{where}={type(value).__name__}: expected an object or null")
    for key, kind in (("backend", str), ("layout", str), ("step_time", (int, float)),
                      ("eager_step_time", (int, float)), ("layers", list)):
        item = value.get(key)
        if not isinstance(item, kind) or isinstance(item, bool):
            raise error(f"{where}.{key}={item!r:.40}: expected {getattr(kind, '__name__', 'a number')}")
    numbers = [(f"{where}.{k}", value[k]) for k in ("step_time", "eager_step_time")]
    for i, row in enumerate(value["layers"]):
        if not isinstance(row, dict) or row.get("layer") != i:
            raise error(f"{where}.layers[{i}]={row!r:.40}: expected an object with layer={i}")
        for variant in VARIANTS:
            fig = row.get(variant)
            if not isinstance(fig, dict) or set(fig) != set(_FIGURES):
                raise error(f"{where}.layers[{i}].{variant}={fig!r:.40}: expected an object with keys "
                            f"{', '.join(_FIGURES)}")
            numbers += [(f"{where}.layers[{i}].{variant}.{k}", fig[k]) for k in _FIGURES]
        numbers += _unit_numbers(f"{where}.layers[{i}].units", row.get("units"), error)
    if value["layout"] not in LAYOUTS:
        raise error(f"{where}.layout={value['layout']!r}: expected one of {', '.join(LAYOUTS)}")
    if (value["layout"] == "whole-model") != (value.get("whole") is not None):
        raise error(f"{where}.whole={value.get('whole')!r:.40}: expected an object of unit names to saved bytes "
                    "exactly when layout is 'whole-model'")
    numbers += _unit_numbers(f"{where}.whole", value.get("whole"), error)
    for name, number in numbers:
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number < float("inf"):
            raise error(f"{name}={number!r}: expected a number, finite and >= 0")
        if (name.endswith("saved_bytes") or ".units." in name or ".whole." in name) and not isinstance(number, int):
            raise error(f"{name}={number!r}: expected int")


def _unit_numbers(where: str, table: Any, error: type[ValueError]) -> list[tuple[str, Any]]:
    """The numbers of a row's optional ``units`` table (unit name relative to the layer -> saved bytes)."""
    if table is None:
        return []
    if not isinstance(table, dict) or not all(isinstance(k, str) and k for k in table):
        raise error(f"{where}={table!r:.40}: expected an object of unit names to saved bytes")
    return [(f"{where}.{k}", v) for k, v in table.items()]
