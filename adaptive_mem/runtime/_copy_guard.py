"""Copies of a model with hooks and instance forwards installed on it are plain models.

Note: [copy drops the plan]. ``copy.deepcopy``, ``pickle`` and ``torch.save`` of a planned model give a
plain model: every module the plan touched carries an instance ``__reduce_ex__`` / ``__deepcopy__``
whose state leaves out the plan's hooks, its instance forwards and these two attributes. So the copy
has the same weights and forward results and no plan (nothing in it refers to the original or to the
plan's executor, swap engine or copy thread), and one warning says so. The original is not changed
by the copy. Guarded by tests/test_planned_model_integrations.py.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any

from torch import nn

__all__ = ["CopyGuard", "NOT_COPIED"]

log = logging.getLogger(__name__)

NOT_COPIED = "the plan was not copied; apply it to the copy with adaptive_mem.optimize"
_WARNED = ("adaptive_mem", "plan not copied")  # a deepcopy memo key: one warning per deepcopy call
_NAMES = ("__reduce_ex__", "__deepcopy__")


class CopyGuard:
    """Guards the modules under ``root`` that ``handles`` (hook handles) and ``forwards`` (``(module, had,
    old)`` of each instance forward set) touch; both lists are the owner's, read when installed and when
    copied."""

    def __init__(self, root: nn.Module, *, handles: list[Any], forwards: list[tuple[nn.Module, bool, Any]],
                 attrs: list[tuple[nn.Module, str, bool, Any, Any]] | None = None) -> None:
        self.root = root
        self.handles = handles
        self.forwards = forwards
        self.attrs = attrs if attrs is not None else []  # (module, name, had, old, new) of other attributes set
        self._guarded: dict[int, tuple[nn.Module, dict[str, Any]]] = {}
        self._owned: dict[int, set[int]] = {}  # id(hook dict) -> ids of the owner's hooks in it
        self._announced = False

    def install(self) -> None:
        self.remove()
        for handle in self.handles:
            for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
                hooks = ref()
                if hooks is not None:
                    self._owned.setdefault(id(hooks), set()).add(handle.id)
        touched = {id(m): m for m, _, _ in self.forwards}
        touched.update((id(m), m) for m, *_ in self.attrs)
        if self._owned:
            for module in self.root.modules():
                if any(id(v) in self._owned for v in module.__dict__.values()):
                    touched.setdefault(id(module), module)
        if touched:
            touched.setdefault(id(self.root), self.root)
        for module in touched.values():
            self._guarded[id(module)] = (module, {n: module.__dict__[n] for n in _NAMES if n in module.__dict__})
            module.__dict__["__reduce_ex__"] = functools.partial(self._reduce_ex, module)
            module.__dict__["__deepcopy__"] = functools.partial(self._deepcopy, module)

    def remove(self) -> None:
        for module, previous in self._guarded.values():
            for name in _NAMES:
                if name in previous:
                    module.__dict__[name] = previous[name]
                else:
                    module.__dict__.pop(name, None)
        self._guarded.clear()
        self._owned.clear()

    def _warn(self) -> None:
        log.warning("copy of a model with a plan applied (%s): %s", type(self.root).__name__, NOT_COPIED)

    def _reduce_ex(self, module: nn.Module, protocol: int, *, announce: bool = True) -> Any:
        if announce and (module is self.root or not self._announced):  # pickle: the root comes first
            self._announced = True
            self._warn()
        rv = type(module).__reduce_ex__(module, protocol)
        if len(rv) < 3 or rv[2] is None:
            return rv
        state = rv[2]
        if isinstance(state, tuple):
            state = (self._plain_state(module, state[0]),) + state[1:]
        else:
            state = self._plain_state(module, state)
        return rv[:2] + (state,) + rv[3:]

    def _deepcopy(self, module: nn.Module, memo: dict[Any, Any]) -> Any:
        if _WARNED not in memo:
            memo[_WARNED] = True
            self._warn()
        return copy._reconstruct(module, memo, *self._reduce_ex(module, 4, announce=False))

    def _plain_state(self, module: nn.Module, state: Any) -> Any:
        if not isinstance(state, dict):
            return state
        state = dict(state)
        previous = self._guarded[id(module)][1] if id(module) in self._guarded else {}
        for name in _NAMES:
            if name in previous:
                state[name] = previous[name]
            else:
                state.pop(name, None)
        for owner, had, old in self.forwards:
            if owner is module:
                if had:
                    state["forward"] = old
                else:
                    state.pop("forward", None)
        for owner, name, had, old, _ in self.attrs:
            if owner is module:
                if had:
                    state[name] = old
                else:
                    state.pop(name, None)
        for key, value in list(state.items()):
            ids = self._owned.get(id(value))
            if ids:
                state[key] = type(value)((k, v) for k, v in value.items() if k not in ids)
        return state
