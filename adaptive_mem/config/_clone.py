"""Throw-away clones of a model: what every trace of a user's model runs on (Note: [throw-away clone]).

:func:`clone_module` copies the module tree and gives every tensor a replacement (:func:`fake_clone`: fake
tensors), dropping hooks and wrappers, so that a trace leaves nothing on the user's model.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from profiler.naming import COMPILE_CHILD, is_compile_wrapper
from profiler.naming import is_data_parallel

__all__ = ["clone_module", "fake_clone", "fake_mode_of", "rebind"]

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class _Through(nn.Module):
    """Stands in a wrapper (DDP, DataParallel, torch.compile's OptimizedModule) in a clone: runs its one child."""

    def __init__(self, child_name: str, child: nn.Module) -> None:
        super().__init__()
        self.add_module(child_name, child)
        self.child_name = child_name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._modules[self.child_name](*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Its child's attributes read through, as ``OptimizedModule``'s do: paths without ``_orig_mod`` reach into
        the child (Note: [compile wrapper names])."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "child_name" or "child_name" not in self.__dict__:
                raise
            return getattr(self._modules[self.__dict__["child_name"]], name)


def _wrapped_child(module: nn.Module) -> str | None:
    if is_data_parallel(module):
        return "module"
    return COMPILE_CHILD if is_compile_wrapper(module) else None


def _plain_class(module: nn.Module) -> type:
    """The module's own class: ``fully_shard``'s generated ``FSDP<Class>`` loses its hooks in the clone."""
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    cls = type(module)
    if fsdp_module is None or not isinstance(module, fsdp_module):
        return cls
    return next(c for c in cls.__mro__ if not issubclass(c, fsdp_module))


def rebind(fn: Any, old: nn.Module, new: nn.Module) -> Callable[..., Any] | None:
    """``fn`` (a forward) made to run on ``new`` where it ran on ``old``: a method of ``old`` or a
    ``functools.partial`` over it (accelerate's hooks); None for anything else."""
    if isinstance(fn, types.MethodType):
        return fn.__func__.__get__(new) if fn.__self__ is old else None
    if isinstance(fn, functools.partial):
        func = rebind(fn.func, old, new) if isinstance(fn.func, (types.MethodType, functools.partial)) else fn.func
        if func is None or (func is fn.func and not any(a is old for a in fn.args)):
            return None
        return functools.partial(func, *(new if a is old else a for a in fn.args), **fn.keywords)
    return None


_LAYOUT_HOOK_MODULES = ("torch.distributed.tensor._api", "torch.distributed.tensor.parallel.style")


def _layout_hooks(module: nn.Module, key: str) -> dict[int, Any]:
    """The forward hooks DTensor's ``distribute_module`` / ``parallelize_module`` styles put on ``module`` (they
    turn inputs and outputs into DTensors of a layout and close over no module state)."""
    hooks = module.__dict__.get(key, {})
    return {k: h for k, h in hooks.items() if getattr(h, "__module__", None) in _LAYOUT_HOOK_MODULES}


def clone_module(model: nn.Module, tensor: Callable[[torch.Tensor, bool], torch.Tensor], *,
                 layout_hooks: bool = False) -> tuple[nn.Module, dict[int, nn.Module]]:
    """A copy of ``model``'s module tree that shares no tensor, hook or container with it.

    Note: [throw-away clone] every trace of a user's model runs on such a copy (tests/test_model_state.py).
    Each parameter and buffer becomes ``tensor(t, is_parameter)`` (tied ones stay tied), other tensors held
    in a module's attributes ``tensor(t, False)``; hooks are dropped (FSDP2's unshard, DDP's and the
    executor's), ``fully_shard``'s class and state are dropped, DDP/DataParallel/``torch.compile`` wrappers
    become a plain call of their child under the same name, an instance ``forward`` bound to the module is
    rebound to the copy (:func:`rebind`) and any other (a wrapper closing over the original: the executor's)
    is dropped. With ``layout_hooks`` the tensor-parallel layout hooks are kept (:func:`_layout_hooks`): a clone
    whose DTensor parameters must meet DTensor inputs (Note: [tensor-parallel trace]).
    Returns the copy and, by ``id`` of each copied module, its original.
    """
    memo: dict[int, Any] = {}
    originals: dict[int, nn.Module] = {}

    def leaf(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = tensor(t, is_param)
        return memo[id(t)]

    def value(v: Any) -> Any:
        return tree_map(lambda x: leaf(x, False) if isinstance(x, torch.Tensor) else x, v)

    def copy(module: nn.Module) -> nn.Module:
        if id(module) in memo:
            return memo[id(module)]
        child = _wrapped_child(module)
        if child is not None:
            new: nn.Module = _Through(child, copy(module._modules[child]))
        else:
            new = object.__new__(_plain_class(module))
            state: dict[str, Any] = {}
            for key, v in module.__dict__.items():
                if key in ("_forward_hooks", "_forward_pre_hooks") and layout_hooks:
                    state[key] = type(v)(_layout_hooks(module, key))
                elif key in _HOOK_DICTS:
                    state[key] = type(v)()
                elif key == "_parameters":
                    state[key] = type(v)((n, None if p is None else leaf(p, True)) for n, p in v.items())
                elif key == "_buffers":
                    state[key] = type(v)((n, None if b is None else leaf(b, False)) for n, b in v.items())
                elif key == "_modules":
                    state[key] = type(v)((n, None if m is None else copy(m)) for n, m in v.items())
                elif key == "_compiled_call_impl":  # module.compile()'s, bound to the original: the clone runs eager
                    state[key] = None
                elif key == "forward":
                    forward = rebind(v, module, new)
                    if forward is not None:
                        state[key] = forward
                elif "composable_api" not in key:  # fully_shard's state
                    state[key] = value(v)
            new.__dict__.update(state)
        memo[id(module)] = new
        originals[id(new)] = module
        return new

    return copy(model), originals


def fake_clone(model: nn.Module, fake_mode: Any) -> tuple[nn.Module, dict[int, nn.Module]]:
    """:func:`clone_module` with fake tensors of ``fake_mode`` (full shape, dtype, device, ``requires_grad``)."""
    def make(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        with fake_mode:
            new = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device)
            return nn.Parameter(new, requires_grad=t.requires_grad) if is_param else new
    return clone_module(model, make)


def fake_mode_of(model: nn.Module) -> Any:
    """The fake mode ``model``'s parameters live in (a model built on the meta device), else a new one that also
    takes real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode, maybe_get_fake_mode

    param = next(model.parameters(), None)
    return (maybe_get_fake_mode(param) if param is not None else None) or FakeTensorMode(allow_non_fake_inputs=True)
