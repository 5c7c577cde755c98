"""Checkpoint groups of the :class:`~adaptive_mem.runtime._executor.Executor`: layers a..b recomputed as one unit.

Note: [group inputs]. A checkpoint group runs layers a..b in one checkpoint on layer a's inputs, handing
each next layer the previous one's hidden states and layer a's other inputs. A stack that passes a value
from one layer to the next besides the hidden states (T5's position bias, computed by its first block)
calls the member with other objects than the replay used: the member then runs as its own whole-layer
recompute on its real inputs, the group is split for good (per-layer recompute) and one warning names the
input; gradients stay exact (tests/test_encoder_decoder.py). A replay that wrote a KV cache for the members
could not be undone, so a group whose call carries a cache (Note: [cache in recompute]) runs its first
call per layer, checking each member's inputs the same way, and as one group from then on.

:class:`CheckpointGroups` makes the forwards of a group's layers; it shares the plan's state through its
:class:`~adaptive_mem.runtime._plan_context.PlanContext`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch
from torch import nn

from profiler.tracing import tensor_leaves

from ._layer_cache import cache_snapshot, has_cache, replays_on_snapshot
from ._plan_context import PlanContext
from ._recompute import WholeLayers

__all__ = ["CheckpointGroups"]

log = logging.getLogger(__name__)


def _first_tensor(obj: Any) -> torch.Tensor | None:
    leaves = tensor_leaves(obj)
    return leaves[0] if leaves else None


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return kwargs.get("hidden_states")


def _with_hidden(args: tuple, kwargs: dict, h: torch.Tensor) -> tuple[tuple, dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (h,) + tuple(args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": h}
    raise RuntimeError("checkpoint group: cannot find the hidden states argument of the layer call "
                       "(expected a tensor as first argument or hidden_states=)")


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, (torch.Tensor, nn.Module)) or isinstance(b, (torch.Tensor, nn.Module)):
        return False
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (bool, int, float, str, type(None))) and isinstance(b, (bool, int, float, str, type(None))):
        return a == b
    return False


def _positional_names(layer: nn.Module) -> list[str]:
    try:
        params = list(inspect.signature(type(layer).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _differing_input(used_args: tuple, used_kwargs: dict, args: tuple, kwargs: dict,
                     names: list[str] = ()) -> str | None:
    """The first input of a group member's real call that differs from what its group replay passed it
    (Note: [group inputs]); None when they are the same objects."""
    if len(used_args) != len(args):
        return "a different number of positional arguments"
    for k, (a, b) in enumerate(zip(used_args, args)):
        if not _same(a, b):
            return names[k] if k < len(names) else f"positional argument {k}"
    for key in sorted(set(used_kwargs) | set(kwargs)):
        if not _same(used_kwargs.get(key), kwargs.get(key)):
            return key
    return None


class CheckpointGroups:
    """A group head runs the whole group in one checkpoint; each member hands back its share of the result."""

    def __init__(self, ctx: PlanContext, whole: WholeLayers) -> None:
        self.ctx = ctx
        self.whole = whole
        self.outputs: dict[int, tuple[torch.Tensor | None, Any, tuple, dict]] = {}
        """Member index -> (hidden states it must be called with, its output or None, the inputs the replay used)."""
        self.split: set[int] = set()
        """First layers of the groups run per layer for good (Note: [group inputs])."""
        self.checked: set[int] = set()
        """First layers of the groups whose members' inputs a first call with a cache checked."""

    def head(self, group: list[int]) -> Callable[..., Any]:
        ctx = self.ctx
        origs = [ctx.orig(j) for j in group]
        head = origs[0]
        whole = self.whole.forward(group[0])

        def run_group(*args: Any, **kwargs: Any) -> tuple:
            outs = []
            for orig in origs:
                out = orig(*args, **kwargs)
                outs.append(out)
                args, kwargs = _with_hidden(args, kwargs, _first_tensor(out))
            return tuple(outs)

        run = ctx.opaque_run(run_group)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return head(*args, **kwargs)
            if group[0] in self.split:  # Note: [group inputs]
                return whole(*args, **kwargs)
            if group[0] not in self.checked and has_cache(args, kwargs):
                out = whole(*args, **kwargs)  # a first call with a cache runs per layer, checking inputs
                self.outputs[group[1]] = (_first_tensor(out), None, *_with_hidden(args, kwargs, _first_tensor(out)))
                return out
            args, kwargs, fresh = cache_snapshot(ctx.layers[group[0]], args, kwargs, ctx.cache_warned)
            outs = ctx.checkpoint(group[0], replays_on_snapshot(run, fresh), *args, **kwargs)
            for k, j in enumerate(group[1:]):
                member_args, member_kwargs = _with_hidden(args, kwargs, _first_tensor(outs[k]))
                self.outputs[j] = (_first_tensor(outs[k]), outs[k + 1], member_args, member_kwargs)
            return outs[0]
        return forward

    def member(self, i: int, group: list[int]) -> Callable[..., Any]:
        orig = self.ctx.orig(i)
        whole = self.whole.forward(i)
        position = group.index(i)
        names = _positional_names(self.ctx.layers[i])

        def forward(*args: Any, **kwargs: Any) -> Any:
            if group[0] in self.split and torch.is_grad_enabled():
                return whole(*args, **kwargs)
            pending = self.outputs.pop(i, None)
            if pending is None:
                if torch.is_grad_enabled():
                    raise RuntimeError(f"layer {i} of a checkpoint group ran without its group's first layer")
                return orig(*args, **kwargs)
            expected, out, used_args, used_kwargs = pending
            if _hidden_of(args, kwargs) is not expected:
                raise RuntimeError(f"checkpoint group: layer {i} was not called with the previous layer's output; "
                                   "groups need layers that feed each other directly")
            differs = _differing_input(used_args, used_kwargs, args, kwargs, names)
            if differs is not None:
                return self._split(i, group, differs, whole, args, kwargs)
            if out is not None:
                return out
            out = whole(*args, **kwargs)  # checking call (a cache): the next member is checked against it
            if i == group[-1]:
                self.checked.add(group[0])
            else:
                nxt = _first_tensor(out)
                self.outputs[group[position + 1]] = (nxt, None, *_with_hidden(used_args, used_kwargs, nxt))
            return out
        return forward

    def _split(self, i: int, group: list[int], differs: str, whole: Callable[..., Any], args: tuple,
               kwargs: dict) -> Any:
        """Member ``i`` takes another input than the replay gave it: the group runs per layer from now on."""
        self.split.add(group[0])  # Note: [group inputs]
        for j in group[group.index(i) + 1:]:
            self.outputs.pop(j, None)
        log.warning("adaptive_mem: checkpoint group of layers %d-%d runs as per-layer recompute: layer %d "
                    "takes %s from the layer before it, which one group checkpoint cannot replay",
                    group[0], group[-1], i, differs)
        return whole(*args, **kwargs)
