"""Custom ``torch.autograd.Function``s as plan units: ``wrap_function(Fn, *args)`` for ``Fn.apply(*args)``.

Note: [wrapped Function unit]. A wrapped call runs ``Fn.apply`` inside
:func:`profiler._units.function_scope`, so every :class:`UnitNamer` (the profiler's, the
executor's swap tracker, the selective-checkpoint policy and its trace) names all of the
Function's forward ops as one unit ``<module path>.<label>``. Its decisions then come from the
paths every op takes, nothing Function-specific:

* ``recompute``: the layer runs under the selective-checkpoint policy, the Function's ops are
  ``PREFER_RECOMPUTE``, so the tensors its ``ctx.save_for_backward`` saved are not cached and
  ``Fn.forward`` runs again in backward;
* ``swap``: the storages its ops produced and its context saved go through the swap hooks;
* ``keep``: nothing changes.

An unwrapped Function is ops of its enclosing module like any other code: its saved tensors
go through the saved-tensor hooks and a layer checkpoint replays it. Guarded by
tests/test_custom_functions.py.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from adaptive_mem.config._errors import ConfigError
from profiler.naming import function_scope

__all__ = ["wrap_function", "adapt_mem_func_wrapper", "function_labels"]

_LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _label(fn: Any) -> str:
    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        raise ConfigError(f"wrap_function: fn={fn!r}: expected a torch.autograd.Function subclass "
                        "(the class whose .apply the call replaces)")
    label = getattr(fn, "unit_label", None) or fn.__name__
    if not isinstance(label, str) or not _LABEL.match(label):
        raise ConfigError(f"wrap_function: {fn.__name__}.unit_label={label!r}: expected an identifier "
                         "(letters, digits, '_'), the last part of the unit name")
    return label


def wrap_function(fn: type[torch.autograd.Function], /, *args: Any, **kwargs: Any) -> Any:
    """``fn.apply(*args, **kwargs)`` as one plan unit ``<enclosing module path>.<label>`` (label: ``fn.unit_label``,
    else the class name; ``_1``, ``_2``... for later calls in one module call), profiled, kept,
    recomputed or swapped like any op (Note: [wrapped Function unit])."""
    label = _label(fn)
    if torch.compiler.is_compiling():  # plans on compiled code run outside dynamo (Note: [compile honoured])
        return fn.apply(*args, **kwargs)
    with function_scope(label):
        return fn.apply(*args, **kwargs)


def adapt_mem_func_wrapper(fn: type[torch.autograd.Function], /, *args: Any, **kwargs: Any) -> Any:
    """MindSpeed's name for :func:`wrap_function`: ``adapt_mem_func_wrapper(Fn, *args)`` replaces ``Fn.apply(*args)``."""
    return wrap_function(fn, *args, **kwargs)


def function_labels() -> set[str]:
    """Unit labels a wrapped call can take: those of every ``torch.autograd.Function`` subclass defined now
    (a plan may name ``layers.0.mlp.SiluMul`` before the first forward has shown the unit)."""
    labels: set[str] = set()
    stack = list(torch.autograd.Function.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        label = getattr(cls, "unit_label", None) or cls.__name__
        if isinstance(label, str) and _LABEL.match(label):
            labels.add(label)
    return labels
