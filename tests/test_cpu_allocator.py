"""The counting C++ CPU allocator behind DeviceMemory: it is what runs here, it agrees with independent
trackers, and its edge cases (pre-existing tensors, other threads, host marks, the GIL, errors raised by
a rescue, the fallback's warning)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from adaptive_mem import DeviceMemory
from adaptive_mem.models import PRESETS, LlamaModel
from adaptive_mem.runtime._accounting import accounting_backend, host_allocations, mark_host
from adaptive_mem.runtime._host_marks import ENV, extension

ROOT = Path(__file__).resolve().parents[1]
forced_dispatch = os.environ.get(ENV, "").lower() == "dispatch"
needs_cpp = pytest.mark.skipif(forced_dispatch, reason=f"{ENV}=dispatch forces the fallback")


@needs_cpp
def test_the_cpp_hook_is_the_active_backend():
    # CI fails here if the extension stopped building and DeviceMemory silently ran on the fallback.
    assert accounting_backend() == "cpp"
    with DeviceMemory(track_existing=False) as mem:
        assert mem.backend == "cpp"
        assert extension().installed()
        t = torch.empty(1000, dtype=torch.uint8)
        assert mem.live == 1000
        del t


def _llama_step(model, opt, ids, labels):
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@needs_cpp
def test_cpp_agrees_exactly_with_the_dispatch_mode_and_memtracker_on_a_training_step():
    torch.manual_seed(0)
    cfg = PRESETS["llama-tiny"].config
    model = LlamaModel(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    labels = torch.randint(0, cfg.vocab_size, (2, 32))
    _llama_step(model, opt, ids, labels)
    cpp = DeviceMemory(track_existing=False, backend="cpp")
    dispatch = DeviceMemory(track_existing=False, backend="dispatch")
    for mem in (cpp, dispatch):
        mem.track(model, opt, ids, labels)
    tracker = MemTracker()
    tracker.track_external(model, opt, ids, labels)
    with tracker, cpp, dispatch:
        _llama_step(model, opt, ids, labels)
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert cpp.peak == dispatch.peak == theirs
    assert cpp.live == dispatch.live > 0


@pytest.mark.parametrize("backend", ["cpp", "dispatch"])
def test_tensors_from_before_entry_count_only_when_tracked(backend):
    if backend == "cpp" and accounting_backend() != "cpp":
        pytest.skip("no C++ back-end here")
    untracked = torch.empty(3000, dtype=torch.uint8)
    tracked = torch.empty(5000, dtype=torch.uint8)
    with DeviceMemory(track_existing=False, backend=backend) as mem:
        mem.track(tracked)
        assert mem.live == 5000
        del untracked  # never counted: its free changes nothing
        assert mem.live == 5000
        del tracked
        assert mem.live == 0
        inside = torch.empty(700, dtype=torch.uint8)
        assert mem.live == 700
    del inside  # freed after exit: still seen (the storage was counted)
    assert mem.live == 0
    assert mem.peak == 5000


@needs_cpp
def test_allocations_of_other_threads_count_and_can_be_rescued():
    held = [torch.empty(4000, dtype=torch.uint8)]
    calls = []

    def hook(needed: int) -> bool:
        calls.append((needed, threading.current_thread().name))
        held.clear()
        return True

    out = {}
    with DeviceMemory(track_existing=False, cap=6000, on_oom=hook) as mem:
        mem.track(held)
        worker = threading.Thread(target=lambda: out.setdefault("t", torch.empty(3000, dtype=torch.uint8)),
                                  name="worker")
        worker.start()
        worker.join()
        assert mem.live == 3000
    assert calls == [(1000, "worker")]


@needs_cpp
def test_host_mark_is_kept_until_the_free():
    with DeviceMemory(track_existing=False) as mem:
        with host_allocations():
            host = torch.empty(10_000, dtype=torch.uint8)
        assert mem.live == 0
    with DeviceMemory(track_existing=True) as scan:
        before = scan.live
        del host
        assert scan.live == before  # never counted, so its free subtracts nothing
    plain = mark_host(torch.empty(2_000, dtype=torch.uint8))
    with DeviceMemory(track_existing=False) as mem:
        mem.track(plain)
        assert mem.live == 0


@needs_cpp
def test_rescue_during_backward_takes_the_gil_and_its_error_propagates():
    class Refused(torch.OutOfMemoryError):
        pass

    x = torch.randn(64, 64, requires_grad=True)
    calls = []

    def refuse(needed: int) -> bool:
        calls.append(needed)
        raise Refused(f"nothing to swap for {needed} bytes")

    with DeviceMemory(track_existing=False) as mem:
        loss = (x @ x).sum()
        mem.cap = mem.live + 100  # backward's first buffer does not fit
        mem.add_oom_hook(refuse)
        with pytest.raises(Refused, match="nothing to swap"):
            loss.backward()
    assert calls and calls[0] > 0


@needs_cpp
def test_no_rescue_inside_a_rescue():
    depth = []

    def hook(needed: int) -> bool:
        depth.append(needed)
        torch.empty(10_000, dtype=torch.uint8)  # over the cap again: refused, not rescued recursively
        return False

    with DeviceMemory(track_existing=False, cap=5000, on_oom=hook) as mem:
        with pytest.raises(torch.OutOfMemoryError, match="needs 10000 bytes"):
            torch.empty(6000, dtype=torch.uint8)
        assert mem.live == 0
    assert depth == [1000]


@needs_cpp
def test_nested_sessions_both_count_and_resize_of_an_adopted_storage_goes_through_the_hook():
    old = torch.empty(100, dtype=torch.uint8)
    with DeviceMemory(track_existing=False) as outer:
        outer.track(old)
        with DeviceMemory(track_existing=False) as inner:
            a = torch.empty(1000, dtype=torch.uint8)
            old.resize_(400)
            assert inner.live == 1400
            assert outer.live == 1400
            del a
        assert outer.live == 400


@pytest.mark.parametrize("backend", ["cpp", "dispatch"])
def test_storages_of_other_allocators_are_tracked_too(backend):
    if backend == "cpp" and accounting_backend() != "cpp":
        pytest.skip("no C++ back-end here")
    array = np.zeros(2500, dtype=np.uint8)
    shared = torch.from_numpy(array)
    with DeviceMemory(track_existing=False, backend=backend) as mem:
        mem.track(shared)
        assert mem.live == 2500
        del shared
        assert mem.live == 0


def test_a_failed_build_warns_once_and_falls_back(tmp_path):
    code = ("import logging; logging.basicConfig(); import adaptive_mem\n"
            "a = adaptive_mem.DeviceMemory(); b = adaptive_mem.DeviceMemory()\n"
            "print(a.backend, b.backend)\n")
    env = dict(os.environ, CXX="/bin/false", TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop(ENV, None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["dispatch", "dispatch"]
    assert run.stderr.count("falls back to dispatch-mode accounting") == 1
    env[ENV] = "cpp"  # strict: the failed build is an error
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "building the C++ CPU allocator" in run.stderr


@needs_cpp
def test_a_forked_child_counts_nothing_of_the_parents_sessions():
    calls = []
    with DeviceMemory(track_existing=False, cap=10_000, on_oom=lambda n: calls.append(n) or False) as mem:
        pid = os.fork()
        if pid == 0:  # the child (a DataLoader worker, say): neither the cap nor the hooks are its own
            try:
                t = torch.empty(1 << 20, dtype=torch.uint8)
                code = 0 if (t.numel() and not calls) else 3
            except BaseException:
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert mem.live == 0 and calls == []
