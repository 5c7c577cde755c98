"""What every collaborator of one :class:`~adaptive_mem.runtime._executor.Executor` shares: the plan applied, the
model's structure, the layers, the swap engine, and the bookkeeping of what was installed (hook handles, instance
forwards) that ``Executor.remove`` undoes."""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from profiler.naming import ModelStructure
from search import Plan

from ._lean_checkpoint import lean_applies, lean_checkpoint
from ._resolve import Resolution
from ._swap_engine import SwapEngine

__all__ = ["PlanContext"]


class PlanContext:
    """The state of one plan application, handed to each collaborator of the executor."""

    def __init__(self, model: nn.Module, plan: Plan, res: Resolution, structure: ModelStructure,
                 engine: SwapEngine | None) -> None:
        self.model = model
        self.plan = plan
        self.res = res
        self.structure = structure
        self.namer = structure.namer()
        info = res.layers
        self.num_layers = info.count if info is not None else 0
        self.layers: list[nn.Module] = [model.get_submodule(info.layer_path(i)) for i in range(self.num_layers)]
        self.engine = engine
        self.handles: list[Any] = []
        """Every hook handle installed for the plan (removed and left out of copies together)."""
        self.forwards: list[tuple[nn.Module, bool, Any]] = []
        """``(module, had an instance forward, that forward)`` of each instance forward set."""
        self.opaque = 0
        """> 0 inside a checkpointed layer: the op tracker does not name its ops."""
        self.cache_warned: set[str] = set()
        """Layers already warned about a KV cache in recompute (Note: [cache in recompute])."""

    def set_forward(self, i: int, fn: Callable[..., Any]) -> None:
        """Install ``fn`` as layer ``i``'s instance forward."""
        layer = self.layers[i]
        had = "forward" in layer.__dict__
        self.forwards.append((layer, had, layer.__dict__.get("forward")))
        layer.forward = fn

    def orig(self, i: int) -> Callable[..., Any]:
        """Layer ``i``'s forward before the plan's."""
        layer = self.layers[i]
        for module, had, old in self.forwards:
            if module is layer:
                return old if had else type(layer).forward.__get__(layer)
        return layer.forward

    def opaque_run(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, run with the op tracker blind (a checkpointed body)."""
        def run(*args: Any, **kwargs: Any) -> Any:
            self.opaque += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.opaque -= 1
        return run

    def checkpoint(self, index: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Non-reentrant checkpoint of ``fn`` in layer ``index``, distributed when the plan says so; eager, the lean
        one (Note: [lean checkpoint] in ``_lean_checkpoint.py``)."""
        if self.plan.distribute_saved_activations:
            from ._distributed_checkpoint import distributed_checkpoint

            return distributed_checkpoint(functools.partial(fn, **kwargs) if kwargs else fn, *args,
                                          layer=self.layers[index])
        if lean_applies():  # Note: [lean checkpoint]
            return lean_checkpoint(fn, *args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
