"""The structure of a model, discovered once where a plan meets it and handed down.

:class:`ModelStructure` holds what applying, resolving, compiling or naming a plan's units needs to know of a
model's module tree: its repeated layers and their stacks (:func:`find_layers`), the kinds of those layers, a
:class:`UnitNamer` over it, its structure fingerprint, and the wrapper around it (data parallel, FSDP2,
``torch.compile``). Each is found on first use and kept: the module tree must not change while the structure
is in use (compiling a block in place, ``layer.compile()``, does not change it).
"""

from __future__ import annotations

import sys
from functools import cached_property

from torch import nn

from ._fingerprint import structure_fingerprint
from ._kinds import LayerKinds, layer_kinds
from ._paths import is_compile_wrapper
from ._units import LayerInfo, UnitNamer, find_layers

__all__ = ["ModelStructure", "is_data_parallel"]


def is_data_parallel(module: nn.Module) -> bool:
    """A ``DistributedDataParallel`` / ``DataParallel`` wrapper: it runs its one child ``module``."""
    return isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel))


class ModelStructure:
    """The module tree of one model as a plan sees it; make it with :meth:`of`."""

    def __init__(self, model: nn.Module, layers: LayerInfo | None) -> None:
        self.model = model
        self.layers = layers
        """The repeated blocks, or None for a model without them."""

    @classmethod
    def of(cls, model: nn.Module) -> "ModelStructure":
        return cls(model, find_layers(model))

    def of_model(self, model: nn.Module) -> "ModelStructure":
        """This structure when ``model`` is its model, else ``model``'s own (a wrapper's inner module)."""
        return self if model is self.model else ModelStructure.of(model)

    @property
    def layer_paths(self) -> list[str]:
        """Module path of each repeated layer, by global index."""
        info = self.layers
        return [info.layer_path(i) for i in range(info.count)] if info is not None else []

    @cached_property
    def fingerprint(self) -> str:
        """:func:`structure_fingerprint` of the model."""
        return structure_fingerprint(self.model)

    @cached_property
    def kinds(self) -> LayerKinds | None:
        """The kinds of the repeated layers (Note: [layer kinds]); None without layers."""
        return layer_kinds(self.model, self.layers) if self.layers is not None else None

    def namer(self) -> UnitNamer:
        """A fresh :class:`UnitNamer` of the model (each pass drives its own)."""
        return UnitNamer(self.model, layers=self.layers)

    @cached_property
    def wrapper(self) -> str | None:
        """What wraps the model at its root: ``"data_parallel"`` (DistributedDataParallel, DataParallel),
        ``"compiled"`` (``torch.compile(model)``), else None."""
        if is_data_parallel(self.model):
            return "data_parallel"
        return "compiled" if is_compile_wrapper(self.model) else None

    @cached_property
    def sharded(self) -> bool:
        """Some module is ``fully_shard``ed (FSDP2)."""
        fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
        return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in self.model.modules())
