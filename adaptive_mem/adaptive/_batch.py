"""``--adaptive-batch-size``: the micro-batch grows to the largest the memory budget allows, the global batch stays.

The training loop asks :class:`AdaptiveBatch` how to cut each global batch::

    for piece, weight in handle.batch.split(batch):      # micro-batches of the current size
        (loss_fn(model, piece) * weight).backward()     # weight = micro-batch / global batch
    optimizer.step(); optimizer.zero_grad()

The adaptive loop profiles the first micro-batch (size ``micro_batch``, 1 by default) and calls
:meth:`AdaptiveBatch.observe`: ``search.maximize_throughput`` over the divisors of the global batch
(scaled from that profile, Note: [batch scaling]) gives the largest micro-batch whose fastest plan fits
the budget. It takes effect at the next global batch (never inside one), with ``global / micro``
accumulation steps; the loop then sees the new input shape and plans for it. The gradients are those of
the same accumulation done by hand: ``split`` only slices the batch along dim 0 and weighs each
micro-batch's loss by its share.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["AdaptiveBatch"]

log = logging.getLogger("adaptive_mem.adaptive._loop")  # Note: [the loop's logger]


def _positive(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key}={value!r}: expected a positive integer")
    return value


class AdaptiveBatch:
    """Micro-batch size and gradient-accumulation steps for a fixed global batch (see the module doc)."""

    def __init__(self, global_batch: int, *, micro_batch: int = 1, solver: str = "milp") -> None:
        self.global_batch = _positive("global_batch", global_batch)
        micro = _positive("micro_batch", micro_batch)
        if self.global_batch % micro:
            raise ValueError(f"micro_batch={micro}: does not divide the global batch {self.global_batch}; expected "
                             f"one of {', '.join(map(str, self.candidates))}")
        self.micro_batch = micro
        """The micro-batch size of the global batch being split now (or next)."""
        self.solver = solver
        self.table: Any = None
        """The ``search.ThroughputResult`` the choice was made from (None until the first profile)."""
        self._next: int | None = None

    @property
    def candidates(self) -> list[int]:
        """Micro-batch sizes that divide the global batch."""
        return [b for b in range(1, self.global_batch + 1) if self.global_batch % b == 0]

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch // (self._next or self.micro_batch)

    def observe(self, profile: Any, budget: int) -> None:
        """Choose the micro-batch from ``profile`` (one micro-batch of the current size) once."""
        from dataclasses import replace

        from search import InfeasibleBudgetError, maximize_throughput

        if self.table is not None:
            return
        profile = replace(profile, model={**profile.model, "batch_size": self.micro_batch})
        try:
            self.table = maximize_throughput(profiles=profile, batch_sizes=self.candidates, budget=int(budget),
                                             solver=self.solver)
        except InfeasibleBudgetError as exc:
            log.info("adaptive batch size: keeping micro-batch %d: %s", self.micro_batch, exc)
            self.table = False
            return
        chosen = self.table.largest_fitting().batch_size
        if chosen != self.micro_batch:
            self._next = chosen
        log.info("adaptive batch size: micro-batch %d x %d accumulation steps (global batch %d) from the next "
                 "global batch on; largest that fits the budget among %s",
                 chosen, self.global_batch // chosen, self.global_batch, ", ".join(map(str, self.candidates)))

    def split(self, batch: Any) -> Iterator[tuple[Any, float]]:
        """``(micro_batch, weight)`` pairs covering ``batch`` (tensors with the global batch in dim 0) in order;
        ``weight`` = micro-batch size / global batch, the factor of that micro-batch's mean loss."""
        tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.dim() == 0 or t.shape[0] != self.global_batch:
                raise ValueError(f"batch: a tensor of shape {tuple(t.shape)}; expected the global batch "
                                 f"{self.global_batch} in dim 0")
        if self._next is not None:
            self.micro_batch, self._next = self._next, None
        m = self.micro_batch
        for start in range(0, self.global_batch, m):
            yield tree_map(lambda t: t[start:start + m] if isinstance(t, torch.Tensor) else t, batch), m / self.global_batch
