"""Units of the nodes of a compiled (AOT autograd) graph, named by the eager namer's rules.

Note: [graph unit names]. A node traced by dynamo carries ``nn_module_stack``: the modules running it,
outermost first, keyed ``str(id(module))`` with ``@n`` for the (n+1)-th call of a module. The unit of an
aten op node follows :class:`~profiler._units.UnitNamer`'s rules from that stack: the outermost leaf module
gives ``<path>.<label>``; otherwise the innermost named module gives ``<path>.<op label>`` with ``_1``,
``_2``... counted per module call; a view, or an item of an op's tuple output (``getitem``), belongs to the
unit of the op that made its storage. The compiled selective-checkpoint policy names the ops it tags by these
rules, the graph swap pass the values it swaps, and the compiled profile the bytes each unit's values hold
in the partitioned graph, so the three agree with each other and with the eager profile. Guarded by
tests/test_compile_sac.py, tests/test_profile_compiled.py and tests/test_compiled_whole_profile.py.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import fx

from ._units import UnitNamer, is_view_op, join, op_label

__all__ = ["graph_units", "is_view_node", "saved_unit_bytes", "stack_frames", "stack_unit", "storage_base"]


def stack_frames(stack: dict | None) -> list[tuple[str, int]]:
    """``(call key, module id)`` of each module of an ``nn_module_stack``, outermost first."""
    out = []
    for key in stack or {}:
        mid = key.partition("@")[0]
        if mid.isdigit():
            out.append((key, int(mid)))
    return out


def stack_unit(namer: UnitNamer, func: Any, frames: list[tuple[str, int]], counts: dict[tuple[str, str], int],
               default_path: str) -> str:
    """The unit of op ``func`` run under ``frames`` (only the modules the namer names), by the eager namer's rules
    (Note: [graph unit names]); ``counts`` carries the op ordinals per module call across calls."""
    for _, mid in frames:
        if mid in namer.leaves:
            return join(namer.paths[mid], namer.labels[mid])
    call, path = (frames[-1][0], namer.paths[frames[-1][1]]) if frames else ("", default_path)
    label = op_label(func)
    seen = counts.get((call, label), 0)
    counts[call, label] = seen + 1
    return join(path, label if seen == 0 else f"{label}_{seen}")


def is_view_node(node: fx.Node) -> bool:
    """An aten op whose output aliases an input (a view)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                           for r in schema.returns))


def storage_base(node: fx.Node, items: bool = True) -> fx.Node:
    """The node whose op made ``node``'s storage: through views and, with ``items``, tuple items (``getitem``:
    the op node; without, the item's node, which holds the storage's value)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and (
            (items and node.target is operator.getitem) or is_view_node(node)):
        node = node.args[0]
    return node


def graph_units(graph: fx.Graph, namer: UnitNamer, keep: Callable[[int], bool] | None = None,
                default_path: str = "") -> dict[fx.Node, str]:
    """The unit of each forward op node of ``graph`` and of the views and items of those (Note: [graph unit
    names]); ``keep(module id)``: the modules that name units (default: every module the namer names);
    ``default_path``: the path naming ops under none of them."""
    keep = keep or (lambda mid: mid in namer.paths)
    counts: dict[tuple[str, str], int] = {}
    out: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if (node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward"
                or not hasattr(node.target, "overloadpacket") or is_view_op(node.target)):
            continue
        frames = [(k, mid) for k, mid in stack_frames(node.meta.get("nn_module_stack")) if keep(mid)]
        out[node] = stack_unit(namer, node.target, frames, counts, default_path)
    for node in graph.nodes:
        base = storage_base(node)
        if base is not node and base in out:
            out[node] = out[base]
    return out


def _storage_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return int(val.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return val.numel() * val.element_size()


def saved_unit_bytes(fw_module: fx.GraphModule, num_fwd_outputs: int, namer: UnitNamer,
                     keep: Callable[[int], bool] | None = None, default_path: str = "") -> dict[str, int]:
    """The bytes a partitioned forward graph saves for backward, per unit (Note: [graph unit names]): each
    storage once, under the unit of the op that made it; inputs of the graph (parameters, the block's input)
    and values of no unit are left out."""
    graph = fw_module.graph
    units = graph_units(graph, namer, keep, default_path)
    outputs = list(graph.find_nodes(op="output")[0].args[0])[num_fwd_outputs:]
    out: dict[str, int] = {}
    seen: set[fx.Node] = set()
    for x in outputs:
        if not isinstance(x, fx.Node):
            continue
        base = storage_base(x, items=False)
        if base in seen or base.op != "call_function" or x not in units:
            continue
        seen.add(base)
        out[units[x]] = out.get(units[x], 0) + _storage_bytes(base)
    return out
