"""Hugging Face KV caches handed to a layer that a plan recomputes.

Note: [cache in recompute] a layer that writes a ``Cache`` (``past_key_values``) in forward writes it again
when checkpoint replays the layer in backward: the replay sees keys twice as long (bloom, falcon, gemma2:
66 vs 33) or, for T5's ``EncoderDecoderCache``, a cross-attention already marked updated, so it saves
fewer tensors (``CheckpointError``). Dropping the cache, as Hugging Face's gradient checkpointing does, is
not exact: the cache's ``torch.cat`` hands SDPA contiguous keys, and without it the kernel sums in another
order (T5, 5e-7 on the loss). So the forward runs on the user's cache, and every replay (and the SAC trace)
on a copy of the cache as it was before that forward: its objects and containers copied, its tensors
shared (caches replace their tensors, they do not write into them). A cache that cannot be copied is
left out of the call instead, with one warning per layer class. Guarded by tests/test_encoder_decoder.py.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["cache_snapshot", "has_cache", "replays_on_snapshot"]

log = logging.getLogger(__name__)

_PLAIN = (bool, int, float, str, type(None), tuple, list, dict)


def _is_cache(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN:  # no __mro__ walk: dynamo breaks the graph on it
        return False
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(obj).__mro__)


def has_cache(args: tuple, kwargs: dict) -> bool:
    return any(_is_cache(a) for a in args) or any(_is_cache(v) for v in kwargs.values())


def _copy(cache: Any) -> Any:
    """``cache`` with its objects and containers copied and its tensors shared."""
    memo: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [cache]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            memo[id(obj)] = obj
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
    return copy.deepcopy(cache, memo)


def cache_snapshot(layer: nn.Module, args: tuple, kwargs: dict, warned: set[str]
                   ) -> tuple[tuple, dict, Callable[[], tuple[tuple, dict]] | None]:
    """``(args, kwargs, fresh)`` for a recomputed call of ``layer``: ``fresh()`` gives the arguments with a new
    copy of each cache as it is now (None: the call has no cache). A cache that cannot be copied is taken out of ``args``/``kwargs`` here."""
    at = [k for k, a in enumerate(args) if _is_cache(a)]
    keys = [k for k, v in kwargs.items() if _is_cache(v)]
    if not at and not keys:  # no cache: the call is checkpointed as it is (nothing mutated under compile)
        return args, kwargs, None
    try:
        saved = {("a", k): _copy(args[k]) for k in at} | {("k", k): _copy(kwargs[k]) for k in keys}
    except Exception as exc:  # noqa: BLE001 - an uncopyable cache: run without it, as HF's checkpointing does
        return _drop(layer, args, kwargs, at, keys, warned, exc)

    def fresh() -> tuple[tuple, dict]:
        new_args = tuple(_copy(saved["a", k]) if ("a", k) in saved else a for k, a in enumerate(args))
        return new_args, {k: _copy(saved["k", k]) if ("k", k) in saved else v for k, v in kwargs.items()}
    return args, kwargs, fresh


def replays_on_snapshot(fn: Callable[..., Any], fresh: Callable[[], tuple[tuple, dict]] | None) -> Callable[..., Any]:
    """``fn`` for checkpoint: the first call runs as given, every later call (a replay) on ``fresh()``."""
    if fresh is None:
        return fn
    calls = [0]

    def run(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > 1:
            args, kwargs = fresh()
        return fn(*args, **kwargs)
    return run


def _drop(layer: nn.Module, args: tuple, kwargs: dict, at: list[int], keys: list[str], warned: set[str],
          exc: Exception) -> tuple[tuple, dict, Callable[[], tuple[tuple, dict]]]:
    args = tuple(None if k in at else a for k, a in enumerate(args))
    kwargs = {k: None if k in keys else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    name = type(layer).__name__
    if name not in warned:
        warned.add(name)
        log.warning("adaptive_mem: the KV cache of recomputed %s layers cannot be copied (%s: %s); they run "
                    "without it in training, as Hugging Face's gradient checkpointing does", name,
                    type(exc).__name__, exc)
    return args, kwargs, lambda: (args, kwargs)
