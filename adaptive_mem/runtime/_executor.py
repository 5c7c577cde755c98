"""Apply a resolved plan to a live ``nn.Module``: recompute and swap, removable without a trace.

What gets installed, and only when the plan needs it (an all-keep plan installs nothing):

* a layer that is recomputed gets an instance ``forward`` wrapping the class
  forward in non-reentrant checkpoint (whole layer, group, or selective);
* swaps outside checkpointed layers need the unit of the op that *produced*
  each saved storage: module pre/post hooks drive a :class:`UnitNamer`, a
  dispatch mode records producing units of swap storages, and saved-tensor
  hooks hand those to the :class:`SwapEngine`;
* prefetch triggers are tensor hooks on a layer's output (backward begins
  that layer: only where a reload is due, Note: [triggers where due] in ``_swap_engine.py``)
  and on the model output (backward begins);
* with swaps, the model's forward runs outside dynamo (an instance ``forward``;
  Note: [compile honoured] in ``_op_level.py``); compiled blocks get a wrapper around their
  compiled call that keeps them compiled (Note: [swap around compiled blocks] in ``_compiled_swap.py``).

:meth:`Executor.remove` deletes the instance forwards and every hook handle.

Copies of the model (``copy.deepcopy``, ``pickle``, ``torch.save``) leave all of it out
(Note: [copy drops the plan] in ``_copy_guard.py``).

The executor composes collaborators, each in the file of its job, that share the plan's state through one
:class:`PlanContext` (``_plan_context.py``): whole-layer recompute (``_recompute.py``), checkpoint groups
(``_groups.py``, Note: [group inputs]), selective checkpoint (``_selective.py``), the op-level swap path: the
dispatch mode, saved-tensor hooks and prefetch triggers (``_op_swap.py``), compiled blocks under swaps
(``_compiled_swap.py``) and the plan's swaps in compiled graphs (``_graph_plan.py``; what runs outside dynamo:
Note: [compile honoured] in ``_op_level.py``). This module installs them in order and removes them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from adaptive_mem.config._collective_names import layout_styles
from profiler.naming import ModelStructure
from search import Action, Plan

from ._accounting import current_accounting
from ._compiled_swap import CompiledBlocks
from ._copy_guard import CopyGuard
from ._graph_plan import GraphPlan, activate, deactivate
from ._groups import CheckpointGroups
from ._op_level import eager_only
from ._op_swap import OpSwaps
from ._plan_context import PlanContext
from ._recompute import WholeLayers
from ._resolve import LayerMode, Resolution
from ._selective import SelectiveLayers
from ._swap_engine import SwapEngine
from ._swap_scopes import outputs

__all__ = ["Executor"]

log = logging.getLogger(__name__)


def _accounted_headroom() -> int | None:
    """Free bytes under the active ``DeviceMemory`` cap, less a tenth of it kept for backward's own
    allocations; None without a capped accounting (then every scheduled prefetch is issued)."""
    mem = current_accounting()
    if mem is None or mem.cap is None:
        return None
    return mem.cap - mem.live - mem.cap // 10


def _engine(model: nn.Module, plan: Plan, res: Resolution, num_layers: int, **host: Any) -> SwapEngine | None:
    """The swap engine of a plan with swaps, None without."""
    if not (plan.targets(Action.SWAP) or res.input_swaps):
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    engine = SwapEngine(device=device, num_layers=num_layers, **host)
    engine.headroom = _accounted_headroom  # Note: [budget-aware prefetch]
    return engine


class Executor:
    """One plan installed on one model: the collaborators below, installed in order and removed together."""

    def __init__(self, model: nn.Module, plan: Plan, res: Resolution, *, structure: ModelStructure | None = None,
                 host_store: str = "memory", host_dir: str | None = None, host_budget: Any = None) -> None:
        structure = structure.of_model(model) if structure is not None else ModelStructure(model, res.layers)
        num_layers = res.layers.count if res.layers is not None else 0
        engine = _engine(model, plan, res, num_layers, host_store=host_store, host_dir=host_dir,
                         host_budget=host_budget)
        self.ctx = ctx = PlanContext(model, plan, res, structure, engine)
        self.whole = WholeLayers(ctx)
        self.groups = CheckpointGroups(ctx, self.whole)
        self.selective = SelectiveLayers(ctx)
        self.swaps = OpSwaps(ctx, on_forward=self._forward_begins)
        self.blocks = CompiledBlocks(ctx, self.swaps, self.selective.states,  # Note: [swap around compiled blocks]
                                     on_wrap=lambda: self.copies.install())
        self.copies = CopyGuard(model, handles=ctx.handles, forwards=ctx.forwards, attrs=self.blocks.attrs)
        self.selective.on_hooks = lambda: self.copies.install()  # hooks of Note: [recompute at pack], at first call
        self._layouts: dict[int, bool] = {}
        self._leave_ids: dict[int, int] = {}
        self.graph = GraphPlan(ctx, self.blocks.op_swap) if engine is not None else None
        """The plan's swaps in whole-model compiled graphs (Note: [partitioner hook])."""

    @property
    def engine(self) -> SwapEngine | None:
        return self.ctx.engine

    # ================================================================== install / remove
    def install(self) -> None:
        ctx = self.ctx
        self._install_forwards()
        sac = self.selective.states
        named = [ctx.layers[i] for i, state in sac.items() if state.hooked]  # the others: Note: [SAC table]
        if ctx.res.swap_outside_sac or named:
            roots = self.swaps.named_roots() if ctx.res.swap_outside_sac else []  # Note: [swap scopes]
            self._install_namer_hooks(roots + named)
        if ctx.engine is not None:
            self.swaps.install(self.blocks.track)
        self.copies.install()
        if ctx.engine is not None:
            self.blocks.sync()
            activate(self.graph)

    def _install_forwards(self) -> None:
        """The instance forward of each recomputed layer: group, whole layer or selective."""
        ctx = self.ctx
        grouped = {i: g for g in ctx.res.groups for i in g}
        for i, mode in enumerate(ctx.res.modes):
            if i in grouped:
                group = grouped[i]
                ctx.set_forward(i, self.groups.head(group) if i == group[0] else self.groups.member(i, group))
            elif mode is LayerMode.WHOLE:
                ctx.set_forward(i, self.whole.forward(i))
            elif mode is LayerMode.SAC:
                ctx.set_forward(i, self.selective.forward(i))

    def _install_namer_hooks(self, roots: list[nn.Module]) -> None:
        """The unit namer's enter / exit hooks on every module under ``roots``."""
        ctx = self.ctx
        owner = {id(m): i for i, layer in enumerate(ctx.layers) for m in layer.modules()}
        seen: set[int] = set()
        enter, leave = eager_only(self._enter), eager_only(self._exit)  # Note: [compile honoured]
        for root in roots:
            for module in root.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                # Note: [collective units]: before a layout's input hooks; after FSDP2's (its unshard is no unit)
                layout = any(True for _ in layout_styles(module))
                for handle in (module.register_forward_pre_hook(enter, prepend=layout),
                               module.register_forward_hook(leave, always_call=True)):
                    ctx.handles.append(handle)
                    self.blocks.track(owner.get(id(module)), handle)
                self._leave_ids[id(module)] = ctx.handles[-1].id

    def own(self, handle: Any) -> None:
        """Take a hook handle registered on the model for this plan: removed and left out of copies with the rest."""
        self.ctx.handles.append(handle)

    def remove(self) -> None:
        ctx = self.ctx
        if self.graph is not None:
            deactivate(self.graph)
        self.copies.remove()
        self.blocks.remove()
        for handle in ctx.handles:
            handle.remove()
        ctx.handles.clear()
        for module, had, old in reversed(ctx.forwards):
            if had:
                module.forward = old
            else:
                del module.forward
        ctx.forwards.clear()
        self.swaps.close()
        self.groups.outputs.clear()

    def _forward_begins(self) -> None:
        """An outermost planned forward with swaps begins (after the engine's ``begin_forward``)."""
        self.blocks.sync()
        self.swaps.scoped = not self.blocks.attrs  # Note: [swap scopes]

    # ================================================================== namer hooks
    def _enter(self, module: nn.Module, args: Any) -> None:
        # Note: [collective units]: a module's layout hooks (registered before or after the plan) run inside it;
        # only DTensor layout modules are reordered (FSDP2's own hooks must keep their order)
        layout = self._layouts.get(id(module))
        if layout is None:
            layout = self._layouts[id(module)] = any(True for _ in layout_styles(module))
        if layout:
            hooks, leave = module._forward_hooks, self._leave_ids[id(module)]
            if leave in hooks:
                hooks.move_to_end(leave)
        self.ctx.namer.enter(module)
        marks = self.swaps.marks
        if marks.watching:  # Note: [scopes by their boundaries]
            marks.boundary(module, args, self.swaps.record_unit)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.ctx.namer.exit(module)
        marks = self.swaps.marks
        if marks.watching:
            marks.boundary(module, outputs(output), self.swaps.record_unit)
