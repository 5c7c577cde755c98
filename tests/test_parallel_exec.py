"""Plans under real parallel layouts, 2 gloo ranks spawned once for the file (every collective and the spawn with a
timeout): DDP and FSDP2 (``optimize`` before and after wrapping), DTensor tensor and sequence parallel, and the
stage modules of ``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B with 2 chunks per rank). Loss and
every gradient (each rank's local shard) are ``torch.equal`` to the same layout without a plan."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _parallel_cases import PLANS, TIMEOUT, worker  # noqa: E402
from _spawn import spawn_ranks  # noqa: E402

GROUPS = ["ddp", "fsdp", "tp", "sp", "pp"]



@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("parallel")
    groups = os.environ.get("PARALLEL_EXEC_GROUPS", ",".join(GROUPS)).split(",")
    return spawn_ranks(worker, groups, out=out, timeout=TIMEOUT)


def _exact(ranks: list[dict], name: str) -> list[dict]:
    found = [r[name] for r in ranks if name in r]
    if not found:
        pytest.skip(f"{name}: its group was not run (PARALLEL_EXEC_GROUPS)")
    for rank, result in enumerate(found):
        assert result["error"] is None, f"rank {rank}: {result['error']}\n{result.get('trace')}"
        assert result["loss"], f"rank {rank}: loss differs"
        assert result["count"] > 0 and result["mismatched"] == [], f"rank {rank}: gradients differ: {result['mismatched']}"
    return found


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp", "sp"])
def test_data_or_tensor_parallel_plan_is_exact_in_either_order(ranks, layout, plan, order):
    found = _exact(ranks, f"{layout}-{plan}-{order}")
    for result in found:
        assert (result["offloaded"] > 0) == (plan == "swap"), result


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_pipeline_stage_modules_with_their_own_plans_are_exact(ranks, schedule):
    found = _exact(ranks, f"pp-{schedule}")
    for result in found:
        assert (result["offloaded"] > 0) == result["swaps"], result
        assert all("layers recomputed" in s for s in result["summaries"]), result["summaries"]


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_swap_of_dtensor_activations_moves_the_local_shard(ranks, layout, order):
    # Note: [DTensor swap]: the engine copies a DTensor's local shard, never its (empty) wrapper storage
    for result in _exact(ranks, f"{layout}-swap-{order}"):
        swapped = result["swapped"]
        sharded = [s for s in swapped if s[0] == "DTensor" and s[3] < s[4]]
        assert sharded, swapped  # column-wise outputs are swapped, each rank its half
        assert all(s[3] * 2 == s[4] for s in sharded), sharded
        assert result["offloaded"] == sum(dict((s[1], s[2]) for s in swapped).values())
