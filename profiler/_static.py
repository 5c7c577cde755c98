"""Static memory of a training step: parameters, buffers, gradients, optimizer state."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ._profile import StaticMemory
from ._recorder import local_shard

log = logging.getLogger(__name__)

__all__ = ["OPTIMIZERS", "allocated_optimizer_state", "static_memory", "unique_bytes"]

# Bytes of optimizer state per trainable parameter element, for optimizers named by string.
# Adam/AdamW: two fp32 moments (mixed-precision practice: fp32 state whatever the parameter dtype).
OPTIMIZERS: dict[str, int] = {"adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4}


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights count once; a DTensor's local shard, what
    the rank holds: FSDP2's gathered blocks are the wrapper's memory, ``static.other``)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = local_shard(t).untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def allocated_optimizer_state(optimizer: str | torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer state tensors allocated now (0 before a torch optimizer's first step, or for a name)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return 0
    return unique_bytes(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def _optimizer_state(params: list[nn.Parameter], optimizer: str | torch.optim.Optimizer) -> tuple[int, str]:
    numel = sum(p.numel() for p in {id(p): p for p in params}.values())
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}: expected one of {', '.join(OPTIMIZERS)} or a torch optimizer")
        return OPTIMIZERS[key] * numel, key
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer={type(optimizer).__name__}: expected one of {', '.join(OPTIMIZERS)} or a torch optimizer"
        )
    name = type(optimizer).__name__.lower()
    state = allocated_optimizer_state(optimizer)
    if state:
        return state, name
    # torch creates the state lazily at the first step, one tensor per parameter-sized buffer, in the
    # parameters' dtype; the buffers each torch optimizer keeps (torch/optim/<name>.py, _init_group).
    return _lazy_state_copies(optimizer) * unique_bytes(params), name


def _lazy_state_copies(optimizer: torch.optim.Optimizer) -> int:
    def flag(key: str) -> int:
        return int(any(g.get(key) for g in optimizer.param_groups))

    kind = type(optimizer).__name__
    if kind == "SGD":
        return 1 if flag("momentum") else 0
    if kind == "RMSprop":
        return 1 + flag("momentum") + flag("centered")
    if kind in ("Adam", "AdamW"):
        return 2 + flag("amsgrad")
    if kind in ("Adagrad", "ASGD"):
        return 1
    if kind in ("Adamax", "NAdam", "RAdam", "Adadelta", "Rprop"):
        return 2
    log.warning("optimizer %s: state size unknown before its first step; assuming two parameter-sized buffers "
                "(Adam-like)", kind)
    return 2


def static_memory(model: nn.Module, *, optimizer: str | torch.optim.Optimizer | None = None) -> StaticMemory:
    """Parameters, buffers, gradients (trainable parameters) and optimizer state (Adam when not given), as this
    rank holds them (local shards of sharded parameters)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    state, name = _optimizer_state(trainable, "adam" if optimizer is None else optimizer)
    return StaticMemory(
        parameters=unique_bytes(params), gradients=unique_bytes(trainable),
        optimizer_state=state, optimizer=name,
        buffers=unique_bytes(b for b in model.buffers() if b is not None),
    )
