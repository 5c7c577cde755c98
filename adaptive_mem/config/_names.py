"""Local names inside a model's layers, and config keys resolved against them per layer.

A config names ops by their *local* name (the unit or module path with the
``<container>.<i>.`` prefix removed): ``feed_forward.w1.activation.silu``,
``attention``, ``ffn_norm.norm``. Keys select local names as :func:`._errors.match_key` says
(Note: [key matching]); each layer takes the selected names it has (Note: [keys per layer]).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Iterable, Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from profiler.naming import LayerKinds
from profiler.naming import named_modules
from profiler.naming import ModelStructure
from profiler.naming import LayerInfo, UnitNamer, join, leaf_label

from ._clone import fake_clone, fake_mode_of
from ._collective_names import layout_collectives
from ._errors import ConfigError, fmt, match_key

__all__ = ["LayerNames", "layer_names"]

log = logging.getLogger(__name__)

_ATTENTION_MODULES = ("attention", "self_attn", "attn", "self_attention")


@dataclass(frozen=True)
class LayerNames:
    container: str
    """Path of the layer container (``layers``, ``model.layers``)."""
    count: int
    """Number of layers."""
    modules: tuple[str, ...]
    """Local module paths inside a layer, in definition order; with layers of several kinds (Note: [layer kinds])
    or stacks (Note: [several layer stacks]), those of every kind."""
    units: tuple[str, ...]
    """Local leaf unit names inside a layer (plus its traced op units, the attention core when it is an op and
    the collectives of a layout); with several kinds, those of every kind."""
    stacks: tuple[tuple[str, int], ...] = ()
    """``(container, blocks)`` per stack when there are several (``encoder.block``, ``decoder.block``);
    empty for one stack."""
    kinds: LayerKinds | None = None
    """The kind of each layer when there are several; None for one kind, whose layers all take every name."""
    by_kind: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)
    """First layer of a kind -> its ``(modules, units)``, with several kinds."""

    def layer_path(self, index: int) -> str:
        if self.stacks:
            return LayerInfo.of(self.stacks).layer_path(index)
        return f"{self.container}.{index}" if self.container else str(index)

    def names_of(self, index: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(modules, units)`` local to layer ``index``: those of its kind."""
        if self.kinds is None:
            return self.modules, self.units
        return self.by_kind[self.kinds.first[index]]

    def in_layer(self, index: int, locals_: list[str] | tuple[str, ...]) -> list[str]:
        """The local names of ``locals_`` that layer ``index`` has (``layer.2.DenseReluDense`` is a name of T5's
        decoder blocks, ``linear_attn`` of Qwen3-Next's linear-attention layers)."""
        if self.kinds is None:
            return list(locals_)
        modules, units = self.names_of(index)
        have = set(modules) | set(units)
        return [t for t in locals_ if t in have]

    def select(self, pattern: object, path: str, layers: Iterable[int]) -> dict[int, tuple[str, ...]]:
        """The local names the key ``pattern`` selects in each of ``layers`` that has them (Note: [keys per
        layer]); ConfigError when it selects nothing in any of them (with no layers: in any layer)."""
        layers = list(dict.fromkeys(layers))
        modules, units = self._union(layers or range(self.count))
        where = "" if self.kinds is None or not layers else f" of {self.span(layers)}"
        hits = match_key(pattern, path, modules=modules, units=units, where=where)
        return self.spread(hits, path, layers, key=pattern)

    def spread(self, targets: tuple[str, ...], path: str, layers: list[int], *,
               key: object) -> dict[int, tuple[str, ...]]:
        """Note: [keys per layer] a key applies in each named layer that has what it selects, and says once,
        at INFO, which named layers lack it; it is refused (ConfigError) only when none of them has any.
        One rule for every front-end (MindFormers select_recompute, select_comm_recompute, op_swap, the
        default swap strategy; Megatron's selective recompute); tests/test_hybrid_layers.py."""
        out = {i: tuple(self.in_layer(i, targets)) for i in layers}
        lacking = [i for i in layers if not out[i]]
        if layers and len(lacking) == len(layers):
            raise ConfigError(f"{path}={key!r}: selects {', '.join(targets)}, which no layer of "
                              f"{self.span(layers)} has; expected a key naming ops of those layers")
        if lacking:
            log.info("%s=%r: applies in %s; not in %s, which ha%s no %s", path, key,
                     self.span([i for i in layers if out[i]]), self.span(lacking), "s" if len(lacking) == 1 else "ve",
                     " or ".join(targets))
        return {i: t for i, t in out.items() if t}

    def _union(self, layers: Iterable[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self.kinds is None:
            return self.modules, self.units
        firsts = dict.fromkeys(self.kinds.first[i] for i in layers if i < self.count)
        return (tuple(dict.fromkeys(m for k in firsts for m in self.by_kind[k][0])),
                tuple(dict.fromkeys(u for k in firsts for u in self.by_kind[k][1])))

    def span(self, layers: list[int]) -> str:
        """``layers 0, 2 (with conv)``: the layers grouped by kind, each kind described."""
        if self.kinds is None:
            return _indices(layers)
        groups: dict[int, list[int]] = {}
        for i in layers:
            groups.setdefault(self.kinds.first[i], []).append(i)
        return "; ".join(f"{_indices(g)} ({self.kinds.describe(g[0])})" for g in groups.values())

    def sample(self, k: int = 6) -> str:
        return ", ".join(self.units[:k])

    def attention_core(self) -> str:
        """Local unit of the attention core (Megatron's "core attention", MindFormers' flash_attention); with
        several kinds, that of the first kind with one (:meth:`spread` puts it in the layers that have it)."""
        for unit in self.units:
            if unit.rsplit(".", 1)[-1] == "flash_attention":
                return unit
        raise ConfigError(f"this model has no attention core unit; expected a module labelled flash_attention or "
                          f"a child named one of {', '.join(_ATTENTION_MODULES)}; its units are {self.sample()}")


def _indices(layers: list[int], most: int = 12) -> str:
    """``layer 1``, ``layers 0-3, 6``; a long list cut: ``layers 0, 2, 4, ... (24 layers)``."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    shown = ", ".join(parts[:most]) + (f", ... ({len(layers)} layers)" if len(parts) > most else "")
    return ("layer " if len(layers) == 1 else "layers ") + shown


def _local_names(layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    modules, units = [], []
    for path, module in named_modules(layer):  # Note: [compile wrapper names]
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


def _traced_units(model: nn.Module, info: LayerInfo, layers: list[int]) -> dict[int, tuple[str, ...]]:
    """Units of each of ``layers`` (the first layer of each kind) from one fake-tensor forward on token ids (LMs;
    encoder-decoder models get the same ids as ``decoder_input_ids``); {} when the model takes other inputs.

    Catches op units run by a non-leaf module itself (``feed_forward.w1.matmul``, HF ``self_attn.flash_attention``).
    """
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        return {}
    fake = fake_mode_of(model)
    try:
        model, _ = fake_clone(model, fake)  # Note: [throw-away clone]
    except Exception:  # noqa: BLE001 - a model that cannot be copied: structural names only
        return {}
    namer = UnitNamer(model, layers=info)
    prefixes = [info.layer_path(i) + "." for i in layers]
    found: list[dict[str, None]] = [{} for _ in prefixes]
    _name_layers(model, namer, prefixes)
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), fake:
            tokens = torch.zeros(1, 4, dtype=torch.long, device=embedding.weight.device)
            extra = {"decoder_input_ids": tokens} if "decoder_input_ids" in _parameters(model) else {}
            with _Collect(namer, prefixes, found):
                model(tokens, **extra)
    except _Stop:
        pass
    except Exception:  # noqa: BLE001 - a model that does not take token ids: structural names only
        return {}
    return {i: tuple(f) for i, f in zip(layers, found)}


class _Stop(Exception):
    """Raised after the last layer to name: the rest of the forward is skipped."""


class _Collect(TorchDispatchMode):
    """Collects the local unit names of the ops run in the layers at ``prefixes``, one dict per layer."""

    def __init__(self, namer: UnitNamer, prefixes: list[str], found: list[dict[str, None]]) -> None:
        super().__init__()
        self.namer, self.prefixes, self.found = namer, prefixes, found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = self.namer.name(func, args)  # every op: the namer keeps its regions (Note: [wrapper ops])
        if func.namespace != "aten" or not any(isinstance(o, torch.Tensor) for o in
                                               (out if isinstance(out, (tuple, list)) else (out,))):
            return out  # metadata queries (prim.device) create no unit
        for k, prefix in enumerate(self.prefixes):
            if name is not None and name.startswith(prefix):
                self.found[k][name[len(prefix):]] = None
        return out


def _name_layers(model: nn.Module, namer: UnitNamer, prefixes: list[str]) -> None:
    """The namer's hooks on the modules of the layers at ``prefixes``; the last one stops the forward."""
    def stop(module, args, output):
        raise _Stop

    for prefix in prefixes:
        for module in model.get_submodule(prefix[:-1]).modules():
            module.register_forward_pre_hook(lambda m, a: namer.enter(m))
            module.register_forward_hook(lambda m, a, o: namer.exit(m))
    model.get_submodule(prefixes[-1][:-1]).register_forward_hook(stop)


def _parameters(model: nn.Module) -> Mapping[str, Any]:
    """The parameters of ``model.forward``'s signature; empty when it has none to read."""
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def layer_names(model: nn.Module | None, *, structure: ModelStructure | None = None) -> LayerNames:
    """Names of ``model``'s layers (from its ``structure`` when found already); ``None`` means the reference
    Llama's (for planning without a model)."""
    if model is None:
        return _reference_names()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={fmt(model)}: expected a torch.nn.Module")
    structure = structure.of_model(model) if structure is not None else ModelStructure.of(model)
    info = structure.layers
    if info is None or info.count == 0:
        raise ConfigError(f"model {type(model).__name__}: no repeated layers found; expected a ModuleList of "
                          "identical blocks (the layers a config's layer indices refer to)")
    kinds = structure.kinds  # Note: [layer kinds]
    firsts = list(dict.fromkeys(kinds.first))
    traced = _traced_units(model, info, firsts)
    by_kind = {}
    for k in firsts:
        layer = model.get_submodule(info.layer_path(k))
        modules, units = _local_names(layer)
        units = tuple(dict.fromkeys(units + traced[k])) if traced else units + _guessed_core(modules, units)
        by_kind[k] = (modules, units + layout_collectives(layer))  # Note: [collective units]
    stacks = info.stacks if len(info.stacks) > 1 else ()
    if len(firsts) == 1:
        return LayerNames(info.container, info.count, *by_kind[firsts[0]], stacks=stacks)
    modules = tuple(dict.fromkeys(m for k in firsts for m in by_kind[k][0]))
    units = tuple(dict.fromkeys(u for k in firsts for u in by_kind[k][1]))
    return LayerNames(info.container, info.count, modules, units, stacks=stacks, kinds=kinds, by_kind=by_kind)


@lru_cache(maxsize=1)
def _reference_names() -> LayerNames:
    from adaptive_mem.models import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                                   max_seq_len=8))
    return replace(layer_names(model), count=0)
