"""What the model's forward graph saves per unit when the whole model is compiled (``torch.compile(model)``).

Note: [whole-model compiled profile]. A whole-model graph saves less than the blocks compiled one by one: it fuses
across block boundaries (a block's output is read by the next block's norm, which saves what it needs, not the
output), the head and the rotary tables; llama-small 2 x 512: 10.3 MiB less with no plan. ``layout="whole-model"``
compiles the model's forward once under a partition observer (Note: [partitioner hook]) and reads what its
forward graphs save per unit (Note: [graph unit names]): every unit that runs in the graph gets those bytes (zero
for the units it saves nothing of; bytes of an op the compiler made that eager has no unit of go to the unit of the
nearest enclosing module that saves the most), the units outside it (the loss) keep theirs. The blocks' times stay the
per-block measurements. So the simulator's peak, at the end of forward as at the end of backward, is the
whole-model graph's, where subtracting one offset measured at keep-all misplaced peaks that fall in backward.
Guarded by tests/test_profile_compiled.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._graph_names import graph_units, saved_unit_bytes
from ._partitions import fresh_call, observe_partitions
from ._units import UnitNamer

__all__ = ["measure_whole_graph"]


def measure_whole_graph(model: torch.nn.Module, loss: Callable[[], torch.Tensor], *, backend: str) -> dict[str, int]:
    """Saved bytes per unit of the forward graphs of ``model`` compiled whole by ``backend``: every unit whose ops
    run in a graph, zero for those it saves nothing of. One step; the model's ``forward`` and ``.grad`` restored."""
    namer = UnitNamer(model)
    table: dict[str, int] = {}

    def observe(fw_module: Any, bw_module: Any, num_fwd_outputs: int) -> None:
        units = graph_units(fw_module.graph, namer)
        handed = {units.get(x) for x in list(fw_module.graph.find_nodes(op="output")[0].args[0])[:num_fwd_outputs]}
        for unit in units.values():
            if unit not in handed:  # a value handed out may be saved past the graph (a graph break): not ours to zero
                table.setdefault(unit, 0)
        for unit, n in saved_unit_bytes(fw_module, num_fwd_outputs, namer).items():
            table[unit] = table.get(unit, 0) + n

    attr = model.__dict__.get("forward")
    model.forward = torch.compile(fresh_call(model.forward), backend=backend)
    try:
        with observe_partitions(observe):
            loss().backward()
    finally:
        if attr is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = attr
        for p in model.parameters():
            p.grad = None
    return table
