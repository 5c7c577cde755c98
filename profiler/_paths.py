"""Module paths as profiles, plans and configs name them: ``torch.compile``'s wrapper is not part of a path.

Note: [compile wrapper names] compiling a block the torchtitan way (``model.layers[i] = torch.compile(layer)``)
puts an ``OptimizedModule`` at ``layers.i`` that holds the block as its child ``_orig_mod``, so
``named_modules`` calls the block's attention ``layers.i._orig_mod.attention``. Every name made or matched
here drops that component (:func:`module_path`), as torch's distributed checkpoint drops it from state-dict
keys (``torch.distributed.checkpoint.state_dict._get_fqns``): a profile, a plan and a config written for the
plain model name the compiled one's modules alike (``layers.i.attention``), and a plan naming
``layers.i._orig_mod.attention`` means the same module. Everyone who lists a module tree uses
:func:`named_modules`. Guarded by tests/test_compile_names.py.
"""

from __future__ import annotations

from typing import Iterator

from torch import nn

__all__ = ["COMPILE_CHILD", "is_compile_wrapper", "module_path", "named_modules"]

COMPILE_CHILD = "_orig_mod"
"""The child under which ``torch.compile(module)`` holds the module it compiles."""


def is_compile_wrapper(module: nn.Module) -> bool:
    """``torch.compile(module)``'s ``OptimizedModule``."""
    cls = type(module)
    return cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")


def module_path(path: str) -> str:
    """``path`` without ``_orig_mod`` components: ``layers.0._orig_mod.add`` -> ``layers.0.add``."""
    if COMPILE_CHILD not in path:
        return path
    return ".".join(part for part in path.split(".") if part != COMPILE_CHILD)


def named_modules(root: nn.Module, *, wrappers: bool = False) -> Iterator[tuple[str, nn.Module]]:
    """``root.named_modules()`` named by :func:`module_path`. A compile wrapper (a module holding its module as
    ``_orig_mod``: ``OptimizedModule``, or its stand-in in a throw-away clone) shares its module's path and is
    left out, unless ``wrappers`` (maps from module to path, for hooks that also fire on the wrapper)."""
    for path, module in root.named_modules():
        if wrappers or COMPILE_CHILD not in module._modules:
            yield module_path(path), module
