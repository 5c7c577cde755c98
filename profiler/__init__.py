"""Profile one training step: per-op saved activations, times, static memory, link bandwidth."""

from ._profile import (PROFILE_FORMAT, PROFILE_VERSION, HardwareSpec, OpRecord, Profile, ProfileError, StaticMemory,
                       UnitRecord)
from ._units import machinery_scope
from ._hardware import HARDWARE, HardwareError, hardware_spec, measure_cpu, measure_device, measure_disk, measure_link
from ._static import OPTIMIZERS
from ._compiled import CompileBackendError
from ._step import profile_compiled, profile_step
from ._fusion import compiled_estimate
from ._layout import SCHEDULES, Layout, LayoutError
from ._shard import shard_profile
from ._precision import PRECISIONS, Precision, PrecisionError
from ._summary import format_summary
from ._target_kernels import CUDA_HARDWARE, is_cuda_hardware

__all__ = ["CUDA_HARDWARE", "CompileBackendError", "HARDWARE", "HardwareError", "HardwareSpec", "Layout",
           "LayoutError", "OPTIMIZERS", "OpRecord", "PRECISIONS", "PROFILE_FORMAT", "PROFILE_VERSION", "Precision",
           "PrecisionError", "Profile", "ProfileError", "SCHEDULES", "StaticMemory", "UnitRecord", "compiled_estimate",
           "format_summary", "hardware_spec", "is_cuda_hardware", "machinery_scope", "measure_cpu", "measure_device",
           "measure_disk", "measure_link", "profile_compiled", "profile_step", "shard_profile"]
