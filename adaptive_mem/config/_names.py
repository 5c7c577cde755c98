"""Local names inside a model's layers, and config regexes resolved against them.

A config names ops by their *local* name (the unit or module path with the
``<container>.<i>.`` prefix removed): ``feed_forward.w1.activation.silu``,
``attention``, ``ffn_norm.norm``. Regexes are matched whole (``re.fullmatch``)
against every local module path and leaf unit name of a layer; a match that
lies under another match is dropped (the module already covers it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import nn

from profiler._units import UnitNamer, find_layers, join, leaf_label

from ._errors import ConfigError, fmt

__all__ = ["LayerNames", "layer_names"]

_ATTENTION_MODULES = ("attention", "self_attn", "attn", "self_attention")


@dataclass(frozen=True)
class LayerNames:
    container: str
    """Path of the layer container (``layers``, ``model.layers``)."""
    count: int
    """Number of layers."""
    modules: tuple[str, ...]
    """Local module paths inside a layer, in definition order."""
    units: tuple[str, ...]
    """Local leaf unit names inside a layer (plus the attention core when it is an op)."""

    def layer_path(self, index: int) -> str:
        return f"{self.container}.{index}" if self.container else str(index)

    def sample(self, k: int = 6) -> str:
        return ", ".join(self.units[:k])

    def resolve(self, pattern: str, path: str) -> list[str]:
        """Local targets whose name matches ``pattern`` whole; ConfigError if none do."""
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{path}={fmt(pattern)}: expected a regular expression naming ops of a layer, "
                              f"like {self.sample(3)}")
        return list(_resolve(self, pattern, path))

    def attention_core(self) -> str:
        """Local unit of the attention core (Megatron's "core attention", MindFormers' flash_attention)."""
        for unit in self.units:
            if unit.rsplit(".", 1)[-1] == "flash_attention":
                return unit
        raise ConfigError(f"this model has no attention core unit; expected a module labelled flash_attention or "
                          f"a child named one of {', '.join(_ATTENTION_MODULES)}; its units are {self.sample()}")


@lru_cache(maxsize=256)
def _resolve(names: LayerNames, pattern: str, path: str) -> tuple[str, ...]:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"{path}={pattern!r}: not a valid regular expression ({exc})") from None
    hits = [name for name in dict.fromkeys(names.modules + names.units) if regex.fullmatch(name)]
    if not hits:
        raise ConfigError(f"{path}={pattern!r}: matches no op of a layer; expected a regular expression matching "
                          f"local unit or module names such as {names.sample()}")
    return tuple(h for h in hits if not any(h.startswith(other + ".") for other in hits if other != h))


def _local_names(layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    modules, units = [], []
    for path, module in layer.named_modules():
        if not path:
            continue
        modules.append(path)
        if next(module.children(), None) is None:
            units.append(join(path, leaf_label(module)))
    return tuple(modules), tuple(units)


def _guessed_core(modules: tuple[str, ...], units: tuple[str, ...]) -> tuple[str, ...]:
    """Without a trace: HF attention runs SDPA as a function in its attention module (``self_attn.flash_attention``)."""
    if any(u.rsplit(".", 1)[-1] == "flash_attention" for u in units):
        return ()
    for path in modules:
        if path.rsplit(".", 1)[-1] in _ATTENTION_MODULES and path.count(".") == 0:
            return (join(path, "flash_attention"),)
    return ()


def _traced_units(model: nn.Module, container: str) -> tuple[str, ...]:
    """Units of layer 0 from one fake-tensor forward on token ids (LMs); () when the model takes other inputs.

    Catches op units run by a non-leaf module itself (``feed_forward.w1.matmul``, HF ``self_attn.flash_attention``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode, maybe_get_fake_mode
    from torch.utils._python_dispatch import TorchDispatchMode

    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        return ()
    namer = UnitNamer(model)
    prefix = (container + ".0.") if container else "0."
    found: dict[str, None] = {}

    class _Collect(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace != "aten" or not any(isinstance(o, torch.Tensor) for o in
                                                   (out if isinstance(out, (tuple, list)) else (out,))):
                return out  # metadata queries (prim.device) create no unit
            name = namer.name(func)
            if name is not None and name.startswith(prefix):
                found[name[len(prefix):]] = None
            return out

    class _Stop(Exception):
        pass

    def stop(module, args, output):
        raise _Stop  # layer 0 is all we need: skip the rest of the forward

    handles = []
    layer0 = model.get_submodule(prefix[:-1])
    for module in layer0.modules():
        handles.append(module.register_forward_pre_hook(lambda m, a: namer.enter(m)))
        handles.append(module.register_forward_hook(lambda m, a, o: namer.exit(m)))
    handles.append(layer0.register_forward_hook(stop))
    try:
        param = next(model.parameters(), None)
        fake = maybe_get_fake_mode(param) if param is not None else None
        fake = fake or FakeTensorMode(allow_non_fake_inputs=True)
        with torch.no_grad(), torch.random.fork_rng(devices=[]), fake:
            tokens = fake.from_tensor(torch.zeros(1, 4, dtype=torch.long))
            with _Collect():
                model(tokens)
    except _Stop:
        pass
    except Exception:  # noqa: BLE001 - a model that does not take token ids: structural names only
        return ()
    finally:
        for handle in handles:
            handle.remove()
    return tuple(found)


def layer_names(model: nn.Module | None) -> LayerNames:
    """Names of ``model``'s layers; ``None`` means the reference Llama's (for planning without a model)."""
    if model is None:
        return _reference_names()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={fmt(model)}: expected a torch.nn.Module")
    info = find_layers(model)
    if info is None or info.count == 0:
        raise ConfigError(f"model {type(model).__name__}: no repeated layers found; expected a ModuleList of "
                          "identical blocks (the layers a config's layer indices refer to)")
    container = model.get_submodule(info.container) if info.container else model
    modules, units = _local_names(container[0])
    traced = _traced_units(model, info.container)
    units = tuple(dict.fromkeys(units + traced)) if traced else units + _guessed_core(modules, units)
    return LayerNames(info.container, info.count, modules, units)


@lru_cache(maxsize=1)
def _reference_names() -> LayerNames:
    from adaptive_mem.models import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                                   max_seq_len=8))
    return replace(layer_names(model), count=0)
