"""Local names inside a model's layers, and config regexes resolved against them.

A config names ops by their *local* name (the unit or module path with the
``<container>.<i>.`` prefix removed): ``feed_forward.w1.activation.silu``,
``attention``, ``ffn_norm.norm``. Regexes are matched whole (``re.fullmatch``)
against every local module path and leaf unit name of a layer; a match that
lies under another match is dropped (the module already covers it).
"""

from __future__ import annotations

import functools
import re
import sys
import types
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from profiler._units import LayerInfo, UnitNamer, find_layers, join, leaf_label

from ._collective_names import layout_collectives
from ._errors import ConfigError, fmt

__all__ = ["LayerNames", "clone_module", "fake_clone", "layer_names", "rebind"]

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
    """Local leaf unit names inside a layer (plus the attention core when it is an op); with several
    stacks, the names of every stack's first block (Note: [several layer stacks])."""
    stacks: tuple[tuple[str, int], ...] = ()
    """``(container, blocks)`` per stack when there are several (``encoder.block``, ``decoder.block``);
    empty for one stack, whose layers all take every resolved name."""
    present: tuple[frozenset[str], ...] = ()
    """With several stacks, per layer: the local names that exist in it (module paths, leaf units, the
    traced op units of its stack whose module it has)."""

    def layer_path(self, index: int) -> str:
        if self.stacks:
            return LayerInfo.of(self.stacks).layer_path(index)
        return f"{self.container}.{index}" if self.container else str(index)

    def in_layer(self, index: int, locals_: list[str] | tuple[str, ...]) -> list[str]:
        """The local names of ``locals_`` that layer ``index`` has: all of them with one stack; with several,
        those of its own stack (``layer.2.DenseReluDense`` is a decoder name of T5, not an encoder one)."""
        if not self.present:
            return list(locals_)
        have = self.present[index]
        return [t for t in locals_ if t in have]

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


def _wrapped_child(module: nn.Module) -> str | None:
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return "module"
    cls = type(module)
    if cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo"):
        return "_orig_mod"
    return None


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


def _structure(block: nn.Module) -> tuple[tuple[str, str], ...]:
    return tuple((path, type(m).__name__) for path, m in block.named_modules())


def _representatives(model: nn.Module, info: LayerInfo) -> list[int]:
    """Note: [blocks of two kinds] the global index of each block that differs in structure from every earlier
    block of its stack: the first block of each stack, and e.g. DeepSeek-V3's first MoE layer after its dense
    ones (``first_k_dense_replace``). Keys are matched against the names of all of them, and a layer takes the
    names its own kind of block has (tests/test_hf_zoo.py, expert plans on ``deepseek_v3``)."""
    reps: list[int] = []
    for s in range(len(info.stacks)):
        seen: set[tuple] = set()
        for i in range(info.first(s), info.first(s) + info.stacks[s][1]):
            kind = _structure(model.get_submodule(info.layer_path(i)))
            if kind not in seen:
                seen.add(kind)
                reps.append(i)
    return reps


def _traced_units(model: nn.Module, info: LayerInfo, reps: list[int]) -> tuple[tuple[str, ...], ...]:
    """Units of the blocks ``reps`` from one fake-tensor forward on token ids (LMs; encoder-decoder
    models get the same ids as ``decoder_input_ids``); () when the model takes other inputs.

    Catches op units run by a non-leaf module itself (``feed_forward.w1.matmul``, HF ``self_attn.flash_attention``).
    """
    import inspect

    from torch._subclasses.fake_tensor import FakeTensorMode, maybe_get_fake_mode
    from torch.utils._python_dispatch import TorchDispatchMode

    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        return ()
    param = next(model.parameters(), None)
    fake = (maybe_get_fake_mode(param) if param is not None else None) or FakeTensorMode(allow_non_fake_inputs=True)
    try:
        model, _ = fake_clone(model, fake)  # Note: [throw-away clone]
    except Exception:  # noqa: BLE001 - a model that cannot be copied: structural names only
        return ()
    namer = UnitNamer(model)
    prefixes = [info.layer_path(i) + "." for i in reps]
    found: list[dict[str, None]] = [{} for _ in prefixes]

    class _Collect(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace != "aten" or not any(isinstance(o, torch.Tensor) for o in
                                                   (out if isinstance(out, (tuple, list)) else (out,))):
                return out  # metadata queries (prim.device) create no unit
            name = namer.name(func)
            for k, prefix in enumerate(prefixes):
                if name is not None and name.startswith(prefix):
                    found[k][name[len(prefix):]] = None
            return out

    class _Stop(Exception):
        pass

    def stop(module, args, output):
        raise _Stop  # the last block of ``reps`` is all we need: skip the rest of the forward

    for prefix in prefixes:
        for module in model.get_submodule(prefix[:-1]).modules():
            module.register_forward_pre_hook(lambda m, a: namer.enter(m))
            module.register_forward_hook(lambda m, a, o: namer.exit(m))
    model.get_submodule(prefixes[-1][:-1]).register_forward_hook(stop)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), fake:
            tokens = torch.zeros(1, 4, dtype=torch.long, device=embedding.weight.device)
            extra = {"decoder_input_ids": tokens} if "decoder_input_ids" in params else {}
            with _Collect():
                model(tokens, **extra)
    except _Stop:
        pass
    except Exception:  # noqa: BLE001 - a model that does not take token ids: structural names only
        return ()
    return tuple(tuple(f) for f in found)


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
    reps = _representatives(model, info)  # Note: [blocks of two kinds]
    traced = _traced_units(model, info, reps)
    per_kind: dict[tuple, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for k, i in enumerate(reps):
        block = model.get_submodule(info.layer_path(i))
        modules, units = _local_names(block)
        units = tuple(dict.fromkeys(units + traced[k])) if traced else units + _guessed_core(modules, units)
        units += layout_collectives(block)  # Note: [collective units]
        per_kind[info.stack_of(i), _structure(block)] = (modules, units)
    if len(per_kind) == 1:
        return LayerNames(info.container, info.count, *next(iter(per_kind.values())))
    present = []
    for i in range(info.count):  # Note: [several layer stacks]
        block = model.get_submodule(info.layer_path(i))
        modules, leaves = _local_names(block)
        own = set(modules) | set(leaves)
        kind = per_kind[info.stack_of(i), _structure(block)][1]
        ops = (u for u in kind if u.rpartition(".")[0] in own or "." not in u)
        present.append(frozenset(own.union(ops)))
    modules = tuple(dict.fromkeys(m for kind in per_kind.values() for m in kind[0]))
    units = tuple(dict.fromkeys(u for kind in per_kind.values() for u in kind[1]))
    stacks = info.stacks if len(info.stacks) > 1 else ()
    return LayerNames(info.container, info.count, modules, units, stacks=stacks, present=tuple(present))


@lru_cache(maxsize=1)
def _reference_names() -> LayerNames:
    from adaptive_mem.models import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                                   max_seq_len=8))
    return replace(layer_names(model), count=0)
