"""Profiles at other micro-batch sizes: scaled from one or two profiles of the same model.

Note: [batch scaling] a step's activations grow with the micro-batch: every op's output and saved
bytes, the inputs autograd saves, the loss workspace above static memory, and every op's forward and
backward time and FLOPs. Static memory (parameters, gradients, optimizer state) does not change, nor
does the optimizer step's time or the rest of a measured step's time outside the ops (Python overhead).

* From one profile at batch ``b``: each activation quantity ``v`` becomes ``v * N / b`` (linear).
* From two profiles at ``b1 < b2`` of the same structure (same ops, same units): ``v(N) = v1 + (v2 - v1)
  (N - b1) / (b2 - b1)`` (affine, floored at 0): a per-step constant in an op (a mask, a fixed-size
  workspace, a kernel's launch overhead) is kept constant instead of scaled.
* The workspace beyond the saved bytes (the profile's peak minus static memory without gradients minus
  saved bytes: the loss and logits) scales linearly from the largest reference: at a small batch the
  measured peak is often set by the gradients allocated in backward, not by the workspace (llama-tiny
  at batch 1), so a line through two points would bend it the wrong way.

A scaled profile says so: ``model["extrapolated_from"]`` lists the batch sizes it was made from, and
its fingerprint keeps only the structure half (the input half names the other batch's shapes); the
plan's ``model.batch_size`` / ``seq_len`` tie it to its inputs instead. :func:`scaling_error` checks
the rule against a third measured batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from profiler import Profile

__all__ = ["scale_profile", "profile_for_batch", "scaling_error", "ScalingCheck", "SCALING_TOLERANCE",
           "keep_all_step_time"]

SCALING_TOLERANCE = 0.1
"""Relative error of the keep-all peak activations and step time above which the scaling check warns."""


class _Line:
    """``v(N)`` through one point (through the origin) or two points."""

    def __init__(self, batch: int, points: tuple[int, ...]) -> None:
        self.n = batch
        self.points = points

    def __call__(self, *values: float) -> float:
        if len(self.points) == 1:
            return values[0] * self.n / self.points[0]
        (b1, b2), (v1, v2) = self.points, values
        return max(0.0, v1 + (v2 - v1) * (self.n - b1) / (b2 - b1))

    def bytes(self, *values: int) -> int:
        return int(round(self(*values)))


def _same_structure(a: Profile, b: Profile) -> bool:
    return (a.num_layers == b.num_layers and [o.op for o in a.ops] == [o.op for o in b.ops]
            and [u.name for u in a.units] == [u.name for u in b.units])


def _batch(profile: Profile, where: str) -> int:
    value = profile.model.get("batch_size")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}.model.batch_size={value!r}: expected a positive integer (the profile's "
                         "micro-batch size, needed to scale it to other batch sizes)")
    return value


def scale_profile(refs: Profile | tuple[Profile, ...], batch_size: int) -> Profile:
    """``refs`` (one profile, or two of the same model at different batch sizes) scaled to ``batch_size``."""
    refs = (refs,) if isinstance(refs, Profile) else tuple(refs)
    if len(refs) == 2 and not _same_structure(*refs):
        refs = refs[:1]
    refs = tuple(sorted(refs, key=lambda p: _batch(p, "profile")))
    sizes = tuple(_batch(p, "profile") for p in refs)
    if len(set(sizes)) != len(sizes):
        refs, sizes = refs[:1], sizes[:1]
    if sizes == (batch_size,):
        return refs[0]
    line = _Line(batch_size, sizes)
    first = refs[0]
    ops = [replace(op, output_bytes=line.bytes(*(r.ops[i].output_bytes for r in refs)),
                   saved_bytes=line.bytes(*(r.ops[i].saved_bytes for r in refs)),
                   fwd_time=line(*(r.ops[i].fwd_time for r in refs)), bwd_time=line(*(r.ops[i].bwd_time for r in refs)),
                   flops=line.bytes(*(r.ops[i].flops for r in refs)))
           for i, op in enumerate(first.ops)]
    units = [replace(u, output_bytes=line.bytes(*(r.units[i].output_bytes for r in refs)),
                     saved_bytes=line.bytes(*(r.units[i].saved_bytes for r in refs)),
                     fwd_time=line(*(r.units[i].fwd_time for r in refs)),
                     bwd_time=line(*(r.units[i].bwd_time for r in refs)))
             for i, u in enumerate(first.units)]
    no_grads = first.static.total - first.static.gradients  # Note: [batch scaling] the workspace beyond saved bytes
    top = refs[-1]  # the largest batch: its peak is the least set by gradients allocated in backward
    workspace = int(round(max(0, top.peak_memory - no_grads - top.saved_bytes) * batch_size / sizes[-1]))
    compute = sum(u.fwd_time + u.bwd_time for u in units)
    if len(refs) == 1:  # the time outside the ops stays (Python overhead, optimizer step)
        step_time = compute + max(0.0, first.step_time - sum(u.fwd_time + u.bwd_time for u in first.units))
        unattributed = first.unattributed_time
    else:
        step_time, unattributed = line(*(r.step_time for r in refs)), line(*(r.unattributed_time for r in refs))
    fingerprint = first.model.get("fingerprint")
    model = {**first.model, "batch_size": batch_size, "extrapolated_from": list(sizes),
             "fingerprint": fingerprint.partition("-")[0] if isinstance(fingerprint, str) else fingerprint}
    saved = sum(u.saved_bytes for u in units) + line.bytes(*(r.saved_input_bytes for r in refs))
    return replace(first, model=model, ops=ops, units=units, peak_memory=no_grads + saved + workspace,
                   saved_input_bytes=line.bytes(*(r.saved_input_bytes for r in refs)),
                   step_time=max(step_time, compute), unattributed_time=unattributed,
                   layer_forward=[])  # measured at its batch size only


def profile_for_batch(profiles: Mapping[int, Profile], batch_size: int) -> Profile:
    """The profile at ``batch_size``: given; else interpolated between the nearest given sizes below and above it;
    else (outside the given sizes) scaled from the two nearest.

    Note: [bracketing profiles] a line through two measured points is off by their noise between them, and by
    more the farther it goes beyond them (a 2 % error at batches 2 and 4 is 6 % at 8). With profiles at 1, 2, 4
    and 8, batch 5 comes from 4 and 8, not from 4 and 2 (as near as 8)."""
    if batch_size in profiles:
        return profiles[batch_size]
    if not profiles:
        raise ValueError("profiles: expected at least one profile to scale")
    below = [b for b in profiles if b < batch_size]
    above = [b for b in profiles if b > batch_size]
    if below and above:
        pair = [max(below), min(above)]
    else:
        pair = sorted(profiles, key=lambda b: (abs(b - batch_size), b))[:2]
    return scale_profile(tuple(profiles[b] for b in pair), batch_size)


def keep_all_step_time(profile: Profile) -> float:
    """The simulated step time of ``profile`` with nothing recomputed or swapped."""
    from ._budget import keep_all
    from ._model import StepModel
    from ._simulator import simulate_assignment

    model = StepModel.build(profile)
    return simulate_assignment(model, keep_all(model)).step_time


@dataclass(frozen=True)
class ScalingCheck:
    """A measured profile against the one scaled to its batch size from two others."""
    batch_size: int
    scaled_from: tuple[int, ...]
    activation_error: float
    """Relative error of the keep-all step's activation peak (``search.planning.activation_peak``)."""
    time_error: float
    """Relative error of the keep-all step's simulated time."""

    @property
    def ok(self) -> bool:
        return max(self.activation_error, self.time_error) <= SCALING_TOLERANCE

    def describe(self) -> str:
        return (f"scaling check: batch {self.batch_size} measured vs extrapolated from batches "
                f"{', '.join(map(str, self.scaled_from))}: activation peak off by {self.activation_error:.1%}, "
                f"step time by {self.time_error:.1%}" + ("" if self.ok else f" (above {SCALING_TOLERANCE:.0%})"))


def _rel(measured: float, predicted: float) -> float:
    return abs(predicted - measured) / measured if measured else abs(predicted)


def keep_all_errors(measured: Profile, scaled: Profile) -> tuple[float, float]:
    """Relative errors of ``scaled`` against ``measured``: the keep-all step's activation peak and its time."""
    from ._budget import activation_peak, keep_all
    from ._model import StepModel

    acts = [activation_peak(m, keep_all(m)) for m in (StepModel.build(measured), StepModel.build(scaled))]
    return _rel(acts[0], acts[1]), _rel(keep_all_step_time(measured), keep_all_step_time(scaled))


def scaling_error(profiles: Mapping[int, Profile]) -> list[ScalingCheck]:
    """Each batch size past the two smallest, checked against the rule applied to the two smallest."""
    sizes = sorted(profiles)
    checks = []
    for b in sizes[2:]:
        scaled = scale_profile((profiles[sizes[0]], profiles[sizes[1]]), b)
        checks.append(ScalingCheck(b, tuple(sizes[:2]), *keep_all_errors(profiles[b], scaled)))
    return checks
