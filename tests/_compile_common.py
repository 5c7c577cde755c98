"""Shared by the torch.compile tests: one training step returning the loss and every gradient."""

from __future__ import annotations

from typing import Any, Callable

import torch

from profiler.naming import module_path

__all__ = ["compiled_step"]


def compiled_step(model: torch.nn.Module, call: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    """Loss and gradients of one step of ``call`` (the model, or its compiled wrapper) on ``batch``; gradient
    names without torch.compile's ``_orig_mod.``, the loss under ``"loss"``."""
    ids, labels = batch
    for p in model.parameters():
        p.grad = None
    loss = torch.nn.functional.cross_entropy(call(ids).flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {module_path(n): p.grad.clone() for n, p in model.named_parameters()}
    grads["loss"] = loss.detach()
    return grads
