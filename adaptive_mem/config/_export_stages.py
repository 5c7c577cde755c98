"""Per-stage plans back as MindFormers per-stage count lists and Megatron flags with the pipeline layout.

MindFormers (non-swap mode) gives recompute per pipeline chunk as counts, ``[stage]`` or
``[interleave][stage]``: a count ``N`` recomputes the *first* ``N`` layers of the chunk (``_layers.py``).
Megatron's ``--recompute-method block --recompute-num-layers N`` is one ``N`` for every chunk. A plan
either form cannot express raises ``ConfigError`` naming the chunk; plans with swaps keep the
swap-mode index lists of :func:`plan_to_mindformers` (valid under any pipeline layout).
"""

from __future__ import annotations

import re
from collections import defaultdict

from search import Action, Plan

from ._errors import ConfigError
from ._export import _entries, _covered, plan_to_megatron, plan_to_mindformers
from ._layers import StageLayout

__all__ = ["plan_to_megatron_stages", "plan_to_mindformers_stages"]


def _counts(layers: set[int], geometry: StageLayout, what: str) -> list[list[int]]:
    """Per-chunk counts ``[interleave][stage]`` selecting exactly ``layers`` (the first N of each chunk)."""
    starts = geometry.starts()
    grid = []
    for v, row in enumerate(geometry.counts):
        grid.append([])
        for s, count in enumerate(row):
            mine = sorted(i for i in layers if starts[v][s] <= i < starts[v][s] + count)
            first = list(range(starts[v][s], starts[v][s] + len(mine)))
            if mine != first:
                raise ConfigError(f"plan {what} layers {mine} of stage {s}, chunk {v} (layers {starts[v][s]}.."
                                  f"{starts[v][s] + count - 1}): per-stage counts recompute the first N layers of a "
                                  "chunk; expected those, or --format plan")
            grid[-1].append(len(mine))
    return grid


def _shape(grid: list[list[int]]) -> list:
    return grid[0] if len(grid) == 1 else grid


def plan_to_mindformers_stages(plan: Plan, *, num_layers: int, pipeline_stages: int, interleave: int = 1) -> dict:
    """``recompute_config`` with per-stage counts, plus ``parallel_config.pipeline_stage`` and
    ``model.model_config.pp_interleave_num`` so the config reads back to the same plan."""
    if any(d.action is Action.SWAP for d in plan.decisions.values()):
        return plan_to_mindformers(plan, num_layers=num_layers)
    plan_to_mindformers(plan, num_layers=num_layers)  # the same refusals (groups, keep exceptions, ...)
    geometry = StageLayout.build(num_layers=num_layers, pipeline_stage=pipeline_stages, interleave=interleave)
    entries = _entries(plan, num_layers)
    recomputed = [t for t, _, _, d in entries if d.action is Action.RECOMPUTE]
    full: set[int] = set()
    select: dict[str, set[int]] = defaultdict(set)
    for target, index, local, decision in entries:
        if decision.action is not Action.RECOMPUTE or _covered(target, [r for r in recomputed if r != target]):
            continue
        if local:
            select[local].add(index)
        else:
            full.add(index)
    return {
        "parallel_config": {"pipeline_stage": pipeline_stages},
        "model": {"model_config": {"num_layers": num_layers, "pp_interleave_num": interleave}},
        "recompute_config": {
            "recompute": _shape(_counts(full, geometry, "recomputes")),
            "select_recompute": {re.escape(k): _shape(_counts(v, geometry, f"recomputes {k!r} in"))
                                 for k, v in select.items()},
            "select_comm_recompute": False,
        },
    }


def plan_to_megatron_stages(plan: Plan, *, num_layers: int, pipeline_stages: int, interleave: int = 1,
                            tensor_parallel: int = 1, sequence_parallel: bool = False) -> list[str]:
    """Megatron flags: the parallel layout and one ``--recompute-num-layers`` for every chunk."""
    layout = ["--tensor-model-parallel-size", str(tensor_parallel), "--pipeline-model-parallel-size",
              str(pipeline_stages)]
    if interleave > 1:
        layout += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (pipeline_stages * interleave))]
    if sequence_parallel:
        layout.append("--sequence-parallel")
    if pipeline_stages == 1 and interleave == 1:
        return layout + plan_to_megatron(plan, num_layers=num_layers)
    entries = _entries(plan, num_layers)
    if any(d.action is not Action.RECOMPUTE or local for _, _, local, d in entries) or plan.groups:
        return layout + plan_to_megatron(plan, num_layers=num_layers)  # its refusals, or selective for all layers
    full = {i for _, i, _, _ in entries}
    geometry = StageLayout.build(num_layers=num_layers, pipeline_stage=pipeline_stages, interleave=interleave)
    grid = _counts(full, geometry, "recomputes")
    counts = {n for row in grid for n in row}
    if len(counts) > 1:
        raise ConfigError(f"plan recomputes {_shape(grid)} layers per stage: Megatron's --recompute-num-layers is "
                          "one count for every stage; expected equal counts, or --format mindformers")
    n = counts.pop()
    if n == 0:
        return layout
    flags = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(n)]
    if plan.distribute_saved_activations:
        flags.append("--distribute-saved-activations")
    return layout + flags
