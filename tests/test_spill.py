"""Host memory is finite: the host budget of the swap store, the memory-mapped disk tier beyond it, its
files (none left after a step, an exception or a crash), and what the simulator charges for it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import adaptive_mem
from adaptive_mem import DeviceMemory, optimize
from adaptive_mem.runtime._spill import (SPILL_PREFIX, HostBudget, TieredHostPool, as_host_budget,
                                         default_host_budget, remove_stale_spill_directories)
from profiler import Profile
from search import Plan, StepModel, simulate

from _adaptive_common import bundle

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(batch_size=2, seq_len=32)
SWAP_ALL = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {
    f"layers.{i}": {"action": "swap", "backward_prefetch": 1} for i in range(4)}})


def _grads(b, seed: int) -> dict[str, torch.Tensor]:
    b.loss(b.batch(seed=seed)).backward()
    out = {n: p.grad.clone() for n, p in b.model.named_parameters()}
    b.model.zero_grad(set_to_none=True)
    return out


def _spill_dir(root: Path) -> Path:
    return root / f"{SPILL_PREFIX}{os.getpid()}"


def test_tiny_host_budget_spills_to_disk_with_exact_gradients(tmp_path):
    b = bundle(**TINY)
    expected = [_grads(b, seed) for seed in range(2)]
    handle = optimize(b.model, plan=SWAP_ALL, host_memory_budget=64 << 10, host_dir=str(tmp_path))
    try:
        for seed in range(2):
            with DeviceMemory(track_existing=False):
                b.loss(b.batch(seed=seed)).backward()
            for name, p in b.model.named_parameters():
                assert torch.equal(p.grad, expected[seed][name]), f"step {seed}: {name} differs with spills"
            b.model.zero_grad(set_to_none=True)
            assert list(_spill_dir(tmp_path).iterdir()) == [], "a spill file outlived the step"
        stats = handle.swap_stats
        assert stats.spilled_bytes > 0
        assert stats.spilled_bytes < stats.offloaded_bytes  # the first 64 KiB stayed in RAM
        pool = handle._executor.engine.pool
        assert isinstance(pool, TieredHostPool) and pool.memory.allocated_bytes <= 64 << 10
    finally:
        handle.remove()
    assert not _spill_dir(tmp_path).exists(), "the spill directory outlived the pool"


def test_no_spill_file_after_an_exception(tmp_path):
    b = bundle(**TINY)
    handle = optimize(b.model, plan=SWAP_ALL, host_memory_budget=1, host_dir=str(tmp_path))

    def boom(module, args, output):
        raise RuntimeError("injected failure after three layers swapped")

    hook = b.model.get_submodule("layers.3").register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            b.loss(b.batch(seed=0)).backward()
        assert handle.swap_stats.spilled_bytes > 0
        assert list(_spill_dir(tmp_path).iterdir()) == []
    finally:
        hook.remove()
        handle.remove()
    assert not _spill_dir(tmp_path).exists()


def test_a_crashed_process_leaves_no_file_and_its_directory_goes_at_the_next_start(tmp_path):
    code = ("import os, torch\n"
            "from adaptive_mem.runtime._spill import HostBudget, TieredHostPool\n"
            f"pool = TieredHostPool(pin=False, budget=HostBudget(1), host_dir={str(tmp_path)!r})\n"
            "buf = pool.acquire(1 << 20)\n"
            "pool.write(buf, torch.ones(1 << 20, dtype=torch.uint8), non_blocking=False)\n"
            "print(os.getpid(), flush=True)\n"
            "os._exit(9)  # a crash: no atexit, no close\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 9, run.stderr
    stale = tmp_path / f"{SPILL_PREFIX}{int(run.stdout.split()[0])}"
    assert stale.is_dir() and list(stale.iterdir()) == []  # the file was unlinked when it was mapped
    (stale / "leftover.swap").write_bytes(b"x")  # as if it had crashed between creating and unlinking
    assert remove_stale_spill_directories(tmp_path) == [stale]
    assert not stale.exists()
    pool = TieredHostPool(pin=False, budget=HostBudget(1), host_dir=str(tmp_path))  # starts cleanly
    pool.close()


def test_host_budget_values_and_the_default_share_of_free_ram():
    assert as_host_budget(None) is None
    assert as_host_budget("2MiB").limit == 2 << 20
    assert as_host_budget(1000).limit == 1000
    with pytest.raises(ValueError, match="host_memory_budget"):
        as_host_budget(0)
    with pytest.raises(ValueError, match="--host-memory-budget"):
        as_host_budget("lots", flag="--host-memory-budget")
    import psutil

    free = psutil.virtual_memory().available
    assert 0.3 * free < default_host_budget() <= 0.55 * free  # half the free RAM (it moves a little)


def test_the_flag_is_on_every_parser_and_on_run():
    parser = adaptive_mem.add_memory_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--host-memory-budget", "8GiB"]).host_memory_budget == "8GiB"
    from adaptive_mem.cli._main import build_parser

    args = build_parser().parse_args(["run", "--model", "llama-tiny", "--host-memory-budget", "1GiB"])
    assert args.host_memory_budget == "1GiB"


def _profile() -> Profile:
    from profiler import profile_step

    return profile_step(bundle(**TINY), warmup=0, repeat=0)


def test_the_simulator_charges_spilled_swaps_at_disk_bandwidth():
    import dataclasses

    prof = _profile()
    fast = dataclasses.replace(prof, hardware=dataclasses.replace(prof.hardware, disk_bandwidth=1e12))
    slow = dataclasses.replace(prof, hardware=dataclasses.replace(prof.hardware, disk_bandwidth=1e6))
    unbounded = simulate(StepModel.build(slow), SWAP_ALL)
    assert unbounded.spilled_bytes == 0
    tight = simulate(StepModel.build(slow, host_budget=1), SWAP_ALL)
    assert tight.spilled_bytes == tight.swapped_bytes - 1 > 0  # one byte fits in RAM
    assert tight.step_time > unbounded.step_time + tight.spilled_bytes / 1e6 * 0.9
    assert simulate(StepModel.build(fast, host_budget=1), SWAP_ALL).step_time == pytest.approx(unbounded.step_time)
    data = slow.to_dict()
    del data["hardware"]["disk_bandwidth"]  # a profile written before the field existed
    assert Profile.from_dict(data).hardware.disk_bandwidth == 1e9


def test_disk_bandwidth_is_measured_where_spill_files_go(tmp_path):
    from profiler import measure_disk

    bandwidth = measure_disk(str(tmp_path), nbytes=4 << 20)
    assert bandwidth > 0
    assert list(tmp_path.iterdir()) == []  # the probe file is removed
