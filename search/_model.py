"""``StepModel``: the numbers of a Profile arranged for the simulator and the solvers.

Positions: 0 = units before the repeated layers ("pre"), ``1 + i`` = layer ``i``,
``num_layers + 1`` = units after the layers ("post"). Backward runs the positions
in reverse. Every per-unit quantity the rules of ``docs/plan-format.md`` need is
precomputed here once, so simulating a plan is a few passes over small lists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property

from profiler import HardwareSpec, Profile, ProfileError
from profiler.naming import MATMUL_OPS

__all__ = ["StepModel", "UnitInfo"]

log = logging.getLogger(__name__)

def aten_label(op: str) -> str:
    """``aten.mm.default`` -> ``matmul``; SDPA kernels -> ``flash_attention``; else the packet name."""
    parts = op.split(".")
    name = (parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]).strip("_")
    if name in MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in name and "attention" in name and "backward" not in name:
        return "flash_attention"
    return name


@dataclass
class UnitInfo:
    index: int
    name: str
    local_name: str
    position: int
    saved: int
    """Saved bytes (what keep costs)."""
    output: int
    """Output bytes."""
    fwd: float
    bwd: float
    pinned: bool
    """Output read by a unit of another position (the layer output): recompute never frees it."""
    sac_extra: int
    """Bytes the SAC policy caches beyond what autograd saves: 0 for the executor's policy (it caches only saved
    outputs, Note: [SAC policy]); torchtitan's under ``estimate(ac="op")`` (Note: [torchtitan SAC cache])."""
    sac_replay: float
    """Forward seconds of this unit's ops the SAC replay runs when the unit is *not* recomputed (ops
    whose output autograd does not save), up to the replay's early stop."""
    sac_replay_all: float = 0.0
    """Forward seconds of this unit's ops the SAC replay runs when the unit *is* recomputed (all its
    ops up to the early stop)."""
    ops: int = 0
    """Forward aten ops of the unit (what a selective-checkpoint policy dispatches)."""
    fwd_end: float = 0.0
    """Forward end time of the unit in an unoptimized step (forward has no stalls)."""
    consumers: list[int] = field(default_factory=list)


@dataclass
class StepModel:
    profile: Profile
    hardware: HardwareSpec
    units: list[UnitInfo]
    positions: list[list[int]]
    """Unit indices per position, in forward order."""
    input_extra: list[int]
    """Per position: bytes of its inputs from other positions that are not saved anyway (held by a
    whole-layer checkpoint)."""
    base: int
    """Parameters + optimizer state + saved model inputs: held for the whole step."""
    grads: list[int]
    """Per position: gradient bytes allocated during its backward (gradients are set to None between
    steps, as ``optimizer.zero_grad()`` does by default). Split as the profile's ``gradient_split`` (the
    parameters each position uses), else by the position's share of matmul FLOPs (weight sizes), evenly
    over the layers when the profile has neither."""
    boundary: int
    """Workspace at the start of backward beyond saved activations (loss, logits gradient)."""
    other_time: float
    """Step seconds outside the units' forward/backward: the optimizer step, plus in a measured profile
    the rest of the plain step (loss, gradient accumulation) the op times do not cover."""
    forward_time: float
    backward_time: float
    host_budget: int | None = None
    """Bytes of RAM the swap store may hold (None: unbounded); swaps beyond it go to the disk tier at
    ``hardware.disk_bandwidth``. Swaps take host memory in forward order, all of them at once."""
    grad_temp: list[int] = field(default_factory=list)
    """Per position: with resident gradients, the bytes of its largest parameter gradient, allocated before it is
    added into ``.grad`` (one at a time) and held by the simulator through the position's backward; 0 with
    per-step gradients (the first gradient is assigned, not added) or a profile without ``gradient_largest``."""
    input_swap: list[int] = field(default_factory=list)
    """Per position: bytes a whole-layer recompute with ``swap_input`` swaps: the outputs of the previous position
    read by this position alone (the hidden states; Note: [swapped checkpoint input])."""
    spill_bound: list[int] = field(default_factory=list)
    """Per unit: bytes of its swap beyond ``host_budget`` when every unit before it swaps too (an upper
    bound the solvers' per-unit costs use; the simulator tracks the plan's real host use)."""
    replay_extra: list[float] = field(default_factory=list)
    """Per position: seconds a replay of the whole position (a layer recomputed as a whole) takes beyond its units'
    forward times: the profile's ``layer_forward`` of the layer less those times where more (its modules' Python:
    Note: [layer forward time] in ``profiler/_repeats.py``), else 0."""

    @cached_property
    def largest_allocation(self) -> int:
        """Bytes of the profile's largest op output: the step's largest single allocation (Note: [allocator
        reserve])."""
        return max((o.output_bytes for o in self.profile.ops), default=0)

    @property
    def static_bytes(self) -> int:
        """Parameters, optimizer state, saved model inputs and every gradient: the bytes a step holds beside its
        activations once backward has written all gradients."""
        return self.base + sum(self.grads)

    @property
    def num_layers(self) -> int:
        return len(self.positions) - 2

    @property
    def layer_positions(self) -> range:
        return range(1, len(self.positions) - 1)

    def layer_of(self, position: int) -> int | None:
        return position - 1 if 1 <= position <= self.num_layers else None

    def stack_ranges(self) -> list[tuple[int, int]]:
        """Positions ``(first, last)`` of each stack of layers (one for decoder-only models; encoder and
        decoder for encoder-decoder ones: Note: [several layer stacks]); checkpoint groups stay inside one."""
        info = self.profile.layer_info()
        if info is None or not self.num_layers:
            return []
        return [(info.first(s) + 1, info.first(s) + n) for s, (_, n) in enumerate(info.stacks)]

    def d2h(self, nbytes: int, spilled: int = 0) -> float:
        """Seconds to swap ``nbytes`` out, ``spilled`` of them to the disk tier (no faster than the disk)."""
        return (nbytes - spilled) / self.hardware.d2h_bandwidth + spilled / self._disk(self.hardware.d2h_bandwidth)

    def h2d(self, nbytes: int, spilled: int = 0) -> float:
        """Seconds to reload ``nbytes``, ``spilled`` of them from the disk tier."""
        return (nbytes - spilled) / self.hardware.h2d_bandwidth + spilled / self._disk(self.hardware.h2d_bandwidth)

    def _disk(self, link: float) -> float:
        disk = getattr(self.hardware, "disk_bandwidth", 0.0) or link
        return min(disk, link)

    def spill(self, host_used: int, nbytes: int) -> int:
        """Bytes of a swap of ``nbytes`` beyond the host budget when ``host_used`` bytes of it are taken."""
        if self.host_budget is None:
            return 0
        return min(nbytes, max(0, host_used + nbytes - self.host_budget))

    def unit_d2h(self, i: int) -> float:
        """Swap-out seconds of unit ``i`` as the solvers charge them (``spill_bound``)."""
        return self.d2h(self.units[i].saved, self.spill_bound[i] if self.spill_bound else 0)

    def unit_h2d(self, i: int) -> float:
        return self.h2d(self.units[i].saved, self.spill_bound[i] if self.spill_bound else 0)

    def sac_overhead(self, ops: int) -> float:
        """Compute seconds a selective-checkpoint policy adds to a layer of ``ops`` aten ops."""
        return ops * self.hardware.sac_op_overhead

    def swap_compute(self, nbytes: int) -> float:
        """Compute seconds a swap of ``nbytes`` (out and back) costs beside its copies (0 on copy engines)."""
        bandwidth = self.hardware.swap_compute_bandwidth
        return nbytes / bandwidth if bandwidth > 0 else 0.0

    @property
    def activation_bytes(self) -> int:
        return sum(u.saved for u in self.units)

    @classmethod
    def build(cls, profile: Profile, *, hardware: HardwareSpec | None = None,
              outside: frozenset[str] = frozenset(), gradients: str = "per-step",
              host_budget: int | None = None) -> "StepModel":
        """``outside``: unit names that exist on another pipeline stage (their inputs stay pinned).
        ``host_budget``: RAM of the swap store (None: unbounded), see the field.

        ``gradients``: ``per-step`` (the default: set to None between steps and allocated during
        backward, as PyTorch's ``optimizer.zero_grad()`` and ``adaptive-mem run`` do; measured
        profiles are measured that way) or ``persistent`` (resident gradient buffers, as Megatron /
        MindSpeed keep them).
        """
        if gradients not in ("per-step", "persistent"):
            raise ValueError(f"gradients={gradients!r}: expected per-step or persistent")
        per_step = gradients == "per-step"
        hw = hardware or profile.hardware
        if hw.h2d_bandwidth <= 0 or hw.d2h_bandwidth <= 0:
            raise ProfileError(f"hardware {hw.name!r}: h2d/d2h bandwidth must be > 0")
        n = profile.num_layers
        units, by_name = _unit_infos(profile)
        positions: list[list[int]] = [[] for _ in range(n + 2)]
        for u in units:
            positions[u.position].append(u.index)
        _sac_replay(profile, units, positions)
        input_extra = _link_consumers(profile, units, by_name, outside, n)
        t = 0.0
        for u in units:
            t += u.fwd
            u.fwd_end = t
        fwd = sum(u.fwd for u in units)
        bwd = sum(u.bwd for u in units)
        saved = sum(u.saved for u in units) + profile.saved_input_bytes
        resident_grads = 0 if per_step else profile.static.gradients
        base = profile.static.total - profile.static.gradients + resident_grads + profile.saved_input_bytes
        boundary = max(0, profile.peak_memory - base - (saved - profile.saved_input_bytes))
        grads = _split_gradients(profile, units, positions, profile.static.gradients - resident_grads)
        other = max(0.0, profile.step_time - fwd - bwd) if profile.measured else 0.0
        other += profile.optimizer_time
        largest = profile.gradient_largest
        grad_temp = ([v if positions[p] else 0 for p, v in enumerate(largest)]
                     if not per_step and len(largest) == n + 2 else [0] * (n + 2))
        model = cls(profile=profile, hardware=hw, units=units, positions=positions, input_extra=input_extra,
                    base=base, grads=grads, boundary=boundary, other_time=other,
                    forward_time=fwd, backward_time=bwd, host_budget=host_budget,
                    input_swap=_input_swap(units, positions), grad_temp=grad_temp,
                    replay_extra=_replay_extra(profile, units, positions))
        used = 0
        for u in units:
            model.spill_bound.append(model.spill(used, u.saved))
            used += u.saved
        return model


def _replay_extra(profile: Profile, units: list[UnitInfo], positions: list[list[int]]) -> list[float]:
    """``StepModel.replay_extra``: each layer's replay (``Profile.replayed_forward``) beyond its units' times (0
    without a measure)."""
    if not profile.layer_forward:
        return [0.0] * len(positions)
    return [max(0.0, profile.replayed_forward(p - 1) - sum(units[i].fwd for i in members))
            if members and 1 <= p <= profile.num_layers else 0.0 for p, members in enumerate(positions)]


def _unit_infos(profile: Profile) -> tuple[list[UnitInfo], dict[str, int]]:
    """One :class:`UnitInfo` per profiled unit at its position (0 before the layers, ``1 + layer``, ``n + 1``
    after them), and each unit's index by name."""
    n = profile.num_layers
    by_name: dict[str, int] = {}
    units: list[UnitInfo] = []
    seen_layer = False
    for i, rec in enumerate(profile.units):
        if rec.layer is not None:
            if not 0 <= rec.layer < n:
                raise ProfileError(f"profile.units[{i}].layer={rec.layer}: expected 0..{n - 1}")
            pos = rec.layer + 1
            seen_layer = True
        else:
            pos = n + 1 if seen_layer else 0
        if rec.name in by_name:
            raise ProfileError(f"profile.units[{i}].name={rec.name!r}: duplicate unit name")
        by_name[rec.name] = i
        for oi in rec.ops:
            if not 0 <= oi < len(profile.ops):
                raise ProfileError(f"profile.units[{i}].ops: index {oi} out of range")
        units.append(UnitInfo(index=i, name=rec.name, local_name=rec.local_name, position=pos,
                              saved=rec.saved_bytes, output=rec.output_bytes, fwd=rec.fwd_time, bwd=rec.bwd_time,
                              pinned=False, sac_extra=0, sac_replay=0.0, ops=len(rec.ops)))
    return units, by_name


def _sac_replay(profile: Profile, units: list[UnitInfo], positions: list[list[int]]) -> None:
    """Each unit's replay seconds under a selective checkpoint of its position: all its ops, and the ops that
    save nothing, up to where the replay stops."""
    for members in positions:
        # Note: [SAC policy] the replay stops early: just before the last op that saves an input or
        # parameter, or just after the last op that saves its own output, whichever is later.
        op_ids = sorted(oi for i in members for oi in profile.units[i].ops)
        stop = op_ids[-1] if op_ids else -1
        before = [oi for oi in op_ids if getattr(profile.ops[oi], "saves_inputs", False)]
        after = [oi for oi in op_ids if getattr(profile.ops[oi], "saves_outputs", False)]
        if before or after:
            stop = max(max(before, default=-1) - 1, max(after, default=-1))
        for i in members:
            ops = [profile.ops[oi] for oi in profile.units[i].ops if oi <= stop]
            units[i].sac_replay_all = sum(op.fwd_time for op in ops)
            units[i].sac_replay = sum(op.fwd_time for op in ops if op.saved_bytes == 0)


def _link_consumers(profile: Profile, units: list[UnitInfo], by_name: dict[str, int], outside: frozenset[str],
                    n: int) -> list[int]:
    """Fill each unit's consumers and pin the units read from another position (or stage); return per position
    the bytes of inputs from other positions that are not saved anyway."""
    input_extra = [0] * (n + 2)
    held_inputs: set[tuple[int, int]] = set()
    for i, rec in enumerate(profile.units):
        for cname in rec.consumers:
            j = by_name.get(cname)
            if j is None and cname in outside:
                units[i].pinned = True
                continue
            if j is None:
                raise ProfileError(f"profile.units[{i}].consumers: unknown unit {cname!r}")
            units[i].consumers.append(j)
            if units[j].position != units[i].position:
                units[i].pinned = True
                if rec.saved_bytes == 0 and (i, units[j].position) not in held_inputs:
                    held_inputs.add((i, units[j].position))
                    input_extra[units[j].position] += rec.output_bytes
    return input_extra


def _split_gradients(profile: Profile, units: list[UnitInfo], positions: list[list[int]], total: int) -> list[int]:
    """``total`` gradient bytes per position: as the profile's ``gradient_split``, else by matmul FLOPs, else
    evenly over the layers (the remainder to the heaviest position)."""
    n = len(positions) - 2
    weight = [0.0] * (n + 2)
    split = profile.gradient_split
    if len(split) == n + 2 and sum(split[p] for p in range(n + 2) if positions[p]):
        weight = [float(split[p]) if positions[p] else 0.0 for p in range(n + 2)]  # a stage: its positions only
    else:
        for u, rec in zip(units, profile.units):
            weight[u.position] += sum(profile.ops[i].flops for i in rec.ops
                                      if aten_label(profile.ops[i].op) == "matmul")
    if not sum(weight):
        weight = [0.0] + [1.0] * n + [0.0] if n else [1.0] * (n + 2)
    grads = [int(total * w / sum(weight)) for w in weight]
    grads[max(range(n + 2), key=lambda q: weight[q])] += total - sum(grads)
    return grads


def _input_swap(units: list[UnitInfo], positions: list[list[int]]) -> list[int]:
    """Per position: the outputs of the previous position read by this position alone (Note: [swapped checkpoint
    input])."""
    input_swap = [0] * len(positions)
    for q in range(1, len(positions) - 1):
        for i in positions[q - 1]:
            reach = {units[c].position for c in units[i].consumers}
            if q in reach and reach <= {q - 1, q}:
                input_swap[q] += units[i].saved or units[i].output
    return input_swap
