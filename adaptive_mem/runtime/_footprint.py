"""The machinery's footprint: how many Python calls a plan adds to a step, counted.

Note: [footprint counters]. :data:`FOOTPRINT` counts the Python ``__torch_dispatch__`` calls made by the
runtime's dispatch modes (the selective-checkpoint policy calls included), the saved-tensor pack hook calls
and the unpack hook calls, and the swap engine's backward triggers registered (a gradient hook on a layer's output:
Note: [triggers where due] in ``_swap_engine.py``). Each call site adds one with a single attribute increment: always on, no lock
(the counts are exact for the thread that runs the step; concurrent steps in several threads may lose
increments, which only the footprint tests would see and they run one step in one thread). The tests bound
the counts per step by the units a plan decides (tests/test_footprint.py) and ``profile --calibrate``
divides a measured overhead by them to price one call.
"""

from __future__ import annotations

__all__ = ["FOOTPRINT", "Footprint"]


class Footprint:
    """Counts of Python dispatch, pack and unpack calls made by the runtime since the last :meth:`reset`."""

    __slots__ = ("dispatch", "pack", "unpack", "trigger")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.dispatch = 0
        self.pack = 0
        self.unpack = 0
        self.trigger = 0

    def snapshot(self) -> dict[str, int]:
        """The current counts, as a new dict ``{"dispatch", "pack", "unpack", "trigger"}``."""
        return {"dispatch": self.dispatch, "pack": self.pack, "unpack": self.unpack, "trigger": self.trigger}


FOOTPRINT = Footprint()
"""The process-wide counter every call site increments (Note: [footprint counters])."""
