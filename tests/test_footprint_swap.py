"""The swap machinery's footprint (Note: [swap scopes] in adaptive_mem/runtime/_op_swap.py): per step, a plan's
Python dispatch calls and pack-hook calls are bounded by the ops and saved tensors of the modules that hold its
swap units, never by the model's; counted with FOOTPRINT (Note: [footprint counters]), so nothing can flake.
Each plan's step is bit-identical to the same step with no plan."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_mem import build_model, optimize
from adaptive_mem.runtime._footprint import FOOTPRINT
from search import Plan
from _deterministic import assert_same_step, deterministic, seeded_step  # noqa: F401 - fixture used by name

pytestmark = pytest.mark.usefixtures("deterministic")

SWAP = {"action": "swap", "backward_prefetch": 1}


class _Ops(TorchDispatchMode):
    """Counts the ops run, and the tensors autograd saves, inside the calls of ``modules`` (a plain step)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        super().__init__()
        self.depth = 0
        self.ops = 0
        self.saved = 0
        for m in modules:
            m.register_forward_pre_hook(lambda *_: setattr(self, "depth", self.depth + 1))
            m.register_forward_hook(lambda *_: setattr(self, "depth", self.depth - 1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += self.depth > 0
        return func(*args, **(kwargs or {}))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved += self.depth > 0
        return t


def _inside(paths: list[str]) -> tuple[int, int, int]:
    """(ops run inside the modules at ``paths``, tensors saved there, ops of the whole forward) in one plain step."""
    bundle = build_model("llama-tiny", seed=0)
    counter = _Ops([bundle.model.get_submodule(p) for p in paths])
    whole = _Ops([bundle.model])
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), counter, whole:
        bundle.loss(bundle.batch(seed=0)).backward()
    return counter.ops, counter.saved, whole.ops


def _counts(decisions: dict, *, first: bool = False) -> tuple[dict[str, int], int]:
    """FOOTPRINT of the second planned step of llama-tiny (with ``first``, of the first), exact against no plan,
    and the bytes it offloaded."""
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})
    with optimize(bundle.model, plan=plan) as handle:
        for step in range(1 if first else 2):
            before = handle.swap_stats.offloaded_bytes
            FOOTPRINT.reset()
            assert_same_step(seeded_step(bundle, batch), want, f"{decisions} step {step}")
        return FOOTPRINT.snapshot(), handle.swap_stats.offloaded_bytes - before


@pytest.mark.parametrize("unit, scope", [
    ("layers.0.feed_forward.w1.matmul", "layers.0.feed_forward.w1"),  # seen at its activation's input
    ("layers.0.feed_forward.mul", "layers.0.feed_forward.mul"),  # the output of its own module
])
def test_one_op_level_swap_tracks_its_module_once(unit, scope):
    """Note: [scopes by their boundaries]: the first step runs the scope module under the tracker (a dispatch
    call per op of it, never the model's); its swap storage crosses a module boundary before it is saved, so
    the next steps make no dispatch call at all and offload the same bytes."""
    first, first_offloaded = _counts({unit: SWAP}, first=True)
    counts, offloaded = _counts({unit: SWAP})
    ops, saved, model_ops = _inside([scope])
    assert 0 < first["dispatch"] <= 2 * ops + saved < model_ops // 10  # its ops, a detach per save, the offload
    assert 0 < first["pack"] <= 2 * saved
    assert counts["dispatch"] == 0
    assert 0 < counts["pack"] <= first["pack"]
    assert offloaded == first_offloaded > 0


def test_a_storage_saved_inside_its_module_keeps_the_tracker():
    """Attention's core saves what its swap unit made before any module boundary: the tracker stays, every step,
    still only over that module's ops."""
    counts, offloaded = _counts({"layers.1.attention.flash_attention": SWAP})
    ops, saved, model_ops = _inside(["layers.1.attention"])
    assert offloaded > 0
    assert 0 < counts["dispatch"] <= 2 * ops + saved < model_ops // 2


@pytest.mark.parametrize("prefetch, triggers", [(1, [0, 1]), (2, [0, 1, 2]), (0, [])])
def test_backward_triggers_only_where_a_reload_is_due(prefetch, triggers, monkeypatch):
    """Note: [triggers where due]: a swap in layer 0 reloaded ``prefetch`` layers ahead hooks the outputs of
    layers 0 .. 0 + prefetch (the trigger and the layers a deferred reload may wait for), none above them and not
    the model's; on demand (prefetch 0) none at all. llama-tiny has 4 layers. Copies on the copy thread, where a
    prefetch overlaps compute (Note: [reload at the unpack] in ``_copier.py``)."""
    monkeypatch.setattr("adaptive_mem.runtime._copier.INLINE_BYTES", 0)
    counts, offloaded = _counts({"layers.0.feed_forward.w1.matmul": {"action": "swap", "backward_prefetch": prefetch}})
    assert offloaded > 0
    assert counts["trigger"] == len(triggers)


@pytest.mark.parametrize("overlap, triggers", [(False, 0), (True, 2)], ids=["inline", "overlapped"])
def test_reloads_the_cpu_copier_runs_inline_need_no_trigger(overlap, triggers, monkeypatch):
    """Note: [reload at the unpack]: the CPU copier runs these copies inline, so the swap's reload waits for its
    unpack: no gradient hook at all, and the step is still the plain one bit for bit (``_counts`` checks it).
    Where the native store's worker runs them (Note: [overlapped native copies]), the reload starts at its trigger:
    the hooks of a prefetch one layer ahead, as on the copy thread."""
    monkeypatch.setattr("adaptive_mem.runtime._native_swap.core_to_spare", lambda: overlap)
    counts, offloaded = _counts({"layers.0.feed_forward.w1.matmul": {"action": "swap", "backward_prefetch": 1}})
    assert offloaded > 0 and counts["trigger"] == triggers and counts["pack"] > 0


def test_a_swap_storage_leaving_its_module_keeps_the_hooks_to_the_layer_end():
    """silu's output leaves its module and is saved by the feed-forward's mul: the hooks stay entered for that save
    (it is offloaded) and leave at the layer's end, not the forward's."""
    counts, offloaded = _counts({"layers.0.feed_forward.w1.activation.silu": SWAP})
    ops, _, _ = _inside(["layers.0.feed_forward.w1.activation"])
    _, layer_saved, _ = _inside(["layers.0"])
    assert offloaded > 0
    assert counts["dispatch"] <= 2 * ops
    assert 0 < counts["pack"] < layer_saved


def test_op_level_swaps_in_two_layers():
    units = {"layers.0.feed_forward.mul": SWAP, "layers.2.attention.flash_attention": SWAP}
    counts, offloaded = _counts(units, first=True)
    ops, saved, model_ops = _inside(["layers.0.feed_forward", "layers.2.attention"])
    assert offloaded > 0
    assert 0 < counts["dispatch"] <= 2 * ops < model_ops // 2
    assert 0 < counts["pack"] <= 2 * saved


def test_whole_layer_swap_packs_without_a_dispatch_mode():
    """A layer swapped as a whole needs no op names: no dispatch call; its pack calls are its saved tensors and
    those of the next layer, which saves its output."""
    counts, offloaded = _counts({"layers.1": SWAP})
    _, saved, _ = _inside(["layers.1"])
    assert offloaded > 0
    assert counts["dispatch"] == 0
    assert saved <= counts["pack"] <= 2 * saved
