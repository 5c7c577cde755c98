"""A plan's swaps inside a whole-model compiled graph: which saved values of the forward graph a plan swaps,
and where each reload goes.

Note: [graph swap names]. A saved value is swapped when the unit that produced it swaps (the eager path's
rule: the op tracker records the producing unit of each storage). Its unit comes from the forward node's
``nn_module_stack`` by the eager namer's rules (Note: [graph unit names] in ``profiler/_graph_names.py``), as
the compiled selective-checkpoint policy names the ops it tags and the compiled profile the bytes it
attributes. The reload's anchor is the first
backward node of the layer the engine's trigger names (``min(layer + prefetch, num_layers)``; the number
of layers is "backward begins": the first backward node), found from the backward nodes'
``fwd_nn_module_stack`` (Note: [graph swap placement] in ``_graph_swap.py``).
"""

from __future__ import annotations

import weakref
from typing import Callable

from torch import fx

from profiler.naming import graph_units, stack_frames
from profiler.tracing import add_partition_observer, remove_partition_observer
from search import Action

from ._graph_ops import count_into
from ._graph_swap import GraphSwap, SwapChoice, insert_graph_swaps
from ._plan_context import PlanContext
from ._resolve import decide

__all__ = ["GraphPlan", "activate", "deactivate"]


class GraphPlan:
    """The swap decisions of one executor's plan for the compiled graphs of its model."""

    def __init__(self, ctx: PlanContext, op_swap: list[int] | tuple[int, ...] = ()) -> None:
        """``op_swap``: the layers holding op-level swaps, whose blocks compiled on their own swap in their graph."""
        self.ctx = ctx
        self.op_swap = set(op_swap)
        self.namer = ctx.namer
        self.layer_of = {id(m): i for i, layer in enumerate(ctx.layers) for m in layer.modules()}
        self.owner = f"{id(self):x}"
        """The suffix of this plan's op keys (``<unit>@<owner>``): their bytes count into its engine's stats."""
        self.swaps: list[GraphSwap] = []
        """The offload/reload pairs inserted in this plan's graphs."""

    def owns(self, graph: fx.Graph) -> bool:
        """Whether the pass places this plan's swaps in ``graph``: a whole-model graph of its model (it runs modules
        of more than one layer, or outside the layers), or the block graph of a layer holding op-level swaps (Note:
        [op-level swap in a block]). Other blocks compiled on their own swap through the hooks around them (Note:
        [swap around compiled blocks])."""
        paths, layers = self.namer.paths, set()
        for node in graph.nodes:
            for _, mid in stack_frames(node.meta.get("nn_module_stack")):
                if mid in paths:
                    layers.add(self.layer_of.get(mid))
        return bool(layers) and (None in layers or len(layers) > 1 or layers <= self.op_swap)

    def unit_names(self, graph: fx.Graph) -> dict[fx.Node, str]:
        """The unit of each forward op node and of its views and items (Note: [graph swap names])."""
        return graph_units(graph, self.namer)

    def anchors(self, bw: fx.Graph) -> Callable[[int], fx.Node | None]:
        """``anchor(trigger)`` on a backward graph: the first node of layer ``trigger``'s backward, or the first
        node reading a tangent for ``trigger >= num_layers`` (Note: [graph swap placement])."""
        first: dict[int, fx.Node] = {}
        start = None
        for node in bw.nodes:
            if start is None and any(a.op == "placeholder" and a.name.startswith("tangents")
                                     for a in node.all_input_nodes):
                start = node
            if start is None:
                continue
            stack = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack")  # a recomputed op
            layer = next((self.layer_of[mid] for _, mid in stack_frames(stack) if mid in self.layer_of), None)
            if layer is not None:
                first.setdefault(layer, node)
        num_layers = self.ctx.num_layers
        return lambda trigger: start if trigger >= num_layers else first.get(trigger, start)

    def chooser(self, graph: fx.Graph) -> Callable[[fx.Node], SwapChoice | None]:
        """``choose`` for :func:`insert_graph_swaps` on a forward graph: the swap units' values."""
        units = self.unit_names(graph)
        plan, num_layers = self.ctx.plan, self.ctx.num_layers

        def choose(x: fx.Node) -> SwapChoice | None:
            unit = units.get(x)
            if unit is None:
                return None
            decision = decide(plan, unit)
            if decision.action is not Action.SWAP:
                return None
            layer, _ = self.namer.split(unit)
            trigger = None
            if decision.backward_prefetch > 0 and layer is not None:
                trigger = min(layer + decision.backward_prefetch, num_layers)
            return SwapChoice(key=f"{unit}@{self.owner}", trigger=trigger)
        return choose


_active: weakref.WeakSet[GraphPlan] = weakref.WeakSet()
"""The installed plans; weak, so a plan whose model is gone without ``remove()`` does not live on here."""


def _place(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_fwd_outputs: int) -> None:
    """The partition observer (Note: [partitioner hook] in ``profiler/_partitions.py``) while plans are installed:
    the graphs of a planned model get its swaps; every other model's graphs pass through untouched."""
    plan = next((p for p in list(_active) if p.owns(fw_module.graph)), None)
    if plan is not None:
        plan.swaps.extend(insert_graph_swaps(fw_module, bw_module, num_fwd_outputs, plan.chooser(fw_module.graph),
                                             plan.anchors(bw_module.graph)))
    if not _active:  # every plan gone without remove(): the observer goes too
        remove_partition_observer(_place)


def activate(plan: GraphPlan) -> None:
    """Hand the graphs of ``plan``'s model to it (Note: [partitioner hook])."""
    add_partition_observer(_place)
    _active.add(plan)
    count_into(plan.owner, plan.ctx.engine.stats if plan.ctx.engine is not None else None)


def deactivate(plan: GraphPlan) -> None:
    count_into(plan.owner, None)
    _active.discard(plan)
    if not _active:
        remove_partition_observer(_place)
