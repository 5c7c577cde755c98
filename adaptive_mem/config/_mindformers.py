"""A MindFormers training YAML (``recompute_config``, ``swap_config``) as a :class:`search.Plan`.

Where the pipeline layout comes from: ``parallel_config.pipeline_stage``,
``model.model_config.num_layers``, ``.offset`` and ``.pp_interleave_num`` (all
optional; one stage, no interleave, no offset by default). Full recompute of a
layer wins over selective recompute on it, and recompute wins over swap on the
same op (the seeds' first coupling rule; the second, swap dropped for an op whose
output a recomputed op consumes, needs data flow and is applied by the executor).
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

from search import Action, Decision, Plan

from ._errors import ConfigError, expect_int, fmt
from ._layers import StageLayout
from ._mindformers_recompute import RECOMPUTE_KEYS, LayerRecompute, parse_recompute
from ._mindformers_swap import SWAP_KEYS, LayerSwap, parse_swap
from ._names import LayerNames

__all__ = ["plan_from_mindformers"]

log = logging.getLogger(__name__)

_TOP = ("recompute_config", "swap_config", "parallel_config", "model")
_MODEL_CONFIG = ("num_layers", "offset", "pp_interleave_num")
_PARALLEL = ("pipeline_stage",)


def _near_miss(section: dict, path: str, wanted: tuple[str, ...]) -> None:
    """Flag a key that is almost one we read (the rest of a training YAML is not ours to check)."""
    for key in section:
        if not isinstance(key, str) or key in wanted:
            continue
        near = difflib.get_close_matches(key, wanted, n=1, cutoff=0.8)
        if near:
            raise ConfigError(f"{path}{key}: unknown key; did you mean {near[0]!r}? "
                              f"expected one of {', '.join(wanted)}")


def _mapping(value: Any, path: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}={fmt(value)}: expected a mapping")
    return value


def _layer_count(names: LayerNames, config_layers: Any, num_layers: int | None) -> int:
    if config_layers is not None:
        expect_int(config_layers, "model.model_config.num_layers", minimum=1)
    if num_layers is not None:
        expect_int(num_layers, "num_layers", minimum=1)
    have = names.count or num_layers or config_layers
    if not have:
        raise ConfigError("model.model_config.num_layers: missing; expected it in the config, or pass model= or "
                          "num_layers=")
    for value, what in ((num_layers, "num_layers"), (config_layers, "model.model_config.num_layers")):
        if value is not None and value != have:
            raise ConfigError(f"{what}={fmt(value)}: the model has {have} layers; expected {have}")
    return have


def plan_from_mindformers(data: dict, *, names: LayerNames, num_layers: int | None = None,
                          source: str = "<dict>") -> Plan:
    for key in data:
        if key in RECOMPUTE_KEYS or key in SWAP_KEYS:
            section = "recompute_config" if key in RECOMPUTE_KEYS else "swap_config"
            raise ConfigError(f"{key}: a {section} key at the top level; expected it nested under {section}:")
    _near_miss(data, "", _TOP)
    parallel = _mapping(data.get("parallel_config"), "parallel_config")
    _near_miss(parallel, "parallel_config.", _PARALLEL)
    model_config = _mapping(_mapping(data.get("model"), "model").get("model_config"), "model.model_config")
    _near_miss(model_config, "model.model_config.", _MODEL_CONFIG)

    n = _layer_count(names, model_config.get("num_layers"), num_layers)
    pp = expect_int(parallel.get("pipeline_stage", 1), "parallel_config.pipeline_stage", minimum=1)
    vv = expect_int(model_config.get("pp_interleave_num", 1), "model.model_config.pp_interleave_num", minimum=1)
    layout = StageLayout.build(num_layers=n, pipeline_stage=pp, interleave=vv,
                               offset=model_config.get("offset", 0),
                               where={"pipeline_stage": "parallel_config.pipeline_stage",
                                      "interleave": "model.model_config.pp_interleave_num",
                                      "offset": "model.model_config.offset"})
    swap_section = data.get("swap_config")
    swap_mode = isinstance(swap_section, dict) and swap_section.get("swap") is True
    recompute = LayerRecompute()
    if data.get("recompute_config") is not None:
        recompute = parse_recompute(data["recompute_config"], layout=layout, names=names, swap_mode=swap_mode)
    swap = parse_swap(swap_section, names=names, num_layers=n)
    if "recompute_config" not in data and "swap_config" not in data:
        raise ConfigError(f"config {source}: neither recompute_config nor swap_config; expected a MindFormers config "
                          "with at least one of them")

    plan = Plan(model={"num_layers": n},
                meta={"source": "mindformers", "config": source, "pipeline_stage": pp, "pp_interleave_num": vv,
                      "swap": swap.enabled, "inactive": list(recompute.inactive),
                      "layer_stage": [layout.chunk_of(i)[1] for i in range(n)],
                      "layer_interleave": [layout.chunk_of(i)[0] for i in range(n)]})
    for i in range(n):
        _apply_layer(plan, i, names, recompute, swap, swap_mode)
    return plan


def _apply_layer(plan: Plan, i: int, names: LayerNames, recompute: LayerRecompute, swap: LayerSwap,
                 swap_mode: bool) -> None:
    lp = names.layer_path(i)
    recomputed: list[str] = []
    if i in recompute.full:
        recomputed.append(lp)
        log.info("Set full recompute at layer %d", i)
    else:
        select, comm = recompute.select.get(i, []), recompute.comm.get(i, [])  # Note: [keys per layer]
        recomputed.extend(f"{lp}.{t}" for t in dict.fromkeys(select + comm))
        _log_select(i, select, comm, swap_mode)
    # a target under another recomputed target of this layer adds nothing: keep the plan minimal
    recomputed = [t for t in recomputed if not any(t.startswith(r + ".") for r in recomputed)]
    for target in recomputed:
        plan.decisions[target] = Decision(Action.RECOMPUTE)
    if recomputed and recompute.keep_comm:  # mp_comm_recompute: False (Note: [collective units])
        for name in names.in_layer(i, list(recompute.collectives)):
            plan.decisions.setdefault(f"{lp}.{name}", Decision(Action.KEEP))

    def covered(target: str) -> bool:
        return any(target == r or target.startswith(r + ".") for r in recomputed)

    if i in swap.layer:
        log.info("Set layer swap at layer %d and value is: %d", i, swap.layer[i])
        if i in recompute.full:
            log.warning("All operator in layer %d that is enabled swap do not work! Because it is enabled recompute.",
                        i)
        else:
            plan.decisions[lp] = Decision(Action.SWAP, swap.layer[i])
    ops = swap.ops.get(i, [])
    if ops:
        log.info("Set op_swap at layer %d: %s", i, ", ".join(op.describe() for op in ops))
    for op in ops:
        for target in op.targets:
            full = f"{lp}.{target}"
            if covered(full):
                log.warning("%s operator in layer %d that is enabled swap do not work! Because it is enabled "
                            "recompute.", target, i)
            elif full not in plan.decisions:
                plan.decisions[full] = Decision(Action.SWAP, op.prefetch)


def _log_select(i: int, select: list[str], comm: list[str], swap_mode: bool) -> None:
    # Note: [per-layer recompute line] Without swap every layer gets exactly one line with its final
    # setting. In swap mode only layers with something set print, as MindFormers does: the swap seed's
    # case 4 (`grep 'Set op_swap at layer' -C 1`) shows no line between two op_swap lines.
    if swap_mode:
        if select:
            log.info("Set select recompute at layer %d: %s", i, ", ".join(select))
        if comm:
            log.info("Set select comm recompute at layer %d: %s", i, ", ".join(comm))
        return
    if select and comm:
        log.info("Set select recompute at layer %d: %s; select comm recompute: %s", i, ", ".join(select),
                 ", ".join(comm))
    elif select:
        log.info("Set select recompute at layer %d: %s", i, ", ".join(select))
    elif comm:
        log.info("Set select comm recompute at layer %d: %s", i, ", ".join(comm))
    else:
        log.info("Set no recompute at layer %d", i)
