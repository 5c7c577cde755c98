"""Padding-free packing: every plan kind exact on packed batches of the Hugging Face families llama, qwen2, mixtral.

A packed batch is what transformers' ``DataCollatorWithFlattening`` makes (``hf_packed``): batch 1, sequences of
varying lengths concatenated, ``position_ids`` restarting at 0 per sequence, labels -100 at each sequence's
first token; transformers attends within each sequence only. Per family and plan: the planned step against the
same packed step without a plan (same weights, same batch, same seed); loss and every gradient ``torch.equal``.
The milp plan is searched on a profile of the packed step; the adaptive loop trains on packed batches whose
totals change from step to step.
"""

from __future__ import annotations

import functools

import pytest
import torch

from adaptive_mem import ModelSpecError, build_model, optimize
from adaptive_mem.models._hf import hf_packed
from _deterministic import deterministic  # noqa: F401 - the fixture is used by name

FAMILIES = ("llama", "qwen2", "mixtral")
LENGTHS = (20, 7, 30, 7)
"""One packed step: four sequences, 64 tokens."""


def _op_swap(attn: str) -> dict:
    return {"swap": True, "op_swap": [{"op_name": attn, "backward_prefetch": 1, "layers": True}]}


CONFIGS: dict[str, dict] = {
    "full-recompute": {"recompute_config": {"recompute": True}},
    "select-recompute-mlp": {"recompute_config": {"select_recompute": {"mlp": True}}},
    "select-recompute-attention": {"recompute_config": {"select_recompute": {"self_attn": True}}},
    "layer-swap": {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]}},
    "op-swap-attention": {"swap_config": _op_swap("self_attn")},
    "mixed-alternating": {"recompute_config": {"select_recompute": {"mlp": [0, 2]}},
                          "swap_config": _op_swap("self_attn")},
}
PLANS = (*CONFIGS, "milp-half")

pytestmark = pytest.mark.usefixtures("deterministic")


def _build(family: str, lengths=LENGTHS):
    args = {"num_hidden_layers": 3} if family == "llama" else {}  # every family: 3 layers
    return hf_packed(build_model(f"hf:{family}", model_args=args, batch_size=1, seq_len=sum(lengths), seed=0), lengths)


def _step(bundle, batch):
    model = bundle.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = bundle.loss(batch)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@functools.lru_cache(maxsize=None)
def _reference(family: str):
    bundle = _build(family)
    batch = bundle.batch(seed=0)
    return bundle, batch, _step(bundle, batch)


def _assert_same(got, want, what: str) -> None:
    loss, grads = got
    assert torch.equal(loss, want[0]), f"{what}: loss {loss} != {want[0]}"
    assert grads.keys() == want[1].keys(), what
    for key, grad in want[1].items():
        assert torch.equal(grads[key], grad), f"{what}: grad of {key} differs"


def test_packed_batch_is_the_flattening_collators_form():
    bundle = _build("llama", (3, 2, 4))
    ids, positions, labels = bundle.batch(seed=0)
    assert (bundle.batch_size, bundle.seq_len) == (1, 9)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    want = ids.clone()
    want[0, [0, 3, 5]] = -100
    assert torch.equal(labels, want)
    assert all(torch.equal(a, b) for a, b in zip(bundle.batch(seed=0), (ids, positions, labels)))


def test_packed_sequences_attend_within_themselves_only():
    """The packing takes effect: each sequence's logits are those of the sequence run alone (``assert_close``:
    the packed run multiplies other shapes, so the sums round differently), not those of one long sequence."""
    bundle, (ids, positions, _), _ = _reference("llama")
    model = bundle.model
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits
        start = 0
        for n in LENGTHS:
            alone = model(input_ids=ids[:, start:start + n]).logits
            torch.testing.assert_close(packed[:, start:start + n], alone)
            start += n
        one_sequence = model(input_ids=ids).logits
    assert not torch.allclose(packed[:, LENGTHS[0]:], one_sequence[:, LENGTHS[0]:])


@pytest.mark.parametrize("bad", [(), (3, 0), (2.0,), (True, 3)])
def test_packed_lengths_are_positive_integers(bad):
    with pytest.raises(ModelSpecError, match=r"packed lengths="):
        hf_packed(build_model("hf:llama", batch_size=1, seq_len=8), bad)


def test_packed_needs_a_causal_lm_of_a_family():
    with pytest.raises(ModelSpecError, match=r"packed batches: expected an hf:<family> causal LM"):
        hf_packed(build_model("hf:bert", batch_size=1, seq_len=8), (4, 4))
    with pytest.raises(ModelSpecError, match=r"packed batches: expected an hf:<family> causal LM"):
        hf_packed(build_model("llama-tiny"), (4, 4))


def _milp_plan(family: str, tmp_path) -> str:
    """The milp plan at half the activation peak, searched on a profile of the packed step."""
    import profiler
    from adaptive_mem.cli import main
    from search import Plan

    profile, plan = tmp_path / "p.json", tmp_path / "plan.yaml"
    profiler.profile_step(_build(family), warmup=0, repeat=0, record=1, optimizer_time=0.0).save(profile)
    assert main(["search", str(profile), "--activation-budget", "0.5", "-o", str(plan)]) == 0
    made_for = Plan.load(plan).model
    assert (made_for["batch_size"], made_for["seq_len"]) == (1, sum(LENGTHS)), made_for
    return str(plan)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_step_exact(family: str, plan: str, tmp_path):
    bundle, batch, ref = _reference(family)
    kwargs = {"plan": _milp_plan(family, tmp_path)} if plan == "milp-half" else {"config": CONFIGS[plan]}
    with optimize(bundle.model, **kwargs) as handle:
        assert handle.summary().takes_effect, handle.summary()
        for _ in range(2):  # the second step reuses what the first one traced
            _assert_same(_step(bundle, batch), ref, f"{family} {plan}")


def _layer_units(profile) -> list[tuple[str, int, int]]:
    return [(u.name, u.output_bytes, u.saved_bytes) for u in profile.units if u.layer is not None]


def test_packed_step_profiled_on_fake_tensors_is_the_real_one(tmp_path):
    """On fake tensors (``device="meta"``) the packed step takes the packed attention path of the real run
    (Note: [packed on fake tensors]): every layer unit with the same bytes, the same peak; the milp plan searched
    on the fake profile runs the real packed step exactly."""
    import profiler
    from adaptive_mem.cli import main

    profiles = {}
    for device in ("cpu", "meta"):
        bundle = hf_packed(build_model("hf:qwen2", batch_size=1, seq_len=64, seed=0, device=device), LENGTHS)
        profiles[device] = profiler.profile_step(bundle, warmup=0, repeat=0, record=1, optimizer_time=0.0)
    assert _layer_units(profiles["meta"]) == _layer_units(profiles["cpu"])
    assert profiles["meta"].peak_memory == profiles["cpu"].peak_memory
    profile, plan = tmp_path / "p.json", tmp_path / "plan.yaml"
    profiles["meta"].save(profile)
    assert main(["search", str(profile), "--activation-budget", "0.5", "-o", str(plan)]) == 0
    bundle, batch, ref = _reference("qwen2")
    with optimize(bundle.model, plan=str(plan)) as handle:
        assert handle.summary().takes_effect, handle.summary()
        _assert_same(_step(bundle, batch), ref, "qwen2 milp on the fake profile")
