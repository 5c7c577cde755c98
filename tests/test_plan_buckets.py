"""A plan per sequence-length bucket (Note: [plan buckets]): the file form, the offline search, and the plan picked
per step at run time (Note: [plan per step]) with gradients bit-identical to the plain model."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import adaptive_mem
import profiler
from adaptive_mem import build_model, optimize
from adaptive_mem.cli._main import main
from search import Plan, PlanError, SeqLenBucketError, simulate
from search.planning import bucketed_plan, scale_to_seq_len
from _deterministic import deterministic  # noqa: F401 - the fixture is used by name


def _plan(decisions: dict, seq_len: int | None = None) -> Plan:
    model = {"spec": "llama-tiny", "batch_size": 2, "dtype": "float32"}
    if seq_len is not None:
        model["seq_len"] = seq_len
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, "model": model})


def _swap(prefetch: int) -> dict:
    return {"action": "swap", "backward_prefetch": prefetch}


def _llama_buckets() -> Plan:
    L = "layers"
    return bucketed_plan({
        16: _plan({}, 16),
        32: _plan({f"{L}.0": "recompute", f"{L}.2.feed_forward.mul": "recompute"}, 32),
        64: _plan({f"{L}.1": _swap(1), f"{L}.3.attention.flash_attention": _swap(0)}, 64),
        128: _plan({L: "recompute", f"{L}.1.attention.flash_attention": _swap(2)}, 128),
    })


# ---------------------------------------------------------------- the file form
def test_round_trip_and_top_level_is_the_longest(tmp_path):
    plan = _llama_buckets()
    for name in ("plans.json", "plans.yaml"):
        plan.save(tmp_path / name)
        again = Plan.load(tmp_path / name)
        assert again == plan
    assert plan.decisions == plan.buckets[-1][1].decisions and plan.model["seq_len"] == 128
    data = plan.to_dict()
    assert list(data)[-1] == "buckets" and [b["seq_len"] for b in data["buckets"]] == [16, 32, 64, 128]
    assert all(set(b) == {"seq_len", "plan"} for b in data["buckets"])
    assert "buckets" not in _plan({}).to_dict()  # a plan of one shape is written as before


@pytest.mark.parametrize("seq_len, bucket", [(1, 16), (16, 16), (17, 32), (100, 128), (128, 128)])
def test_for_seq_len_picks_the_smallest_bucket_covering_it(seq_len, bucket):
    assert _llama_buckets().for_seq_len(seq_len).model["seq_len"] == bucket


def test_a_length_above_every_bucket_fails_loudly():
    with pytest.raises(SeqLenBucketError, match=r"^seq_len=129: above the largest bucket 128 \(buckets "
                                                r"16,32,64,128\); expected [^\n]*$"):
        _llama_buckets().for_seq_len(129)


def _mutated(change) -> dict:
    data = json.loads(json.dumps(_llama_buckets().to_dict()))
    change(data)
    return data


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(buckets=[]), r"^plan\.buckets=\[\]: expected a non-empty list"),
    (lambda d: d.update(buckets={"a": 1}), r"^plan\.buckets=\{'a': 1\}: expected a non-empty list"),
    (lambda d: d["buckets"].__setitem__(0, 3), r"^plan\.buckets\[0\]=3: expected a mapping"),
    (lambda d: d["buckets"][1].update(extra=1), r"^plan\.buckets\[1\]\.extra: unknown key; expected seq_len, plan$"),
    (lambda d: d["buckets"][1].update(seq_len=0), r"^plan\.buckets\[1\]\.seq_len=0: expected a positive integer$"),
    (lambda d: d["buckets"][1].pop("plan"), r"^plan\.buckets\[1\]\.plan: missing"),
    (lambda d: (d["buckets"][2].update(seq_len=20), d["buckets"][2]["plan"]["model"].update(seq_len=20)),
     r"^plan\.buckets\[2\]\.seq_len=20: expected ascending lengths"),
    (lambda d: d["buckets"][1]["plan"]["decisions"].update({"layers.0": "drop"}),
     r"^plan\.buckets\[1\]\.plan\.decisions\.layers\.0\.action='drop': expected one of keep, recompute, swap$"),
    (lambda d: d["buckets"][1]["plan"].update(buckets=[]),
     r"^plan\.buckets\[1\]\.plan\.buckets: a bucket's plan holds no buckets"),
    (lambda d: d["buckets"][1]["plan"]["model"].update(seq_len=33),
     r"^plan\.buckets\[1\]\.plan\.model\.seq_len=33: expected the bucket's seq_len 32$"),
    (lambda d: d["decisions"].clear(), r"^plan\.decisions: differ from the longest bucket's"),
])
def test_bad_bucket_files_are_refused_in_one_line(change, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(_mutated(change))


# ---------------------------------------------------------------- the offline search
@functools.lru_cache(maxsize=None)
def _fake_profile(seq_len: int) -> profiler.Profile:
    return profiler.profile_step(build_model("llama-tiny", seq_len=seq_len, device="meta"))


def test_search_a_plan_per_bucket_under_one_budget():
    budget = 5_000_000
    result = adaptive_mem.search(_fake_profile(32), budget=budget, seq_lens="128,16,64,32")
    assert [s for s, _ in result.buckets] == [16, 32, 64, 128]
    assert [s for s, _ in result.plan.buckets] == [16, 32, 64, 128]
    assert result.plan.decisions == result.buckets[-1][1].plan.decisions
    for s, one in result.buckets:
        assert one.peak_bytes <= budget and one.plan.model["seq_len"] == s
        assert one.profile.model["seq_len"] == s
    assert result.buckets[1][1].profile is _fake_profile(32)  # the given length is not scaled
    # monotone in the length: the longest bucket's plan fits the budget at every shorter length too
    longest = result.buckets[-1][1].plan
    for s in (16, 32, 64):
        assert simulate(scale_to_seq_len(_fake_profile(32), s), longest).peak_bytes <= budget


def test_search_profiles_the_lengths_with_a_model():
    result = adaptive_mem.search(_fake_profile(32), budget=5_000_000, seq_lens=[32, 64], model="llama-tiny")
    assert "extrapolated_from_seq_lens" not in result.profile.model  # profiled at 64, not scaled
    with pytest.raises(ValueError, match=r"^model='llama-tiny', model_args=None without seq_lens"):
        adaptive_mem.search(_fake_profile(32), budget=5_000_000, model="llama-tiny")


def test_an_infeasible_bucket_names_its_length():
    from search import InfeasibleBudgetError

    with pytest.raises(InfeasibleBudgetError, match=r"^sequence length 128: budget .* below the minimum"):
        adaptive_mem.search(_fake_profile(32), budget=4_600_000, seq_lens="32,128")


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_writes_one_plan_file_with_a_plan_per_bucket(tmp_path, capsys):
    prof = tmp_path / "p.json"
    _fake_profile(32).save(prof)
    out = tmp_path / "plans.json"
    code, text, _ = _cli(capsys, "search", prof, "--budget", "5MB", "--seq-lens", "16,32,64,128", "-o", out)
    assert code == 0, text
    assert "sequence length 64 (scaled from 32):" in text
    assert text.rstrip().endswith(f"wrote {out} (plan, 4 buckets: sequence lengths 16,32,64,128)")
    assert [s for s, _ in Plan.load(out).buckets] == [16, 32, 64, 128]


@pytest.mark.parametrize("extra, message", [
    (["--seq-lens", "16,x"], "--seq-lens='16,x': expected positive integers separated by commas"),
    (["--seq-lens", "16", "--format", "megatron"], "--format='megatron' with --seq-lens: expected plan"),
    (["--seq-lens", "16", "--maximize", "throughput"], "--seq-lens='16' with --maximize throughput: expected one"),
    (["--model", "llama-tiny"], "--model='llama-tiny' without --maximize throughput or --seq-lens"),
    (["--seq-lens", "16", "--batch-sizes", "1,2"], "--batch-sizes='1,2' with --seq-lens: expected --maximize"),
    (["--batch-sizes", "1,2"], "--batch-sizes='1,2' without --maximize throughput: expected both"),
])
def test_cli_refusals(tmp_path, capsys, extra, message):
    prof = tmp_path / "p.json"
    _fake_profile(32).save(prof)
    code, _, err = _cli(capsys, "search", prof, "--budget", "5MB", "-o", tmp_path / "o.json", *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_simulate_picks_the_bucket_of_the_profiles_length(tmp_path, capsys):
    prof = tmp_path / "p.json"
    _fake_profile(32).save(prof)
    plans = tmp_path / "plans.json"
    assert _cli(capsys, "search", prof, "--budget", "5MB", "--seq-lens", "16,32,128", "-o", plans)[0] == 0
    buckets = dict(Plan.load(plans).buckets)
    code, text, err = _cli(capsys, "simulate", prof, plans)
    assert code == 0, err
    peaks = {s: simulate(_fake_profile(32), buckets[s]).peak_bytes for s in (32, 128)}
    assert peaks[32] != peaks[128], "the test needs buckets whose plans differ at 32 tokens"
    assert f"({peaks[32]} bytes)" in text.splitlines()[0], text


def test_simulate_refuses_a_profile_longer_than_every_bucket(tmp_path, capsys):
    prof, long = tmp_path / "p.json", tmp_path / "long.json"
    _fake_profile(32).save(prof)
    _fake_profile(64).save(long)
    plans = tmp_path / "plans.json"
    assert _cli(capsys, "search", prof, "--budget", "5MB", "--seq-lens", "16,32", "-o", plans)[0] == 0
    code, _, err = _cli(capsys, "simulate", long, plans)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the profile's seq_len=64 is above every bucket (16,32)" in err, err


# ---------------------------------------------------------------- the plan picked per step
pytestmark = pytest.mark.usefixtures("deterministic")

LENGTHS = (20, 64, 5, 128, 33, 64, 100, 16)
"""Every bucket, switching at most steps and staying at one (64, 64)."""


def _batch(vocab: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (2, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _step(bundle, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    bundle.model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = bundle.loss(batch)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in bundle.model.named_parameters()
                                   if p.grad is not None}


def _hf_buckets() -> Plan:
    L = "model.layers"
    return bucketed_plan({
        16: _plan({}, 16),
        32: _plan({f"{L}.0": "recompute"}, 32),
        64: _plan({f"{L}.0.self_attn": _swap(1), f"{L}.1.mlp.act_fn.silu": "recompute"}, 64),
        128: _plan({L: "recompute", f"{L}.1.self_attn": _swap(0)}, 128),
    })


@pytest.mark.parametrize("spec, make", [("llama-tiny", _llama_buckets), ("hf:qwen2", _hf_buckets)])
def test_gradients_bit_identical_at_every_step_across_buckets(spec, make):
    bundle = build_model(spec, seed=0)
    batches = [_batch(bundle.vocab_size, s, seed) for seed, s in enumerate(LENGTHS)]
    refs = [_step(bundle, b) for b in batches]
    plan = make()
    with optimize(bundle.model, plan=plan) as handle:
        picked = []
        for batch, (ref_loss, ref_grads) in zip(batches, refs):
            loss, grads = _step(bundle, batch)
            picked.append(handle.bucket)
            assert torch.equal(loss, ref_loss)
            assert grads.keys() == ref_grads.keys()
            assert all(torch.equal(grads[k], g) for k, g in ref_grads.items()), handle.bucket
        assert picked == [32, 64, 16, 128, 64, 64, 128, 16]
        assert handle.switches == 7  # the first step switches from the longest plan, 64 -> 64 does not
        with pytest.raises(SeqLenBucketError, match=r"^seq_len=129: above the largest bucket 128"):
            bundle.loss(_batch(bundle.vocab_size, 129, 0))
    for path, module in bundle.model.named_modules():
        assert "forward" not in module.__dict__ and not module._forward_pre_hooks, path


def test_optimize_refuses_a_bucket_plan_that_does_not_fit_the_model():
    plan = bucketed_plan({16: _plan({"layers.9": "recompute"}, 16), 32: _plan({}, 32)})
    bundle = build_model("llama-tiny", seed=0)
    with pytest.raises(PlanError, match=r"^plan\.buckets seq_len=16: plan\.decisions\.'layers\.9'"):
        optimize(bundle.model, plan=plan)
    assert not bundle.model._forward_pre_hooks


def test_run_picks_the_plan_for_its_length(tmp_path, capsys):
    path = tmp_path / "plans.json"
    _llama_buckets().save(path)
    code, out, _ = _cli(capsys, "run", "--model", "llama-tiny", "--seq-len", "50", "--plan", path, "--steps", "2")
    assert code == 0, out
    code, _, err = _cli(capsys, "run", "--model", "llama-tiny", "--seq-len", "200", "--plan", path, "--steps", "1")
    assert code == 2 and "seq_len=200: above the largest bucket 128" in err and len(err.strip().splitlines()) == 1


def test_the_step_length_is_dim_1_of_the_first_token_id_tensor():
    from adaptive_mem.runtime._buckets import seq_len_of

    ids = torch.zeros(2, 37, dtype=torch.long)
    assert seq_len_of((ids, ids)) == 37
    assert seq_len_of((), {"input_ids": ids, "attention_mask": torch.ones(2, 37)}) == 37
    packed = torch.zeros(1, 90, dtype=torch.long)  # three sequences flattened, position_ids restarting
    assert seq_len_of((), {"input_ids": packed, "position_ids": torch.cat([torch.arange(n) for n in (30, 40, 20)])
                           .unsqueeze(0)}) == 90
    assert seq_len_of((torch.randn(4, 12, 8),)) == 12  # no token ids: the first tensor of two or more dims
    assert seq_len_of((torch.randn(4),)) is None


def test_two_profiles_at_different_lengths_on_the_cli(tmp_path, capsys):
    paths = []
    for s in (32, 64):
        paths.append(tmp_path / f"p{s}.json")
        _fake_profile(s).save(paths[-1])
    out = tmp_path / "plans.yaml"
    code, text, _ = _cli(capsys, "search", *paths, "--budget", "5MB", "--seq-lens", "48,128", "-o", out)
    assert code == 0, text
    assert "sequence length 48 (scaled from 32, 64):" in text and "sequence length 128 (scaled from 32, 64):" in text
    assert [s for s, _ in Plan.load(out).buckets] == [48, 128]


def test_monotone_in_the_length_on_measured_profiles():
    """The plan searched at the longest length holds the budget at every shorter one, on measured CPU profiles."""
    measured = {s: profiler.profile_step(build_model("llama-tiny", seq_len=s, device="cpu"), repeat=1, record=1)
                for s in (32, 64, 128)}
    budget = 5_000_000
    longest = adaptive_mem.search(measured[128], budget=budget).plan
    for s in (32, 64):
        assert simulate(measured[s], longest).peak_bytes <= budget, s


def test_packed_steps_pick_by_their_total_tokens():
    """Padding-free packing (batch 1, ``position_ids`` restarting per sequence): the bucket of the total tokens."""
    bundle = build_model("hf:qwen2", seed=0)
    model = bundle.model

    def step(n: int, seed: int):
        ids = torch.randint(0, bundle.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
        pos = torch.cat([torch.arange(k) for k in (n // 3, n // 3, n - 2 * (n // 3))]).unsqueeze(0)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    totals = (90, 30, 120, 60)
    refs = [step(n, i) for i, n in enumerate(totals)]
    with optimize(model, plan=_hf_buckets()) as handle:
        for i, n in enumerate(totals):
            loss, grads = step(n, i)
            assert handle.bucket == (128, 32, 128, 64)[i]
            assert torch.equal(loss, refs[i][0])
            assert all(torch.equal(grads[k], g) for k, g in refs[i][1].items())
