"""The CUDA caching allocator's reserve: hand-made allocation sequences, and reserved >= allocated in simulations."""

from __future__ import annotations

import pytest

import profiler
from adaptive_mem import build_model
from search import Action, Decision, Plan, simulate
from search._reserve import ReserveError, replay_reserved, reserve_model, round_size, segment_size

KIB, MIB = 1 << 10, 1 << 20


def test_sizes_round_to_512_bytes_and_segments_by_pool():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(MIB) == 2 * MIB  # small pool
    assert segment_size(MIB + 512) == segment_size(10 * MIB - 512) == 20 * MIB  # large pool, packed
    assert segment_size(10 * MIB) == 10 * MIB and segment_size(11 * MIB + 1) == 12 * MIB  # rounded to 2 MiB


def test_small_allocations_share_one_two_mib_segment():
    peak, reserved = replay_reserved([("malloc", 100)] * 4 + [("malloc", 700 * KIB)])
    assert peak == 4 * 512 + 700 * KIB
    assert reserved == 2 * MIB


def test_a_freed_block_is_reused_and_merged_with_its_neighbours():
    seq = [("malloc", 4 * MIB), ("malloc", 4 * MIB), ("free", 0), ("free", 1), ("malloc", 8 * MIB)]
    assert replay_reserved(seq) == (8 * MIB, 20 * MIB)


def test_a_request_no_cached_block_fits_maps_a_new_segment():
    seq = [("malloc", 30 * MIB), ("free", 0), ("malloc", 40 * MIB)]
    peak, reserved = replay_reserved(seq)
    assert (peak, reserved) == (40 * MIB, 70 * MIB)
    assert reserve_model(peak, 40 * MIB) >= reserved


def test_small_and_large_pools_are_apart():
    seq = [("malloc", 512 * KIB), ("free", 0), ("malloc", 2 * MIB)]
    assert replay_reserved(seq) == (2 * MIB, 2 * MIB + 20 * MIB)


@pytest.mark.parametrize("bad", [[("malloc", 0)], [("free", 3)], [("realloc", 1)]])
def test_a_malformed_sequence_is_refused(bad):
    with pytest.raises(ReserveError, match="expected"):
        replay_reserved(bad)


def test_reserve_model_is_the_rounded_peak_and_one_segment():
    assert reserve_model(3 * MIB, 30 * MIB) == 4 * MIB + 30 * MIB + 2 * MIB
    assert reserve_model(3 * MIB, 30 * MIB, expandable_segments=True) == 4 * MIB + 2 * MIB
    with pytest.raises(ReserveError, match="expected bytes"):
        reserve_model(-1, 0)


@pytest.fixture(scope="module")
def fake_profile():
    return profiler.profile_step(build_model("llama-tiny", device="meta", dtype="bfloat16"), hardware="h100")


@pytest.mark.parametrize("plan", [{}, {"layers": Decision(Action.RECOMPUTE)}])
def test_reserved_is_at_least_allocated_on_a_cuda_target(fake_profile, plan):
    sim = simulate(fake_profile, Plan(decisions=plan) if plan else Plan())
    assert sim.peak_reserved_bytes >= sim.peak_bytes + 2 * MIB


def test_cuda_hardware_names():
    assert [profiler.is_cuda_hardware(n) for n in ("h100", "H200", "a100", "cuda")] == [True] * 4
    assert [profiler.is_cuda_hardware(n) for n in ("cpu", "ascend-910b", "npu", None)] == [False] * 4


def test_reserved_is_allocated_off_cuda(fake_profile):
    sim = simulate(fake_profile, Plan(), hardware=profiler.hardware_spec("ascend-910b"))
    assert sim.peak_reserved_bytes == sim.peak_bytes


@pytest.mark.parametrize("hardware, shown", [("h100", True), ("ascend-910b", False)])
def test_search_and_simulate_print_the_reserve_on_a_cuda_target(tmp_path, capsys, hardware, shown):
    from adaptive_mem.cli._main import main

    prof, plan = tmp_path / "tiny.json", tmp_path / "plan.yaml"
    assert main(["profile", "--model", "llama-tiny", "--device", "meta", "--hardware", hardware, "-o", str(prof)]) == 0
    capsys.readouterr()
    assert main(["search", str(prof), "--activation-budget", "0.5", "-o", str(plan)]) == 0
    searched = capsys.readouterr().out
    assert main(["simulate", str(prof), str(plan)]) == 0
    simulated = capsys.readouterr().out
    assert ("allocated," in searched and " reserved (" in searched) is shown
    assert ("peak reserved" in simulated) is shown
    if shown:
        allocated = int(simulated.split("peak device memory")[1].split("(")[1].split(" bytes")[0])
        reserved = int(simulated.split("peak reserved")[1].split("(")[1].split(" bytes")[0])
        assert reserved >= allocated
