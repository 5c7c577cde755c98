"""Which storages a rescue swaps out first: the one needed furthest in the future.

Without a profile that is the one saved earliest (backward uses the last saved first). With a
profile (:meth:`EvictionPolicy.set_profile`) the choice is cost-aware: backward seconds until the
owner's layer starts its backward, minus the storage's reload time. Only storages the manager
alone owns are candidates (Note: [never swap a tensor in use], ``_storage.py``).
"""

from __future__ import annotations

from typing import Any

from ._storage import StorageGroup

__all__ = ["EvictionPolicy"]


class EvictionPolicy:
    """Orders a SwapManager's storages for swapping out, furthest next use first."""

    def __init__(self, *, num_layers: int) -> None:
        self.num_layers = num_layers
        self.bwd_before: dict[int, float] = {}
        """Backward seconds before each layer's backward starts (-1: before the layers, ``num_layers``: after)."""
        self.h2d = 0.0
        """Reload bandwidth, bytes per second (0: unknown)."""

    def set_profile(self, profile: Any) -> None:
        """Backward seconds before each layer's backward starts, and the reload bandwidth."""
        after = self.num_layers
        per_layer: dict[int, float] = {}
        seen_layer = False
        for unit in profile.units:
            seen_layer = seen_layer or unit.layer is not None
            pos = unit.layer if unit.layer is not None else (after if seen_layer else -1)
            per_layer[pos] = per_layer.get(pos, 0.0) + unit.bwd_time
        before: dict[int, float] = {}
        acc = 0.0
        for pos in sorted(per_layer, reverse=True):
            before[pos] = acc
            acc += per_layer[pos]
        self.bwd_before = before
        self.h2d = float(getattr(profile.hardware, "h2d_bandwidth", 0.0) or 0.0)

    def score(self, group: StorageGroup) -> float:
        """Higher: needed later, so swapped out sooner."""
        if not self.bwd_before:
            return -float(group.seq)
        until = self.bwd_before.get(group.layer, 0.0)
        reload = group.nbytes / self.h2d if self.h2d > 0 else 0.0
        return until - reload - group.seq * 1e-12

    def candidates(self, groups: list[StorageGroup]) -> list[StorageGroup]:
        """What a rescue may swap out, in order: storages still on the device that only the manager owns,
        then what a prefetch brought back too early (it is needed soonest: last)."""
        first = sorted((g for g in groups if g.record is None and g.exclusive()), key=self.score, reverse=True)
        return first + sorted((g for g in groups if g.record is not None and g.record.h2d is not None
                               and not any(s.used for s in g.live_slots())), key=self.score, reverse=True)
