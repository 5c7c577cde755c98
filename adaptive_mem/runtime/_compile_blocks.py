"""Per-block ``torch.compile`` for ``optimize(compile=...)`` and ``--compile [BACKEND]`` (torchtitan style).

Each repeated layer is compiled in place with ``layer.compile(...)``, after the plan is applied: whole-layer
recompute and the swap hooks then sit around or inside each compiled block as they should (Note: [swap
around compiled blocks] in ``_compiled_swap.py``). :meth:`CompiledLayers.remove` makes the blocks plain again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from profiler.naming import is_compile_wrapper
from profiler.naming import ModelStructure

from adaptive_mem.config._errors import ConfigError, fmt

__all__ = ["CompiledLayers", "compile_blocks", "compile_options"]

_KEYS = ("backend", "mode", "fullgraph", "dynamic")
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_FORMS = ("expected True, a torch.compile backend name ('inductor', 'aot_eager', ...) or a dict with keys "
          f"{', '.join(_KEYS)}")


def _backend(value: Any, key: str) -> Any:
    if callable(value):
        return value
    if not isinstance(value, str) or value not in torch._dynamo.list_backends(exclude_tags=()):
        shown = sorted({*torch._dynamo.list_backends(), "aot_eager"})  # without the debugging-only ones
        raise ConfigError(f"{key}={fmt(value)}: expected a torch.compile backend name such as 'inductor' or "
                          f"'aot_eager' (known: {', '.join(shown)})")
    return value


def compile_options(value: Any, *, key: str = "compile") -> dict[str, Any] | None:
    """``layer.compile`` keywords of a ``compile=`` value, None for False/None; bad values raise ConfigError."""
    if value is None or value is False:
        return None
    if value is True:
        return {"backend": "inductor"}
    if isinstance(value, str) or callable(value):
        return {"backend": _backend(value, key)}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={fmt(value)}: {_FORMS}")
    for name in value:
        if name not in _KEYS:
            raise ConfigError(f"{key}.{name}={fmt(value[name])}: unknown key; expected keys {', '.join(_KEYS)}")
    out: dict[str, Any] = {"backend": _backend(value.get("backend", "inductor"), f"{key}.backend")}
    mode = value.get("mode")
    if mode is not None:
        if mode not in _MODES:
            raise ConfigError(f"{key}.mode={fmt(mode)}: expected one of {', '.join(_MODES)}")
        out["mode"] = mode
    for name, allowed in (("fullgraph", (True, False)), ("dynamic", (True, False, None))):
        if name in value:
            if not any(value[name] is a for a in allowed):
                raise ConfigError(f"{key}.{name}={fmt(value[name])}: expected "
                                  f"{' or '.join(str(a) for a in allowed)}")
            out[name] = value[name]
    return out


def _is_compiled(module: nn.Module) -> bool:
    return is_compile_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None


class CompiledLayers:
    """The blocks that ``compile=`` compiled; :meth:`remove` makes them plain again."""

    swap_stats = None

    def __init__(self, modules: list[nn.Module], paths: list[str], options: dict[str, Any]) -> None:
        self.modules = modules
        self.paths = paths
        self.options = options

    def summary(self) -> str:
        backend = getattr(self.options["backend"], "__name__", self.options["backend"])
        return f"compiled {len(self.paths)} blocks ({self.paths[0]}...) with backend {backend}"

    def remove(self) -> None:
        for module in self.modules:
            module._compiled_call_impl = None
        self.modules = []

    def __enter__(self) -> "CompiledLayers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def check_blocks(model: nn.Module, value: Any, *, key: str = "compile",
                 structure: ModelStructure | None = None) -> list[str]:
    """The layer paths ``compile=`` will compile (``structure``: ``model``'s, when found already); raises
    ConfigError when there are none or one is compiled."""
    layers = (structure.of_model(model) if structure is not None else ModelStructure.of(model)).layers
    if layers is None or layers.count == 0:
        raise ConfigError(f"{key}={fmt(value)}: {type(model).__name__} has no repeated layers to compile per block; "
                          "expected a model with repeated layers (or compile it yourself: torch.compile(model))")
    paths = [layers.layer_path(i) for i in range(layers.count)]
    if _is_compiled(model):
        raise ConfigError(f"{key}={fmt(value)}: the model is already compiled; expected an uncompiled model "
                          "(drop compile= or the torch.compile call)")
    for path in paths:
        if _is_compiled(model.get_submodule(path)):
            raise ConfigError(f"{key}={fmt(value)}: {path} is already compiled; expected uncompiled blocks "
                              "(drop compile= or the torch.compile call)")
    return paths


def compile_blocks(model: nn.Module, value: Any, *, key: str = "compile",
                   structure: ModelStructure | None = None) -> CompiledLayers | None:
    """Compile each repeated layer of ``model`` in place (``layer.compile``); None when ``value`` asks for nothing."""
    options = compile_options(value, key=key)
    if options is None:
        return None
    paths = check_blocks(model, value, key=key, structure=structure)
    modules = [model.get_submodule(p) for p in paths]
    for module in modules:
        module.compile(**options)
    return CompiledLayers(modules, paths, options)
