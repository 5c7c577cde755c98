"""The bench's competitor policies do what they claim: same gradients as the plain model, less memory
where they checkpoint, and they come off again."""

from __future__ import annotations

import pytest
import torch

from adaptive_mem import DeviceMemory, build_model
from adaptive_mem.bench import PolicyError, get_policy, policy_names


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: thread hand-offs cost more than they bring on a shared machine
    yield
    torch.set_num_threads(threads)


def _grads_and_activation_peak(bundle, model=None):
    model = bundle.model if model is None else model
    for p in model.parameters():
        p.grad = None
    batch = bundle.batch(seed=3)
    with DeviceMemory() as mem:
        base = mem.live
        loss = bundle.loss(batch)
        loss.backward()
        peak = mem.peak - base
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(loss), grads, peak


def _apply(name, bundle, **job):
    opt = torch.optim.SGD(bundle.model.parameters(), lr=0.0)
    return get_policy(name).apply(bundle, opt, {"spec": bundle.spec, "policy": name, **job})


@pytest.mark.parametrize("name", ["full", "op-sac", "megatron-selective"])
def test_eager_competitors_give_the_plain_gradients(name):
    bundle = build_model("llama-tiny", seq_len=64)
    loss0, grads0, peak0 = _grads_and_activation_peak(bundle)
    applied = _apply(name, bundle)
    loss1, grads1, peak1 = _grads_and_activation_peak(applied.bundle)
    applied.remove()
    assert loss1 == loss0
    for n, g in grads0.items():
        assert torch.equal(g, grads1[n]), n
    if name in ("full", "op-sac"):
        assert peak1 < peak0  # checkpointing every layer must save activation memory
    _, _, peak2 = _grads_and_activation_peak(bundle)
    assert peak2 == peak0  # removed: the plain model again


def test_hf_gradient_checkpointing_policy():
    bundle = build_model("hf:llama", seq_len=64)
    loss0, grads0, peak0 = _grads_and_activation_peak(bundle)
    applied = _apply("hf-gc", bundle)
    assert bundle.model.is_activation_checkpointing
    loss1, grads1, peak1 = _grads_and_activation_peak(applied.bundle)
    applied.remove()
    assert not bundle.model.is_activation_checkpointing
    assert loss1 == loss0 and peak1 < peak0
    for n, g in grads0.items():
        assert torch.equal(g, grads1[n]), n
    assert get_policy("hf-gc").unavailable("llama-tiny") is not None
    assert get_policy("hf-gc").unavailable("hf:llama") is None


def test_compile_policy_sets_and_restores_the_budget():
    import torch._functorch.config as functorch_config

    bundle = build_model("llama-tiny")
    loss0, grads0, _ = _grads_and_activation_peak(bundle)
    applied = _apply("compile", bundle, budget=0.3)
    assert functorch_config.activation_memory_budget == 0.3
    assert applied.bundle.model is not bundle.model and applied.bundle.batch_size == bundle.batch_size
    loss1, grads1, _ = _grads_and_activation_peak(applied.bundle, bundle.model)
    applied.remove()
    assert functorch_config.activation_memory_budget == 1.0
    assert loss1 == pytest.approx(loss0, rel=1e-5)
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("spec", ["llama-tiny", "hf:llama"])
def test_sac_ilp_policy_checkpoints_layers_under_a_tight_budget(spec):
    pytest.importorskip("pulp", reason="sac-ilp needs pulp (pip install pulp pwlf)")
    pytest.importorskip("pwlf", reason="sac-ilp needs pwlf (pip install pulp pwlf)")
    bundle = build_model(spec, seq_len=64)
    loss0, grads0, peak0 = _grads_and_activation_peak(bundle)
    static = sum(p.numel() * p.element_size() for p in bundle.model.parameters())
    applied = _apply("sac-ilp", bundle, sac_budget_bytes=2 * static + peak0 * 2 // 3)
    info = applied.info
    assert info["feasible"] and info["checkpointed_layers"] >= 1, info
    loss1, grads1, peak1 = _grads_and_activation_peak(applied.bundle)
    applied.remove()
    assert info["counters"]["unmatched"] == 0  # every op matched a decision of its module's MILP
    assert loss1 == loss0 and peak1 < peak0
    for n, g in grads0.items():
        assert torch.equal(g, grads1[n]), n


def test_unknown_policy_is_a_one_line_value_error():
    with pytest.raises(PolicyError, match=r"--policies: 'magic' is not a policy; expected names from none, full"):
        get_policy("magic")
    assert {"none", "full", "hf-gc", "megatron-selective", "op-sac", "sac-ilp", "compile", "full+compile", "ours-milp",
            "ours-milp+compile", "ours-adaptive"} == set(policy_names())
