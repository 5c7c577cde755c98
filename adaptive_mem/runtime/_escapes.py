"""Swap storages that left their scope, and when the saved-tensor hooks kept entered for them may leave.

Note: [hooks leave after the last save]. A swap scope that returns a storage a swap unit made keeps the saved-tensor
hooks entered after its call, since a later op may save that storage (Note: [swap scopes] in ``_op_swap.py``): up to
the end of the layer call at the latest, every save of the layer after the scope goes through the pack hook (on an
HF Llama MLP, a swapped ``gate_proj`` output is saved by ``act_fn`` alone, but ``up_proj``, ``mul`` and
``down_proj`` pack six more tensors). So each forward counts the saves of each swap unit's storages; from the next
forward on, once every escaped storage's unit has had as many saves as in the previous forward, the hooks leave at
that save, and a unit whose storage was not saved at all in it never enters them. Counts are per unit and per
forward: a unit called twice has its saves summed, so the hooks stay through the first call. A forward whose control
flow saves a unit's storage more often than the previous one keeps the extra saves on the device (memory, never a
gradient: a save outside the hooks is autograd's own); the next forward counts them. The first forward keeps the
hooks to the layer's end. tests/test_footprint_swap.py counts the pack calls and checks the bytes swapped and the
gradients of every step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Escapes"]


class Escapes:
    """The escaped swap storages of the forward under way, and the saves of each swap unit in it and the last one."""

    __slots__ = ("refs", "counts", "expected")

    def __init__(self) -> None:
        self.refs: list[tuple[Any, str]] = []
        """(weak storage, unit) of the swap storages that left a scope, while the hooks stay for them."""
        self.counts: dict[str, int] = {}  # unit -> saves of its storages in this forward
        self.expected: dict[str, int] | None = None  # the same for the last forward; None before one ended

    def __bool__(self) -> bool:
        return bool(self.refs)

    def add(self, escaped: list[tuple[Any, str]]) -> None:
        for _, unit in escaped:
            self.counts.setdefault(unit, 0)
        self.refs.extend(escaped)

    def saved(self, unit: str) -> None:
        self.counts[unit] = self.counts.get(unit, 0) + 1

    def done(self) -> bool:
        """Every escaped storage's unit had as many saves as in the last forward (none before one ended)."""
        expected, counts = self.expected, self.counts
        if expected is None:
            return False
        for _, unit in self.refs:
            want = expected.get(unit)
            if want is None or counts[unit] < want:
                return False
        return True

    def keep_returned(self, returned: frozenset[int]) -> None:
        """At a layer's end: the escaped storages it does not return are dead."""
        self.refs = [(ref, unit) for ref, unit in self.refs if (st := ref()) is not None and st._cdata in returned]

    def clear(self) -> None:
        self.refs.clear()

    def end_forward(self) -> None:
        """The outermost forward ended: its counts are what the next one expects."""
        self.refs.clear()
        self.expected, self.counts = self.counts, {}
