"""How modules, layers and units are named and found: the rules the search and the executor share with the
profiler, so a plan names what the profile recorded and the executor finds what the plan names.

Not part of the user API (``profiler.__all__``); the other packages of adaptive-mem import these from here.
"""

from ._fingerprint import input_fingerprint, model_fingerprint, split_fingerprint, structure_fingerprint
from ._graph_names import graph_units, is_view_node, saved_unit_bytes, stack_frames, stack_unit, storage_base
from ._kinds import LayerKinds, layer_kinds
from ._paths import COMPILE_CHILD, is_compile_wrapper, module_path, named_modules
from ._saved import OpCounter, OpKey
from ._structure import ModelStructure, is_data_parallel
from ._units import (COLLECTIVE_LABELS, MATMUL_OPS, LayerInfo, UnitNamer, find_layers, function_scope, is_view_op,
                     join, leaf_label, op_label)

__all__ = ["COLLECTIVE_LABELS", "COMPILE_CHILD", "MATMUL_OPS", "LayerInfo", "LayerKinds", "ModelStructure",
           "OpCounter", "OpKey", "UnitNamer", "find_layers", "function_scope", "graph_units", "input_fingerprint",
           "is_compile_wrapper", "is_data_parallel", "is_view_node", "is_view_op", "join", "layer_kinds", "leaf_label",
           "model_fingerprint", "module_path", "named_modules", "op_label", "saved_unit_bytes", "split_fingerprint",
           "stack_frames", "stack_unit", "storage_base", "structure_fingerprint"]
