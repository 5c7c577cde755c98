"""The collective units a tensor-parallel layout (DTensor ``parallelize_module``) adds to a layer, read from
its modules' layout hooks without running it, so configs can name them before the first forward
(Note: [collective units] in ``profiler/_units.py``: ``<module path>.all_reduce`` and so on).

* a row-wise linear's output hook: ``all_reduce`` (output replicated) or ``reduce_scatter`` (output sharded:
  sequence parallel);
* an input hook (``ColwiseParallel``, ``RowwiseParallel``, ``PrepareModuleInput``) turning a sharded input into
  a replicated one: ``all_gather``.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from torch import nn

from profiler.naming import named_modules
from profiler.naming import COLLECTIVE_LABELS

__all__ = ["is_collective_name", "layout_collectives", "layout_styles"]


def is_collective_name(name: str) -> bool:
    """``attention.wo.all_reduce``, ``..._1``: a collective's unit name."""
    return re.sub(r"_\d+$", "", name.rpartition(".")[2]) in COLLECTIVE_LABELS


def layout_styles(module: nn.Module) -> Iterator[tuple[str, tuple]]:
    """``(style function qualname, its bound arguments)`` of each layout hook on ``module``: a hook closing over a
    ``functools.partial`` of a PyTorch distributed style function (other partials, the runtime's own hooks among
    them, are no layout)."""
    for hook in list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values()):
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            func = getattr(value, "func", None)
            if func is not None and getattr(func, "__module__", "").startswith("torch.distributed"):
                yield getattr(func, "__qualname__", ""), tuple(getattr(value, "args", ()))
            elif type(value).__name__ == "PrepareModuleInput":
                yield "PrepareModuleInput._prepare_input_fn", (value.input_layouts, value.desired_input_layouts)


def _gathers(src: Any, dst: Any) -> bool:
    pairs = zip(src, dst) if isinstance(src, (tuple, list)) and isinstance(dst, (tuple, list)) else [(src, dst)]
    return any(s is not None and d is not None and s.is_shard() and d.is_replicate() for s, d in pairs)


def layout_collectives(layer: nn.Module) -> tuple[str, ...]:
    """Local names of the collectives ``layer``'s layout hooks issue, in module order (``()`` without a layout)."""
    found: list[str] = []
    for path, module in named_modules(layer):  # Note: [compile wrapper names]
        prefix = f"{path}." if path else ""
        for qualname, args in layout_styles(module):
            if qualname.endswith("._prepare_input_fn") and len(args) == 2 and _gathers(*args):
                found.append(prefix + "all_gather")
            elif qualname == "RowwiseParallel._prepare_output_fn" and args:
                layouts = args[0] if isinstance(args[0], (tuple, list)) else (args[0],)
                found.append(prefix + ("reduce_scatter" if any(p.is_shard() for p in layouts) else "all_reduce"))
    return tuple(dict.fromkeys(found))
