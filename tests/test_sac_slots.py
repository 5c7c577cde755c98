"""Select recompute with swaps in one layer under PyTorch's older selective-checkpoint cache (Note: [swap slots
without op_output] in ``adaptive_mem/runtime/_sac_policy.py``).

Older PyTorch (2.11 among them) calls the forward policy before the op with a context that has no ``op_output``
and caches saved outputs as ``storage[func]``, a list; the recompute pops them in order. The two modes below
follow that form, so the executor's slot naming for it runs here on a newer PyTorch too.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy

from _deterministic import assert_same_step, deterministic, seeded_step  # noqa: F401 (fixture)
from adaptive_mem import build_model, optimize
from search import Plan

pytestmark = pytest.mark.usefixtures("deterministic")

_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


class _OldMode(TorchDispatchMode):
    def __init__(self, policy_fn, storage) -> None:
        super().__init__()
        self.policy_fn, self.storage = policy_fn, storage


class _OldCaching(_OldMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in torch_checkpoint.SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        policy = self.policy_fn(SimpleNamespace(is_recompute=False), func, *args, **kwargs)
        out = func(*args, **kwargs)
        if policy in _SAVE:
            self.storage[func].append(tree_map(lambda x: torch_checkpoint._VersionWrapper(x.detach())
                                               if isinstance(x, torch.Tensor) else x, out))
        return out


class _OldCached(_OldMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in torch_checkpoint.SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        policy = self.policy_fn(SimpleNamespace(is_recompute=True), func, *args, **kwargs)
        if policy in _SAVE:
            return tree_map(lambda x: x.get_val(False) if hasattr(x, "get_val") else x, self.storage[func].pop(0))
        return func(*args, **kwargs)


def _old_contexts(policy_fn):
    storage: dict = defaultdict(list)
    return _OldCaching(policy_fn, storage), _OldCached(policy_fn, storage)


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, "groups": []})


@pytest.mark.parametrize("decisions", [
    {"layers.1.feed_forward.mul": "recompute", "layers.1.feed_forward.w2": {"action": "swap", "backward_prefetch": 1}},
    {"layers.0.feed_forward.w1.activation.silu": "recompute",
     "layers.0.attention.flash_attention": {"action": "swap", "backward_prefetch": 0}},
], ids=["swap-w2-recompute-mul", "swap-attention-recompute-silu"])
def test_select_recompute_with_swaps_on_the_older_cache_form(monkeypatch, decisions):
    bundle = build_model("llama-tiny", seed=0, batch_size=2, seq_len=32)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    monkeypatch.setattr("adaptive_mem.runtime._selective.create_selective_checkpoint_contexts", _old_contexts)
    with optimize(bundle.model, plan=_plan(decisions)) as handle:
        for step in range(2):
            assert_same_step(seeded_step(bundle, batch), want, f"step {step}")
        assert handle.swap_stats.offloaded_bytes > 0  # the swap took effect through the slot names
        # reloaded where a backward unpacks it (Note: [reload at the unpack]: the replay may stop before w2)
        assert handle.swap_stats.reloaded_bytes <= handle.swap_stats.offloaded_bytes
