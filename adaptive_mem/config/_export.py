"""A :class:`search.Plan` back as a MindFormers config or Megatron flags (``--format`` of the search CLI).

The MindFormers form is swap mode (``swap: True``) with layer-index lists, the only
form that can select any layer; feeding it back through ``plan_from_config`` gives
the same decisions. A plan the target cannot express raises ``ConfigError`` naming why.
"""

from __future__ import annotations

import re
from collections import defaultdict

from search import Action, Plan

from ._errors import ConfigError, expect_int

__all__ = ["plan_to_megatron", "plan_to_mindformers"]


def _split(target: str, num_layers: int) -> tuple[str, int, str]:
    """``model.layers.3.mlp`` -> ``("model.layers", 3, "mlp")``."""
    parts = target.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            index = int(part)
            if index >= num_layers:
                raise ConfigError(f"plan.decisions.{target}: layer {index} out of range; expected 0..{num_layers - 1}")
            return ".".join(parts[:k]), index, ".".join(parts[k + 1:])
    raise ConfigError(f"plan.decisions.{target}: not inside a layer; MindFormers and Megatron configs only "
                      "name layers and the ops inside them")


def _covered(target: str, others: list[str]) -> bool:
    return any(target == o or target.startswith(o + ".") for o in others)


def _entries(plan: Plan, num_layers: int) -> list[tuple[str, int, str, object]]:
    expect_int(num_layers, "num_layers", minimum=1)
    out = []
    containers = set()
    acting = [t for t, d in plan.decisions.items() if d.action is not Action.KEEP]
    for target, decision in plan.decisions.items():
        if decision.swap_input:
            raise ConfigError(f"plan.decisions.{target}: swap_input; MindFormers and Megatron configs cannot swap a "
                              "recomputed layer's input; expected recompute without swap_input")
        if decision.action is Action.KEEP and not _covered(target, [t for t in acting if t != target]):
            continue  # an explicit keep where nothing else acts: the default, nothing to say
        container, index, local = _split(target, num_layers)
        containers.add(container)
        out.append((target, index, local, decision))
    if len(containers) > 1:
        raise ConfigError(f"plan.decisions: targets in several layer containers {sorted(containers)}; expected one")
    return out


def plan_to_mindformers(plan: Plan, *, num_layers: int) -> dict:
    """``{"recompute_config": ..., "swap_config": ...}`` in swap-mode layer-index form."""
    if plan.groups:
        raise ConfigError(f"plan.groups={plan.groups}: MindFormers cannot checkpoint several layers as one unit; "
                          "expected no groups (use Megatron flags)")
    if plan.distribute_saved_activations:
        raise ConfigError("plan.distribute_saved_activations=True: MindFormers has no such option; expected False")
    entries = _entries(plan, num_layers)
    recomputed = [t for t, _, _, d in entries if d.action is Action.RECOMPUTE]
    swapped = [t for t, _, _, d in entries if d.action is Action.SWAP]
    full: list[int] = []
    select: dict[str, list[int]] = defaultdict(list)
    layer_swap: dict[int, list[int]] = defaultdict(list)
    op_swap: dict[tuple[str, int], list[int]] = defaultdict(list)
    for target, index, local, decision in entries:
        parent = [r for r in recomputed if r != target]
        if decision.action is Action.KEEP:
            if _covered(target, parent + [s for s in swapped if s != target]):
                raise ConfigError(f"plan.decisions.{target}: keep inside a recomputed or swapped module; "
                                  "MindFormers cannot express exceptions")
            continue
        if decision.action is Action.RECOMPUTE:
            if _covered(target, parent):
                continue  # already recomputed with its layer or module
            if local:
                select[re.escape(local)].append(index)
            else:
                full.append(index)
            continue
        if _covered(target, recomputed):
            raise ConfigError(f"plan.decisions.{target}: swap inside a recomputed module; MindFormers recomputes it "
                              "instead (recompute wins), expected no swap there")
        if local:
            op_swap[(re.escape(local), decision.backward_prefetch)].append(index)
        else:
            layer_swap[decision.backward_prefetch].append(index)
    return {
        "recompute_config": {
            "recompute": sorted(full),
            "select_recompute": {k: sorted(v) for k, v in select.items()},
            "select_comm_recompute": False,
        },
        "swap_config": {
            "swap": True,
            "layer_swap": [{"backward_prefetch": p, "layers": sorted(v)} for p, v in layer_swap.items()],
            "op_swap": [{"op_name": name, "backward_prefetch": p, "layers": sorted(v)}
                        for (name, p), v in op_swap.items()],
        },
    }


def plan_to_megatron(plan: Plan, *, num_layers: int) -> list[str]:
    """Megatron flags giving the same decisions (one pipeline stage), or ConfigError."""
    entries = _entries(plan, num_layers)
    n = num_layers
    full = sorted({i for _, i, local, d in entries if d.action is Action.RECOMPUTE and not local})
    ops = {(i, local) for _, i, local, d in entries if d.action is Action.RECOMPUTE and local}
    for target, _, _, d in entries:
        if d.action is Action.SWAP:
            raise ConfigError(f"plan.decisions.{target}: swap; Megatron flags only recompute, expected no swap")
        if d.action is Action.KEEP:
            raise ConfigError(f"plan.decisions.{target}: keep inside a recomputed layer; Megatron flags cannot "
                              "express exceptions")
    flags: list[str]
    if ops:
        locals_ = {local for _, local in ops}
        if full or plan.groups or len(locals_) != 1 or not next(iter(locals_)).endswith("flash_attention") \
                or len(ops) != n:
            raise ConfigError("plan.decisions: op-level recompute other than the attention core of every layer; "
                              "Megatron's selective granularity recomputes exactly that")
        if plan.distribute_saved_activations:
            raise ConfigError("plan.distribute_saved_activations=True: needs full granularity in Megatron")
        return ["--recompute-granularity", "selective"]
    if not full:
        if plan.groups or plan.distribute_saved_activations:
            raise ConfigError("plan: groups or distribute_saved_activations without recomputed layers")
        return []
    if plan.groups:
        size = len(plan.groups[0])
        chunks = [list(range(a, min(a + size, n))) for a in range(0, n, size)]
        if [g for g in chunks if len(g) > 1] != plan.groups or full != list(range(n)):
            raise ConfigError(f"plan.groups={plan.groups}: expected consecutive chunks of {size} layers covering all "
                              f"{n} layers (Megatron uniform)")
        flags = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                 str(size)]
    elif full == list(range(n)):
        flags = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif full == list(range(len(full))):
        flags = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
                 str(len(full))]
    else:
        raise ConfigError(f"plan recomputes layers {full}: Megatron recomputes every layer (uniform) or the first N "
                          "layers of each stage (block); expected one of those")
    if plan.distribute_saved_activations:
        flags.append("--distribute-saved-activations")
    return flags
