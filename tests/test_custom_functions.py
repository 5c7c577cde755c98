"""Custom autograd Functions: ``wrap_function`` / ``adapt_mem_func_wrapper`` make one unit of a Function
(Note: [wrapped Function unit]); unwrapped Functions stay exact under layer plans.

Every plan is checked against the same model without a plan: loss and every gradient ``torch.equal``.
Memory is measured with ``DeviceMemory`` (live bytes after forward), replays by counting ``forward`` calls
made during backward.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_mem
from adaptive_mem import ConfigError, DeviceMemory, adapt_mem_func_wrapper, optimize, wrap_function
from adaptive_mem.runtime._apply import trace_units
from profiler import profile_step
from search import Plan, PlanError

CALLS = {"forward": 0}


class SiluMul(torch.autograd.Function):
    """``x * sigmoid(x) * w`` with a hand-written backward; saves ``sigmoid(x)`` (its own) and ``x``, ``w``."""

    @staticmethod
    def forward(ctx, x, w):
        CALLS["forward"] += 1
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s, w)
        return x * s * w

    @staticmethod
    def backward(ctx, g):
        x, s, w = ctx.saved_tensors
        dy = g * w
        return dy * (s + x * s * (1 - s)), (g * x * s).sum((0, 1))


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up``, fused: saves both inputs and ``sigmoid(gate)``."""

    @staticmethod
    def forward(ctx, gate, up):
        CALLS["forward"] += 1
        s = torch.sigmoid(gate)
        ctx.save_for_backward(gate, up, s)
        return gate * s * up

    @staticmethod
    def backward(ctx, g):
        gate, up, s = ctx.saved_tensors
        silu = gate * s
        return g * up * (s + gate * s * (1 - s)), g * silu


class Mlp(nn.Module):
    def __init__(self, d: int, call: str) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.w = nn.Parameter(torch.rand(4 * d) + 0.5)
        self.down = nn.Linear(4 * d, d)
        self.call = call

    def forward(self, x):
        h = self.up(x)
        if self.call == "wrap":
            h = wrap_function(SiluMul, h, self.w)
        elif self.call == "alias":
            h = adapt_mem_func_wrapper(SiluMul, h, self.w)
        elif self.call == "twice":
            h = wrap_function(SiluMul, wrap_function(SiluMul, h, self.w), self.w)
        else:
            h = SiluMul.apply(h, self.w)
        return self.down(h)


class Block(nn.Module):
    def __init__(self, d: int, call: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = Mlp(d, call)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, call: str = "wrap", d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, call) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


X = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
FN_BYTES = 2 * 2 * 8 * 64 * 4  # sigmoid(x) and the Function's output (saved by ``down``), fp32
# Each recomputed layer's checkpoint keeps the CPU RNG state (``preserve_rng_state``): a tensor the C++
# allocator hook counts on the CPU "device" (the dispatch accounting never saw it: not an aten op's output).
RNG_BYTES = torch.get_rng_state().nbytes


def _net(call: str = "wrap") -> Net:
    torch.manual_seed(0)
    return Net(call)


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


class _Sigmoids(TorchDispatchMode):
    """Counts sigmoid kernels that really run (a selective-checkpoint replay answers cached ops above this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.sigmoid.default
        return func(*args, **(kwargs or {}))


def _step(model: nn.Module, run, plan: Plan | None = None, **apply) -> dict:
    """One step: loss, grads, device bytes live after forward, Function forwards called and sigmoid kernels run
    during backward (the Functions' only sigmoid), swap stats."""
    model.zero_grad(set_to_none=True)
    handle = optimize(model, plan=plan, **apply) if plan is not None else None
    try:
        mem = DeviceMemory(track_existing=False)
        with mem:
            base = mem.live
            loss = run(model)
            engine = handle._executor.engine if handle is not None else None
            if engine is not None:  # the offload copies run in order on the copy thread: wait for the last
                engine.copier.sync(engine.copier.submit(lambda non_blocking: None))
            held = mem.live - base
            CALLS["forward"] = 0
            with _Sigmoids() as sigmoids:
                loss.backward()
            replays = CALLS["forward"]
        stats = handle.swap_stats if handle is not None else None
    finally:
        if handle is not None:
            handle.remove()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "held": held, "replays": replays, "recomputed": sigmoids.count, "stats": stats}


def _assert_exact(out: dict, ref: dict) -> None:
    assert torch.equal(out["loss"], ref["loss"])
    assert out["grads"].keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        assert torch.equal(out["grads"][name], grad), name


def _run(model):
    return model(X)


def _fn_units(n: int = 3) -> list[str]:
    return [f"layers.{i}.mlp.SiluMul" for i in range(n)]


def test_wrapped_function_is_one_profiled_unit_with_its_saved_bytes():
    prof = profile_step(_net(), inputs=(X,), loss_fn=lambda m, b: m(*b), warmup=0, repeat=1, record=1)
    units = {u.name: u for u in prof.units}
    layer0 = [n for n in units if n.startswith("layers.0.")]
    assert layer0 == ["layers.0.norm", "layers.0.mlp.up.matmul", "layers.0.mlp.SiluMul", "layers.0.mlp.down.matmul",
                      "layers.0.add"]
    for name in _fn_units():
        assert units[name].saved_bytes == FN_BYTES, name


def test_unwrapped_function_ops_are_ops_of_its_module():
    prof = profile_step(_net("apply"), inputs=(X,), loss_fn=lambda m, b: m(*b), warmup=0, repeat=1, record=1)
    names = [u.name for u in prof.units]
    assert "layers.0.mlp.sigmoid" in names and "layers.0.mlp.mul" in names
    assert not any("SiluMul" in n for n in names)


def test_calls_in_one_module_call_are_numbered_and_unit_label_is_honoured(monkeypatch):
    names = trace_units(_net("twice"), (X,))
    assert [n for n in names if n.startswith("layers.1.mlp.")] == [
        "layers.1.mlp.up.matmul", "layers.1.mlp.SiluMul", "layers.1.mlp.SiluMul_1", "layers.1.mlp.down.matmul"]
    monkeypatch.setattr(SiluMul, "unit_label", "silu_mul", raising=False)
    assert "layers.2.mlp.silu_mul" in trace_units(_net(), (X,))


@pytest.mark.parametrize("call", ["wrap", "alias"])
@pytest.mark.parametrize("plan", [
    "keep", "recompute", "swap", "swap-prefetch", "recompute-up-swap-fn", "mixed-layers", "layer-recompute",
    "layer-swap"])
def test_plans_on_a_wrapped_function_are_exact(call, plan):
    fn = _fn_units()
    decisions = {
        "keep": {u: "keep" for u in fn},
        "recompute": {u: "recompute" for u in fn},
        "swap": {u: {"action": "swap", "backward_prefetch": 0} for u in fn},
        "swap-prefetch": {u: {"action": "swap", "backward_prefetch": 1} for u in fn},
        "recompute-up-swap-fn": {"layers.0.mlp.up": "recompute", "layers.0.mlp.SiluMul": "swap",
                                 "layers.1.mlp.SiluMul": "swap"},
        "mixed-layers": {fn[0]: "recompute", fn[1]: {"action": "swap", "backward_prefetch": 1}, "layers.2": "recompute"},
        "layer-recompute": {f"layers.{i}": "recompute" for i in range(3)},
        "layer-swap": {f"layers.{i}": "swap" for i in range(3)},
    }[plan]
    ref = _step(_net(call), _run)
    model = _net(call)
    out = _step(model, _run, _plan(decisions), example_inputs=(X,))
    _assert_exact(out, ref)


def test_recompute_frees_the_function_bytes_and_replays_its_forward():
    model = _net()
    ref = _step(model, _run)
    keep = _step(model, _run, _plan({u: "keep" for u in _fn_units()}), example_inputs=(X,))
    rec = _step(model, _run, _plan({u: "recompute" for u in _fn_units()}), example_inputs=(X,))
    _assert_exact(rec, ref)
    assert ref["replays"] == keep["replays"] == ref["recomputed"] == keep["recomputed"] == 0
    assert rec["replays"] == rec["recomputed"] == 3
    assert keep["held"] == ref["held"]
    assert ref["held"] - rec["held"] == 3 * (FN_BYTES - RNG_BYTES)


def test_recompute_of_one_layer_replays_that_layer_only():
    model = _net()
    ref = _step(model, _run)
    rec = _step(model, _run, _plan({"layers.1.mlp.SiluMul": "recompute"}), example_inputs=(X,))
    _assert_exact(rec, ref)
    assert rec["replays"] == rec["recomputed"] == 1
    assert ref["held"] - rec["held"] == FN_BYTES - RNG_BYTES


def test_function_unit_named_without_profile_or_example_inputs():
    model = _net()
    ref = _step(model, _run)
    rec = _step(model, _run, _plan({"layers.1.mlp.SiluMul": "recompute"}))
    _assert_exact(rec, ref)
    assert rec["replays"] == 1 and ref["held"] - rec["held"] == FN_BYTES - RNG_BYTES
    with pytest.raises(PlanError, match="SiluMull"):
        _step(model, _run, _plan({"layers.1.mlp.SiluMull": "recompute"}))


@pytest.mark.parametrize("prefetch", [0, 1])
def test_swap_moves_the_function_bytes(prefetch):
    model = _net()
    ref = _step(model, _run)
    out = _step(model, _run, _plan({u: {"action": "swap", "backward_prefetch": prefetch} for u in _fn_units()}),
                example_inputs=(X,))
    _assert_exact(out, ref)
    assert out["stats"].offloaded_bytes == out["stats"].reloaded_bytes == 3 * FN_BYTES
    assert ref["held"] - out["held"] == 3 * FN_BYTES
    assert out["replays"] == out["recomputed"] == 0


@pytest.mark.parametrize("plan", ["layer-recompute", "layer-swap", "module-swap", "op-recompute"])
def test_unwrapped_function_is_exact_under_layer_plans(plan):
    decisions = {
        "layer-recompute": {f"layers.{i}": "recompute" for i in range(3)},
        "layer-swap": {f"layers.{i}": "swap" for i in range(3)},
        "module-swap": {f"layers.{i}.mlp": "swap" for i in range(3)},
        "op-recompute": {"layers.0.mlp.sigmoid": "recompute"},
    }[plan]
    model = _net("apply")
    ref = _step(model, _run)
    out = _step(model, _run, _plan(decisions), example_inputs=(X,))
    _assert_exact(out, ref)
    if plan == "layer-recompute":
        assert out["replays"] == out["recomputed"] == 3
    if plan.endswith("swap"):
        assert out["stats"].offloaded_bytes > 0 and ref["held"] > out["held"]


def test_wrap_function_refuses_what_is_not_a_function():
    with pytest.raises(ConfigError, match=r"wrap_function: fn=.*Linear.*expected a torch.autograd.Function subclass"):
        wrap_function(nn.Linear, X)
    bad = type("SiluMul", (SiluMul,), {"unit_label": "a b"})
    with pytest.raises(ConfigError, match=r"SiluMul.unit_label='a b': expected an identifier"):
        wrap_function(bad, X, X)


def test_wrap_function_passes_keyword_arguments():
    x, w = torch.randn(3, 4), torch.randn(4)
    assert torch.equal(wrap_function(SiluMul, x, w=w), SiluMul.apply(x, w))
    assert torch.equal(adapt_mem_func_wrapper(SiluMul, x, w), SiluMul.apply(x, w))
    assert "wrap_function" in adaptive_mem.__all__ and "adapt_mem_func_wrapper" in adaptive_mem.__all__


# ---------------------------------------------------------------- a Hugging Face layer with a fused Function
class FusedMlp(nn.Module):
    """Llama's MLP with ``act_fn(gate) * up`` as one fused Function."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x):
        return self.down_proj(wrap_function(SwiGLU, self.gate_proj(x), self.up_proj(x)))


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.0,
                                   pad_token_id=0, use_cache=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        layer.mlp = FusedMlp(layer.mlp)
    return model


IDS = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(2))


def _lm(model):
    return model(input_ids=IDS, labels=IDS).loss


HF_FN = [f"model.layers.{i}.mlp.SwiGLU" for i in range(2)]


def test_hf_layer_profiles_the_fused_function():
    prof = profile_step(_llama(), inputs=(IDS,), loss_fn=lambda m, b: _lm(m), warmup=0, repeat=1, record=1)
    units = {u.name: u for u in prof.units}
    for name in HF_FN:
        assert units[name].saved_bytes == 2 * 9 * 64 * 4 * 2, name  # sigmoid(gate) and the output, fp32
    assert [n for n in units if n.startswith("model.layers.0.mlp.")] == [
        "model.layers.0.mlp.gate_proj.matmul", "model.layers.0.mlp.up_proj.matmul", "model.layers.0.mlp.SwiGLU",
        "model.layers.0.mlp.down_proj.matmul"]


@pytest.mark.parametrize("plan", ["recompute", "swap", "attention-swap-fn-recompute", "layer-recompute"])
def test_hf_layer_plans_on_the_fused_function_are_exact(plan):
    decisions = {
        "recompute": {u: "recompute" for u in HF_FN},
        "swap": {u: {"action": "swap", "backward_prefetch": 1} for u in HF_FN},
        "attention-swap-fn-recompute": {"model.layers.0.self_attn": "swap", "model.layers.0.mlp.SwiGLU": "recompute",
                                        "model.layers.1.mlp.SwiGLU": "swap"},
        "layer-recompute": {"model.layers.0": "recompute", "model.layers.1": "recompute"},
    }[plan]
    model = _llama()
    ref = _step(model, _lm)
    out = _step(model, _lm, _plan(decisions), example_inputs=(IDS,))
    _assert_exact(out, ref)
    if plan == "recompute":
        # Baseline with checkpoints: recompute a unit that saves nothing. Its checkpoints are the layers' (they
        # hold the int64 position ids, one tensor for both), the SwiGLU's are the MLPs' (Note: [narrowed select
        # recompute]).
        sac = _step(model, _lm, _plan({f"model.layers.{i}.mlp.down_proj": "recompute" for i in range(2)}),
                    example_inputs=(IDS,))
        assert sac["recomputed"] == 0 and out["recomputed"] == 2
        assert sac["held"] - out["held"] == 2 * (2 * 9 * 64 * 4 * 2) + 9 * 8
    if plan == "swap":
        assert out["stats"].offloaded_bytes == 2 * (2 * 9 * 64 * 4 * 2)
