"""Communication recompute under tensor parallel: plans and configs act on the collectives a DTensor
layout issues in a layer (Note: [collective units]), and Megatron's --distribute-saved-activations shards the saved
layer input over the tensor-parallel group (Note: [TP group]). 2 gloo ranks spawned once for the file (every
collective and the spawn with a timeout); loss and every gradient (local shards) ``torch.equal`` to the same layout
without a plan; the bytes held after forward are measured exactly (Note: [exact held bytes]). On one device
the keys warn that there is no collective to act on."""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _parallel_comm import KEEP_COMMS, TIMEOUT, _Held, worker  # noqa: E402
from _spawn import free_port, spawn_ranks  # noqa: E402

from adaptive_mem import build_model, optimize  # noqa: E402
from search import Plan  # noqa: E402

BYTES = 2 * 16 * 64 * 4  # one replicated hidden-state tensor of llama-tiny here: batch 2, seq 16, hidden 64, fp32


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("comm")
    return spawn_ranks(worker, out=out, timeout=TIMEOUT)


def _exact(ranks: list[dict], name: str) -> list[dict]:
    found = [r[name] for r in ranks]
    for rank, result in enumerate(found):
        assert result["error"] is None, f"rank {rank}: {result['error']}\n{result.get('trace')}"
        assert result["loss"], f"rank {rank}: loss differs"
        assert result["count"] > 0 and result["mismatched"] == [], f"rank {rank}: gradients differ: {result['mismatched']}"
    return found


def test_whole_layer_recompute_issues_the_row_parallel_all_reduce_again(ranks):
    for result in _exact(ranks, "whole"):
        # the replay stops before w2's matmul (PyTorch's early stop), so only attention.wo's all-reduce runs again
        assert result["backward_all_reduce"] == result["ref"]["backward_all_reduce"] + 2, result
        assert result["warnings"] == [], result["warnings"]


@pytest.mark.parametrize("case", ["keep-comms", "keep-comms-before", "mp-comm-false"])
def test_kept_collectives_are_not_issued_again_and_their_outputs_are_held(ranks, case):
    # Note: [collective units]: a plan keeping layers.N.<path>.all_reduce (or mp_comm_recompute: False) caches them
    whole = [r["whole"] for r in ranks]
    for rank, result in enumerate(_exact(ranks, case)):
        assert result["backward_all_reduce"] == result["ref"]["backward_all_reduce"], result
        assert result["held"] - whole[rank]["held"] == len(KEEP_COMMS) * BYTES, (result["held"], whole[rank]["held"])
        assert result["warnings"] == [], result["warnings"]
        if case == "mp-comm-false":
            assert {t for t, a in result["decisions"].items() if a == "keep"} == set(KEEP_COMMS)


def test_mp_comm_recompute_true_recomputes_the_collectives_with_the_layer(ranks):
    whole = [r["whole"] for r in ranks]
    for rank, result in enumerate(_exact(ranks, "mp-comm-true")):
        assert result["decisions"] == {"layers.0": "recompute", "layers.1": "recompute"}
        assert result["backward_all_reduce"] == whole[rank]["backward_all_reduce"]
        assert result["held"] == whole[rank]["held"]


def test_distribute_saved_activations_halves_the_saved_layer_input_over_the_tp_group(ranks):
    # Note: [TP group]: each TP rank holds half of the (replicated) layer input between forward and backward
    whole = [r["whole"] for r in ranks]
    for rank, result in enumerate(_exact(ranks, "distribute")):
        assert result["full_input_bytes"] == [BYTES, BYTES]
        assert result["input_bytes"] == [BYTES // 2, BYTES // 2]
        assert whole[rank]["held"] - result["held"] == 2 * (BYTES // 2)
        assert result["warnings"] == []


def test_distribute_saved_activations_under_sequence_parallel_keeps_the_input_and_warns(ranks):
    for result in _exact(ranks, "sp-distribute"):
        assert result["input_bytes"] == result["full_input_bytes"] == [BYTES // 2, BYTES // 2]
        assert len(result["warnings"]) == 1 and "sequence parallel" in result["warnings"][0], result["warnings"]


def _on_a_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_held_bytes_count_the_forward_thread_and_tally_what_other_threads_free():
    # Note: [exact held bytes]: another thread's allocation never counts; a free there is tallied apart
    held = _Held()  # needs the C++ accounting, as tests/test_cpu_allocator.py asks of every run
    theirs: list[torch.Tensor] = []
    with held.mem:
        mine = [torch.empty(1024), torch.empty(512)]
        _on_a_thread(lambda: theirs.append(torch.empty(256)))
    assert held.mem.live == 6144 and held.session.foreign_freed() == 0
    theirs.clear()
    del mine[1]
    assert held.mem.live == 4096 and held.session.foreign_freed() == 0
    _on_a_thread(mine.clear)  # the last reference dropped on another thread: freed there
    assert held.mem.live == 0 and held.session.foreign_freed() == 4096


# ------------------------------------------------------------------------------------------ one device
def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("key, value", [("mp_comm_recompute", False), ("mp_comm_recompute", True),
                                        ("select_comm_recompute", True)])
def test_comm_keys_on_one_device_warn_once_that_there_is_no_collective(caplog, key, value):
    bundle = build_model("llama-tiny", seed=0, model_args={"num_layers": 2}, batch_size=2, seq_len=16)
    with caplog.at_level(logging.INFO, logger="adaptive_mem"):
        handle = optimize(bundle.model, config={"recompute_config": {"recompute": True, key: value}})
    found = [w for w in _warnings(caplog) if key in w]
    assert len(found) == 1 and "no collective to act on" in found[0], _warnings(caplog)
    assert all(a.action.value == "recompute" for a in handle.plan.decisions.values())
    handle.remove()


def test_a_plan_keeping_a_collective_on_one_device_warns_and_stays_exact(caplog):
    def bundle():
        return build_model("llama-tiny", seed=0, model_args={"num_layers": 2}, batch_size=2, seq_len=16)

    ref = bundle()
    ids, labels = ref.batch(seed=0)
    ref.model(ids).logsumexp(-1).sum().backward()
    got = bundle()
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1,
                           "decisions": {"layers": "recompute", "layers.0.attention.wo.all_reduce": "keep"}})
    with caplog.at_level(logging.WARNING, logger="adaptive_mem"), optimize(got.model, plan=plan):
        got.model(ids).logsumexp(-1).sum().backward()
    found = [w for w in _warnings(caplog) if "all_reduce" in w]
    assert len(found) == 1 and "no such collective" in found[0], _warnings(caplog)
    for (n, p), q in zip(got.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_distribute_saved_activations_without_tensor_parallel_warns_and_keeps_the_input(caplog):
    import torch.distributed as dist

    from adaptive_mem.runtime import _distributed_checkpoint as dc

    def bundle():
        return build_model("llama-tiny", seed=0, model_args={"num_layers": 2}, batch_size=2, seq_len=16)

    ref = bundle()
    ids, _ = ref.batch(seed=0)
    ref.model(ids).logsumexp(-1).sum().backward()
    got = bundle()
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {"layers": "recompute"},
                           "distribute_saved_activations": True})
    dc._warned.clear()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="adaptive_mem"), optimize(got.model, plan=plan):
            for _ in range(2):
                got.model.zero_grad(set_to_none=True)
                got.model(ids).logsumexp(-1).sum().backward()
    finally:
        dist.destroy_process_group()
    found = [w for w in _warnings(caplog) if "distribute_saved_activations" in w]
    assert len(found) == 1 and "no tensor-parallel" in found[0], _warnings(caplog)
    for (n, p), q in zip(got.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p.grad, q.grad), n
