"""The graph pass that swaps saved activations inside a compiled graph: offload after the last forward use,
reload at the plan's prefetch distance in backward.

It runs on the forward and backward graphs AOT autograd's partitioner made (aot_eager and inductor alike;
how it is reached: Note: [partitioner hook] in ``profiler/_partitions.py``). For each saved value ``x`` (a forward
output handed to backward) that ``choose(x)`` swaps, :func:`insert_graph_swaps` inserts ``h =
adaptive_mem::offload(x)`` after the last forward use of ``x`` and of its views and saves ``h`` in its
place; in backward, ``y = adaptive_mem::reload(h, after=[anchor])`` goes right after the anchor (or before
the first use) and every use of the saved value reads ``y``. The device bytes of ``x`` are freed at the
offload (the graph drops ``x`` after its last use), and come back at the reload.

Note: [graph swap placement]. The reload is inserted right after its anchor, the first backward node of
the layer ``prefetch`` layers above the swapped one (the eager engine's trigger: backward begins that
layer); the first backward node that reads a tangent when that is past the last layer; and just before
the first use for prefetch 0. The anchor is also an argument of the reload (``after``), so no later
scheduler hoists it above the anchor. Guarded by tests/test_graph_swap.py (positions in the backward
graph, bytes off the device between the offload and the reload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from profiler.naming import is_view_node

from . import _graph_ops  # noqa: F401  (registers the ops this pass inserts)

__all__ = ["GraphSwap", "SwapChoice", "insert_graph_swaps", "is_dense", "view_base"]


@dataclass(frozen=True)
class SwapChoice:
    """What the plan says of one saved value: swap it under ``key``; ``trigger``: the layer whose backward
    start reloads it (None: just before its first use)."""

    key: str
    trigger: int | None = None


@dataclass(frozen=True)
class GraphSwap:
    """One inserted pair: the saved value's name, its offload and reload nodes, and its bytes."""

    key: str
    value: str
    offload: fx.Node
    reload: fx.Node
    nbytes: int


def _tensor_val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def is_dense(t: torch.Tensor) -> bool:
    """Its elements fill one block without gaps or overlaps, in any dimension order (so a copy with the same
    strides holds exactly its bytes)."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def view_base(x: fx.Node) -> fx.Node:
    """The node whose storage ``x`` views (``x`` itself when it is no view)."""
    while x.op == "call_function" and x.args and isinstance(x.args[0], fx.Node) and is_view_node(x):
        x = x.args[0]
    return x


def _swappable(x: fx.Node, outputs: list, bases: dict[fx.Node, int]) -> bool:
    """A dense value saved once, not also handed out by the graph (a user output), the only saved value on its
    storage, which an op of the graph made and which it covers whole (a view included): its dense copy then holds
    exactly the bytes the offload frees (the backward graph reads values, never aliasing)."""
    val = _tensor_val(x)
    if not (isinstance(x, fx.Node) and x.op == "call_function" and val is not None and is_dense(val)
            and outputs.count(x) == 1):
        return False
    base = view_base(x)
    whole = _tensor_val(base)
    return (base.op == "call_function" and bases.get(base) == 1 and whole is not None and is_dense(whole)
            and whole.numel() == val.numel())


def _last_forward_use(x: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """The last node reading ``x`` or a view of it (the output node aside)."""
    last, stack = x, [x]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.op == "output":
                continue
            if order[user] > order[last]:
                last = user
            if is_view_node(user):
                stack.append(user)
    return last


def _fake(node: fx.Node, op: Callable, *args: object) -> None:
    """``node.meta['val']`` from ``op`` run on the fake values of ``args``."""
    vals = [a.meta["val"] if isinstance(a, fx.Node) else [n.meta["val"] for n in a] if isinstance(a, list) else a
            for a in args]
    mode = next((v.fake_mode for v in vals if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode")), None)
    if mode is None:
        return
    with mode:
        node.meta["val"] = op(*vals)


def _offload(fw: fx.Graph, x: fx.Node, key: str, order: dict[fx.Node, int]) -> fx.Node:
    op = torch.ops.adaptive_mem.offload.default
    with fw.inserting_after(_last_forward_use(x, order)):
        h = fw.call_function(op, (x, key))
    _fake(h, op, x, key)
    return h


def _reload(bw: fx.Graph, p: fx.Node, key: str, device: torch.device, anchor: fx.Node | None) -> fx.Node | None:
    users = [u for u in p.users]
    if not users:
        return None
    order = {n: i for i, n in enumerate(bw.nodes)}
    first = min(users, key=order.__getitem__)
    if anchor is not None and (order[anchor] >= order[first] or anchor.op == "placeholder"):
        anchor = None
    after = [anchor] if anchor is not None and _tensor_val(anchor) is not None else []
    op = torch.ops.adaptive_mem.reload.default
    with bw.inserting_after(anchor) if anchor is not None else bw.inserting_before(first):
        y = bw.call_function(op, (p, key, device, after))
    _fake(y, op, p, key, device, after)
    for user in users:
        user.replace_input_with(p, y)
    return y


def insert_graph_swaps(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_fwd_outputs: int,
                       choose: Callable[[fx.Node], SwapChoice | None],
                       anchor: Callable[[int], fx.Node | None]) -> list[GraphSwap]:
    """Swap the saved values ``choose`` picks (module docstring); ``anchor(trigger)``: the backward node a
    reload triggered at that layer follows. Returns the pairs inserted, in forward order."""
    fw, bw = fw_module.graph, bw_module.graph
    out_node = fw.find_nodes(op="output")[0]
    outputs = list(out_node.args[0])
    placeholders = {n.name: n for n in bw.find_nodes(op="placeholder")}
    order = {n: i for i, n in enumerate(fw.nodes)}
    swaps: list[GraphSwap] = []
    bases: dict[fx.Node, int] = {}
    for x in outputs[num_fwd_outputs:]:
        if isinstance(x, fx.Node):
            bases[view_base(x)] = bases.get(view_base(x), 0) + 1
    for k in range(num_fwd_outputs, len(outputs)):
        x = outputs[k]
        if not _swappable(x, outputs, bases) or x.name not in placeholders:
            continue
        choice = choose(x)
        if choice is None:
            continue
        p = placeholders[x.name]
        where = anchor(choice.trigger) if choice.trigger is not None else None
        y = _reload(bw, p, choice.key, x.meta["val"].device, where)
        if y is None:
            continue
        h = _offload(fw, x, choice.key, order)
        outputs[k] = h
        p.meta["val"] = h.meta.get("val", p.meta.get("val"))
        val = x.meta["val"]
        swaps.append(GraphSwap(choice.key, x.name, h, y, val.numel() * val.element_size()))
    if swaps:
        out_node.args = (tuple(outputs), *out_node.args[1:])
        fw.lint()
        bw.lint()
        fw_module.recompile()
        bw_module.recompile()
    return swaps
