"""The saved-tensor hooks of a layer swapped as a whole on the engine's native store (Note: [whole-layer pack in
C++] in ``_layer_pack.h``), for :class:`~adaptive_mem.runtime._op_swap.OpSwaps`."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterable

import torch

from ._footprint import FOOTPRINT
from ._host_marks import extension
from ._swap_scopes import Outer

__all__ = ["LayerHooks", "weakly"]


class LayerHooks:
    """One plan's C++ packer, set up anew for each call of a layer swapped as a whole."""

    def __init__(self, engine: Any, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> None:
        """``pack``/``unpack``: the Python hooks, which take what the packer leaves to them (and count it)."""
        self.engine = engine
        self.packer = extension().LayerPacker(engine.store, FOOTPRINT, weakly(pack), unpack, Outer)

    @staticmethod
    def available(engine: Any, opaque: bool) -> bool:
        """The engine has a native store (so the extension is loaded) and the model no opaque region (where the Python
        pack decides)."""
        return engine.store is not None and not opaque

    def enter(self, whole: tuple[int, int, str], inputs: Iterable[int], kept: Callable[[], Iterable[int]],
              outer: tuple[Callable, Callable] | None) -> Any:
        """The hooks of one layer call, entered: ``whole`` = (layer index, backward prefetch, layer path); ``inputs``:
        the storages of its inputs; ``kept()``: those of its parameters and buffers, asked at its first save (after
        FSDP2 gathered them); ``outer``: the hooks entered before (Note: [scope hooks chain outward])."""
        layer, prefetch, label = whole
        trigger, limit = self.engine.native_terms(layer, prefetch)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)
        self.packer.configure(list(inputs), kept, label, trigger, limit, outer_pack, outer_unpack)
        hooks = torch.autograd.graph.saved_tensors_hooks(self.packer.pack, self.packer.unpack)
        hooks.__enter__()
        return hooks

    def exit(self, hooks: Any) -> None:
        """The layer call's hooks leave; the packer lets go of the call's sources and outer hooks."""
        hooks.__exit__(None, None, None)
        self.packer.release()


def weakly(method: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``method(*args, ...)`` through a weak reference to its object, for the C++ packer to hold: the garbage
    collector does not see into it, so a strong reference there would keep the plan, and the model its hooks hang
    on, alive for good."""
    return functools.partial(_call_weak, weakref.WeakMethod(method), *args)


def _call_weak(ref: weakref.WeakMethod, *args: Any) -> Any:
    method = ref()
    if method is None:
        raise RuntimeError("a whole-layer swap's hooks ran after their plan was removed")
    return method(*args)
