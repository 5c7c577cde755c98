"""The reference Llama's fused RMSNorm and SwiGLU (``LlamaConfig(fused_norm=True, fused_swiglu=True)``): the
gradients of the unfused model, the saved bytes of the fused kernels Megatron runs (apex / Transformer Engine
RMSNorm, ``bias_swiglu_impl``), their unit names, fake-tensor profiles by hand count, and every plan kind exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import adaptive_mem as am
import profiler
from adaptive_mem.models import LlamaConfig
from adaptive_mem.models._fused import FusedRMSNormFunction, SwiGLUFunction
from adaptive_mem.runtime._apply import trace_units
from profiler import Layout
from profiler.tracing import rank_share
from search import Budget, Plan, StepModel, get_solver
from _deterministic import deterministic  # noqa: F401 - the fixture is used by name

FUSED = {"fused_norm": True, "fused_swiglu": True}
GIB = 2 ** 30


def _bundle(fused: bool, dtype: str = "float32"):
    return am.build_model("llama-tiny", model_args=FUSED if fused else {}, seed=0, dtype=dtype)


def _step(bundle, batch, *, autocast: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    bundle.model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = bundle.loss(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in bundle.model.named_parameters()}


@pytest.mark.parametrize("dtype,autocast", [("float32", False), ("float32", True), ("bfloat16", False)])
def test_fused_layer_has_the_unfused_gradients(dtype, autocast):
    """Same weights, same batch: the loss is equal and every gradient agrees to fp32 rounding (Note: [fused
    kernels' gradients]); in a bf16 model, where the norm's fp32 upcast is its input's only use, to the bit."""
    plain, fused = _bundle(False, dtype), _bundle(True, dtype)
    batch = plain.batch(seed=0)
    ref_loss, ref = _step(plain, batch, autocast=autocast)
    loss, grads = _step(fused, batch, autocast=autocast)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref.keys()
    for name, grad in ref.items():
        if dtype == "bfloat16":
            assert torch.equal(grads[name], grad), name
        else:
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _saved_bytes(fn, *args) -> int:
    """Bytes of the activations autograd saves while ``fn(*args)`` runs (parameters, which are no activations,
    not counted)."""
    params = {id(a) for a in args if isinstance(a, torch.nn.Parameter)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


@pytest.mark.parametrize("dtype,size", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_fused_rms_norm_saves_its_input_and_the_inverse_rms(dtype, size):
    """Per token of width h: the fused norm saves the input (its dtype) and a fp32 inverse RMS, 2 h + 4 bytes in
    bf16; ``F.rms_norm`` saves the fp32 upcast and the fp32 normalised value and the inverse RMS, 8 h + 4."""
    tokens, h = 24, 64
    x = torch.randn(tokens, h, dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.ones(h, dtype=dtype))
    assert _saved_bytes(FusedRMSNormFunction.apply, x, w, 1e-5) == tokens * (size * h + 4)
    if dtype == torch.bfloat16:
        assert _saved_bytes(F.rms_norm, x, (h,), w, 1e-5) == tokens * (8 * h + 4)


def test_fused_swiglu_saves_its_inputs_only():
    """Per token of width f in bf16: the fused SwiGLU saves gate and up (2 x 2 f, the bytes of Megatron's
    concatenated input); ``silu`` then ``mul`` saves gate, silu(gate) and up (3 x 2 f)."""
    tokens, f = 24, 176
    gate, up = (torch.randn(tokens, f, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    assert _saved_bytes(SwiGLUFunction.apply, gate, up) == tokens * 4 * f
    assert _saved_bytes(lambda g, u: F.silu(g) * u, gate, up) == tokens * 6 * f


def test_fused_layer_units_and_parameters():
    plain, fused = _bundle(False), _bundle(True)
    units = [u for u in trace_units(fused.model, (fused.batch(seed=0)[0],)) if u.startswith("layers.0.")]
    assert units == ["layers.0.attention_norm.norm", "layers.0.attention.wq.matmul", "layers.0.attention.wk.matmul",
                     "layers.0.attention.wv.matmul", "layers.0.attention.apply_rotary_emb.rope",
                     "layers.0.attention.flash_attention", "layers.0.attention.wo.matmul", "layers.0.add",
                     "layers.0.ffn_norm.norm", "layers.0.feed_forward.w1.matmul", "layers.0.feed_forward.w3.matmul",
                     "layers.0.feed_forward.swiglu", "layers.0.feed_forward.w2.matmul", "layers.0.add_1"]
    assert list(dict(plain.model.named_parameters())) == list(dict(fused.model.named_parameters()))


@pytest.mark.parametrize("key", ["fused_norm", "fused_swiglu"])
def test_fused_flags_must_be_booleans(key):
    with pytest.raises(ValueError, match=f"LlamaConfig.{key}='yes': expected True or False"):
        LlamaConfig(**{key: "yes"})


def _layer_saved(profile: profiler.Profile, layer: int = 1) -> int:
    return sum(u.saved_bytes for u in profile.layer_units(layer))


def _fused_layer_bytes(s: int, b: int, h: int, f: int, heads: int) -> int:
    """A fused Megatron layer in bf16 with flash attention, no dropout (Korthikanti et al. 2022 with SwiGLU):
    ``s b (16 h + 6 f)`` (both norm inputs and outputs, Q K V, the attention output; the SwiGLU's gate and up
    and its output), each norm's fp32 inverse RMS ``4 s b`` and the logsumexp ``4 b heads s``."""
    return s * b * (16 * h + 6 * f) + 2 * 4 * s * b + 4 * b * heads * s


def test_fused_layer_profile_matches_the_hand_count_whole_and_under_tp8_sp():
    """A middle layer's saved bytes on fake tensors under ``megatron-bf16``: whole, and one TP8 rank with
    sequence parallelism (every activation divided by 8). The unfused layer saves 12 s b h + 2 s b f more: each
    norm's fp32 upcast and normalised copy less its bf16 input (4 + 4 - 2 bytes), the SiLU output (2 f)."""
    s, b, h, f, heads = 64, 2, 64, 176, 8
    args = dict(hidden_size=h, intermediate_size=f, num_heads=heads, num_kv_heads=heads, num_layers=3)
    whole = {}
    for fused in (False, True):
        bundle = am.build_model("llama-tiny", model_args={**args, **(FUSED if fused else {})}, batch_size=b,
                                seq_len=s, dtype="bfloat16", device="meta")
        whole[fused] = profiler.profile_step(bundle, optimizer="adam", precision="megatron-bf16")
    hand = _fused_layer_bytes(s, b, h, f, heads)
    assert _layer_saved(whole[True]) == hand
    assert _layer_saved(whole[False]) == hand + 12 * s * b * h + 2 * s * b * f
    rank = rank_share(whole[True], bundle.model, Layout(tensor_parallel=8, sequence_parallel=True))
    assert _layer_saved(rank) == hand // 8


def test_seed_layer_hand_count():
    """The seed table's stand-in layer at TP8 with SP, micro-batch 10, seq 8192 (GPT-175B's hidden 12288, MLP
    32768, 96 heads): 3.75 GiB a layer fused, 5.78 GiB unfused (the scaled profile above checks the rule)."""
    fused = _fused_layer_bytes(8192, 10, 12288, 32768, 96) // 8
    unfused = fused + (12 * 8192 * 10 * 12288 + 2 * 8192 * 10 * 32768) // 8
    assert round(fused / GIB, 2) == 3.75 and round(unfused / GIB, 2) == 5.78


def _plans(model_profile: profiler.Profile) -> dict[str, Plan]:
    def plan(decisions: dict) -> Plan:
        return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})

    swap = {"action": "swap", "backward_prefetch": 1}
    milp = get_solver("milp").solve(Budget(activation_fraction=0.5).problem(StepModel.build(model_profile)))
    return {
        "full": plan({"layers": "recompute"}),
        "select": plan({f"layers.{i}.{u}": "recompute" for i in range(4)
                        for u in ("attention_norm.norm", "ffn_norm.norm", "feed_forward.swiglu")}),
        "swap": plan({"layers.0": swap, "layers.1.feed_forward.swiglu": swap, "layers.2.ffn_norm.norm": swap,
                      "norm": swap}),
        "milp": Plan.from_dict(milp.plan.to_dict()),
    }


@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("autocast", [False, True])
def test_every_plan_kind_is_exact_on_the_fused_layer(autocast):
    bundle = _bundle(True)
    batch = bundle.batch(seed=0)
    prof = profiler.profile_step(bundle, warmup=0, repeat=1, record=1)
    ref_loss, ref = _step(bundle, batch, autocast=autocast)
    for name, plan in _plans(prof).items():
        assert plan.decisions, name
        with am.optimize(bundle.model, plan=plan, profile=prof):
            for _ in range(2):
                loss, grads = _step(bundle, batch, autocast=autocast)
                assert torch.equal(loss, ref_loss), name
                for key, grad in ref.items():
                    assert torch.equal(grads[key], grad), f"{name}: grad of {key} differs"
