"""The recording machinery under ``profile_step``, for the runtime that traces and counts the same way: fake-tensor
fallbacks, saved-output tracking, timing, static bytes, shard arithmetic.

Not part of the user API (``profiler.__all__``); the other packages of adaptive-mem import these from here.
"""

from ._compiled import check_backend, check_layout
from ._fake_ops import install_fake_fallbacks
from ._partitions import (PartitionObserver, add_partition_observer, fresh_call, fresh_code, observe_partitions,
                          remove_partition_observer, with_code)
from ._precision import precision_of
from ._leaves import tensor_leaves
from ._recorder import OpEvent, Recorder, local_shard, no_cycle
from ._saved import SavedOutputs, saved_output_units, saved_outputs
from ._shard import (ParameterSplit, collective_time, ddp_bucket_bytes, fsdp_buffer_bytes, group_bandwidth,
                     parameter_split, rank_share, rank_static, tp_roles)
from ._static import static_memory, unique_bytes
from ._step import StepTarget
from ._timing import timed

__all__ = ["OpEvent", "ParameterSplit", "PartitionObserver", "add_partition_observer", "fresh_call", "fresh_code", "observe_partitions",
           "remove_partition_observer", "Recorder", "SavedOutputs", "StepTarget", "check_backend", "check_layout",
           "collective_time", "ddp_bucket_bytes", "fsdp_buffer_bytes", "group_bandwidth", "install_fake_fallbacks", "local_shard", "no_cycle", "parameter_split",
           "precision_of", "rank_share", "rank_static", "saved_output_units", "saved_outputs", "static_memory", "timed",
           "tensor_leaves", "tp_roles", "unique_bytes", "with_code"]
