"""Swapping every saved tensor can peak above keeping them all: on a small model whose copies out outlast the
forward, the prefetched reloads of the last layers are allocated while the tensors they reload still wait for
their copy out (Note: [reload behind queued copies out]); on a fast link the same plan peaks below keep-all."""

from __future__ import annotations

import pytest

from _profiles import SyntheticUnit, synthetic_profile
from search import Action, StepModel
from search.planning import Assignment, keep_all, simulate_assignment

MiB = 1 << 20
_LAYER = [SyntheticUnit("norm", MiB, 1e-6, 2e-6), SyntheticUnit("mlp.matmul", 2 * MiB, 1e-6, 2e-6),
          SyntheticUnit("out", MiB, 1e-6, 2e-6)]


def _swap_all(bandwidth: float):
    """(model, keep-all simulation, swap-all simulation): every saved, unpinned unit of a layer swapped, prefetch 1
    (the published-runs benchmark's offload-all arm)."""
    model = StepModel.build(synthetic_profile(layers=[_LAYER] * 3, static=10 * MiB, bandwidth=bandwidth))
    swap = {u.index for u in model.units if model.layer_of(u.position) is not None and u.saved and not u.pinned}
    asg = Assignment(tuple(Action.SWAP if u.index in swap else Action.KEEP for u in model.units),
                     tuple([1] * len(model.units)))
    return model, simulate_assignment(model, keep_all(model)), simulate_assignment(model, asg, record=True)


def _layer_swapped(model: StepModel, layer: int) -> int:
    return sum(u.saved for u in model.units if model.layer_of(u.position) == layer and not u.pinned)


def test_copies_out_outlasting_the_forward_peak_above_keep_all():
    model, keep, swap = _swap_all(bandwidth=1e9)  # 1 MiB takes a millisecond, the forward 9 microseconds
    copies = [i for i in swap.timeline.intervals if i.kind == "d2h"]
    forward_end = sum(u.fwd for u in model.units)
    assert all(c.end > forward_end for c in copies)  # none landed when backward starts
    # every tensor still on the device, plus the reload buffers of the last layer and the one before it
    assert swap.peak_bytes == keep.peak_bytes + _layer_swapped(model, 2) + _layer_swapped(model, 1)


def test_copies_out_within_the_forward_peak_below_keep_all():
    _, keep, swap = _swap_all(bandwidth=1e15)
    assert swap.peak_bytes < keep.peak_bytes


@pytest.mark.parametrize("bandwidth", [1e9, 1e15])
def test_every_swapped_byte_comes_back(bandwidth):
    model, _, swap = _swap_all(bandwidth)
    h2d = [i.label for i in swap.timeline.intervals if i.kind == "h2d"]
    assert sorted(h2d) == sorted(i.label for i in swap.timeline.intervals if i.kind == "d2h")  # each reloaded once
