"""What ``torch.compile`` (inductor, per block) does to a step, modelled on a profile: :func:`compiled_estimate`.

A profile recorded on fake tensors cannot run a compiled block (``profiler._compiled`` measures one on a real
device); this module rewrites the eager profile's ops the way inductor's partitioner and fusion change them
(Note: [compile model]). Its rules are reproduced from ``torch/_functorch/partitioners.py`` (torch 2.13.0,
``min_cut_rematerialization_partition``, ``solve_min_cut``, ``get_default_op_list``); not its code.

Note: [compile model] per block (``torch.compile`` of each repeated layer, torchtitan's layout; units outside the
blocks run eager and keep their figures):
(a) memory: the partitioner saves for backward the cheapest set of tensors from which backward can rebuild every
tensor eager autograd saves, rebuilding only through ops it may recompute, and recomputes the rest inside the
backward kernels. It never recomputes ops outside its allow-list (matmuls, attention, embedding, ``cat``: compute
intensive or not pointwise), random ops (dropout), reductions (output under a quarter of the inputs' bytes), ops
whose output a non-fusible backward op reads (a matmul's or attention's input: "materialized in backward") nor a
fusible use that comes after a non-fusible op on the way from the same input ("used far apart": the residual
add). The cut is a minimum s-t cut over the block's ops split in two nodes (in -> out, capacity: the output's
bytes, times 1.1 per op of distance from backward, twice for an output read only by fusible ops), the block's
inputs already saved are free, the others cost their bytes; an op in the cut keeps its eager saved bytes (or its
output's, when eager saved none of it), every other op of the block saves 0. Inputs the cut saves are charged to
their producer (the previous block's output), as eager charges saved tensors.
(b) time: inductor fuses each connected chain of fusible ops (pointwise, reductions, casts, a ``cat`` of them)
into one kernel, which reads the chain's inputs from outside it once and writes only the outputs read outside
it or saved; each fused op's forward and backward seconds are scaled by the chain's external bytes over the sum
of its ops' own reads and writes (bytes from the ops' producers, parameters not counted). A chain is one kernel
in forward and one in backward: of the eager ops' per-kernel latency (``hardware.kernel_latency``, Note: [op
pricing]; one taken off each op's forward and, where it has one, backward seconds) the chain keeps one per
direction. Matmuls, attention and every op left alone keep their seconds; recomputation fused into backward adds
none.
Checked against the inductor-compiled CPU profile (``profiler.profile_compiled``, torch 2.13.0): saved bytes per
block equal to the byte for ``llama-tiny``, ``llama-small``, ``hf:llama`` and ``hf:qwen2`` (the first kept within
10 % by tests/test_compile_estimate.py). CPU step times (measured, no GPU figure) moved the same way on three of
the four, by other amounts: the model prices only fusion, not the compiled code's other changes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ._compiled import CompileBackendError
from ._profile import OpRecord, Profile

__all__ = ["compiled_estimate"]

_NEVER_RECOMPUTED = frozenset({"native_dropout", "rand_like", "randn_like", "bernoulli", "rand", "randn", "randint",
                               "randperm", "normal", "uniform", "exponential"})
"""Random ops: fusible, never recomputed (a recomputation would draw other numbers)."""

_RECOMPUTABLE = frozenset({
    "add", "sub", "div", "mul", "pow", "max", "min", "maximum", "minimum", "where", "clamp", "lerp", "addcmul",
    "rsub", "sum", "mean", "amax", "var", "std", "var_mean", "argmax", "any", "isinf", "_grad_sum_to_size",
    "sum_to_size", "to", "type_as", "_to_copy", "clone", "full", "full_like", "zeros", "zeros_like", "ones",
    "empty", "empty_like", "new_zeros", "scalar_tensor", "arange", "triu", "index", "gather", "lift_fresh_copy",
    "expand", "view", "reshape", "_unsafe_view", "slice", "select", "squeeze", "unsqueeze", "permute", "t",
    "as_strided", "alias", "split", "broadcast_tensors", "masked_fill",
    # composites inductor decomposes into the ops above before partitioning
    "_softmax", "_log_softmax", "native_layer_norm", "_fused_rms_norm", "rms_norm",
})
"""Ops the partitioner may recompute beside every pointwise-tagged aten op (``get_default_op_list``)."""


@functools.lru_cache(maxsize=None)
def _kind(op: str) -> str:
    """``random``, ``recomputable`` (fusible, may be recomputed) or ``fixed`` (neither) for ``aten.name.overload``."""
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] == "aten" else ""
    if name in _NEVER_RECOMPUTED:
        return "random"
    if name in _RECOMPUTABLE or name.rstrip("_") in _RECOMPUTABLE:
        return "recomputable"
    packet = getattr(torch.ops.aten, name, None) if name else None
    overload = getattr(packet, parts[2], None) if packet is not None and len(parts) >= 3 else None
    if overload is not None and torch.Tag.pointwise in overload.tags:
        return "recomputable"
    return "fixed"


def _fusible(op: OpRecord) -> bool:
    return _kind(op.op) != "fixed"


def _fuses(producer: OpRecord, consumer: OpRecord) -> bool:
    """Whether inductor fuses ``consumer`` with its input ``producer`` (a ``cat`` takes fusible producers in)."""
    return _fusible(producer) and (_fusible(consumer) or consumer.op.startswith("aten.cat."))


class _Block:
    """The ops of one block and the ops outside it that they read."""

    def __init__(self, profile: Profile, layer: int) -> None:
        ops = profile.ops
        self.ops = ops
        self.inside = [op.index for op in ops if op.layer == layer]
        members = set(self.inside)
        self.members = members
        self.producers: dict[int, list[int]] = {i: [] for i in self.inside}
        for op in ops:
            for c in op.consumers:
                if c in members:
                    self.producers[c].append(op.index)
        self.outside = sorted({p for i in self.inside for p in self.producers[i] if p not in members})
        self.output = {i for i in self.inside if any(c not in members for c in ops[i].consumers)}

    def input_bytes(self, i: int) -> int:
        return sum(self.ops[p].output_bytes for p in self.producers[i])

    def required(self) -> list[int]:
        """Ops whose outputs eager autograd saves for this block's backward (the block's outputs are the next
        block's concern)."""
        return [i for i in self.inside if self.ops[i].saved_bytes > 0 and i not in self.output]

    def materialized_backward(self, i: int) -> bool:
        """Saved for a non-fusible backward op: read by a consumer that saves its inputs and is not fusible."""
        op = self.ops[i]
        return op.saved_bytes > 0 and any(self.ops[c].saves_inputs and not _fusible(self.ops[c]) for c in op.consumers)


def _first_unfusible(block: _Block, start: int, users: list[int]) -> int:
    """Forward position of the first op reached from ``start``'s users through a non-fusible edge."""
    ops, limit = block.ops, max(users)
    frontier = sorted((u, True) for u in users)
    seen: set[int] = set()
    while frontier:
        frontier.sort()
        i, fusible = frontier.pop(0)
        if not fusible:
            return i
        if i in seen:
            continue
        seen.add(i)
        frontier += [(c, _fuses(ops[i], ops[c])) for c in ops[i].consumers if c in block.members and c <= limit]
    return limit


def _banned(block: _Block) -> set[int]:
    """Ops of the block the partitioner never recomputes (Note: [compile model] (a))."""
    ops = block.ops
    banned = {i for i in block.inside if _kind(ops[i].op) != "recomputable" or block.materialized_backward(i)
              or ops[i].output_bytes * 4 < block.input_bytes(i)}
    for start in [*block.outside, *block.inside]:
        users = sorted(c for c in ops[start].consumers if c in block.members)
        if not users:
            continue
        first = _first_unfusible(block, start, users)
        banned |= {u for u in users if u > first and _fuses(ops[start], ops[u])}
    return banned


def _distances(block: _Block, required: set[int]) -> dict[int, int]:
    far = 10 ** 9
    dist: dict[int, int] = {}
    for i in reversed(block.inside):
        inner = [dist[c] + 1 for c in block.ops[i].consumers if c in dist]
        dist[i] = 1 if i in required else min(inner, default=far)
    return dist


def _weight(block: _Block, i: int, dist: dict[int, int]) -> int:
    op = block.ops[i]
    read_unfused = any(c not in block.members or not _fuses(op, block.ops[c]) for c in op.consumers)
    return int(op.output_bytes * 1.1 ** max(min(dist.get(i, 1), 100), 1)) * (1 if read_unfused else 2)


def _saved_set(block: _Block) -> set[int]:
    """The ops (inside or read by the block) whose outputs the partitioner saves: a minimum cut."""
    import networkx as nx

    required = set(block.required())
    if not required:
        return set()
    banned, dist = _banned(block), _distances(block, required)
    graph = nx.DiGraph()
    for p in block.outside:  # the block's inputs: never recomputed; free to save when eager saves them anyway
        graph.add_edge("source", f"{p}_in")
        graph.add_edge(f"{p}_in", f"{p}_out", capacity=0 if block.ops[p].saved_bytes else block.ops[p].output_bytes)
    for i in block.inside:
        graph.add_edge(f"{i}_in", f"{i}_out", capacity=_weight(block, i, dist))
        if i in banned:
            graph.add_edge("source", f"{i}_in")
        if i in required:
            graph.add_edge(f"{i}_out", "sink")
        for p in block.producers[i]:
            graph.add_edge(f"{p}_out", f"{i}_in")
    _, (reachable, _) = nx.minimum_cut(graph, "source", "sink")
    nodes = [*block.outside, *block.inside]
    return {i for i in nodes if f"{i}_in" in reachable and f"{i}_out" not in reachable}


def _block_saved(block: _Block) -> dict[int, int]:
    """Saved bytes per op after the partitioner: the block's ops, and its inputs newly saved."""
    ops, saved = block.ops, _saved_set(block)
    out = {i: (ops[i].saved_bytes or ops[i].output_bytes) if i in saved else 0
           for i in block.inside if i not in block.output}
    out.update({p: ops[p].output_bytes for p in block.outside if p in saved and ops[p].saved_bytes == 0})
    return out


def _chains(block: _Block) -> list[list[int]]:
    """Connected groups of the block's ops that inductor fuses into one kernel (two ops or more)."""
    parent = {i: i for i in block.inside}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for i in block.inside:
        for c in block.ops[i].consumers:
            if c in block.members and _fuses(block.ops[i], block.ops[c]):
                parent[root(c)] = root(i)
    groups: dict[int, list[int]] = {}
    for i in block.inside:
        if _fusible(block.ops[i]) or block.ops[i].op.startswith("aten.cat."):
            groups.setdefault(root(i), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def _fused_times(block: _Block, saved: dict[int, int], latency: float) -> dict[int, tuple[float, float]]:
    """Per fused op, its forward and backward seconds in its chain's kernels (Note: [compile model] (b))."""
    ops, out = block.ops, {}
    for chain, factor in _fusion_factors(block, saved):
        first_backward = next((i for i in chain if ops[i].bwd_time > 0), None)
        for i in chain:
            fwd = factor * max(ops[i].fwd_time - latency, 0.0) + (latency if i == chain[0] else 0.0)
            bwd = factor * max(ops[i].bwd_time - latency, 0.0) + (latency if i == first_backward else 0.0)
            out[i] = (fwd, bwd)
    return out


def _fusion_factors(block: _Block, saved: dict[int, int]) -> list[tuple[list[int], float]]:
    """Each fused chain with its external bytes over the sum of its ops' own bytes (Note: [compile model] (b))."""
    factors: list[tuple[list[int], float]] = []
    for chain in _chains(block):
        members = set(chain)
        own = sum(block.ops[i].output_bytes + block.input_bytes(i) for i in chain)
        reads = {p for i in chain for p in block.producers[i] if p not in members}
        writes = [i for i in chain if saved.get(i, block.ops[i].saved_bytes) > 0
                  or any(c not in members for c in block.ops[i].consumers) or not block.ops[i].consumers]
        external = sum(block.ops[p].output_bytes for p in reads) + sum(block.ops[i].output_bytes for i in writes)
        if own > 0:
            factors.append((chain, min(1.0, external / own)))
    return factors


def compiled_estimate(profile: Profile, *, backend: str = "inductor") -> Profile:
    """``profile`` (eager, usually on fake tensors) as its model runs with every block compiled by inductor: saved
    bytes and op times rewritten by the partitioner's and inductor's rules (Note: [compile model]). The figures
    per block go under ``compiled`` (``"modelled": true``), whose ``layout`` is ``per-block`` as for a measured
    compiled profile, so solvers plan in the compiled blocks' space. Raises ``CompileBackendError`` for another
    backend, a profile already compiled, or a model without repeated blocks."""
    if backend != "inductor":
        raise CompileBackendError(f"backend={backend!r}: the compile model is inductor's; expected 'inductor'")
    if profile.compiled is not None:
        raise CompileBackendError(f"profile.compiled.backend={profile.compiled['backend']!r}: already a compiled "
                                  "profile; expected the eager profile of the model")
    if profile.num_layers == 0:
        raise CompileBackendError("profile.num_layers=0: no repeated blocks to compile per block; expected a model "
                                  "with layers")
    ops = list(profile.ops)
    rows = []
    for layer in range(profile.num_layers):
        block = _Block(profile, layer)
        saved = _block_saved(block)
        times = _fused_times(block, saved, profile.hardware.kernel_latency)
        for i, value in saved.items():
            ops[i] = dataclasses.replace(ops[i], saved_bytes=int(value))
        for i, (fwd, bwd) in times.items():
            ops[i] = dataclasses.replace(ops[i], fwd_time=fwd, bwd_time=bwd)
        rows.append(_row(profile, ops, block))
    return _rebuilt(profile, ops, rows, backend)


def _row(profile: Profile, ops: list[OpRecord], block: _Block) -> dict[str, Any]:
    """A block's figures in the form of a measured compiled profile's ``layers`` row (full recompute: the block's
    saved inputs, its forward twice; ``units``: the modelled partitioner's saved bytes per unit of the block)."""
    def figures(source: list[OpRecord]) -> dict[str, Any]:
        return {"saved_bytes": int(sum(source[i].saved_bytes for i in block.inside)),
                "fwd_time": float(sum(source[i].fwd_time for i in block.inside)),
                "bwd_time": float(sum(source[i].bwd_time for i in block.inside))}
    keep = figures(ops)
    inputs = int(sum(ops[p].saved_bytes for p in block.outside))
    full = {"saved_bytes": inputs, "fwd_time": keep["fwd_time"], "bwd_time": keep["fwd_time"] + keep["bwd_time"]}
    layer = profile.ops[block.inside[0]].layer if block.inside else 0
    inner = set(block.inside) - set(block.output)
    units = {u.local_name: n for u in profile.layer_units(layer)
             if (n := int(sum(ops[i].saved_bytes for i in u.ops if i in inner))) > 0}
    return {"layer": layer, "eager": figures(profile.ops), "keep": keep, "full": full, "units": units}


def _rebuilt(profile: Profile, ops: list[OpRecord], rows: list[dict[str, Any]], backend: str) -> Profile:
    units = [dataclasses.replace(u, saved_bytes=sum(ops[i].saved_bytes for i in u.ops),
                                 fwd_time=sum(ops[i].fwd_time for i in u.ops),
                                 bwd_time=sum(ops[i].bwd_time for i in u.ops)) for u in profile.units]
    saved_delta = sum(o.saved_bytes for o in ops) - sum(o.saved_bytes for o in profile.ops)
    time_delta = sum(o.fwd_time + o.bwd_time for o in ops) - sum(o.fwd_time + o.bwd_time for o in profile.ops)
    step = max(0.0, profile.step_time + time_delta)
    for i, row in enumerate(rows):
        row["layer"] = i
    compiled = {"backend": backend, "layout": "per-block", "step_time": step, "eager_step_time": profile.step_time,
                "layers": rows, "modelled": True}
    return dataclasses.replace(profile, ops=ops, units=units, peak_memory=int(profile.peak_memory + saved_delta),
                               step_time=step, compiled=compiled, layer_forward=[])  # measured eager
