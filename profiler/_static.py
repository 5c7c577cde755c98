"""Static memory of a training step: parameters, buffers, gradients, optimizer state."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ._paths import module_path
from ._precision import Precision
from ._profile import OpRecord, StaticMemory
from ._recorder import local_shard

log = logging.getLogger(__name__)

__all__ = ["OPTIMIZERS", "allocated_optimizer_state", "gradient_split", "held_beyond_model", "static_memory",
           "unique_bytes"]

# Bytes of optimizer state per trainable parameter element, for optimizers named by string.
# Adam/AdamW: two fp32 moments (mixed-precision practice: fp32 state whatever the parameter dtype).
OPTIMIZERS: dict[str, int] = {"adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4}
_FP32 = 4
"""Bytes of one fp32 state element: ``OPTIMIZERS[name] // _FP32`` state tensors per parameter."""


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


def _numel(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def _optimizer_state(params: list[nn.Parameter], optimizer: str | torch.optim.Optimizer,
                     precision: Precision | None = None) -> tuple[int, str]:
    numel = _numel(params)
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}: expected one of {', '.join(OPTIMIZERS)} or a torch optimizer")
        per_element = OPTIMIZERS[key] if precision is None else OPTIMIZERS[key] // _FP32 * precision.state
        return per_element * numel, key
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer={type(optimizer).__name__}: expected one of {', '.join(OPTIMIZERS)} or a torch optimizer"
        )
    name = type(optimizer).__name__.lower()
    if precision is not None:
        return _lazy_state_copies(optimizer) * precision.state * numel, name
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


def static_memory(model: nn.Module, *, optimizer: str | torch.optim.Optimizer | None = None,
                  precision: Precision | None = None) -> StaticMemory:
    """Parameters, buffers, gradients (trainable parameters) and optimizer state (Adam when not given), as this
    rank holds them (local shards of sharded parameters): in the tensors' own dtypes, or with a precision recipe
    (``profiler.PRECISIONS``) its bytes per element, master weights included."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    state, name = _optimizer_state(trainable, "adam" if optimizer is None else optimizer, precision)
    buffers = unique_bytes(b for b in model.buffers() if b is not None)
    if precision is None:
        return StaticMemory(parameters=unique_bytes(params), gradients=unique_bytes(trainable),
                            optimizer_state=state, optimizer=name, buffers=buffers)
    numel = _numel([local_shard(p) for p in params])
    trained = _numel([local_shard(p) for p in trainable])
    return StaticMemory(parameters=precision.parameters * numel, gradients=precision.gradients * trained,
                        master=precision.master * trained, optimizer_state=state, optimizer=name, buffers=buffers)


def held_beyond_model(static: StaticMemory, model: nn.Module) -> int:
    """Bytes ``static`` holds for the whole step beyond the model's tensors a recorded step counts.

    Note: [precision peak] a recorded step counts the model's parameters and, as backward makes them, its
    gradients, in the dtype the forward computes in (bf16 under ``bf16``, ``fsdp2-bf16`` and ``megatron-bf16``).
    What a precision recipe holds beyond them is held the whole step and added to the peak: the optimizer state,
    master weights, and the parameters it stores wider than computed (FSDP2's fp32 shards beside the bf16
    gathered copies). Without a recipe that is the optimizer state alone. Gradients are not added, however wide
    the recipe keeps them (Megatron's fp32 main grads, FSDP2's fp32 reduced ones): every reader of the profile
    takes ``static.gradients`` as made by backward (``search.StepModel``: the peak less static memory without
    the gradients is the loss workspace), so adding them here would count them twice
    (tests/test_precision.py::test_wide_gradients_are_not_in_the_loss_workspace)."""
    params = list(model.parameters())
    return static.optimizer_state + static.master + max(0, static.parameters - unique_bytes(params))


def gradient_split(model: nn.Module, ops: list[OpRecord], num_layers: int) -> tuple[list[int], list[int]]:
    """``Profile.gradient_split`` and ``gradient_largest``: each trainable parameter's bytes at the position of the
    last forward op of a module using it (its own module, else the nearest enclosing module that ran ops)."""
    last: dict[str, int] = {}
    seen_layer = False
    for op in ops:
        if op.layer is not None:
            pos, seen_layer = op.layer + 1, True
        else:
            pos = num_layers + 1 if seen_layer else 0
        last[op.module] = max(last.get(op.module, 0), pos)
    where: dict[int, tuple[int, int]] = {}  # storage -> (position, bytes)
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        path = module_path(name.rpartition(".")[0])  # Note: [compile wrapper names]
        while path not in last and path:
            path = path.rpartition(".")[0]
        pos = last.get(path)
        if pos is None:
            continue
        st = local_shard(param).untyped_storage()
        key = st._cdata
        where[key] = (max(pos, where[key][0]) if key in where else pos, st.nbytes())
    split = [0] * (num_layers + 2)
    largest = [0] * (num_layers + 2)
    for pos, nbytes in where.values():
        split[pos] += nbytes
        largest[pos] = max(largest[pos], nbytes)
    return split, largest
