"""A plan resolved onto a step model (:class:`Assignment`) and the segments the simulator runs it in
(:class:`Segment`), apart from the simulator so that its timeline (``_step_run.py``) reads them too."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ._plan import Action

__all__ = ["Assignment", "Segment"]


@dataclass(frozen=True)
class Assignment:
    """A plan resolved onto units: one action and prefetch distance per unit, plus groups."""

    actions: tuple[Action, ...]
    """Per unit (``StepModel.units`` order)."""
    prefetch: tuple[int, ...]
    """Per unit: ``backward_prefetch`` of swapped units (ignored for the others)."""
    groups: tuple[tuple[int, int], ...] = ()
    """(first position, last position) of each group of layers checkpointed together."""
    inputs: tuple[tuple[int, int], ...] = ()
    """(position, prefetch) of each layer recomputed as a whole whose checkpoint input is swapped
    (Note: [swapped checkpoint input])."""

    @functools.cached_property
    def grouped(self) -> frozenset[int]:
        """Positions inside a checkpoint group."""
        return frozenset(p for a, b in self.groups for p in range(a, b + 1))


@dataclass
class Segment:
    positions: tuple[int, ...]
    mode: str
    """``plain`` (no recompute), ``sac`` (op-level recompute) or ``full`` (whole layer / group)."""
    units: list[int]
    hold: dict[int, int]
    """Bytes each unit leaves on the device at its forward end (swapped bytes excluded)."""
    inputs: int
    """Bytes of inputs a full checkpoint holds that are not saved anyway."""
    swaps: list[int]
    transient: int
    replay: float
    in_swap: int = 0
    """Bytes of the checkpoint input swapped out after the forward and back before the replay (held by the
    previous position: only the copies and the reload are this segment's)."""
    in_prefetch: int = 1

    @property
    def held(self) -> int:
        return self.inputs + sum(self.hold.values())
