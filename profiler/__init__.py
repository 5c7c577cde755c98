"""Profile one training step: per-op saved activations, times, static memory, link bandwidth."""

from ._fingerprint import input_fingerprint, model_fingerprint, split_fingerprint, structure_fingerprint
from ._profile import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    HardwareSpec,
    OpRecord,
    Profile,
    ProfileError,
    StaticMemory,
    UnitRecord,
)
from ._units import LayerInfo, UnitNamer, find_layers, is_view_op, machinery_scope, op_label
from ._structure import ModelStructure
from ._hardware import HARDWARE, HardwareError, hardware_spec, measure_cpu, measure_device, measure_disk, measure_link
from ._recorder import OpEvent, Recorder
from ._saved import OpCounter, OpKey, SavedOutputs, saved_output_units, saved_outputs
from ._static import OPTIMIZERS, static_memory
from ._compiled import CompileBackendError
from ._step import StepTarget, profile_compiled, profile_step
from ._layout import SCHEDULES, Layout, LayoutError
from ._shard import ParameterSplit, collective_time, parameter_split, rank_static, shard_profile, tp_roles
from ._summary import format_summary

__all__ = [
    "CompileBackendError",
    "SCHEDULES",
    "Layout",
    "LayoutError",
    "ParameterSplit",
    "collective_time",
    "parameter_split",
    "rank_static",
    "shard_profile",
    "tp_roles",
    "HARDWARE",
    "HardwareError",
    "OPTIMIZERS",
    "OpCounter",
    "OpEvent",
    "OpKey",
    "Recorder",
    "SavedOutputs",
    "StepTarget",
    "format_summary",
    "hardware_spec",
    "measure_cpu",
    "measure_device",
    "measure_link",
    "measure_disk",
    "profile_compiled",
    "profile_step",
    "saved_output_units",
    "saved_outputs",
    "static_memory",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "HardwareSpec",
    "LayerInfo",
    "ModelStructure",
    "OpRecord",
    "Profile",
    "ProfileError",
    "StaticMemory",
    "UnitNamer",
    "UnitRecord",
    "find_layers",
    "input_fingerprint",
    "model_fingerprint",
    "split_fingerprint",
    "structure_fingerprint",
    "is_view_op",
    "machinery_scope",
    "op_label",
]
