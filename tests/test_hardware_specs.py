"""Hardware specs with kernel efficiencies, and every estimated op priced at the peak of the dtype it computes in
(Note: [op pricing], ``profiler/_cost.py``): an amp-bf16 matmul costs what a bf16 one does, an fp32 one the fp32
peak; every datasheet's efficiencies are fractions with a source; old profiles load; the CPU spec is measured."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest
import torch

import adaptive_mem as am
import profiler
from profiler import HARDWARE, HardwareSpec, Profile, ProfileError
from profiler._cost import ATTENTION_OPS, flash_shape_factor, op_seconds
from profiler._target_kernels import is_cuda_hardware

_MM = torch.ops.aten.mm.default
_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _step(precision: str) -> Profile:
    """llama-small's step on an h100 priced by the roofline alone: its ~2000 small kernels' latency (Note: [op
    pricing]) would be most of its step and hide the dtypes' peaks these tests compare."""
    recipe = profiler.PRECISIONS[precision]
    bundle = am.build_model("llama-small", device="meta", dtype=recipe.model_dtype)
    spec = replace(profiler.hardware_spec("h100", dtype=getattr(torch, recipe.compute)), kernel_latency=0.0)
    return profiler.profile_step(bundle, hardware=spec, precision=precision)


def _seconds(profile: Profile, packets) -> float:
    return sum(o.fwd_time + o.bwd_time for o in profile.ops if o.op.split(".")[1] in packets)


@pytest.fixture(scope="module")
def steps() -> dict[str, Profile]:
    return {name: _step(name) for name in ("fp32", "bf16", "amp-bf16")}


def test_amp_matmuls_cost_what_bf16_matmuls_cost(steps):
    amp, bf16, fp32 = steps["amp-bf16"], steps["bf16"], steps["fp32"]
    kernels = ("mm", "_scaled_dot_product_flash_attention_for_cpu")
    assert _seconds(amp, kernels) == pytest.approx(_seconds(bf16, kernels), rel=1e-9)
    assert _seconds(fp32, kernels) > 10 * _seconds(amp, kernels)  # fp32 67 TFLOPS against bf16 989


def test_amp_step_is_near_bf16_and_far_below_fp32(steps):
    amp, bf16, fp32 = (steps[k].step_time for k in ("amp-bf16", "bf16", "fp32"))
    # llama-small is small (hidden 512): the amp step also pays its weight casts and its fp32 residual stream,
    # memory-bound ops a real autocast run pays too, so it stays within 40 % of pure bf16, not a few %
    assert bf16 < amp < 1.4 * bf16
    assert amp < fp32 / 3


@pytest.mark.parametrize("dtype, peak", [(torch.bfloat16, "half_flops"), (torch.float16, "half_flops"),
                                         (torch.float32, "fp32_flops")])
@pytest.mark.parametrize("name", list(HARDWARE))
def test_a_matmul_is_priced_at_its_dtype_peak_times_the_matmul_efficiency(name, dtype, peak):
    n = 4096  # compute-bound on every datasheet: 2 n^3 FLOPs over 3 n^2 elements
    a = torch.empty(n, n, dtype=dtype, device="meta")
    flops = 2 * n**3
    for spec_dtype in (torch.float32, torch.bfloat16):  # whatever dtype the spec was made for
        spec = profiler.hardware_spec(name, dtype=spec_dtype)
        seconds = op_seconds(spec, _MM, (a, a), {}, a, flops)
        sheet = HARDWARE[name]
        assert seconds == pytest.approx(flops / (getattr(sheet, peak) * sheet.matmul_efficiency) + sheet.kernel_latency)


@pytest.mark.parametrize("name", list(HARDWARE))
def test_attention_is_priced_at_the_attention_efficiency(name):
    q = torch.empty(1, 8, 4608, 128, dtype=torch.bfloat16, device="meta")  # the efficiency's own shape
    flops = 4 * 8 * 4608 * 4608 * 128
    spec, sheet = profiler.hardware_spec(name), HARDWARE[name]
    assert _SDPA.overloadpacket in ATTENTION_OPS
    expected = flops / (sheet.half_flops * sheet.attention_efficiency)
    assert op_seconds(spec, _SDPA, (q, q, q), {}, q, flops) == pytest.approx(expected + sheet.kernel_latency)
    # Note: [causal attention FLOPs] a causal kernel skips the blocks above the diagonal: half the counted FLOPs;
    # Note: [flash attention shape] on a CUDA target at FlashAttention-2's causal efficiency: at 4608 positions
    # (log2 0.17 of the way from 4k to 8k) 319 + 0.17 x (333 - 319) over 368 + 0.17 x (370 - 368) TFLOPS
    x = math.log2(4608 / 4096)
    causal = (319 + x * 14) / (368 + x * 2) if is_cuda_hardware(name) else 1.0
    for args, kwargs in (((q, q, q, 0.0, True), {}), ((q, q, q), {"is_causal": True})):
        seconds = op_seconds(spec, _SDPA, args, kwargs, q, flops)
        assert seconds == pytest.approx(expected / 2 / causal + sheet.kernel_latency)


@pytest.mark.parametrize("seq, causal, backward, tflops", [
    (512, False, False, 309), (2048, False, False, 362), (16384, False, False, 370), (65536, False, False, 370),
    (2048, True, False, 298), (8192, True, False, 333), (256, True, False, 191),
    (2048, False, True, 291), (8192, False, True, 318),
    (2048, True, True, 291 * 298 / 362), (8192, True, True, 318 * 333 / 370)])
def test_the_flash_shape_factor_is_the_published_curve_over_its_reference(seq, causal, backward, tflops):
    reference = 368 + math.log2(4608 / 4096) * (370 - 368)  # forward, non-causal, 4608 positions
    assert flash_shape_factor(seq, causal=causal, backward=backward) == pytest.approx(tflops / reference)
    # between two measured lengths: log-linear
    mid = flash_shape_factor(3072, causal=False, backward=False) * reference
    assert mid == pytest.approx(362 + math.log2(1.5) * (368 - 362))


def test_the_flash_backward_is_priced_by_its_query_length_on_cuda_targets_only():
    seq = 2048
    q = torch.empty(2, 8, seq, 128, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(2, 8, seq, dtype=torch.float32, device="meta")
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    flops = 2 * 4 * 2 * 8 * seq * seq * 128  # roughly 2.5x the forward: any FLOPs will do
    args = (q, q, q, q, q, lse, 0.0, True)
    for name in HARDWARE:
        spec, sheet = profiler.hardware_spec(name), HARDWARE[name]
        base = flops / 2 / (sheet.half_flops * sheet.attention_efficiency)
        factor = 291 * 298 / 362 / (368 + math.log2(4608 / 4096) * 2) if is_cuda_hardware(name) else 1.0
        seconds = op_seconds(spec, backward, args, {}, (q, q, q), flops)
        assert seconds == pytest.approx(base / factor + sheet.kernel_latency), name
    fp32 = torch.empty(2, 8, seq, 128, dtype=torch.float32, device="meta")  # not the flash kernel on CUDA
    spec, sheet = profiler.hardware_spec("h100"), HARDWARE["h100"]
    seconds = op_seconds(spec, backward, (fp32, fp32, fp32, fp32, fp32, lse, 0.0, False), {}, fp32, flops)
    assert seconds == pytest.approx(flops / (sheet.fp32_flops * sheet.attention_efficiency) + sheet.kernel_latency)


@pytest.mark.parametrize("name", list(HARDWARE))
def test_a_memory_bound_op_moves_its_bytes_at_the_achieved_bandwidth(name):
    x = torch.empty(1 << 20, dtype=torch.bfloat16, device="meta")
    spec = profiler.hardware_spec(name)
    sheet = HARDWARE[name]
    expected = 3 * x.nbytes / (sheet.memory_bandwidth * sheet.memory_efficiency) + sheet.kernel_latency
    assert op_seconds(spec, torch.ops.aten.add.Tensor, (x, x), {}, x, 0) == pytest.approx(expected)


@pytest.mark.parametrize("name", list(HARDWARE))
def test_every_datasheet_has_its_efficiencies_and_their_source(name):
    sheet = HARDWARE[name]
    for key in ("matmul_efficiency", "attention_efficiency", "memory_efficiency", "collective_efficiency"):
        assert 0 < getattr(sheet, key) <= 1, key
    assert sheet.efficiency_source.strip() and sheet.source.strip()
    assert sheet.internode_bandwidth > 0 and sheet.gpus_per_node == 8
    assert sheet.effective_interconnect == pytest.approx(sheet.interconnect_bandwidth * sheet.collective_efficiency)
    assert sheet.effective_interconnect < sheet.interconnect_bandwidth
    assert sheet.efficiency_source in profiler.hardware_spec(name).source


def test_published_node_links():
    assert {n: HARDWARE[n].internode_bandwidth for n in HARDWARE} == {
        "h100": 50e9, "h200": 50e9, "a100": 25e9, "ascend-910b": 25e9}  # 400 / 400 / 200 / 200 Gb/s per device


def test_a_profile_without_the_new_fields_loads_and_prices_as_before(tmp_path):
    bundle = am.build_model("llama-tiny", device="meta")
    data = profiler.profile_step(bundle, hardware="h100").to_dict()
    for key in ("fp32_flops", "half_flops", "matmul_efficiency", "attention_efficiency", "memory_efficiency",
                "kernel_latency"):
        del data["hardware"][key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    spec = Profile.load(path).hardware
    assert (spec.fp32_flops, spec.half_flops, spec.matmul_efficiency, spec.memory_efficiency) == (0.0, 0.0, 1.0, 1.0)
    assert spec.kernel_latency == 0.0
    a = torch.empty(64, 64, dtype=torch.bfloat16, device="meta")
    assert op_seconds(spec, _MM, (a, a), {}, a, 10**12) == pytest.approx(10**12 / spec.peak_flops)


@pytest.mark.parametrize("value", [-1e-6, 1.0, True, "7us"])
def test_a_kernel_latency_that_is_not_seconds_is_refused(value):
    data = asdict(profiler.hardware_spec("h100"))
    with pytest.raises(ProfileError, match=r"hardware\.kernel_latency=.*expected seconds in \[0, 1\)"):
        HardwareSpec(**{**data, "kernel_latency": value})


def test_a_kernel_latency_is_added_to_every_op_once():
    x = torch.empty(16, dtype=torch.bfloat16, device="meta")  # a tiny op: its latency is most of its time
    sheet = HARDWARE["h100"]
    seconds = op_seconds(profiler.hardware_spec("h100"), torch.ops.aten.add.Tensor, (x, x), {}, x, 0)
    assert seconds == pytest.approx(3 * x.nbytes / (sheet.memory_bandwidth * sheet.memory_efficiency) + 7.8e-6)
    # the fit of TileOPs#512's three points (H200, fp16 torch.maximum, read + write bytes): latency + bytes / bw
    points = [(1024 * n * 6, 1024 * n * 6 / bw) for n, bw in ((4096, 1.83e12), (10240, 2.79e12), (20480, 3.37e12))]
    slope = (points[2][1] - points[0][1]) / (points[2][0] - points[0][0])
    assert points[0][1] - slope * points[0][0] == pytest.approx(7.8e-6, rel=0.03)
    assert 1 / slope / 4.8e12 == pytest.approx(0.889, abs=0.01)
    assert profiler.hardware_spec("cpu").kernel_latency == 0.0


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_an_efficiency_outside_zero_one_is_refused(value):
    data = asdict(profiler.hardware_spec("h100"))
    with pytest.raises(ProfileError, match=r"hardware\.memory_efficiency=.*expected a number in \(0, 1\]"):
        HardwareSpec(**{**data, "memory_efficiency": value})


def test_the_cpu_spec_is_measured_at_efficiency_one():
    spec = profiler.hardware_spec("cpu")
    assert spec.source.startswith("measured on this cpu")
    assert (spec.matmul_efficiency, spec.attention_efficiency, spec.memory_efficiency) == (1.0, 1.0, 1.0)
    assert (spec.fp32_flops, spec.half_flops) == (0.0, 0.0)  # every op at the measured peak_flops, as before


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_hopper_compute_is_priced_at_the_sustained_clock(name):
    """Note: [sustained clocks]: the short microbenchmarks' fractions (GEMM 797.51, flash forward 329.483 of 989.4
    TFLOPS) times the sweep's sustained point over its best (719.72 / 797.51); memory-bound kernels unscaled."""
    sheet = HARDWARE[name]
    assert sheet.matmul_efficiency == pytest.approx(719.72 / 989.4)
    assert sheet.attention_efficiency == pytest.approx(329.483 / 989.4 * 719.72 / 797.51)
    assert sheet.memory_efficiency == 0.90


def test_the_a100_is_priced_at_its_own_sweeps_sustained_point():
    sheet = HARDWARE["a100"]
    assert sheet.matmul_efficiency == pytest.approx(211.72 / 312)  # 234.14 / 312 x 211.72 / 234.14
    assert sheet.attention_efficiency == pytest.approx(0.60 * 211.72 / 234.14)
