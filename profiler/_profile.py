"""The ``Profile`` data type: one training step, measured or estimated.

A profile is data: it is saved as JSON (``docs/profile-format.md``) and loaded
with :func:`json.loads` plus validation, never with pickle.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._compiled import check_compiled
from ._precision import PRECISIONS
from ._profile_fields import ProfileError, build_record, check_field, is_type, field_list, short, unique_keys
from ._units import LayerInfo

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "HardwareSpec",
    "OpRecord",
    "Profile",
    "ProfileError",
    "StaticMemory",
    "UnitRecord",
]

PROFILE_FORMAT = "adaptive-mem-profile"
PROFILE_VERSION = 1


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    """Short name: ``h100``, ``a100``, ``ascend-910b``, ``cpu``..."""
    peak_flops: float
    """Dense matmul throughput in FLOP/s for the profiled dtype (an op is priced at the peak of the dtype it
    computes in: ``fp32_flops`` / ``half_flops`` when known, ``profiler._cost``)."""
    memory_bandwidth: float
    """Device memory bandwidth in bytes/s."""
    h2d_bandwidth: float
    """Host-to-device copy bandwidth in bytes/s (pinned host memory)."""
    d2h_bandwidth: float
    """Device-to-host copy bandwidth in bytes/s (pinned host memory)."""
    device_memory: int
    """Device memory capacity in bytes."""
    source: str = ""
    """Where the numbers come from (datasheet, measurement)."""
    swap_compute_bandwidth: float = 0.0
    """Bytes/s of swapped activations (out and back) at which swapping also takes compute time, or 0
    when copies run beside compute (accelerators' copy engines). On CPU the copy shares the cores and
    the memory bus with compute; ``adaptive_mem.calibrate`` measures it from real steps."""
    sac_op_overhead: float = 0.0
    """Seconds per aten op of a layer run under a selective-checkpoint policy (the policy's dispatch in
    forward and in the replay), or 0 when negligible; measured by ``adaptive_mem.calibrate``."""
    disk_bandwidth: float = 1e9
    """Bytes/s of the disk tier of the swap store (swapped activations beyond the host memory budget go
    to memory-mapped files): the slower of writing and reading back a file. Default 1 GB/s (a
    conservative SSD); measured by ``adaptive-mem profile --calibrate`` (``profiler.measure_disk``)."""
    fp32_flops: float = 0.0
    """Dense fp32 matmul FLOP/s (datasheet peak), or 0 when only ``peak_flops`` is known (a measured spec, a
    profile written before the field): fp32 ops are then priced at ``peak_flops``."""
    half_flops: float = 0.0
    """Dense bf16/fp16 tensor-core (cube) FLOP/s (datasheet peak), or 0 when only ``peak_flops`` is known: ops
    computing in half precision are then priced at ``peak_flops``."""
    matmul_efficiency: float = 1.0
    """Fraction of the dtype's peak that dense matmul kernels (mm, bmm, addmm, baddbmm, convolution) reach, from
    published GEMM microbenchmarks (``profiler/_hardware.py`` cites each); 1 for a measured spec."""
    attention_efficiency: float = 1.0
    """Fraction of the dtype's peak that fused attention kernels (flash / memory-efficient SDPA, forward and
    backward) reach; 1 for a measured spec."""
    memory_efficiency: float = 1.0
    """Fraction of ``memory_bandwidth`` that memory-bound kernels reach (a STREAM-like copy); 1 for a measured
    spec (its bandwidth is already a measured copy)."""
    kernel_latency: float = 0.0
    """Seconds every estimated kernel takes beyond its roofline time (launch, ramp-up, tail), from published
    microbenchmarks; 0 for a measured spec and for profiles written before the field."""
    comm_compute_slowdown: float = 0.0
    """Fraction of compute throughput lost while a data-parallel collective runs beside it (the collective
    library's kernels hold SMs), from published figures; 0 for a measured spec and for older profiles."""
    dispatch_call_time: float = 0.0
    """Seconds of one Python dispatch call of the runtime (a dispatch mode's or a selective-checkpoint policy's,
    per op it sees); measured by ``adaptive_mem.calibrate``, 0 when unmeasured (Note: [machinery calls])."""
    hook_call_time: float = 0.0
    """Seconds of one saved-tensor pack or unpack hook call of the runtime; measured by ``adaptive_mem.calibrate``,
    0 when unmeasured (Note: [machinery calls])."""

    def __post_init__(self) -> None:
        for key in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ProfileError(f"hardware.{key}={value!r}: expected a number in (0, 1]")
        latency = self.kernel_latency
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < 1:
            raise ProfileError(f"hardware.kernel_latency={latency!r}: expected seconds in [0, 1)")
        slowdown = self.comm_compute_slowdown
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not 0 <= slowdown < 1:
            raise ProfileError(f"hardware.comm_compute_slowdown={slowdown!r}: expected a fraction in [0, 1)")


@dataclass(frozen=True)
class StaticMemory:
    parameters: int
    """Bytes of model parameters."""
    gradients: int
    """Bytes of parameter gradients."""
    optimizer_state: int
    """Bytes of optimizer state (Adam: two fp32 moments per parameter when not given)."""
    optimizer: str = "adam"
    """Optimizer the state size was computed for."""
    buffers: int = 0
    """Bytes of module buffers (e.g. rotary tables registered as buffers)."""
    other: int = 0
    """Bytes the device held beside the step's tensors at most: a parallel wrapper's own buffers (DDP's gradient
    buckets, FSDP2's gathered block and its collective buffers), other tensors of the program; measured during
    the recorded step (``profiler._other_memory``, Note: [other device memory]); held for the whole step."""
    master: int = 0
    """Bytes of fp32 master weights kept beside lower-precision parameters (a precision recipe's, e.g.
    ``megatron-bf16``; ``profiler.PRECISIONS``); 0, and not written, without them."""

    @property
    def total(self) -> int:
        return self.parameters + self.buffers + self.gradients + self.master + self.optimizer_state + self.other


@dataclass(frozen=True)
class OpRecord:
    index: int
    """Position in forward order (0-based), over non-view ops."""
    op: str
    """Aten overload, e.g. ``aten.mm.default``."""
    unit: str
    """Unit name the op belongs to."""
    module: str
    """Path of the innermost module running the op ("" for the root)."""
    layer: int | None
    """Index of the repeated block, or None outside the blocks."""
    output_bytes: int
    """Bytes of new storage the op allocates for its outputs."""
    saved_bytes: int
    """Bytes of the op's outputs that autograd saves for backward (deduplicated by storage)."""
    fwd_time: float
    """Forward seconds (measured, or estimated on fake tensors)."""
    bwd_time: float
    """Backward seconds of the autograd node(s) this op created."""
    flops: int
    """Forward FLOPs (``torch.utils.flop_counter`` formulas)."""
    consumers: list[int] = field(default_factory=list)
    """Indices of later ops that read this op's outputs."""
    saves_inputs: bool = False
    """The op's autograd node saves a tensor before the op runs (an input or a parameter)."""
    saves_outputs: bool = False
    """The op's autograd node saves the op's own output (after it runs)."""
    saved_tensors: int = 0
    """How many tensors the op's autograd node saves (saved-tensor pack calls: inputs, parameters, outputs); 0 in
    profiles recorded before the field (Note: [machinery calls])."""
    view_ops: int = 0
    """Forward ops without a record of their own (views, detach, metadata) dispatched between the previous op and
    this one: a dispatch mode sees ``1 + view_ops`` calls for this op; 0 in profiles recorded before the field."""


@dataclass(frozen=True)
class UnitRecord:
    name: str
    """Full unit name, e.g. ``layers.3.feed_forward.w1.activation.silu``."""
    local_name: str
    """Name inside its layer, e.g. ``feed_forward.w1.activation.silu`` (== name outside layers)."""
    layer: int | None
    """Index of the repeated block, or None."""
    ops: list[int]
    """Indices of the unit's ops in ``Profile.ops``."""
    output_bytes: int
    """Sum of the ops' output bytes."""
    saved_bytes: int
    """Sum of the ops' saved bytes: what keeping this unit costs until its backward."""
    fwd_time: float
    """Forward seconds, sum over ops: what recomputing this unit costs."""
    bwd_time: float
    """Backward seconds, sum over ops."""
    consumers: list[str] = field(default_factory=list)
    """Names of later units that read this unit's outputs."""


@dataclass
class Profile:
    model: dict[str, Any]
    """What was profiled: ``spec``, ``fingerprint``, ``batch_size``, ``seq_len``, ``dtype``, ``parameters``."""
    device: str
    """``cpu`` / ``cuda`` / ``npu`` / ``meta`` (fake tensors)."""
    measured: bool
    """True when times were measured on a real device, False when estimated from the hardware spec."""
    hardware: HardwareSpec
    """Spec the estimates and the link bandwidth come from."""
    layer_container: str | None
    """Path of the repeated blocks' ModuleList, or None."""
    num_layers: int
    """Number of repeated blocks."""
    static: StaticMemory
    """Parameters, gradients, optimizer state."""
    ops: list[OpRecord]
    """Every non-view forward aten op, in order."""
    units: list[UnitRecord]
    """Ops grouped by unit, in order of first appearance."""
    saved_input_bytes: int
    """Saved bytes not produced by any forward op (model inputs)."""
    peak_memory: int
    """Measured (or fake-tracked) peak device bytes of the step, static memory included."""
    step_time: float
    """Seconds of the unprofiled step (measured) or the sum of estimates."""
    link_source: str = "spec"
    """``measured`` when h2d/d2h bandwidths were measured on this device, else ``spec``."""
    unattributed_time: float = 0.0
    """Backward seconds charged to no forward op (loss seed, gradient accumulation into ``.grad``)."""
    optimizer_time: float = 0.0
    """Seconds of one optimizer step (``static.optimizer``), not part of ``step_time``: measured on
    scratch parameters on a real device, estimated as memory-bound on fake tensors."""
    version: int = PROFILE_VERSION
    """Schema version."""
    layer_stacks: list[dict[str, Any]] = field(default_factory=list)
    """With several stacks of blocks (encoder-decoder): ``{"container": path, "count": blocks}`` per stack in
    layer-index order; empty (and not written) for one stack. Note: [several layer stacks]."""
    gradient_split: list[int] = field(default_factory=list)
    """Gradient bytes per position (pre, layers, post), by each parameter's last forward use (profile-format.md)."""
    gradient_largest: list[int] = field(default_factory=list)
    """Per position, its largest parameter gradient's bytes (profile-format.md); empty when unknown, as the split."""
    layer_forward: list[float] = field(default_factory=list)
    """Each block's median forward seconds in the unrecorded steps, its modules' Python included (Note: [layer
    forward time] in ``profiler/_repeats.py``): what a replay of the whole block costs where that is more than its
    units' times; empty (and not written) on fake tensors, in compiled profiles and in those recorded before."""
    compiled: dict[str, Any] | None = None
    """Per-block ``torch.compile`` figures when the ops were rewritten to the compiled model (``profiler._compiled``,
    Note: [compiled profile]); None (and not written) for an eager profile."""

    def layer_info(self) -> LayerInfo | None:
        """The stacks of blocks as :class:`profiler.naming.LayerInfo` (None without blocks)."""
        if self.layer_stacks:
            return LayerInfo.of([(s["container"], s["count"]) for s in self.layer_stacks])
        if self.layer_container is None or self.num_layers == 0:
            return None
        return LayerInfo(container=self.layer_container, count=self.num_layers)

    def layer_path(self, index: int) -> str:
        """Module path of layer ``index`` (``layers.3``, ``decoder.block.1``)."""
        info = self.layer_info()
        if info is None:
            raise IndexError(f"layer {index}: the profile has no layers")
        return info.layer_path(index)

    @property
    def saved_bytes(self) -> int:
        """Total activation bytes saved for backward."""
        return sum(u.saved_bytes for u in self.units) + self.saved_input_bytes

    def unit(self, name: str) -> UnitRecord:
        for record in self.units:
            if record.name == name:
                return record
        raise KeyError(name)

    def layer_units(self, layer: int) -> list[UnitRecord]:
        return [u for u in self.units if u.layer == layer]

    def replayed_forward(self, layer: int) -> float:
        """Seconds a replay of layer ``layer`` as a whole takes: its units' forward times, or its measured forward
        where longer (Note: [layer forward time] in ``profiler/_repeats.py``)."""
        ops = sum(u.fwd_time for u in self.layer_units(layer))
        return max(ops, self.layer_forward[layer]) if self.layer_forward else ops

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not data["layer_stacks"]:
            del data["layer_stacks"]  # one stack: the version-1 form, readable by older readers
        if data["compiled"] is None:
            del data["compiled"]
        for key in [k for k in ("gradient_split", "gradient_largest", "layer_forward") if not data[k]]:
            del data[key]
        if not data["static"]["master"]:
            del data["static"]["master"]  # no master weights: the form older readers know
        return {"format": PROFILE_FORMAT, **data}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: Any) -> "Profile":
        if not isinstance(data, dict):
            raise ProfileError(f"profile: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"profile.format={short(data.get('format'))}: expected {PROFILE_FORMAT!r}")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile.version={short(data.get('version'))}: expected {PROFILE_VERSION}")
        body = {k: v for k, v in data.items() if k != "format"}
        body["hardware"] = build_record(HardwareSpec, body.get("hardware"), "profile.hardware")
        body["static"] = build_record(StaticMemory, body.get("static"), "profile.static")
        body["ops"] = [build_record(OpRecord, op, f"profile.ops[{i}]") for i, op in enumerate(field_list(body, "ops"))]
        body["units"] = [build_record(UnitRecord, u, f"profile.units[{i}]") for i, u in enumerate(field_list(body, "units"))]
        profile = build_record(cls, body, "profile")
        for key in ("batch_size", "seq_len", "num_layers"):
            value = profile.model.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ProfileError(f"profile.model.{key}={short(value)}: expected a positive integer")
        for key in ("spec", "dtype", "fingerprint"):  # compared with a plan's (search._match)
            value = profile.model.get(key)
            if value is not None and not isinstance(value, str):
                raise ProfileError(f"profile.model.{key}={short(value)}: expected a string or null")
        if profile.model.get("precision") is not None and profile.model["precision"] not in PRECISIONS:
            raise ProfileError(f"profile.model.precision={short(profile.model['precision'])}: expected one of "
                               f"{', '.join(PRECISIONS)} or no key")
        if profile.model.get("parameters") is not None:
            check_field("profile.model.parameters", profile.model["parameters"], "int")
        _check_stacks(profile)
        for key, v in (("gradient_split", profile.gradient_split), ("gradient_largest", profile.gradient_largest)):
            if not isinstance(v, list) or v and (len(v) != profile.num_layers + 2 or not all(is_type(x, "int") and x >= 0
                                                                                            for x in v)):
                raise ProfileError(f"profile.{key}={short(v)}: expected num_layers + 2 integers >= 0, or no key")
        if profile.layer_forward and len(profile.layer_forward) != profile.num_layers:  # each checked as a number
            raise ProfileError(f"profile.layer_forward={short(profile.layer_forward)}: expected num_layers seconds "
                               ">= 0, or no key")
        check_compiled(profile.compiled, ProfileError)
        _check_references(profile)
        return profile

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(f"profile file {str(path)!r}: cannot read ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise ProfileError(f"profile file {str(path)!r}: not UTF-8 text; expected a JSON profile") from None
        if not text.strip():
            raise ProfileError(f"profile file {str(path)!r}: empty; expected a JSON profile")
        try:
            data = json.loads(text, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile file {str(path)!r}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except RecursionError:
            raise ProfileError(f"profile file {str(path)!r}: nested too deeply; expected a JSON profile") from None
        except ProfileError:
            raise
        except ValueError:  # Python refuses to parse an integer literal this long
            raise ProfileError(f"profile file {str(path)!r}: a number of more than {sys.get_int_max_str_digits()} "
                               "digits; expected a JSON profile") from None
        return cls.from_dict(data)


def _check_stacks(profile: Profile) -> None:
    stacks = profile.layer_stacks
    if not isinstance(stacks, list):
        raise ProfileError(f"profile.layer_stacks={short(stacks)}: expected a list of objects")
    form = 'an object {"container": str, "count": int > 0}'
    for i, stack in enumerate(stacks):
        if not isinstance(stack, dict) or set(stack) != {"container", "count"}:
            raise ProfileError(f"profile.layer_stacks[{i}]={short(stack)}: expected {form}")
        if not isinstance(stack["container"], str) or not is_type(stack["count"], "int") or stack["count"] <= 0:
            raise ProfileError(f"profile.layer_stacks[{i}]={short(stack)}: expected {form}")
    if stacks and (stacks[0]["container"] != profile.layer_container
                   or sum(s["count"] for s in stacks) != profile.num_layers):
        raise ProfileError(f"profile.layer_stacks={short(stacks)}: expected the first container to be "
                           f"layer_container ({profile.layer_container!r}) and counts summing to num_layers "
                           f"({profile.num_layers})")


def _check_references(profile: Profile) -> None:
    """Indices and names that point elsewhere in the profile must resolve."""
    n = len(profile.ops)
    for i, op in enumerate(profile.ops):
        if op.index != i:
            raise ProfileError(f"profile.ops[{i}].index={op.index}: expected {i} (ops are stored in order)")
        bad = next((c for c in op.consumers if not i < c < n), None)
        if bad is not None:
            raise ProfileError(f"profile.ops[{i}].consumers: {bad}: expected a later op index below {n}")
    names = {u.name for u in profile.units}
    for j, unit in enumerate(profile.units):
        bad = next((k for k in unit.ops if not 0 <= k < n or profile.ops[k].unit != unit.name), None)
        if bad is not None:
            raise ProfileError(f"profile.units[{j}].ops: {bad}: expected indices of ops of unit {unit.name!r}")
        missing = next((c for c in unit.consumers if c not in names), None)
        if missing is not None:
            raise ProfileError(f"profile.units[{j}].consumers: {missing!r}: not a unit of this profile")
