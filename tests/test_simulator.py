"""The simulator against hand-computed timelines of docs/plan-format.md's rules.

Numbers: 1 MiB copies in 1 ms (bandwidth 1000 MiB/s), times in ms, so every expectation
below can be checked with pencil and paper.
"""

from __future__ import annotations

import pytest

from search import Action, Decision, Plan, PlanError, StepModel, simulate
from _profiles import SyntheticUnit, synthetic_profile
from search.planning import split_stages

MiB = 1 << 20
ms = 1e-3
STATIC = 100 * MiB


def two_layers(*, gradients_mode: str = "per-step", **kw) -> StepModel:
    # chain: layers.0.a -> layers.0.b -> layers.1.a -> layers.1.b  (layers.0.b is the layer-0 output)
    layer = [SyntheticUnit("a", 4 * MiB, 1 * ms, 2 * ms), SyntheticUnit("b", 2 * MiB, 1 * ms, 2 * ms)]
    return StepModel.build(synthetic_profile(layers=[layer, layer], static=STATIC, bandwidth=1000 * MiB, **kw),
                           gradients=gradients_mode)


def plan(**decisions) -> Plan:
    return Plan(decisions={k.replace("__", "."): v if isinstance(v, Decision) else Decision(Action(v))
                           for k, v in decisions.items()})


def test_keep_everything():
    sim = simulate(two_layers(), Plan())
    assert sim.peak_bytes == STATIC + 12 * MiB
    assert sim.step_time == pytest.approx(12 * ms)
    assert sim.stall_time == 0 and sim.recompute_time == 0


def test_persistent_gradients_are_static_memory():
    # gradients="persistent": resident gradient buffers, as Megatron / MindSpeed keep them
    model = two_layers(gradients=6 * MiB, gradients_mode="persistent")
    assert sum(model.grads) == 0
    assert simulate(model, Plan()).peak_bytes == STATIC + 6 * MiB + 12 * MiB


def test_gradients_appear_during_backward():
    # the default: gradients set to None between steps; 6 MiB, 3 per layer (no FLOPs in the
    # profile: split evenly), allocated in each layer's backward, measured or estimated profile alike
    for measured in (True, False):
        assert two_layers(gradients=6 * MiB, measured=measured).grads == [0, 3 * MiB, 3 * MiB, 0]
    model = two_layers(gradients=6 * MiB, measured=True)
    assert model.grads[1:3] == [3 * MiB, 3 * MiB]
    keep = simulate(model, Plan(), record=True)
    assert keep.peak_bytes == STATIC + 12 * MiB + 3 * MiB  # end of layer 1's backward
    assert keep.timeline.memory[-1][1] == STATIC + 6 * MiB
    full = simulate(model, plan(layers__0="recompute", layers__1="recompute"))
    # end of layer 0's backward: its output (2) + replay (6) + all gradients (6)
    assert full.peak_bytes == STATIC + 2 * MiB + 6 * MiB + 6 * MiB


def test_boundary_workspace_counts_at_backward_start():
    sim = simulate(two_layers(boundary_bytes=5 * MiB), Plan())
    assert sim.peak_bytes == STATIC + 17 * MiB


def test_whole_layer_recompute_of_the_top_layer():
    # layer 1 holds nothing (its input is saved by layer 0 anyway); replay 2 ms, transient 6 MiB
    sim = simulate(two_layers(), plan(layers__1="recompute"))
    assert sim.peak_bytes == STATIC + 6 * MiB + 6 * MiB
    assert sim.step_time == pytest.approx(14 * ms)
    assert sim.recompute_time == pytest.approx(2 * ms)


def test_whole_layer_recompute_keeps_the_layer_output():
    # layer 0 keeps layers.0.b (read by layer 1): 2 MiB held, 6 MiB transient in its backward
    sim = simulate(two_layers(), plan(layers__0="recompute"))
    assert sim.peak_bytes == STATIC + 2 * MiB + 6 * MiB
    assert sim.step_time == pytest.approx(14 * ms)


def test_group_holds_only_the_first_layer_input_and_replays_all():
    sim = simulate(two_layers(), Plan(decisions={"layers.0": Decision(Action.RECOMPUTE),
                                                 "layers.1": Decision(Action.RECOMPUTE)}, groups=[[0, 1]]))
    # nothing held between forward and backward; replay both layers (4 ms) with 12 MiB transient
    assert sim.peak_bytes == STATIC + 12 * MiB
    assert sim.recompute_time == pytest.approx(4 * ms)


def test_swap_with_prefetch_one_layer():
    # layers.0.a: d2h 1..5 ms (forward ends at 4 ms); reload issued when layer 1's backward starts
    # (t = 4, +4 MiB while the copy out has not finished: 16 MiB), lands at 9 ms, needed at 10 ms
    sim = simulate(two_layers(), plan(layers__0__a=Decision(Action.SWAP, 1)), record=True)
    assert sim.peak_bytes == STATIC + 16 * MiB
    assert sim.step_time == pytest.approx(12 * ms)
    assert sim.stall_time == 0
    copies = [(iv.kind, round(iv.start / ms, 6), round(iv.end / ms, 6)) for iv in sim.timeline.intervals
              if iv.stream == "copy"]
    assert copies == [("d2h", 1, 5), ("h2d", 5, 9)]


def test_swap_that_also_takes_compute_is_charged_before_the_layer_backward():
    """Note: [swap compute]: at 500 MiB/s of compute share, swapping 4 MiB costs 8 ms of compute."""
    import dataclasses

    base = two_layers()
    hw = dataclasses.replace(base.hardware, swap_compute_bandwidth=500 * MiB)
    model = StepModel.build(dataclasses.replace(base.profile, hardware=hw))
    sim = simulate(model, plan(layers__0__a=Decision(Action.SWAP, 1)), record=True)
    assert sim.step_time == pytest.approx(12 * ms + 8 * ms)
    assert sim.peak_bytes == STATIC + 16 * MiB and sim.stall_time == 0
    charged = [(round(iv.start / ms, 6), round(iv.end / ms, 6)) for iv in sim.timeline.intervals
               if iv.stream == "compute" and iv.kind == "recompute"]
    assert charged == [(8, 16)]  # after layer 1's backward (4..8 ms), before layer 0's
    assert simulate(model, plan()).step_time == pytest.approx(12 * ms)  # nothing swapped, nothing charged


def test_selective_checkpoint_dispatch_is_charged_per_op_of_the_layer():
    """Note: [swap compute]: 1 ms per op under the policy; layer 0 has two one-op units."""
    import dataclasses

    base = two_layers()
    hw = dataclasses.replace(base.hardware, sac_op_overhead=1 * ms)
    model = StepModel.build(dataclasses.replace(base.profile, hardware=hw))
    op_level = plan(layers__0__a="recompute")
    uncharged = simulate(base, op_level).step_time
    assert simulate(model, op_level).step_time == pytest.approx(uncharged + 2 * ms)
    whole = plan(layers__0="recompute")  # a whole-layer checkpoint runs no policy: nothing charged
    assert simulate(model, whole).step_time == pytest.approx(simulate(base, whole).step_time)


def test_swap_on_demand_stalls_for_the_whole_copy():
    # d = 0: the reload starts when layers.0.a's backward needs it (t = 10) and takes 4 ms
    sim = simulate(two_layers(), plan(layers__0__a=Decision(Action.SWAP, 0)))
    assert sim.peak_bytes == STATIC + 12 * MiB
    assert sim.stall_time == pytest.approx(4 * ms)
    assert sim.step_time == pytest.approx(16 * ms)


def test_prefetch_beyond_the_layers_left_starts_at_backward_start():
    far = simulate(two_layers(), plan(layers__0__a=Decision(Action.SWAP, 7)))
    assert far.peak_bytes == STATIC + 16 * MiB and far.stall_time == 0


def _sac_layer(**flags):
    from dataclasses import replace
    layer = [SyntheticUnit("norm", 4 * MiB, 1 * ms, 2 * ms),
             SyntheticUnit("w.matmul", 0, 2 * ms, 2 * ms, output_bytes=3 * MiB),
             SyntheticUnit("silu", 2 * MiB, 1 * ms, 2 * ms)]
    prof = synthetic_profile(layers=[layer], static=0, bandwidth=1000 * MiB)
    prof.ops[1] = replace(prof.ops[1], **flags)
    return StepModel.build(prof)


def test_sac_policy_holds_saved_bytes_minus_recomputed_and_replays_unsaved_ops():
    # Note: [SAC policy] nothing is cached beyond what autograd saves; the matmul (output not saved) is
    # PREFER_RECOMPUTE, so the replay runs norm (recomputed) and the matmul: 1 + 2 ms
    model = _sac_layer()
    assert simulate(model, Plan()).peak_bytes == 6 * MiB
    sac = simulate(model, plan(layers__0__norm="recompute"))
    assert sac.peak_bytes == (6 - 4 + 4) * MiB  # held 2, transient 4 in the backward
    assert sac.recompute_time == pytest.approx(3 * ms)


def test_sac_replay_stops_early():
    # the matmul saves its input (a parameter/input saved before it runs): the replay stops before it
    model = _sac_layer(saves_inputs=True)
    sac = simulate(model, plan(layers__0__norm="recompute"))
    assert sac.recompute_time == pytest.approx(1 * ms)
    # ... and a later op that saves its own output extends the replay through that op
    from dataclasses import replace
    model.profile.ops[2] = replace(model.profile.ops[2], saves_outputs=True)
    again = simulate(StepModel.build(model.profile), plan(layers__0__norm="recompute"))
    assert again.recompute_time == pytest.approx(3 * ms)  # norm + matmul (silu is cached: MUST_SAVE)


def test_coupling_swap_dropped_when_a_recomputed_unit_consumes_it():
    model = two_layers()
    coupled = simulate(model, plan(layers__0__a=Decision(Action.SWAP, 1), layers__0__b="recompute"))
    recompute_only = simulate(model, plan(layers__0__b="recompute"))
    assert coupled == recompute_only


def test_longest_target_wins():
    model = two_layers()
    a = simulate(model, plan(layers__0="recompute", layers__0__a=Decision(Action.SWAP, 1)))
    # layers.0.a swap is dropped (its consumer layers.0.b is recomputed by the layer target): SAC of b only
    b = simulate(model, plan(layers__0__b="recompute"))
    assert a == b


def test_unknown_target_and_recompute_outside_layers_are_refused():
    with pytest.raises(PlanError, match="no such unit"):
        simulate(two_layers(), plan(layers__9="recompute"))
    from dataclasses import replace
    prof = synthetic_profile(layers=[[SyntheticUnit("a", MiB, ms, ms)]], static=0)
    # synthetic units all sit inside layers; move the only one outside
    prof = replace(prof, units=[replace(prof.units[0], layer=None, name="head.a", local_name="head.a")],
                   ops=[replace(prof.ops[0], layer=None, unit="head.a")])
    with pytest.raises(PlanError, match="outside the repeated layers"):
        simulate(prof, plan(head__a="recompute"))


def test_pipeline_stage_holds_its_micro_batches():
    layer = [SyntheticUnit("a", 4 * MiB, 1 * ms, 2 * ms), SyntheticUnit("b", 2 * MiB, 1 * ms, 2 * ms)]
    prof = synthetic_profile(layers=[layer] * 4, static=48 * MiB, bandwidth=1000 * MiB)
    stages = split_stages(prof, stages=2, micro_batches=4)
    assert [s.in_flight for s in stages] == [2, 1]
    assert [list(s.layers) for s in stages] == [[0, 1], [2, 3]]
    first = simulate(stages[0].model, Plan(), in_flight=stages[0].in_flight)
    last = simulate(stages[1].model, Plan(), in_flight=stages[1].in_flight)
    # 24 MiB static each; stage 0 holds two micro-batches of its 12 MiB
    assert first.peak_bytes == 24 * MiB + 2 * 12 * MiB
    assert last.peak_bytes == 24 * MiB + 12 * MiB
    # the last unit of stage 0 feeds stage 1: it stays pinned under whole-layer recompute
    rec = simulate(stages[0].model, plan(layers__1="recompute"), in_flight=1)
    assert rec.peak_bytes == 24 * MiB + 6 * MiB + 2 * MiB + 6 * MiB


def test_timeline_memory_curve_ends_at_static():
    sim = simulate(two_layers(), plan(layers__1="recompute", layers__0__a=Decision(Action.SWAP, 1)), record=True)
    assert sim.timeline.memory[-1][1] == STATIC
    assert max(v for _, v in sim.timeline.memory) == sim.peak_bytes
