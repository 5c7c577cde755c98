"""Reference models: a MindFormers-named Llama and its presets."""

from ._llama import LlamaConfig, LlamaModel
from ._presets import PRESETS, Preset

__all__ = ["LlamaConfig", "LlamaModel", "PRESETS", "Preset"]
