"""Swaps inside whole-model compiled graphs: the offload/reload graph ops and the pass that places them.

Note: [partitioner hook] (profiler/_partitions.py) and Note: [graph swap names] (adaptive_mem/runtime/_graph_plan.py), Note: [graph swap
placement] (adaptive_mem/runtime/_graph_swap.py): with a plan that swaps, ``torch.compile(model)`` of the whole
model stays compiled (0 graph breaks, one graph), both orders (``optimize`` before or after compiling), aot_eager
and inductor; every saved value of a swap unit gets one offload/reload pair, each reload after the backward node
of the layer its prefetch names; the loss and gradients equal the same compiled model without a plan; the
offloaded bytes leave device memory (measured by ``DeviceMemory``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from adaptive_mem import DeviceMemory, build_model, optimize, profile_step
from adaptive_mem.runtime import _graph_plan as graph_plans
from adaptive_mem.runtime._graph_ops import graph_swap_stats
from search import Plan

from _compile_common import compiled_step

LAYERS = 3
WHOLE = {"layers": {"action": "swap", "backward_prefetch": 1}}
OP = {"layers.1.feed_forward.w1.matmul": {"action": "swap", "backward_prefetch": 1},
      "layers.0.attention.flash_attention": {"action": "swap", "backward_prefetch": 0}}
MIXED = {"layers.0": {"action": "swap", "backward_prefetch": 2}, "layers.1": "recompute",
         "layers.2.feed_forward.w3.matmul": "swap"}


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


def _bundle():
    return build_model("llama-tiny", model_args={"num_layers": LAYERS}, batch_size=2, seq_len=32, seed=0)


def _reference(backend: str, batch) -> dict[str, torch.Tensor]:
    model = _bundle().model
    return compiled_step(model, torch.compile(model, backend=backend), batch)


def _planned(decisions: dict, backend: str, order: str):
    torch._dynamo.reset()
    model = _bundle().model
    if order == "after":
        handle = optimize(model, plan=_plan(decisions))
        call = torch.compile(model, backend=backend)
    else:
        call = torch.compile(model, backend=backend)
        handle = optimize(call, plan=_plan(decisions))
    return model, call, handle


def _graph_plan(handle) -> graph_plans.GraphPlan:
    plan = handle._executor.graph
    assert plan in graph_plans._active
    return plan


CASES = [(WHOLE, "aot_eager", "after"), (WHOLE, "aot_eager", "before"), (OP, "aot_eager", "after"),
         (OP, "aot_eager", "before"), (MIXED, "aot_eager", "after"), (WHOLE, "inductor", "before"),
         (MIXED, "inductor", "after")]


@pytest.mark.parametrize("decisions,backend,order", CASES)
def test_compiled_swaps_exact_and_whole(decisions, backend, order):
    batch = _bundle().batch(seed=0)
    torch._dynamo.reset()
    ref = _reference(backend, batch)
    counters.clear()
    model, call, handle = _planned(decisions, backend, order)
    try:
        with graph_swap_stats() as stats:
            got = compiled_step(model, call, batch)
        swaps = list(_graph_plan(handle).swaps)
        engine_bytes = handle.swap_stats.offloaded_bytes
    finally:
        handle.remove()
    assert engine_bytes == stats.offloaded_bytes  # the handle's figures count the graph ops too
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    plan = _plan(decisions)
    swapped_units = {s.key.partition("@")[0] for s in swaps}
    assert swapped_units and all(plan.decide(u).action.value == "swap" for u in swapped_units)
    assert stats.offloads == stats.reloads == len(swaps)
    assert stats.offloaded_bytes == sum(s.nbytes for s in swaps)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_every_saved_value_of_a_swapped_layer_is_offloaded_once():
    model, call, handle = _planned({"layers.1": {"action": "swap", "backward_prefetch": 1}}, "aot_eager", "after")
    try:
        compiled_step(model, call, _bundle().batch(seed=0))
        plan = _graph_plan(handle)
        swaps = list(plan.swaps)
    finally:
        handle.remove()
    assert swaps and all(s.key.startswith("layers.1.") for s in swaps)
    assert len({s.value for s in swaps}) == len(swaps)  # one pair per saved value
    fw = swaps[0].offload.graph
    saved = list(fw.find_nodes(op="output")[0].args[0])
    units = plan.unit_names(fw)
    left = [n for n in saved if isinstance(n, torch.fx.Node) and units.get(n, "").startswith("layers.1.")
            and n.target is not torch.ops.adaptive_mem.offload.default and n.op == "call_function"
            and not n.target._schema.returns[0].alias_info]
    assert left == []  # no saved value of layer 1 stays on the device


def _layer_of_backward(node: torch.fx.Node, model) -> int | None:
    ids = {id(m): i for i, layer in enumerate(model.layers) for m in layer.modules()}
    for key in node.meta.get("fwd_nn_module_stack") or {}:
        mid = key.partition("@")[0]
        if mid.isdigit() and int(mid) in ids:
            return ids[int(mid)]
    return None


def test_reloads_follow_their_prefetch_anchor():
    """Note: [graph swap placement]: layer i with prefetch 1 reloads right after layer i+1's backward begins (the
    first backward node when i+1 is past the last layer); prefetch 0 reloads just before the first use."""
    decisions = {"layers.0": {"action": "swap", "backward_prefetch": 1},
                 "layers.1": {"action": "swap", "backward_prefetch": 0}}
    model, call, handle = _planned(decisions, "aot_eager", "after")
    try:
        compiled_step(model, call, _bundle().batch(seed=0))
        swaps = list(_graph_plan(handle).swaps)
    finally:
        handle.remove()
    assert {s.key.split(".")[1] for s in swaps} == {"0", "1"}
    for s in swaps:
        after = s.reload.args[3]
        if s.key.startswith("layers.0."):
            prev = s.reload.prev
            while prev.target is torch.ops.adaptive_mem.reload.default:  # reloads after one anchor sit together
                prev = prev.prev
            assert len(after) == 1 and prev is after[0]
            assert _layer_of_backward(after[0], model) == 1
        else:
            assert after == []
            first_use = min(s.reload.users, key=lambda n: list(s.reload.graph.nodes).index(n))
            nxt = s.reload.next
            while nxt.target is torch.ops.adaptive_mem.reload.default:  # reloads before one use sit together
                nxt = nxt.next
            assert nxt is first_use


def _live_after_forward(call, model, batch) -> int:
    ids, labels = batch
    with DeviceMemory(track_existing=False) as mem:
        loss = torch.nn.functional.cross_entropy(call(ids).flatten(0, 1), labels.flatten())
        live = mem.live
        loss.backward()
    for p in model.parameters():
        p.grad = None
    return live


def test_offloaded_bytes_leave_device_memory():
    batch = _bundle().batch(seed=0)
    torch._dynamo.reset()
    plain = _bundle().model
    plain_call = torch.compile(plain, backend="aot_eager")
    compiled_step(plain, plain_call, batch)
    base = _live_after_forward(plain_call, plain, batch)
    model, call, handle = _planned(WHOLE, "aot_eager", "after")
    try:
        compiled_step(model, call, batch)
        with graph_swap_stats() as stats:
            live = _live_after_forward(call, model, batch)
    finally:
        handle.remove()
    assert stats.offloaded_bytes > 0
    assert base - live == pytest.approx(stats.offloaded_bytes, rel=0.05)


def test_removed_plan_compiles_without_swaps():
    model, call, handle = _planned(WHOLE, "aot_eager", "after")
    batch = _bundle().batch(seed=0)
    compiled_step(model, call, batch)
    plan = _graph_plan(handle)
    handle.remove()
    assert plan not in graph_plans._active
    with graph_swap_stats() as stats:
        got = compiled_step(model, call, batch)
    assert stats.offloads == 0
    ref = _reference("aot_eager", batch)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_plain_compiles_untouched_while_a_plan_is_installed():
    """Note: [partitioner hook]: another model's graphs pass through the pass untouched."""
    model, call, handle = _planned(WHOLE, "aot_eager", "after")
    other = copy.deepcopy(_bundle().model)
    try:
        with graph_swap_stats() as stats:
            compiled_step(other, torch.compile(other, backend="aot_eager"), _bundle().batch(seed=0))
    finally:
        handle.remove()
    assert stats.offloads == 0


def _swap_candidates() -> list[str]:
    """Units of llama-tiny's layers that save something (the profile's view), for random swap sets."""
    profile = profile_step(_bundle())
    return sorted(u.name for u in profile.units if u.layer is not None and u.saved_bytes > 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_swap_sets_stay_exact_and_swap_only_what_they_name(seed):
    """Property: any set of swapped units (random prefetch 0-2) compiles whole with 0 breaks, equals the plain
    compiled model, and offloads only values the named units produced."""
    import random

    rng = random.Random(seed)
    units = rng.sample(_swap_candidates(), 4)
    decisions = {u: {"action": "swap", "backward_prefetch": rng.randint(0, 2)} for u in units}
    batch = _bundle().batch(seed=0)
    torch._dynamo.reset()
    ref = _reference("aot_eager", batch)
    counters.clear()
    model, call, handle = _planned(decisions, "aot_eager", rng.choice(["before", "after"]))
    try:
        with graph_swap_stats() as stats:
            got = compiled_step(model, call, batch)
        keys = {s.key.partition("@")[0] for s in _graph_plan(handle).swaps}
    finally:
        handle.remove()
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    assert keys <= set(units), keys - set(units)
    assert stats.offloads == stats.reloads
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_graph_ops_match_their_fake_implementations_and_move_bytes_off_the_device():
    t = torch.randn(4, 6).t()  # dense, not contiguous: the host copy keeps its strides
    for op, args in ((torch.ops.adaptive_mem.offload.default, (t, "k")),
                     (torch.ops.adaptive_mem.reload.default, (t, "k", torch.device("cpu"), []))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    with DeviceMemory(track_existing=False) as mem:
        x = torch.randn(256, 256)
        before = mem.live
        host = torch.ops.adaptive_mem.offload.default(x, "k")
        del x
        assert mem.live == before - 256 * 256 * 4  # the host copy is not device memory
        back = torch.ops.adaptive_mem.reload.default(host, "k", torch.device("cpu"), [])
        assert mem.live == before
    assert torch.equal(back, host) and back.stride() == host.stride()


def test_blocks_compiled_on_their_own_swap_through_their_hooks_only():
    """``GraphPlan.owns``: a block's own graph (shared by dynamo between the blocks) is left to the hooks around it
    (Note: [swap around compiled blocks]), so nothing is offloaded twice."""
    bundle = _bundle()
    torch._dynamo.reset()
    handle = optimize(bundle.model, plan=_plan(WHOLE), compile="aot_eager")
    try:
        with graph_swap_stats() as stats:
            compiled_step(bundle.model, bundle.model, bundle.batch(seed=0))
        engine_bytes = handle.swap_stats.offloaded_bytes
    finally:
        handle.remove()
    assert stats.offloads == 0 and engine_bytes > 0


def test_a_second_plan_on_the_same_compiled_model_gets_a_graph_of_its_own():
    """``_two_way``'s code object is one per plan (``with_code``): after plan A is removed, plan B on the same
    compiled model is compiled anew with B's swaps, never served A's graph."""
    batch = _bundle().batch(seed=0)
    model, call, first = _planned({"layers.0": {"action": "swap", "backward_prefetch": 1}}, "aot_eager", "after")
    compiled_step(model, call, batch)
    first.remove()
    second = optimize(model, plan=_plan(OP))
    try:
        with graph_swap_stats() as stats:
            got = compiled_step(model, call, batch)
        swaps = list(_graph_plan(second).swaps)
    finally:
        second.remove()
    assert {s.key.partition("@")[0] for s in swaps} == {"layers.1.feed_forward.w1.matmul",
                                                      "layers.0.attention.flash_attention"}
    assert stats.offloads == len(swaps)
    ref = _reference("aot_eager", batch)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_an_observer_removing_itself_while_graphs_are_partitioned():
    """Note: [partitioner hook]: the graph plans' observer removes itself when every planned model is gone without
    ``remove()`` (garbage collected) while the partitioner calls it; the hook then restores PyTorch's function and
    still calls it for the graphs at hand, and the next compile runs PyTorch's own partitioning."""
    import torch._functorch._activation_offloading.activation_offloading as offloading
    from profiler.tracing import add_partition_observer, remove_partition_observer

    original = offloading.enable_activation_offloading
    seen = []

    def observer(fw, bw, num_fwd_outputs):
        seen.append(num_fwd_outputs)
        remove_partition_observer(observer)

    add_partition_observer(observer)
    x = torch.randn(8, 8, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(lambda t: (t.sin() * t).sum(), backend="aot_eager")(x).backward()
    assert len(seen) == 1
    assert offloading.enable_activation_offloading is original
    torch.compile(lambda t: (t.cos() * t).sum(), backend="aot_eager")(x).backward()
    assert len(seen) == 1
