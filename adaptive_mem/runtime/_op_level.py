"""The executor under ``torch.compile``: what runs outside dynamo, and the helpers that keep compiled code apart.

The op-level paths of the :class:`~adaptive_mem.runtime._executor.Executor` decide per op inside a layer:
selective checkpoint (``_selective.py``) and swap outside checkpointed layers (``_op_swap.py``).

Note: [compile honoured]. Dynamo cannot trace the eager forms of these two paths (a dispatch mode and
saved-tensor hooks; the SAC policy names each op by module), and a compiled frame
first entered under a non-infra dispatch mode is marked to run eager for good (the
block stays eager after ``remove()``, with 0 graphs and 0 graph breaks reported).
So both eager paths run outside dynamo on purpose: the eager selective-checkpoint forward
and every executor hook are ``torch.compiler.disable``d, and while the swap hooks are pushed
the model's forward is disabled and the stance is ``force_eager``, so compiled blocks run
eager without being marked, except those the executor wraps (Note: [swap around compiled blocks]
in ``_compiled_swap.py``: whole-layer swap, op-level swap (Note: [op-level swap in a block]), select recompute
with swaps and blocks without swaps stay compiled). A selective layer chooses at call time:
while dynamo traces it (``torch.compiler.is_compiling()``) it runs a plain checkpoint whose
``context_fn`` is the compile-mode policy (Note: [compiled SAC names]), and the namer hooks
are skipped (:func:`eager_only`), so select recompute stays inside the compiled block with
0 graph breaks; its swap units are swapped by the graph pass (Note: [select recompute with swaps, compiled] in
``_selective.py``); eager, it takes the eager path. Whole-layer and group recompute stay
traceable too (tests/test_compile_sac.py). So every plan runs compiled under a whole-model or a per-block
compile, with 0 graph breaks (guarded by tests/test_compile_honoured.py); what still runs eager is named by
its own warning (a dispatch mode above the op tracker, Note: [swap around compiled blocks]; blocks past dynamo's
recompile limit, Note: [op-level swap in a block]).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from profiler.tracing import with_code

__all__ = ["eager_only", "outside_dynamo", "planned_forward"]


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


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A hook run outside dynamo in eager code and skipped inside a compiled frame, where a call of a
    ``torch.compiler.disable``d function would break the graph (Note: [compile honoured]). Where no frame
    evaluation callback is set (plain eager code, the planned forward) the disabled call is the plain call,
    and the hook makes it without the wrapper's two callback swaps."""
    off = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        if _callback() is None:
            return fn(*args, **kwargs)
        return off(*args, **kwargs)
    return hook


_callback: Callable[[], Any] = torch._C._dynamo.eval_frame.get_eval_frame_callback
"""The frame evaluation callback dynamo has set for this thread (None: frames run as plain Python)."""


def planned_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The model's forward under a plan with swaps. Eager, it runs outside dynamo with the swap hooks (Note:
    [compile honoured]); traced by dynamo (the whole model compiled), it is the plain forward, and a pass over the
    partitioned graphs places the swaps in them (Note: [partitioner hook] in ``profiler/_partitions.py``). Its code object
    is one per plan (:func:`with_code`): dynamo compiles the planned model anew, never serving the graph of an
    earlier plan, and the graph meets the pass."""
    eager = outside_dynamo(forward)

    def forward_with_plan(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        return eager(*args, **kwargs)
    return functools.wraps(forward)(with_code(forward_with_plan))
