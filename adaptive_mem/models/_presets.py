"""Named configurations of the reference model."""

from __future__ import annotations

from dataclasses import dataclass

from ._llama import LlamaConfig

__all__ = ["Preset", "PRESETS"]


@dataclass(frozen=True)
class Preset:
    config: LlamaConfig
    """Model shape."""
    batch_size: int
    """Default micro-batch size for this preset."""
    seq_len: int
    """Default sequence length for this preset."""
    purpose: str
    """One line shown by ``adaptive-mem profile --help``."""


PRESETS: dict[str, Preset] = {
    "llama-tiny": Preset(
        LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=4, num_heads=4,
                    num_kv_heads=2, max_seq_len=256),
        batch_size=2, seq_len=32, purpose="unit tests, well under a second a step",
    ),
    "llama-small": Preset(
        LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                    max_seq_len=2048),
        batch_size=2, seq_len=512, purpose="benchmarks, about two seconds a step on 2 CPU cores",
    ),
    "llama2-7b": Preset(
        LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                    max_seq_len=4096),
        batch_size=1, seq_len=4096, purpose="fake-tensor planning only",
    ),
    "llama2-70b": Preset(
        LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                    num_kv_heads=8, max_seq_len=4096),
        batch_size=1, seq_len=4096, purpose="fake-tensor planning only",
    ),
    # Llama 3 / 3.1 shapes from Meta's published configs (params.json): 8B, 70B, 405B
    "llama3-8b": Preset(
        LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, max_seq_len=8192, rope_theta=500000.0),
        batch_size=1, seq_len=8192, purpose="fake-tensor planning only",
    ),
    "llama3-70b": Preset(
        LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                    num_kv_heads=8, max_seq_len=8192, rope_theta=500000.0),
        batch_size=1, seq_len=8192, purpose="fake-tensor planning only",
    ),
    "llama3-405b": Preset(
        LlamaConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_layers=126, num_heads=128,
                    num_kv_heads=8, max_seq_len=8192, rope_theta=500000.0),
        batch_size=1, seq_len=8192, purpose="fake-tensor planning only",
    ),
}
