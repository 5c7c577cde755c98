"""Hardware specs with kernel efficiencies, and every estimated op priced at the peak of the dtype it computes in
(Note: [op pricing], ``profiler/_cost.py``): an amp-bf16 matmul costs what a bf16 one does, an fp32 one the fp32
peak; every datasheet's efficiencies are fractions with a source; old profiles load; the CPU spec is measured."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

import adaptive_mem as am
import profiler
from profiler import HARDWARE, HardwareSpec, Profile, ProfileError
from profiler._cost import ATTENTION_OPS, op_seconds

_MM = torch.ops.aten.mm.default
_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _step(precision: str) -> Profile:
    bundle = am.build_model("llama-small", device="meta", dtype=profiler.PRECISIONS[precision].model_dtype)
    return profiler.profile_step(bundle, hardware="h100", precision=precision)


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
        assert seconds == pytest.approx(flops / (getattr(HARDWARE[name], peak) * HARDWARE[name].matmul_efficiency))


@pytest.mark.parametrize("name", list(HARDWARE))
def test_attention_is_priced_at_the_attention_efficiency(name):
    q = torch.empty(1, 8, 4096, 128, dtype=torch.bfloat16, device="meta")
    flops = 4 * 8 * 4096 * 4096 * 128
    spec = profiler.hardware_spec(name)
    assert _SDPA.overloadpacket in ATTENTION_OPS
    expected = flops / (HARDWARE[name].half_flops * HARDWARE[name].attention_efficiency)
    assert op_seconds(spec, _SDPA, (q, q, q), {}, q, flops) == pytest.approx(expected)
    # Note: [causal attention FLOPs] a causal kernel skips the blocks above the diagonal: half the counted FLOPs
    assert op_seconds(spec, _SDPA, (q, q, q, 0.0, True), {}, q, flops) == pytest.approx(expected / 2)
    assert op_seconds(spec, _SDPA, (q, q, q), {"is_causal": True}, q, flops) == pytest.approx(expected / 2)


@pytest.mark.parametrize("name", list(HARDWARE))
def test_a_memory_bound_op_moves_its_bytes_at_the_achieved_bandwidth(name):
    x = torch.empty(1 << 20, dtype=torch.bfloat16, device="meta")
    spec = profiler.hardware_spec(name)
    sheet = HARDWARE[name]
    expected = 3 * x.nbytes / (sheet.memory_bandwidth * sheet.memory_efficiency)
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
    for key in ("fp32_flops", "half_flops", "matmul_efficiency", "attention_efficiency", "memory_efficiency"):
        del data["hardware"][key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    spec = Profile.load(path).hardware
    assert (spec.fp32_flops, spec.half_flops, spec.matmul_efficiency, spec.memory_efficiency) == (0.0, 0.0, 1.0, 1.0)
    a = torch.empty(64, 64, dtype=torch.bfloat16, device="meta")
    assert op_seconds(spec, _MM, (a, a), {}, a, 10**12) == pytest.approx(10**12 / spec.peak_flops)


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
