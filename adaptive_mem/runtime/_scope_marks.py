"""Scopes known by their boundaries: an op-level swap scope that needs its tracker only once.

Note: [scopes by their boundaries]. The op tracker of a swap scope (Note: [swap scopes] in ``_op_swap.py``) costs a
Python dispatch call per op of the scope module. Most swap units make a tensor that crosses a module boundary
before anything saves it: a ``Linear``'s matmul is its output, an activation's input is the matmul of its parent.
So the scope's first call runs under the tracker as before and, beside it, notes the module boundaries of the call
in order (each pre-hook's arguments and each forward hook's output of the modules under the scope, which the unit
namer's hooks see): where each storage a swap unit made first appears, before any save of it. When every such
storage appeared at a boundary, later calls run without the tracker and without saved-tensor hooks up to that
boundary: there the storages at the noted positions are recorded as the units' and the hooks enter (a save before
it could not be one of a swap storage). A scope with a storage saved before any boundary (an op in the scope
module's own code saving it) keeps the tracker. A boundary is matched by its index in the call and its module, so
a call that takes another path records nothing there. Which storage is offloaded never changes a gradient (a swap
restores the bytes; the engine checks in-place changes), only the memory; tests/test_footprint_swap.py counts the
dispatch calls and checks every step against the step with no plan.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from profiler.tracing import tensor_leaves

from ._swap_engine import local_shard

__all__ = ["ScopeMarks"]

Mark = tuple[int, list[tuple[int, str]]]  # (id of the module at the boundary, [(position, unit)])


class ScopeMarks:
    """The boundary marks of one plan's swap scopes, and the state of the scope call under way."""

    def __init__(self) -> None:
        self.known: dict[int, dict[int, Mark] | None] = {}
        """id of a scope module -> its marks by boundary index, or None where the tracker stays."""
        self.watching = False  # a scope call is learning or running by its marks: boundaries count
        self.lit: dict[int, Mark] | None = None  # the marks of the call under way
        self.events = 0  # boundaries seen in the call under way
        self.made: set[int] | None = None  # learning: the storages the swap units made
        self.saved: set[int] = set()  # learning: those of them saved so far
        self.located: dict[int, tuple[int, int, int]] = {}  # learning: storage -> (boundary, module id, position)

    def begin(self, module: Any) -> bool:
        """A scope call begins; True when it runs by its marks (no tracker, no hooks yet)."""
        known = self.known.get(id(module), ())
        self.events, self.watching = 0, known is not None
        if known:
            self.lit = known
            return True
        if known == ():  # the first call: learn
            self.made, self.saved, self.located = set(), set(), {}
        return False

    def made_here(self, key: int) -> None:
        if self.made is not None:
            self.made.add(key)

    def saved_here(self, key: int) -> None:
        if self.made is not None:
            self.saved.add(key)

    def boundary(self, module: Any, tree: Any, record: Callable[[torch.Tensor, str], None]) -> None:
        """A module boundary inside the scope call: ``record(tensor, unit)`` the marked storages (running by the
        marks), or note where the swap storages first appear (learning)."""
        index = self.events
        self.events += 1
        if self.lit is not None:
            mark = self.lit.get(index)
            if mark is not None and mark[0] == id(module):
                flat = tensor_leaves(tree)
                for pos, unit in mark[1]:
                    if pos < len(flat):
                        record(flat[pos], unit)
            return
        made = self.made
        if not made:
            return
        for pos, t in enumerate(tensor_leaves(tree)):
            key = local_shard(t).untyped_storage()._cdata
            if key in made and key not in self.saved and key not in self.located:
                self.located[key] = (index, id(module), pos)

    def end(self, module: Any, producer: dict[int, tuple[Any, str, int, int]]) -> None:
        """The scope call ends (the caller then resets); learning, its marks are kept (``producer``: storage ->
        (weak storage, swap unit, layer, backward prefetch))."""
        if self.made is not None:
            made, located = self.made, self.located
            marks: dict[int, Mark] | None = None
            if made and all(key in located for key in made):
                marks = {}
                for key in made:
                    index, owner, pos = located[key]
                    marks.setdefault(index, (owner, []))[1].append((pos, producer[key][1]))
            self.known[id(module)] = marks

    def reset(self) -> None:
        """No scope call under way (what learning noted is read only while ``made`` is set)."""
        self.watching, self.lit, self.made = False, None, None
