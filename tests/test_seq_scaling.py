"""Profiles scaled across sequence lengths (Note: [sequence scaling]) and the length buckets."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import profiler
from adaptive_mem._model_spec import build_model
from search import SeqLenBucketError, StepModel, scale_to_seq_len, seq_len_bucket
from search.planning import (SEQ_SCALING_TOLERANCE, SeqScalingCheck, activation_peak, keep_all, score_ops,
                             seq_scaling_error)


# ---------------------------------------------------------------- buckets
@pytest.mark.parametrize("seq_len, bucket", [(1, 1), (2, 2), (3, 4), (100, 128), (128, 128), (129, 256)])
def test_default_buckets_are_powers_of_two(seq_len, bucket):
    assert seq_len_bucket(seq_len) == bucket


@pytest.mark.parametrize("seq_len, bucket", [(1, 512), (512, 512), (513, 1024), (4096, 4096), (3000, 4096)])
def test_given_buckets(seq_len, bucket):
    assert seq_len_bucket(seq_len, (4096, 512, 1024, 2048)) == bucket


def test_a_length_above_every_bucket_is_refused():
    with pytest.raises(SeqLenBucketError, match=r"^seq_len=5000: above the largest bucket 4096 \(buckets "
                                                r"512,4096\); expected .*$"):
        seq_len_bucket(5000, (512, 4096))


@pytest.mark.parametrize("seq_len, buckets, key", [(0, None, "seq_len"), (True, None, "seq_len"),
                                                   (3.0, None, "seq_len"), (4, (0, 8), "seq_len_buckets"),
                                                   (4, (), "seq_len_buckets")])
def test_bad_lengths_are_refused(seq_len, buckets, key):
    with pytest.raises(SeqLenBucketError, match=f"^{key}"):
        seq_len_bucket(seq_len, buckets)


# ---------------------------------------------------------------- scaling fake-tensor profiles
@functools.lru_cache(maxsize=None)
def _profile(spec: str, seq_len: int, device: str = "meta") -> profiler.Profile:
    bundle = build_model(spec, batch_size=2, seq_len=seq_len, device=device)
    return profiler.profile_step(bundle, repeat=3 if device == "cpu" else 0)


def _keep_all_activations(profile: profiler.Profile) -> int:
    model = StepModel.build(profile)
    return activation_peak(model, keep_all(model))


@pytest.mark.parametrize("spec", ["llama-tiny", "hf:qwen2", "hf:gemma2"])
def test_two_references_give_the_sizes_exactly(spec):
    """Sizes are exact powers of the length (1 for linear ops, 2 for math-attention scores, 0 for constants)."""
    measured = _profile(spec, 128)
    for refs in ((_profile(spec, 32), _profile(spec, 64)), (_profile(spec, 64), _profile(spec, 256))):
        scaled = scale_to_seq_len(refs, 128)
        assert [(o.output_bytes, o.saved_bytes, o.flops) for o in scaled.ops] == \
            [(o.output_bytes, o.saved_bytes, o.flops) for o in measured.ops]
        assert scaled.saved_input_bytes == measured.saved_input_bytes
        check = seq_scaling_error(measured, refs)
        assert check.ok and check.activation_error < 0.01, check.describe()
        assert scaled.model["seq_len"] == 128
        assert scaled.model["extrapolated_from_seq_lens"] == sorted(r.model["seq_len"] for r in refs)


@pytest.mark.parametrize("spec", ["llama-tiny", "hf:qwen2", "hf:gemma2"])
def test_one_reference_scales_sizes_by_kind(spec):
    """Linear, and quadratic for the score ops of a math attention (Note: [score ops by kind])."""
    ref, measured = _profile(spec, 32), _profile(spec, 128)
    scaled = scale_to_seq_len(ref, 128)
    assert scaled.model["extrapolated_from_seq_lens"] == [32]
    assert abs(_keep_all_activations(scaled) / _keep_all_activations(measured) - 1) < 0.01
    scores, _ = score_ops(ref)
    for i, (a, b) in enumerate(zip(scaled.ops, measured.ops)):  # constants (a norm's weight + 1) scale: off a little
        if i in scores:
            assert a.output_bytes == b.output_bytes, (i, a.op, a.unit)


def test_one_reference_time_on_a_model_whose_work_outgrows_the_kernel_latency():
    """llama-small on fake tensors: one reference scaled 4x up and down, the step time within the tolerance."""
    p = {s: profiler.profile_step(build_model("llama-small", batch_size=2, seq_len=s, device="meta"))
         for s in (512, 2048)}
    for target, ref in ((2048, 512), (512, 2048)):
        check = seq_scaling_error(p[target], p[ref])
        assert check.ok and check.activation_error < 0.01, check.describe()


def test_score_ops_of_a_math_attention():
    ref = _profile("hf:gemma2", 32)
    scores, work = score_ops(ref)
    layer0 = {ref.ops[i].op.split(".")[1] for i in scores if ref.ops[i].layer == 0}
    assert layer0 == {"bmm", "mul", "div", "tanh", "add", "_softmax"}
    assert all(ref.ops[i].module.endswith("self_attn") for i in scores)
    assert {ref.ops[i].unit.rsplit(".", 1)[-1] for i in work - scores if ref.ops[i].layer == 0} == {"matmul_1"}
    assert score_ops(_profile("llama-tiny", 32))[0] == frozenset()  # SDPA: no score tensors


def test_same_length_is_the_reference_and_errors_are_one_line():
    ref = _profile("llama-tiny", 32)
    assert scale_to_seq_len(ref, 32) is ref
    with pytest.raises(ValueError, match=r"^seq_len=0: expected a positive integer$"):
        scale_to_seq_len(ref, 0)
    bad = profiler.Profile.from_dict({**ref.to_dict(), "model": {**ref.model, "seq_len": None}})
    with pytest.raises(ValueError, match=r"^refs\[0\]\.model\.seq_len=None: expected a positive integer"):
        scale_to_seq_len(bad, 64)
    other = _profile("llama-tiny", 64)
    other = profiler.Profile.from_dict({**other.to_dict(), "model": {**other.model, "batch_size": 4}})
    with pytest.raises(ValueError, match=r"^refs\[1\]\.model\.batch_size=4: expected the first profile's 2"):
        scale_to_seq_len((ref, other), 128)


def test_check_describes_itself():
    check = SeqScalingCheck(128, (32, 64), 0.001, 0.2, peak_error=0.03)
    assert not check.ok
    assert check.describe() == ("scaling check: sequence length 128 measured vs extrapolated from 32, 64: "
                                "peak off by 3.0%, activation peak by 0.1%, step time by 20.0% (above 10%)")
    assert not SeqScalingCheck(128, (32,), 0.0, 0.0, peak_error=0.2).ok


# ---------------------------------------------------------------- against a third measured length, real CPU profiles
CPU_TIME_TOLERANCE = 0.5
"""The step-time tolerance on CPU profiles measured here. On a shared 2-core machine the same length profiled twice
differs by up to 30 % in step time (the time outside the ops most), so each length is profiled twice and every time
taken at its least (contention only adds time); what is left still cannot be told from the rule's 10 %
(``SEQ_SCALING_TOLERANCE``, met on fake-tensor profiles above). Activations are exact to measure: held to 10 %."""


@functools.lru_cache(maxsize=None)
def _cpu_profile(spec: str, seq_len: int) -> profiler.Profile:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [profiler.profile_step(build_model(spec, batch_size=2, seq_len=seq_len, device="cpu"), warmup=2,
                                      repeat=5, record=5) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    a, b = runs
    ops = [dataclasses.replace(x, fwd_time=min(x.fwd_time, y.fwd_time), bwd_time=min(x.bwd_time, y.bwd_time))
           for x, y in zip(a.ops, b.ops)]
    units = [dataclasses.replace(u, fwd_time=sum(ops[i].fwd_time for i in u.ops),
                                 bwd_time=sum(ops[i].bwd_time for i in u.ops)) for u in a.units]
    return dataclasses.replace(a, ops=ops, units=units, step_time=min(a.step_time, b.step_time))


@pytest.mark.parametrize("spec, timed", [("llama-tiny", True), ("hf:qwen2", True), ("hf:gemma2", False)])
def test_measured_cpu_profiles_at_a_third_length(spec, timed):
    """Two measured lengths scaled to a third (beyond, below and between them) against its measured profile; hf:gemma2
    (math attention: its score gradients set the peak at 512 tokens) for the activations only, its step's time
    outside the ops (the allocator on its score tensors) swinging 10-50 ms between runs here."""
    p = {s: _cpu_profile(spec, s) for s in (128, 256, 512)}
    for target, refs in ((512, (128, 256)), (128, (256, 512)), (256, (128, 512))):
        check = seq_scaling_error(p[target], tuple(p[s] for s in refs))
        assert check.activation_error <= SEQ_SCALING_TOLERANCE, check.describe()
        assert not timed or check.time_error <= CPU_TIME_TOLERANCE, check.describe()
    one = seq_scaling_error(p[512], p[256])  # one reference: linear, score ops quadratic
    assert one.activation_error <= SEQ_SCALING_TOLERANCE, one.describe()


# ---------------------------------------------------------------- the whole peak, real CPU profiles
QWEN2_256 = ("hidden_size=256,intermediate_size=704,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2,"
             "vocab_size=8192,max_position_embeddings=1024")
PEAK_CASES = {
    "llama-small": ("llama-small", None, (64, 128, 512, 1024)),
    "hf:qwen2 width 256": ("hf:qwen2", QWEN2_256, (32, 64, 128, 512)),
    "llama-tiny": ("llama-tiny", None, (64, 128, 256, 1024)),
}
"""Models whose parameters' gradients set the peak at the shorter lengths (llama-small, 114 MiB of gradients, up to
128 tokens; the qwen2 up to 64) and one whose loss sets it at every length (llama-tiny)."""


@functools.lru_cache(maxsize=None)
def _memory_profile(spec: str, model_args: str | None, seq_len: int) -> profiler.Profile:
    """A measured CPU profile, for its bytes (one recorded step, times not used)."""
    bundle = build_model(spec, model_args=model_args, batch_size=2, seq_len=seq_len, device="cpu")
    return profiler.profile_step(bundle, warmup=0, repeat=0, record=1)


@pytest.mark.parametrize("case", sorted(PEAK_CASES))
def test_the_peak_scaled_from_a_short_profile(case):
    """Note: [workspace parts] the keep-all peak scaled from one profile at a quarter of the length or less within
    the tolerance of the measured one, from two within half of it, up and down; the gradients' share of a short
    profile's workspace stays constant (scaled with the length, it would overstate llama-small's peak at 1024
    tokens by 93 % from 64 and 12 % from 128, the qwen2's at 512 by 99 % from 32)."""
    spec, args, lengths = PEAK_CASES[case]
    p = {s: _memory_profile(spec, args, s) for s in lengths}
    short, *_, long = lengths
    checks = [seq_scaling_error(p[long], p[s]) for s in lengths if 4 * s <= long]
    checks += [seq_scaling_error(p[short], p[long])]
    for check in checks:
        assert check.peak_error <= SEQ_SCALING_TOLERANCE, check.describe()
        assert check.activation_error <= SEQ_SCALING_TOLERANCE, check.describe()
    for a, b in zip(lengths, lengths[1:]):
        for target in (s for s in lengths if s not in (a, b)):
            check = seq_scaling_error(p[target], (p[a], p[b]))
            assert check.peak_error <= SEQ_SCALING_TOLERANCE / 2, check.describe()


def test_a_short_profile_set_by_the_gradients_is_told_from_one_set_by_the_loss():
    """Note: [workspace parts] llama-small batch 2: at 128 tokens the workspace is the gradients' (more than twice
    the logits), at 512 the loss's (the logits' gradient and the log-softmax's: twice the logits); scaled, the
    peak at 1024 tokens is the measured one to the bytes of the loss."""
    short, long = (_memory_profile("llama-small", None, s) for s in (128, 512))
    logits = [max(op.output_bytes for op in p.ops[-3:]) for p in (short, long)]
    spaces = [p.peak_memory - (p.static.total - p.static.gradients) - p.saved_bytes for p in (short, long)]
    assert spaces[0] > 4 * logits[0] and 0 <= spaces[1] - 2 * logits[1] <= 64  # and the loss, a scalar
    measured = _memory_profile("llama-small", None, 1024)
    for ref in (short, long, (short, long)):
        assert abs(scale_to_seq_len(ref, 1024).peak_memory - measured.peak_memory) <= 64
