"""The training loss of the models here: next-token cross-entropy on fp32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_lm_loss"]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (batch, seq, vocab) against ``labels`` (batch, seq).

    Note: [loss in fp32] the logits are upcast to fp32 before the softmax, as torchtitan's loss and Hugging Face's
    ``ForCausalLMLoss`` do and as CUDA autocast does for ``cross_entropy``: a half-precision model's step holds
    the fp32 copy of its logits and the fp32 log-softmax saved for backward, the largest tensors of a
    large-vocabulary step. On fp32 logits the upcast is no op and no copy (tests/test_precision.py)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
