"""A plan's swaps inside a whole-model compiled graph: which saved values of the forward graph a plan swaps,
and where each reload goes.

Note: [graph swap names]. A saved value is swapped when the unit that produced it swaps (the eager path's
rule: the op tracker records the producing unit of each storage). Its unit comes from the forward node's
``nn_module_stack`` by the eager namer's rules, as the compiled selective-checkpoint policy names ops (Note:
[compiled SAC names]): the outermost leaf module gives ``<path>.<label>``, else the innermost module gives
``<path>.<op label>`` with ``_1``, ``_2``... counted per module call; a view, or an item of an op's tuple output,
belongs to the unit of the op that made its storage. The reload's anchor is the first
backward node of the layer the engine's trigger names (``min(layer + prefetch, num_layers)``; the number
of layers is "backward begins": the first backward node), found from the backward nodes'
``fwd_nn_module_stack`` (Note: [graph swap placement] in ``_graph_swap.py``).
"""

from __future__ import annotations

import operator
import weakref
from typing import Callable

import torch._functorch._activation_offloading.activation_offloading as _offloading
import torch._functorch.config as functorch_config
from torch import fx

from profiler.naming import is_view_op
from search import Action

from ._compiled_sac import stack_frames, stack_unit
from ._graph_ops import count_into
from ._graph_swap import GraphSwap, SwapChoice, insert_graph_swaps, is_view_node
from ._plan_context import PlanContext
from ._resolve import decide

__all__ = ["GraphPlan", "activate", "deactivate"]


def _base(node: fx.Node) -> fx.Node:
    """The node whose op made ``node``'s storage: through views and tuple items (``getitem``)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and (
            node.target is operator.getitem or is_view_node(node)):
        node = node.args[0]
    return node


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
        """The unit of each forward op node (Note: [graph swap names])."""
        namer, counts, out = self.namer, {}, {}
        for node in graph.nodes:
            if (node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward"
                    or not hasattr(node.target, "overloadpacket") or is_view_op(node.target)):
                continue
            frames = [(k, mid) for k, mid in stack_frames(node.meta.get("nn_module_stack")) if mid in namer.paths]
            out[node] = stack_unit(namer, node.target, frames, counts, "")
        for node in graph.nodes:  # a view or a tuple item is its base's: the op that made the storage
            base = _base(node)
            if base is not node and base in out:
                out[node] = out[base]
        return out

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
            layer = next((self.layer_of[mid] for _, mid in stack_frames(node.meta.get("fwd_nn_module_stack"))
                          if mid in self.layer_of), None)
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


# Note: [partitioner hook]. While a plan with swaps is installed, the partitioners' activation-offloading step is
# ours: both AOT autograd partitioners (the default and min-cut, so aot_eager and inductor) call
# ``enable_activation_offloading`` on the forward and backward graphs they made when
# ``torch._functorch.config.enable_activation_offloading`` is set, looking it up from its module at each call.
# Ours hands the graphs to the installed plan whose model they run (``GraphPlan.owns``), which inserts its
# offload/reload pairs, then calls PyTorch's, which offloads only what others marked ``should_offload``;
# every other model's graphs pass through untouched. The partitioner decides what is saved as without a plan
# (a swap unit's value it recomputes frees its bytes anyway), so a compiled profile measured without a plan
# describes the graph the plan swaps in. AOT autograd's cache is off meanwhile: a graph compiled without the
# pass must not be served from it. All is restored when the last plan is removed.
_active: weakref.WeakSet[GraphPlan] = weakref.WeakSet()
"""The installed plans; weak, so a plan whose model is gone without ``remove()`` does not live on here."""
_saved: dict[str, object] = {}


def _owner(graph: fx.Graph) -> GraphPlan | None:
    return next((plan for plan in list(_active) if plan.owns(graph)), None)


def _partitioned(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_fwd_outputs: int,
                 *args: object, **kwargs: object) -> None:
    plan = _owner(fw_module.graph)
    if plan is not None:
        plan.swaps.extend(insert_graph_swaps(fw_module, bw_module, num_fwd_outputs, plan.chooser(fw_module.graph),
                                             plan.anchors(bw_module.graph)))
    original = _saved["offloading"]
    if not _active:  # every plan gone without remove(): the hook goes too
        _restore()
    original(fw_module, bw_module, num_fwd_outputs, *args, **kwargs)


def _restore() -> None:
    if _saved:
        _offloading.enable_activation_offloading = _saved.pop("offloading")
        for key, value in _saved.items():
            setattr(functorch_config, key, value)
        _saved.clear()


def activate(plan: GraphPlan) -> None:
    """Hand the graphs of ``plan``'s model to it (Note: [partitioner hook])."""
    if not _saved:
        _saved.update(enable_autograd_cache=functorch_config.enable_autograd_cache,
                      enable_activation_offloading=functorch_config.enable_activation_offloading,
                      offloading=_offloading.enable_activation_offloading)
        functorch_config.enable_autograd_cache = False
        functorch_config.enable_activation_offloading = True
        _offloading.enable_activation_offloading = _partitioned
    _active.add(plan)
    count_into(plan.owner, plan.ctx.engine.stats if plan.ctx.engine is not None else None)


def deactivate(plan: GraphPlan) -> None:
    count_into(plan.owner, None)
    _active.discard(plan)
    if not _active:
        _restore()
