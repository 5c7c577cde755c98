"""The swap machinery's footprint (Note: [swap scopes] in adaptive_mem/runtime/_op_swap.py): per step, a plan's
Python dispatch calls and pack-hook calls are bounded by the ops and saved tensors of the modules that hold its
swap units, never by the model's; counted with FOOTPRINT (Note: [footprint counters]), so nothing can flake.
Each plan's step is bit-identical to the same step with no plan."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_mem import DeviceMemory, build_model, optimize
from adaptive_mem.runtime._op_swap import OpSwaps
from adaptive_mem.runtime._swap_engine import SwapEngine
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


def _inside(paths: list[str], spec: str = "llama-tiny") -> tuple[int, int, int]:
    """(ops run inside the modules at ``paths``, tensors saved there, ops of the whole forward) in one plain step."""
    bundle = build_model(spec, seed=0)
    counter = _Ops([bundle.model.get_submodule(p) for p in paths])
    whole = _Ops([bundle.model])
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), counter, whole:
        bundle.loss(bundle.batch(seed=0)).backward()
    return counter.ops, counter.saved, whole.ops


def _save_window(path: str, spec: str) -> int:
    """In one plain step: the saves autograd makes from the output of the module at ``path`` to the last save of
    that output's storage, both included (what a pack hook entered there and left at that save sees)."""
    bundle = build_model(spec, seed=0)
    keys: set[int] = set()
    seen = {"packs": 0, "window": 0}
    bundle.model.get_submodule(path).register_forward_hook(
        lambda m, a, out: keys.add(out.untyped_storage()._cdata))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if keys:
            seen["packs"] += 1
            if t.untyped_storage()._cdata in keys:
                seen["window"] = seen["packs"]
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        bundle.loss(bundle.batch(seed=0)).backward()
    return seen["window"]


def _counts(decisions: dict, *, first: bool = False, spec: str = "llama-tiny",
            cap: int | None = None) -> tuple[dict[str, int], int]:
    """FOOTPRINT of the second planned step of ``spec`` (with ``first``, of the first), exact against no plan,
    and the bytes it offloaded; with ``cap``, the planned steps run under ``DeviceMemory(cap=cap)``."""
    bundle = build_model(spec, seed=0)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})
    with optimize(bundle.model, plan=plan) as handle, \
            DeviceMemory(cap=cap, track_existing=False) if cap else contextlib.nullcontext():
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


@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "capped"])
@pytest.mark.parametrize("prefetch", [1, 2, 0])
def test_backward_triggers_only_where_a_reload_is_due(prefetch, capped, monkeypatch):
    """Note: [triggers where due]: a swap in layer 0 reloaded ``prefetch`` layers ahead hooks the output of layer
    0 + prefetch alone, where every reload is issued at its trigger (no device cap); under a cap, where a reload
    that does not fit waits for the next layer's trigger, the outputs of layers 0 .. 0 + prefetch; never the
    model's, none above; on demand (prefetch 0) none at all. llama-tiny has 4 layers. Copies on the copy thread,
    where a prefetch overlaps compute (Note: [reload at the unpack] in ``_copier.py``)."""
    monkeypatch.setattr("adaptive_mem.runtime._copier.INLINE_BYTES", 0)
    fired: list[int] = []
    on_backward = SwapEngine.on_backward
    monkeypatch.setattr(SwapEngine, "on_backward", lambda self, layer: (fired.append(layer), on_backward(self, layer)))
    decisions = {"layers.0.feed_forward.w1.matmul": {"action": "swap", "backward_prefetch": prefetch}}
    counts, offloaded = _counts(decisions, cap=1 << 40 if capped else None)
    want = [] if prefetch == 0 else list(range(prefetch, -1, -1)) if capped else [prefetch]
    assert offloaded > 0
    assert counts["trigger"] == len(want)
    assert fired[len(fired) - len(want):] == want  # the second step's, in backward order


@pytest.mark.parametrize("overlap, triggers", [(False, 0), (True, 1)], ids=["inline", "overlapped"])
def test_reloads_the_cpu_copier_runs_inline_need_no_trigger(overlap, triggers, monkeypatch):
    """Note: [reload at the unpack]: the CPU copier runs these copies inline, so the swap's reload waits for its
    unpack: no gradient hook at all, and the step is still the plain one bit for bit (``_counts`` checks it).
    Where the native store's worker runs them (Note: [overlapped native copies]), the reload starts at its trigger:
    the hook of a prefetch one layer ahead, as on the copy thread."""
    monkeypatch.setattr("adaptive_mem.runtime._native_swap.core_to_spare", lambda: overlap)
    counts, offloaded = _counts({"layers.0.feed_forward.w1.matmul": {"action": "swap", "backward_prefetch": 1}})
    assert offloaded > 0 and counts["trigger"] == triggers and counts["pack"] > 0


@pytest.mark.parametrize("spec, unit, module", [
    ("llama-tiny", "layers.0.feed_forward.w1.activation.silu", "layers.0.feed_forward.w1.activation"),
    ("hf:llama", "model.layers.0.mlp.gate_proj.matmul", "model.layers.0.mlp.gate_proj"),
])
def test_a_swap_storage_leaving_its_module_keeps_the_hooks_to_its_last_save(spec, unit, module):
    """Note: [hooks leave after the last save]: the unit's output leaves its module and is saved outside it (by
    the feed-forward's mul; by the MLP's activation). The first step keeps the hooks entered to the layer's end
    (every later save of the layer packs); from the second on they leave at the unit's last save, so the pack
    calls are the saves from its output to its last save, and the same bytes are offloaded (``_counts`` checks each
    step bit for bit)."""
    first, first_offloaded = _counts({unit: SWAP}, first=True, spec=spec)
    counts, offloaded = _counts({unit: SWAP}, spec=spec)
    _, layer_saved, _ = _inside([module.split(".feed_forward")[0].split(".mlp")[0]], spec)
    window = _save_window(module, spec)
    assert offloaded == first_offloaded > 0
    assert window < first["pack"] < layer_saved
    assert counts["pack"] == counts["unpack"] == window >= 1


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


def _layers_hooked(model: torch.nn.Module) -> list[bool]:
    """Per layer of llama-tiny: whether the op-level swap path's layer hooks are on it."""
    mine = (OpSwaps._layer_pre, OpSwaps._layer_post)
    return [any(getattr(getattr(getattr(h, "__wrapped__", None), "func", None), "__func__", None) in mine
                for h in (*layer._forward_pre_hooks.values(), *layer._forward_hooks.values()))
            for layer in model.layers]


@pytest.mark.parametrize("decisions, hooked", [
    ({"layers.0.feed_forward.w1.matmul": SWAP}, 2),
    ({"layers.0.feed_forward.w1.matmul": {"action": "swap", "backward_prefetch": 2}}, 3),
    ({"layers.0.feed_forward.w1.matmul": {"action": "swap", "backward_prefetch": 0}}, 1),
    ({"layers.1.attention": SWAP, "layers.0.feed_forward.mul": SWAP}, 3),
    ({"layers.0": {"action": "recompute", "swap_input": True, "backward_prefetch": 1},
      "layers.1.feed_forward.mul": {"action": "swap", "backward_prefetch": 0}}, 2),
    ({"layers.2": SWAP}, 4),
    ({"norm": SWAP}, 4),  # runs after the layers: every layer tells it so
], ids=["one-unit", "prefetch-2", "on-demand", "two-layers", "swapped-input", "last-trigger-is-the-model", "outside"])
def test_layer_hooks_stop_at_the_last_trigger(decisions, hooked, monkeypatch):
    """Note: [layer hooks up to the last trigger]: the layer hooks are on the layers up to the highest a swap's
    backward trigger can be due at (its layer plus its prefetch), none above; the steps stay the plain ones bit for
    bit (``_counts``), capped too, where deferred reloads trigger at the layers below."""
    bundle = build_model("llama-tiny", seed=0)
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})
    with optimize(bundle.model, plan=plan):
        assert _layers_hooked(bundle.model) == [i < hooked for i in range(4)]
    assert not any(_layers_hooked(bundle.model))
    monkeypatch.setattr("adaptive_mem.runtime._copier.INLINE_BYTES", 0)
    for cap in (None, 1 << 40):
        _, offloaded = _counts(decisions, cap=cap)
        assert offloaded > 0
