"""The scope of the runtime's own ops (Note: [machinery ops] in ``_units.py``): the namer and the recorder skip
what runs inside it."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

__all__ = ["in_machinery", "machinery_scope"]


_machinery = threading.local()


class _MachineryScope:
    """One stateless scope object serves every use (the depth is thread-local): a hot path's decorator costs no
    generator per call, and no mark where no dispatch mode is entered (Note: [machinery ops])."""

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def scoped(*args: Any, **kwargs: Any) -> Any:
            if not _modes():  # no mode on this thread: nothing can see the ops
                return fn(*args, **kwargs)
            with self:
                return fn(*args, **kwargs)
        return scoped

    def __enter__(self) -> None:
        _machinery.depth = getattr(_machinery, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _machinery.depth -= 1


_MACHINERY = _MachineryScope()
_modes: Callable[[], int] = torch._C._len_torch_dispatch_stack
"""The Python dispatch modes entered on this thread (the ones that could name an op)."""


def machinery_scope() -> _MachineryScope:
    """Ops run inside are not the model's: no unit, no suffix counted (Note: [machinery ops]). Thread-local, so a
    copy thread's ops are outside every pass anyway. Usable with ``with`` and as a decorator."""
    return _MACHINERY


def in_machinery() -> bool:
    """True inside :func:`machinery_scope` on this thread."""
    return getattr(_machinery, "depth", 0) > 0
