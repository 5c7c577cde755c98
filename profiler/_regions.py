"""The ``record_function`` regions open while ops run, and which of them a parallel wrapper opened.

Note: [wrapper ops] a parallel wrapper runs ops of its own around the model's: FSDP2 all-gathers a block's
parameters into buffers it allocates and copies out (``FSDP::pre_forward``), frees them after the block
(``FSDP::post_forward``), gathers them again and reduce-scatters the gradients in backward. Each such region is a
``record_function`` whose name starts with one of :data:`WRAPPER_REGIONS`. Its ops belong to no unit (no plan can
name an all-gather buffer), what they allocate is the wrapper's memory, not an activation, and the
``record_function`` markers themselves are no units either. Guarded by tests/test_wrapper_ops.py and
tests/test_parallel_adaptive_layouts.py (an FSDP2 rank's profile has the plain model's units).
"""

from __future__ import annotations

import torch

__all__ = ["Regions", "WRAPPER_REGIONS"]

WRAPPER_REGIONS = ("FSDP::",)


class Regions:
    """The open ``record_function`` regions, innermost last, as the ops that open and close them go by."""

    def __init__(self) -> None:
        self._open: list[bool] = []

    @property
    def wrapper(self) -> bool:
        """Ops run now belong to a parallel wrapper's region."""
        return any(self._open)

    def clear(self) -> None:
        self._open.clear()

    def observe(self, func: torch._ops.OpOverload, args: tuple = ()) -> bool:
        """Whether ``func`` opens or closes a region (a marker, no op of the model); keeps the open regions. Call it
        for every op with the op's arguments (the opening marker's first one is the region's name)."""
        if func.namespace != "profiler":
            return False
        name = func.overloadpacket.__name__
        if name.startswith("_record_function_enter"):
            label = args[0] if args else None
            self._open.append(isinstance(label, str) and label.startswith(WRAPPER_REGIONS))
        elif name.startswith("_record_function_exit") and self._open:
            self._open.pop()
        return True
