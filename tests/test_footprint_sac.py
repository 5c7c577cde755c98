"""Op-level select recompute costs the ops it decides, counted (Note: [footprint counters]): a module unit by
saved-tensor hooks on its readers alone (Note: [recompute at pack] in adaptive_mem/runtime/_pack_recompute.py), an
op unit by a policy answering from a table learnt once (Note: [SAC table] in adaptive_mem/runtime/_sac_policy.py)
over the innermost module holding it and its readers (Note: [narrowed select recompute]), with no namer hooks;
gradients bit for bit those of the same step without a plan, the bytes held those of a whole-layer checkpoint."""

from __future__ import annotations

import gc
from copy import deepcopy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_mem import DeviceMemory, build_model, optimize
from adaptive_mem.runtime import _selective
from adaptive_mem.runtime._footprint import FOOTPRINT
from search import Plan
from _deterministic import assert_same_step, deterministic, seeded_step  # noqa: F401 - fixture used by name

pytestmark = pytest.mark.usefixtures("deterministic")

MUL = "layers.0.feed_forward.mul"


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, "groups": []})


class _OpCount(TorchDispatchMode):
    """Counts the aten ops a selective-checkpoint policy is asked about (every op but SAC's ignored ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in (torch.ops.aten.detach.default, torch.ops.prim.device.default):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _ops_of(bundle, module: nn.Module, batch) -> int:
    """The ops one forward runs inside ``module``."""
    count = _OpCount()
    pre = module.register_forward_pre_hook(lambda m, a: count.__enter__() and None)
    post = module.register_forward_hook(lambda m, a, o: count.__exit__(None, None, None))
    try:
        bundle.loss(batch)
    finally:
        pre.remove()
        post.remove()
    return count.n


def _saved_in(bundle, module: nn.Module, batch) -> int:
    """The tensors autograd saves while ``module`` runs, in one forward."""
    count = [0]

    def pack(t):
        count[0] += 1
        return t
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    pre = module.register_forward_pre_hook(lambda m, a: hooks.__enter__() and None)
    post = module.register_forward_hook(lambda m, a, o: hooks.__exit__(None, None, None))
    try:
        bundle.loss(batch)
    finally:
        pre.remove()
        post.remove()
    return count[0]


def _states(handle):
    return handle._executor.selective.states


def _steps(bundle, batch, plan: Plan, want) -> tuple[dict[str, int], object]:
    """The counts of the third step under ``plan`` (every step checked bit for bit), and the layer 0 state."""
    with optimize(bundle.model, plan=plan) as handle:
        for step in range(3):
            FOOTPRINT.reset()
            assert_same_step(seeded_step(bundle, batch), want, f"step {step}")
        layer = bundle.model.layers[0]
        assert not any(m._forward_pre_hooks for m in layer.modules() if m is not layer.feed_forward.w2)
        return FOOTPRINT.snapshot(), _states(handle)[0]


def test_a_module_unit_costs_its_readers_saved_tensors_and_no_dispatch():
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    saved = _saved_in(bundle, bundle.model.layers[0].feed_forward.w2, batch)
    counts, state = _steps(bundle, batch, _plan({MUL: "recompute"}), want)
    assert counts == {"dispatch": 0, "pack": saved, "unpack": saved, "trigger": 0} and saved == 2, (counts, saved)
    assert state.packed and state.region is None


def test_an_op_unit_costs_the_ops_of_its_module_not_the_layers():
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    layer = bundle.model.layers[0]
    region_ops = _ops_of(bundle, layer.attention, batch)
    layer_ops = _ops_of(bundle, layer, batch)
    counts, state = _steps(bundle, batch, _plan({"layers.0.attention.flash_attention": "recompute"}), want)
    assert counts == {"dispatch": region_ops, "pack": 0, "unpack": 0, "trigger": 0}, (counts, region_ops)
    assert state.region is layer.attention and not state.packed
    assert region_ops < layer_ops, (region_ops, layer_ops)
    assert "forward" not in layer.attention.__dict__


def _held(bundle, batch, plan: Plan) -> int:
    """Bytes the forward leaves alive for backward under ``plan`` (its second step)."""
    with optimize(bundle.model, plan=plan):
        seeded_step(bundle, batch)
        gc.collect()
        mem = DeviceMemory(track_existing=False)
        mem.track(bundle.model, batch)
        with mem:
            base = mem.live
            loss = bundle.loss(batch)
            held = mem.live - base
            loss.backward()
            del loss
    return held


def test_hooks_region_and_layer_checkpoint_hold_and_compute_alike(monkeypatch):
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    out = {}

    def record(module, args, output) -> None:
        out.setdefault("bytes", output.numel() * output.element_size())
    hook = bundle.model.layers[0].feed_forward.mul.register_forward_hook(record)
    plain = _held(bundle, batch, _plan({"layers.3": "keep"}))
    hook.remove()
    held = {"hooks": _held(bundle, batch, _plan({MUL: "recompute"}))}
    monkeypatch.setattr(_selective, "pack_units", lambda *args: None)
    monkeypatch.setattr(_selective, "op_units", lambda *args: None)
    held["region"] = _held(bundle, batch, _plan({MUL: "recompute"}))
    monkeypatch.setattr(_selective, "region_path", lambda *args: None)
    with optimize(bundle.model, plan=_plan({MUL: "recompute"})) as handle:
        for _ in range(2):
            assert_same_step(seeded_step(bundle, batch), want, "layer checkpoint")
        assert _states(handle)[0].region is None and not _states(handle)[0].packed
    held["layer"] = _held(bundle, batch, _plan({MUL: "recompute"}))
    rng_state = torch.get_rng_state().numel()  # a checkpoint keeps the CPU generator's state for its replay
    assert held == {"hooks": plain - out["bytes"], "region": plain - out["bytes"] + rng_state,
                    "layer": plain - out["bytes"] + rng_state}, (held, plain, out)


class _Ff(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.sigmoid(self.w1(x)) * x.repeat(1, 1, 2))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.ff = _Ff()
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.extra:  # another control flow: the learnt table no longer fits
            h = h * 0.5
        return x + self.ff(h)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("unit,narrowed", [("layers.0.ff.mul", True), ("layers.0.tanh", False)])
def test_a_call_off_the_table_recomputes_and_learns_again(unit: str, narrowed: bool):
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(2, 4, 16)
    want = {}
    for extra in (False, True):
        model.layers[0].extra = extra
        want[extra] = _grads(model, x)
    with optimize(model, plan=_plan({unit: "recompute"})) as handle:
        state = _states(handle)[0]
        for step, extra in enumerate((False, False, True, True, False)):
            model.layers[0].extra = extra
            got = _grads(model, x)
            assert all(torch.equal(g, w) for g, w in zip(got, want[extra])), (step, extra)
            assert (state.region is model.layers[0].ff) is narrowed
            # the layer's table fits no call whose control flow changed; the region's holds none of the change
            assert (state.table is None) is (not narrowed and step in (2, 4)), step


def test_a_copy_after_the_first_step_carries_no_hook():
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    with optimize(bundle.model, plan=_plan({MUL: "recompute"})):
        seeded_step(bundle, batch)
        copy = deepcopy(bundle.model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in copy.modules())


def _autocast_step(bundle, batch):
    """Forward under bf16 autocast, backward outside it (the recompute must enter it again)."""
    bundle.model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = bundle.loss(batch)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in bundle.model.named_parameters()}


@pytest.mark.parametrize("unit", [MUL, "layers.0.feed_forward.w1.activation.silu"])
def test_module_units_recomputed_under_autocast_are_exact(unit: str):
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    want = _autocast_step(bundle, batch)
    with optimize(bundle.model, plan=_plan({unit: "recompute"})) as handle:
        for step in range(2):
            assert_same_step(_autocast_step(bundle, batch), want, f"{unit} step {step}")
        assert _states(handle)[0].packed


def test_recompute_at_pack_beside_swaps_of_another_layer():
    """A layer without swaps recomputes at pack though the plan swaps in another layer: no dispatch call once traced
    (not the selective checkpoint over the layer); a storage escaping the swapping layer's scopes and saved inside a
    reader still reaches the swap hooks (Note: [scope hooks chain outward]); each step bit for bit. Held bytes: the
    swap plan's less the recomputed output."""
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    swaps = {"layers.0.feed_forward.w1.matmul": {"action": "swap", "backward_prefetch": 1},
             "layers.0.add_1": {"action": "swap", "backward_prefetch": 1}}  # layer 0's output: saved in layer 1
    out = {}

    def record(module, args, output) -> None:
        out.setdefault("bytes", output.numel() * output.element_size())
    hook = bundle.model.layers[1].feed_forward.mul.register_forward_hook(record)
    alone = _held(bundle, batch, _plan(swaps))
    hook.remove()
    mixed = _plan({**swaps, "layers.1.feed_forward.mul": "recompute"})
    with optimize(bundle.model, plan=mixed) as handle:
        for step in range(3):
            FOOTPRINT.reset()
            before = handle.swap_stats.offloaded_bytes
            assert_same_step(seeded_step(bundle, batch), want, f"step {step}")
        assert FOOTPRINT.dispatch == 0 and _states(handle)[1].packed
        assert handle.swap_stats.offloaded_bytes > before
    assert _held(bundle, batch, mixed) == alone - out["bytes"]


def test_a_unit_reading_another_recomputed_unit_is_not_recomputed_at_pack(monkeypatch):
    """Note: [recompute at pack]: ``mul`` reads ``silu``'s output; with both recomputed, a recipe for ``mul`` would
    hold ``silu``'s output, which its own recipe frees. The layer takes the selective checkpoint instead and holds
    what that path holds (each step bit for bit)."""
    bundle = build_model("llama-tiny", seed=0)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    chained = _plan({"layers.0.feed_forward.w1.activation.silu": "recompute", MUL: "recompute"})
    with optimize(bundle.model, plan=chained) as handle:
        for step in range(2):
            assert_same_step(seeded_step(bundle, batch), want, f"step {step}")
        assert not _states(handle)[0].packed
    held = _held(bundle, batch, chained)
    monkeypatch.setattr(_selective, "pack_units", lambda *args: None)
    monkeypatch.setattr(_selective, "op_units", lambda *args: None)
    assert held == _held(bundle, batch, chained)
