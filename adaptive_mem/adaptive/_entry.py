"""The loop's entry into a step: its forward pre-hook on the model, and the wrappers' pre-hooks that run before it.

Note: [hooks before the loop's] the warm-up profiles a whole step (forward and backward) inside the loop's
forward pre-hook. A wrapper applied after the loop (FSDP2's ``fully_shard`` prepends its pre-hook) has set up
state for this forward before the loop's hook ran, and the profiled step's end took it down again (FSDP2
reshards every block and ends its iteration after backward): the blocks would meet sharded parameters. Those
hooks run again for this forward, and the loop's hook goes first for the next ones. Guarded by
tests/test_parallel_adaptive_layouts.py (FSDP2, the loop applied before ``fully_shard``).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["hooks_before", "run_again_then_first"]


def hooks_before(module: nn.Module, handle: RemovableHandle) -> list[tuple[int, Callable[..., Any]]]:
    """The forward pre-hooks of ``module`` that run before the one of ``handle``."""
    hooks = list(module._forward_pre_hooks.items())
    position = next((i for i, (key, _) in enumerate(hooks) if key == handle.id), 0)
    return hooks[:position]


def run_again_then_first(module: nn.Module, earlier: list[tuple[int, Callable[..., Any]]], handle: RemovableHandle,
                         hook: Callable[..., Any], args: tuple, kwargs: dict) -> RemovableHandle:
    """Run the ``earlier`` pre-hooks again for this forward; register ``hook`` (``handle``'s) first; its new handle."""
    with_kwargs = module._forward_pre_hooks_with_kwargs
    for key, earlier_hook in earlier:
        earlier_hook(module, args, kwargs) if key in with_kwargs else earlier_hook(module, args)
    handle.remove()
    return module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
