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
from ._units import LayerInfo, UnitNamer, find_layers, is_view_op, op_label

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "HardwareSpec",
    "LayerInfo",
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
    "op_label",
]
