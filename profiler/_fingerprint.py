"""Fingerprints that tie a plan or a cached result to one model and input shape."""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

from torch import nn

from ._paths import named_modules

__all__ = ["structure_fingerprint", "input_fingerprint", "model_fingerprint", "split_fingerprint"]


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def structure_fingerprint(model: nn.Module) -> str:
    """Hash of the module tree: paths, classes, parameter/buffer names, shapes and dtypes; blocks compiled by
    ``torch.compile(block)`` hash as the plain ones (Note: [compile wrapper names])."""
    rows = []
    for path, module in named_modules(model):
        tensors = [(n, list(t.shape), str(t.dtype)) for n, t in module.named_parameters(recurse=False)]
        tensors += [(n, list(t.shape), str(t.dtype)) for n, t in module.named_buffers(recurse=False) if t is not None]
        rows.append((path, type(module).__name__, tensors))
    return _digest(rows)


def input_fingerprint(shapes: Sequence[Sequence[int]], dtype: str) -> str:
    """Hash of the step's input shapes and compute dtype."""
    return _digest({"shapes": [list(s) for s in shapes], "dtype": dtype})


def model_fingerprint(model: nn.Module, *, input_shapes: Sequence[Sequence[int]], dtype: str) -> str:
    """``"<structure>-<inputs>"``: the two halves are checked separately (structure at apply, inputs at run)."""
    return f"{structure_fingerprint(model)}-{input_fingerprint(input_shapes, dtype)}"


def split_fingerprint(fingerprint: str) -> tuple[str, str | None]:
    structure, _, inputs = fingerprint.partition("-")
    return structure, inputs or None
