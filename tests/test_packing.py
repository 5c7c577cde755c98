"""Padding-free packing: every plan kind exact on packed batches of the Hugging Face families llama, qwen2, mixtral.

A packed batch is what transformers' ``DataCollatorWithFlattening`` makes (``hf_packed``): batch 1, sequences of
varying lengths concatenated, ``position_ids`` restarting at 0 per sequence, labels -100 at each sequence's
first token; transformers attends within each sequence only. Per family and plan: the planned step against the
same packed step without a plan (same weights, same batch, same seed); loss and every gradient ``torch.equal``.
The milp plan is searched on a profile of the packed step; the adaptive loop trains on packed batches whose
totals change from step to step.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from adaptive_mem import ModelSpecError, build_model, optimize
from adaptive_mem.models._hf import HF_HEADS, hf_packed
from _deterministic import assert_same_step as _assert_same, deterministic, seeded_step as _step  # noqa: F401 - the fixture is used by name
from test_hf_zoo import KEYS

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


@functools.lru_cache(maxsize=None)
def _reference(family: str):
    bundle = _build(family)
    batch = bundle.batch(seed=0)
    return bundle, batch, _step(bundle, batch)


def test_packed_batch_is_the_flattening_collators_form():
    from transformers import DataCollatorWithFlattening

    bundle = _build("llama", (3, 2, 4))
    ids, positions, labels = bundle.batch(seed=0)
    assert (bundle.batch_size, bundle.seq_len) == (1, 9)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert labels[0, [0, 3, 5]].tolist() == [-100] * 3
    sequences = [{"input_ids": part.tolist()} for part in ids[0].split([3, 2, 4])]
    collated = DataCollatorWithFlattening(return_tensors="pt")(sequences)
    assert collated.keys() == {"input_ids", "position_ids", "labels"}
    for name, tensor in zip(("input_ids", "position_ids", "labels"), (ids, positions, labels)):
        assert torch.equal(collated[name], tensor), name
    assert all(torch.equal(a, b) for a, b in zip(bundle.batch(seed=0), (ids, positions, labels)))
    repacked = hf_packed(bundle, (5, 5))  # the same model, other lengths
    assert repacked.model is bundle.model and repacked.batch(seed=0)[1].tolist() == [[0, 1, 2, 3, 4] * 2]


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


@pytest.mark.parametrize("lengths", [LENGTHS, (64,)], ids=["four-sequences", "one-sequence"])
def test_packed_step_profiled_on_fake_tensors_is_the_real_one(lengths, tmp_path):
    """On fake tensors (``device="meta"``) the packed step takes the attention path of the real run (Note:
    [packed on fake tensors]; one sequence is not packed): every layer unit with the same bytes, the same peak;
    the milp plan searched on the fake profile runs the real packed step exactly."""
    import profiler
    from adaptive_mem.cli import main

    profiles = {}
    for device in ("cpu", "meta"):
        bundle = hf_packed(build_model("hf:qwen2", batch_size=1, seq_len=64, seed=0, device=device), lengths)
        profiles[device] = profiler.profile_step(bundle, warmup=0, repeat=0, record=1, optimizer_time=0.0)
    assert _layer_units(profiles["meta"]) == _layer_units(profiles["cpu"])
    assert profiles["meta"].peak_memory == profiles["cpu"].peak_memory
    profile, plan = tmp_path / "p.json", tmp_path / "plan.yaml"
    profiles["meta"].save(profile)
    assert main(["search", str(profile), "--activation-budget", "0.5", "-o", str(plan)]) == 0
    bundle = hf_packed(build_model("hf:qwen2", batch_size=1, seq_len=64, seed=0), lengths)
    batch = bundle.batch(seed=0)
    ref = _step(bundle, batch)
    with optimize(bundle.model, plan=str(plan)) as handle:
        assert handle.summary().takes_effect, handle.summary()
        _assert_same(_step(bundle, batch), ref, "qwen2 milp on the fake profile")


VARYING = ((20, 7, 30, 7), (50, 14, 30), (9,) * 7, (64, 30, 10, 16), (20, 7, 30, 7), (40, 40), (100,), (12, 20))
"""Packed steps whose totals change from step to step (64, 94, 63, 120, 64, 80, 100, 32 tokens)."""


def _packed_steps(family: str) -> list:
    args = {"num_hidden_layers": 3} if family == "llama" else {}
    base = build_model(f"hf:{family}", model_args=args, batch_size=1, seq_len=max(map(sum, VARYING)), seed=0)
    return [hf_packed(base, lengths) for lengths in VARYING]


def _train(family: str, *, budget: int | None = None, want: list | None = None):
    """``VARYING``'s steps with SGD under ``DeviceMemory(cap=budget)``, in the adaptive loop when ``budget`` is
    given. Returns the gradients of every step (compared in place with ``want``'s when given), the peaks (less
    the gradients kept), and whether a plan deciding something was in place at some step."""
    from adaptive_mem import DeviceMemory, adaptive_optimize

    steps = _packed_steps(family)
    model = steps[0].model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, peaks, planned, held = [], [], False, 0
    loop = (adaptive_optimize(model, budget=budget, optimizer=opt, cache=False, loss_fn=lambda out: out.loss)
            if budget is not None else contextlib.nullcontext())
    with DeviceMemory(cap=budget, track_existing=False) as mem:
        mem.track(model, opt)
        with loop as am:
            for i, bundle in enumerate(steps):
                mem.reset_peak()
                torch.manual_seed(1234)
                bundle.loss(bundle.batch(seed=i)).backward()
                peaks.append(mem.peak - held)
                if want is None:
                    grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                    held += sum(g.untyped_storage().nbytes() for g in grads[-1].values())  # not the step's
                else:
                    assert all(torch.equal(p.grad, want[i][n]) for n, p in model.named_parameters()), f"step {i}"
                planned |= am is not None and am.plan is not None and bool(am.plan.decisions)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return grads, peaks, planned


@pytest.mark.parametrize("family", FAMILIES)
def test_adaptive_loop_on_packed_steps_of_varying_totals_is_exact(family: str):
    want, peaks, _ = _train(family)
    static = 2 * sum(p.untyped_storage().nbytes() for p in _packed_steps(family)[0].model.parameters())
    budget = static + int(0.7 * (max(peaks) - static))  # parameters, gradients and 70% of the largest activations
    _, got, planned = _train(family, budget=budget, want=want)
    assert max(got) <= budget, (got, budget)
    assert planned, "no plan deciding anything was applied"


@pytest.mark.parametrize("plan", CONFIGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_config_plan_on_packed_steps_of_varying_totals_is_exact(family: str, plan: str):
    """A config applies to the layers whatever the step's shape: each packed total is exact, the same model
    without it is the reference (one model, its weights unchanged between steps)."""
    steps = _packed_steps(family)[:4]  # 64, 94, 63, 120 tokens
    batches = [bundle.batch(seed=i) for i, bundle in enumerate(steps)]
    want = [_step(bundle, batch) for bundle, batch in zip(steps, batches)]
    with optimize(steps[0].model, config=CONFIGS[plan]):
        for i, (bundle, batch) in enumerate(zip(steps, batches)):
            _assert_same(_step(bundle, batch), want[i], f"{family} {plan} step {i} ({bundle.seq_len} tokens)")


OTHERS = [f for f in KEYS if f not in (*FAMILIES, *HF_HEADS)]
"""The zoo's other causal LMs. transformers packs (attends within each sequence) in most; opt, bloom and falcon
ignore ``position_ids`` for the mask, the hybrid stacks' linear attention and convolutions run across sequences,
and PhiMoE routes by sampling: their packed step is still a step, and plans must keep it exact."""


@pytest.mark.parametrize("plan", ["layer-swap", "mixed-alternating"])
@pytest.mark.parametrize("family", OTHERS)
def test_packed_step_exact_on_the_other_zoo_families(family: str, plan: str):
    mlp, attn = KEYS[family]
    mixed = {"recompute_config": {"select_recompute": {mlp: [0, 2]}}, "swap_config": _op_swap(attn)}
    config = {"layer-swap": CONFIGS["layer-swap"], "mixed-alternating": mixed}
    bundle = hf_packed(build_model(f"hf:{family}", batch_size=1, seq_len=sum(LENGTHS), seed=0), LENGTHS)
    batch = bundle.batch(seed=0)
    ref = _step(bundle, batch)
    with optimize(bundle.model, config=config[plan]) as handle:
        assert handle.summary().takes_effect, handle.summary()
        _assert_same(_step(bundle, batch), ref, f"{family} {plan}")


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_step_exact_with_the_cache(family: str):
    """``use_cache=True``: the layers get a ``Cache`` object with the packed positions (Note: [cache in
    recompute]); the mixed plan stays exact."""
    args = {"use_cache": True, **({"num_hidden_layers": 3} if family == "llama" else {})}
    bundle = hf_packed(build_model(f"hf:{family}", model_args=args, batch_size=1, seq_len=64, seed=0), LENGTHS)
    batch = bundle.batch(seed=0)
    ref = _step(bundle, batch)
    with optimize(bundle.model, config=CONFIGS["mixed-alternating"]) as handle:
        assert handle.summary().takes_effect, handle.summary()
        _assert_same(_step(bundle, batch), ref, f"{family} with the cache")


@pytest.mark.parametrize("family", FAMILIES)
def test_milp_bucket_plans_on_packed_steps_of_varying_totals_are_exact(family: str, tmp_path):
    """``search --seq-lens`` on the profile of a packed step of 128 tokens (scaled to the shorter buckets): each
    packed step runs the plan of its total's bucket, exactly; the 128 bucket's plan decides something."""
    import profiler
    from adaptive_mem.cli import main

    steps = _packed_steps(family)[:5]  # 64, 94, 63, 120, 64 tokens
    profile = profiler.profile_step(hf_packed(steps[0], (40, 24, 50, 14)), warmup=0, repeat=0, record=1,
                                    optimizer_time=0.0)
    profile.save(tmp_path / "p.json")
    budget = profile.static.total + (profile.peak_memory - profile.static.total) // 2
    plan = tmp_path / "plans.json"
    assert main(["search", str(tmp_path / "p.json"), "--budget", f"{budget}B", "--seq-lens", "32,64,128",
                 "-o", str(plan)]) == 0
    batches = [bundle.batch(seed=i) for i, bundle in enumerate(steps)]
    want = [_step(bundle, batch) for bundle, batch in zip(steps, batches)]
    with optimize(steps[0].model, plan=str(plan)) as handle:
        for i, (bundle, batch) in enumerate(zip(steps, batches)):
            _assert_same(_step(bundle, batch), want[i], f"{family} step {i} ({bundle.seq_len} tokens)")
            assert handle.bucket == (64, 128, 64, 128, 64)[i]
            if handle.bucket == 128:
                assert handle.summary().takes_effect, handle.summary()
