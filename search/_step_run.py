"""The event timeline of one simulated step: forward with its swap-outs, the reloads' schedule, backward with its
replays, reloads and stalls, then the memory peak over the events in time order (``simulate_assignment``).

Memory is released at the end of a segment's backward (the module docstring of ``_simulator.py``).
"""

from __future__ import annotations

from ._assignment import Assignment, Segment
from ._model import StepModel
from ._reserve import reserved_at_peak
from ._timeline import Interval, Simulation, Timeline

__all__ = ["StepRun"]


class StepRun:
    """One step of ``asg`` on ``model`` over its segments: call :meth:`run` once."""

    def __init__(self, model: StepModel, asg: Assignment, segs: list[Segment], *, in_flight: int = 1,
                 record: bool = False) -> None:
        self.model, self.asg, self.segs, self.record = model, asg, segs, record
        self.in_flight = in_flight
        self.events: list[tuple[float, int, int]] = []  # (time, +bytes / -bytes, order)
        self.intervals: list[Interval] = []
        self.t = self.stream = self.stall = self.replay = 0.0
        self.swapped = 0
        self.spilled: dict[int, int] = {}  # unit (or -position of an input) -> bytes of its swap on the disk tier
        self.land: dict[int, float] = {}

    def add(self, time: float, delta: int) -> None:
        if delta:
            self.events.append((time, delta, len(self.events)))

    def interval(self, stream: str, kind: str, start: float, end: float, label: str) -> None:
        if self.record:
            self.intervals.append(Interval(stream, kind, start, end, label))

    def run(self) -> Simulation:
        self.add(0.0, (self.in_flight - 1) * sum(s.held for s in self.segs))
        for seg in self.segs:
            self.forward(seg)
        issue = self.reload_schedule()
        self.add(self.t, self.model.boundary)
        for k, seg in enumerate(reversed(self.segs)):
            self.backward(seg, issue)
            if k == 0:
                self.add(self.t, -self.model.boundary)
        return self.result()

    # ---------------------------------------------------------------- forward
    def copy_out(self, key: int, nbytes: int, label: str) -> None:
        """A swap-out on the copy stream once the bytes exist; they leave the device when it completes."""
        c0 = max(self.stream, self.t)
        self.spilled[key] = self.model.spill(self.swapped, nbytes)
        self.stream = c0 + self.model.d2h(nbytes, self.spilled[key])
        self.add(self.stream, -nbytes)
        self.swapped += nbytes
        self.interval("copy", "d2h", c0, self.stream, label)

    def forward(self, seg: Segment) -> None:
        self.add(self.t, seg.inputs)
        start = self.t
        swaps = set(seg.swaps)
        for i in seg.units:
            u = self.model.units[i]
            self.t += u.fwd
            self.add(self.t, seg.hold.get(i, 0))
            if i in swaps:
                self.add(self.t, u.saved)
                self.copy_out(i, u.saved, u.name)
        if seg.in_swap:  # Note: [swapped checkpoint input]: copied out once the layer's forward returned
            self.copy_out(-seg.positions[0], seg.in_swap, f"{_seg_name(self.model, seg)} input")
        if seg.units:
            self.interval("compute", "forward", start, self.t, _seg_name(self.model, seg))

    def reload_schedule(self) -> dict[int, list[int]]:
        """Position -> swapped keys whose prefetched reload starts when backward begins that position (an input is
        keyed -position: unit keys are >= 0)."""
        last = len(self.model.positions) - 1
        issue: dict[int, list[int]] = {}
        for seg in self.segs:
            for i in seg.swaps:
                d = self.asg.prefetch[i]
                if d > 0:
                    issue.setdefault(min(self.model.units[i].position + d, last), []).append(i)
            if seg.in_swap and seg.in_prefetch > 0:
                issue.setdefault(min(seg.positions[0] + seg.in_prefetch, last), []).append(-seg.positions[0])
        return issue

    # ---------------------------------------------------------------- backward
    def reload(self, key: int, label: str) -> None:
        """A reload's device buffer is allocated when it is issued, its copy runs on the copy stream behind the
        queued copies out (Note: [reload behind queued copies out]).

        Note: [reload behind queued copies out] as the executor's swap engine does (``Record.reload`` in ``adaptive_mem/runtime/_swap_record.py``): a swapped
        tensor's device copy lives until its copy out lands, and the reload buffer is taken when the prefetch is
        issued. Where the copies out take longer than the forward (a small model on a slow link), backward starts
        with most swapped tensors still on the device, and the prefetched reloads of the last layers add their
        buffers on top: swapping everything then peaks above keeping everything, by the bytes of the reloads in
        flight (the last layer's and, at prefetch distance 1, the next one's). That is what such a plan holds on
        this runtime, not a double count."""
        nbytes = self.model.units[key].saved if key >= 0 else self.model.input_swap[-key]
        self.add(self.t, nbytes)
        c0 = max(self.stream, self.t)
        self.stream = self.land[key] = c0 + self.model.h2d(nbytes, self.spilled.get(key, 0))
        self.interval("copy", "h2d", c0, self.stream, label)

    def wait(self, key: int, label: str) -> None:
        if self.land[key] > self.t:
            self.interval("compute", "stall", self.t, self.land[key], label)
            self.stall += self.land[key] - self.t
            self.t = self.land[key]

    def backward(self, seg: Segment, issue: dict[int, list[int]]) -> None:
        model, units = self.model, self.model.units
        name = _seg_name(model, seg)
        due = sorted((i for p in seg.positions for i in issue.get(p, [])),
                     key=lambda i: (i, -(1 << 62)) if i < 0 else (-units[i].position, -i))
        for i in due:
            self.reload(i, units[i].name if i >= 0 else f"{_seg_name(model, self._seg_at(-i))} input")
        if seg.in_swap:
            key = -seg.positions[0]
            if seg.in_prefetch == 0:
                self.reload(key, f"{name} input")
            self.wait(key, f"{name} input")
        temp = max(model.grad_temp[p] for p in seg.positions) if model.grad_temp else 0
        self.add(self.t, seg.transient + temp)  # temp: a new gradient before its accumulation (resident gradients)
        self.add(self.t, sum(model.grads[p] for p in seg.positions))
        if seg.replay:
            self.interval("compute", "recompute", self.t, self.t + seg.replay, name)
            self.t += seg.replay
            self.replay += seg.replay
        start = self.t
        swaps = set(seg.swaps)
        for i in reversed(seg.units):
            if i in swaps:
                if self.asg.prefetch[i] == 0:
                    self.reload(i, units[i].name)
                self.wait(i, units[i].name)
            self.t += units[i].bwd
        if seg.units:
            self.interval("compute", "backward", start, self.t, name)
        self.add(self.t, -(seg.held + seg.transient + temp + sum(units[i].saved for i in seg.swaps)))

    def _seg_at(self, position: int) -> Segment:
        return next(s for s in self.segs if s.positions[0] == position)

    # ---------------------------------------------------------------- result
    def result(self) -> Simulation:
        # In time order; at equal times in order of occurrence (a copy completion is known when issued).
        self.events.sort(key=lambda e: (e[0], e[2]))
        level, peak = 0, 0
        memory: list[tuple[float, int]] = []
        for time, delta, _ in self.events:
            level += delta
            peak = max(peak, level)
            if self.record:
                memory.append((time, self.model.base + level))
        timeline = Timeline(self.intervals, memory) if self.record else None
        return Simulation(peak_bytes=self.model.base + peak, step_time=self.t + self.model.other_time,
                          stall_time=self.stall, recompute_time=self.replay, activation_peak=peak,
                          swapped_bytes=self.swapped, timeline=timeline, spilled_bytes=sum(self.spilled.values()),
                          peak_reserved_bytes=reserved_at_peak(self.model, self.model.base + peak))


def _seg_name(model: StepModel, seg: Segment) -> str:
    names = []
    for p in seg.positions:
        layer = model.layer_of(p)
        names.append(f"layer {layer}" if layer is not None else ("pre" if p == 0 else "post"))
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
