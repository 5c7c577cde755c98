"""The executor under ``torch.compile``: what runs outside dynamo, and the one warning when compiled blocks run eager.

The op-level paths of the :class:`~adaptive_mem.runtime._executor.Executor` decide per op inside a layer:
selective checkpoint (``_selective.py``) and swap outside checkpointed layers (``_op_swap.py``).
:class:`CompileWatch` finds the compiled blocks and warns when they meet one of these paths.

Note: [compile honoured]. Dynamo cannot trace these two paths (a dispatch mode and
saved-tensor hooks; the SAC policy names each op by module), and a compiled frame
first entered under a non-infra dispatch mode is marked to run eager for good (the
block stays eager after ``remove()``, with 0 graphs and 0 graph breaks reported).
So both eager paths run outside dynamo on purpose: the eager selective-checkpoint forward
and every executor hook are ``torch.compiler.disable``d, and while the swap hooks are pushed
the model's forward is disabled and the stance is ``force_eager``, so compiled blocks run
eager without being marked, except those the executor wraps (Note: [swap around compiled blocks]
in ``_compiled_swap.py``: whole-layer swap, op-level swap (Note: [op-level swap in a block]) and blocks without
swaps stay compiled). A selective layer without swap units chooses at call time:
while dynamo traces it (``torch.compiler.is_compiling()``) it runs a plain checkpoint whose
``context_fn`` is the compile-mode policy (Note: [compiled SAC names]), and the namer hooks
are skipped (:func:`eager_only`), so select recompute stays inside the compiled block with
0 graph breaks; eager, it takes the eager path. Whole-layer and group recompute stay
traceable too (tests/test_compile_sac.py). When compiled blocks meet the eager-only path
(a selective layer with swap units), one warning per
plan application names the blocks and the reason (:meth:`CompileWatch.check`,
at install and at each forward until it has warned; guarded by
tests/test_compile_honoured.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import types
from typing import Any, Callable

import torch
from torch import nn

from profiler.naming import is_compile_wrapper

from ._plan_context import PlanContext

__all__ = ["CompileWatch", "eager_only", "fresh_code", "outside_dynamo", "with_code"]

log = logging.getLogger(__name__)

_SAC_WHY = ("its swap units are offloaded from the cache of the eager selective-checkpoint policy (a dispatch "
            "mode naming each op by module), which dynamo cannot trace")


def _is_compiled(module: nn.Module) -> bool:
    """``module.compile()``d, or torch.compile's ``OptimizedModule`` wrapper."""
    return getattr(module, "_compiled_call_impl", None) is not None or is_compile_wrapper(module)


def _in_optimized_module() -> bool:
    """True inside the call of a ``torch.compile(module)`` wrapper (the whole model compiled)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    check = getattr(eval_frame, "_is_in_optimized_module", None)
    return bool(check is not None and check())


def outside_dynamo(fn: Callable[..., Any], *, eager_callees: bool = False) -> Callable[..., Any]:
    """``fn`` never traced by dynamo; with ``eager_callees`` compiled modules it calls run eager, unmarked
    (Note: [compile honoured])."""
    if eager_callees:
        inner = fn

        @functools.wraps(inner)
        def fn(*args: Any, **kwargs: Any) -> Any:
            with torch.compiler.set_stance("force_eager"):
                return inner(*args, **kwargs)
    return torch.compiler.disable(fn)


def with_code(fn: Callable[..., Any], code: types.CodeType | None = None) -> Callable[..., Any]:
    """``fn`` with a code object of its own (``code``, or a fresh copy of its own): dynamo guards on the code of
    the function it inlines, so a forward with its own code is compiled into a graph of its own, never served one
    traced for another (Note: [op-level swap in a block], Note: [partitioner hook])."""
    if code is None:
        code = fresh_code(fn)
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def fresh_code(fn: Callable[..., Any]) -> types.CodeType:
    """A copy of ``fn``'s code object, distinct from every other (renamed with a process-wide ordinal)."""
    return fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_codes)}")


_codes = itertools.count()


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A hook run outside dynamo in eager code and skipped inside a compiled frame, where a call of a
    ``torch.compiler.disable``d function would break the graph (Note: [compile honoured])."""
    off = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return off(*args, **kwargs)
    return hook


def _span(container: str, indices: list[int]) -> str:
    """``layers.0-3``, ``layers.1, layers.3``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{container}.{r[0]}" + (f"-{r[-1]}" if len(r) > 1 else "") for r in runs)


class CompileWatch:
    """Finds the compiled blocks of a planned model and warns once when they meet a path dynamo cannot trace.

    ``sac``: the states of the selectively checkpointed layers by index (``SelectiveLayers.states``: each says
    whether it ``swaps``)."""

    def __init__(self, ctx: PlanContext, sac: dict[int, Any]) -> None:
        self.ctx = ctx
        self.sac = sac
        self.warned = False

    def _compiled_blocks(self, *, in_forward: bool) -> tuple[bool, list[int]]:
        """Whether the whole model is compiled, and the compiled blocks (also those compiled after install)."""
        ctx = self.ctx
        whole = _is_compiled(ctx.model) or (in_forward and _in_optimized_module())
        info = ctx.res.layers
        blocks = [i for i in range(ctx.num_layers)
                  if _is_compiled(ctx.layers[i]) or _is_compiled(ctx.model.get_submodule(info.layer_path(i)))]
        return whole, blocks

    def eager_blocks(self) -> list[int]:
        """Layers whose compiled block runs eager under this plan: select recompute with swaps."""
        return sorted(i for i, st in self.sac.items() if st.swaps)

    def check(self, *, in_forward: bool = False) -> None:
        """Warn once when compiled blocks meet a path dynamo cannot trace."""
        ctx = self.ctx
        if self.warned or not any(st.swaps for st in self.sac.values()):
            return
        whole, blocks = self._compiled_blocks(in_forward=in_forward)
        if not whole and not blocks:
            return
        container = ctx.res.layers.container if ctx.res.layers is not None else ""
        parts = []
        sac = sorted(i for i, st in self.sac.items() if st.swaps and (whole or i in blocks))
        if sac:
            parts.append(f"select recompute of {_span(container, sac)} runs outside the compiled region: {_SAC_WHY}")
        if parts:
            self.warned = True
            log.warning("adaptive_mem: %s; the blocks run eager", "; ".join(parts))

    def watch(self, module: nn.Module, args: Any) -> None:
        """A forward pre-hook: blocks compiled after install are found at the next forward."""
        self.check(in_forward=True)
