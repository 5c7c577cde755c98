"""Observers of the graphs AOT autograd's partitioner makes: one hook, shared by whoever needs the graphs.

Note: [partitioner hook]. Both AOT autograd partitioners (the default and min-cut, so aot_eager and inductor)
call ``enable_activation_offloading`` on the forward and backward graphs they made when
``torch._functorch.config.enable_activation_offloading`` is set, looking the function up from its module at
each call. While an observer is registered, ours is there: it hands ``(fw_module, bw_module,
num_fwd_outputs)`` to every observer in the order they came (an observer may rewrite the graphs: the graph
swap pass inserts its offload/reload pairs), then calls PyTorch's, which offloads only what others marked
``should_offload``. AOT autograd's cache is off meanwhile: a graph compiled without the observers must not be
served from it, nor one they rewrote be served to a compile without them. All is restored when the last
observer goes. Guarded by tests/test_graph_swap.py and tests/test_compiled_whole_profile.py.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from typing import Any, Callable, Iterator

import torch._functorch._activation_offloading.activation_offloading as _offloading
import torch._functorch.config as functorch_config
from torch import fx

__all__ = ["PartitionObserver", "add_partition_observer", "fresh_call", "fresh_code", "observe_partitions",
           "remove_partition_observer", "with_code"]

PartitionObserver = Callable[[fx.GraphModule, fx.GraphModule, int], None]
"""``observer(fw_module, bw_module, num_fwd_outputs)``: called on each pair of partitioned graphs."""

_observers: list[PartitionObserver] = []
_saved: dict[str, object] = {}


def _partitioned(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_fwd_outputs: int,
                 *args: object, **kwargs: object) -> None:
    original = _saved["offloading"]  # first: an observer may remove itself, and the last one restores the hook
    for observer in list(_observers):
        observer(fw_module, bw_module, num_fwd_outputs)
    if not _observers:
        _restore()
    original(fw_module, bw_module, num_fwd_outputs, *args, **kwargs)


def _restore() -> None:
    if _saved:
        _offloading.enable_activation_offloading = _saved.pop("offloading")
        for key, value in _saved.items():
            setattr(functorch_config, key, value)
        _saved.clear()


def add_partition_observer(observer: PartitionObserver) -> None:
    """Call ``observer`` on every pair of graphs partitioned from now on (Note: [partitioner hook])."""
    if not _saved:
        _saved.update(enable_autograd_cache=functorch_config.enable_autograd_cache,
                      enable_activation_offloading=functorch_config.enable_activation_offloading,
                      offloading=_offloading.enable_activation_offloading)
        functorch_config.enable_autograd_cache = False
        functorch_config.enable_activation_offloading = True
        _offloading.enable_activation_offloading = _partitioned
    if observer not in _observers:
        _observers.append(observer)


def remove_partition_observer(observer: PartitionObserver) -> None:
    """Stop calling ``observer``; the hook goes with the last one."""
    if observer in _observers:
        _observers.remove(observer)
    if not _observers:
        _restore()


@contextlib.contextmanager
def observe_partitions(observer: PartitionObserver) -> Iterator[None]:
    """``observer`` registered inside the block."""
    add_partition_observer(observer)
    try:
        yield
    finally:
        remove_partition_observer(observer)


_codes = itertools.count()


def fresh_code(fn: Callable[..., Any]) -> types.CodeType:
    """A copy of ``fn``'s code object, distinct from every other (renamed with a process-wide ordinal)."""
    return fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_codes)}")


def with_code(fn: Callable[..., Any], code: types.CodeType | None = None) -> Callable[..., Any]:
    """``fn`` with a code object of its own (``code``, or a fresh copy of its own): dynamo keeps its compiled
    graphs per code object and guards on the code of the function it inlines, so a function with its own code
    is traced and partitioned anew (the observers see its graphs), never served a graph traced for another."""
    if code is None:
        code = fresh_code(fn)
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def fresh_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling ``fn`` (a bound method too) under a code object of its own (:func:`with_code`)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return with_code(call)
