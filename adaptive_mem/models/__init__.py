"""Reference models: a MindFormers-named Llama and its presets."""

from ._llama import LlamaConfig, LlamaModel
from ._parallelize import KINDS, Parallel, ParallelModel, parallelize
from ._presets import PRESETS, Preset

__all__ = ["LlamaConfig", "LlamaModel", "PRESETS", "Preset", "KINDS", "Parallel", "ParallelModel", "parallelize"]
