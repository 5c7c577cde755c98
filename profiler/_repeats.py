"""What the profiler takes from repeated steps: the ops' median times over the recorded steps (Note: [op time
medians]) and each block's median forward time over the plain ones (Note: [layer forward time])."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch
from torch import nn

from ._recorder import Recorder
from ._structure import ModelStructure

__all__ = ["LayerTimer", "take_median_times"]

log = logging.getLogger(__name__)


def take_median_times(recorders: list[Recorder]) -> None:
    """Give the first recorder's ops the median of their times over every recorder.

    Note: [op time medians] one recorded step times each op once, and on a shared machine a single
    preemption lands in whichever op was running (one profile charged 170 ms instead of 66 ms to the
    loss's backward). The medians over a few recorded steps keep such outliers out of every plan's
    prediction. Bytes, consumers and savers come from the first recording: a deterministic step
    records the same ops each time, and a step that does not (data-dependent control flow) keeps the
    first recording's times. Guarded by ``tests/test_profiler.py::test_op_times_are_medians_of_recordings``.
    """
    first = recorders[0]
    same = [r for r in recorders[1:]
            if [(e.func, e.unit) for e in r.events] == [(e.func, e.unit) for e in first.events]]
    if len(same) < len(recorders) - 1:
        log.warning("the recorded steps ran different ops (data-dependent control flow?): op times from the "
                    "first recording only")
        return
    if not same:
        return
    for i, event in enumerate(first.events):
        event.fwd_time = statistics.median([event.fwd_time, *(r.events[i].fwd_time for r in same)])
        event.bwd_time = statistics.median([event.bwd_time, *(r.events[i].bwd_time for r in same)])
    first.unattributed_bwd_time = statistics.median(
        [first.unattributed_bwd_time, *(r.unattributed_bwd_time for r in same)])


class LayerTimer:
    """Times each block's forward in the steps run inside it (a context entered once per step).

    Note: [layer forward time]. A unit's forward time is the sum of its ops' times, each op timed alone; a
    block's forward also runs the Python of its modules around them (a Hugging Face layer's module calls, its
    rotary embedding and mask handling), which a replay of the whole block runs again: on hf:llama (hidden 64, b8
    s128) a layer's forward took 5.2 ms where its ops' times sum to 4.7 ms. Forward hooks on the blocks alone (two
    calls per block call) time each block's calls in the plain steps: wall clock on the CPU, device events on an
    accelerator (the block's span on the device's queue; unverified on a GPU). Their medians over the steps are
    ``Profile.layer_forward``; the simulator prices the replay of a block recomputed as a whole at the larger of
    it and its units' times (``StepModel.replay_extra``). Guarded by tests/test_layer_forward.py."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.blocks = [model.get_submodule(path) for path in ModelStructure.of(model).layer_paths]
        self.events = device.type not in ("cpu", "meta")
        self.device = device
        self.samples: list[list[float]] = []
        self._spans: list[list[Any]] = []
        self._hooks: list[Any] = []

    def _mark(self, index: int, at_start: bool) -> None:
        if self.events:
            event = torch.Event(device=self.device, enable_timing=True)
            event.record()
        else:
            event = time.perf_counter()
        if at_start:
            self._spans[index].append([event, None])
        elif self._spans[index] and self._spans[index][-1][1] is None:
            self._spans[index][-1][1] = event

    def __enter__(self) -> "LayerTimer":
        self._spans = [[] for _ in self.blocks]
        for i, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(lambda *_, i=i: self._mark(i, True)))
            self._hooks.append(block.register_forward_hook(lambda *_, i=i: self._mark(i, False), always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if exc[0] is None and self.blocks:
            if self.events:
                torch.accelerator.synchronize(self.device)
            self.samples.append([sum(self._seconds(a, b) for a, b in spans if b is not None)
                                 for spans in self._spans])

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.events else end - start

    def medians(self) -> list[float]:
        """Each block's median forward seconds over the steps timed (empty without blocks or steps)."""
        if not self.samples:
            return []
        return [statistics.median(step[i] for step in self.samples) for i in range(len(self.blocks))]
