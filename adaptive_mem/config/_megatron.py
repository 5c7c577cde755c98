"""Megatron-LM recompute flags as a :class:`search.Plan`.

* ``--recompute-activations`` = ``--recompute-granularity selective`` (and overrides it);
* ``selective``: the attention core of every layer (``attention.flash_attention``;
  ``self_attn.flash_attention`` on HF models) is recomputed; no ``--recompute-method``;
* ``full`` + ``uniform``: each pipeline stage's layers cut into chunks of
  ``--recompute-num-layers``, each chunk one checkpoint (``Plan.groups`` when N > 1);
* ``full`` + ``block``: the first ``--recompute-num-layers`` layers of each stage;
* ``--distribute-saved-activations``: full granularity with a method only; shards the
  saved checkpoint inputs over the default ``torch.distributed`` group.

Stages: ``pipeline_model_parallel_size`` (when the namespace has it) equal blocks of layers.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from search import Action, Decision, Plan

from ._errors import ConfigError, fmt
from ._names import LayerNames

__all__ = ["MEGATRON_DESTS", "plan_from_megatron"]

log = logging.getLogger(__name__)

MEGATRON_DESTS = ("recompute_activations", "recompute_granularity", "recompute_method", "recompute_num_layers",
                  "distribute_saved_activations")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _choice(ns: argparse.Namespace, dest: str, choices: tuple[str, ...]) -> str | None:
    value = getattr(ns, dest, None)
    if value is not None and value not in choices:
        raise ConfigError(f"{_flag(dest)}={fmt(value)}: expected one of {', '.join(choices)}")
    return value


def _bool(ns: argparse.Namespace, dest: str) -> bool:
    value = getattr(ns, dest, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{_flag(dest)}={fmt(value)}: expected a switch (True/False)")
    return value


def _int(ns: argparse.Namespace, dest: str, default: int) -> int:
    value = getattr(ns, dest, None)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{_flag(dest)}={fmt(value)}: expected an integer >= 1")
    return value


def megatron_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The validated flags: granularity, method, num_layers, distribute, pipeline size."""
    granularity = _choice(ns, "recompute_granularity", ("full", "selective"))
    method = _choice(ns, "recompute_method", ("uniform", "block"))
    count = _int(ns, "recompute_num_layers", 1)
    distribute = _bool(ns, "distribute_saved_activations")
    pp = _int(ns, "pipeline_model_parallel_size", 1)
    if _bool(ns, "recompute_activations"):
        if granularity == "full":
            log.info("--recompute-activations overrides --recompute-granularity full with selective")
        granularity = "selective"
    if granularity == "selective" and method is not None:
        raise ConfigError(f"--recompute-method={method}: recompute method is not yet supported for selective "
                          "recomputing granularity; expected no --recompute-method with --recompute-granularity "
                          "selective or --recompute-activations")
    if distribute and granularity != "full":
        raise ConfigError(f"--distribute-saved-activations: distributed recompute activations is only applicable "
                          f"to full recompute granularity (got {granularity}); expected --recompute-granularity full "
                          "--recompute-method uniform|block")
    if distribute and method is None:
        raise ConfigError("--distribute-saved-activations: for distributed recompute activations to work you need "
                          "a recompute method; expected --recompute-method uniform or block")
    if granularity == "full" and method is None:
        raise ConfigError("--recompute-granularity=full: no --recompute-method (Megatron: invalid activation "
                          "recompute method); expected --recompute-method uniform or block")
    if method is not None and granularity is None:
        raise ConfigError(f"--recompute-method={method}: has no effect without a granularity; expected "
                          "--recompute-granularity full")
    return {"granularity": granularity, "method": method, "num_layers": count, "distribute": distribute, "pp": pp}


def plan_from_megatron(ns: argparse.Namespace, *, names: LayerNames, num_layers: int) -> Plan:
    s = megatron_settings(ns)
    n, pp = num_layers, s["pp"]
    if n % pp:
        raise ConfigError(f"--pipeline-model-parallel-size={pp}: does not divide the {n} layers; expected a divisor "
                          f"of {n}")
    per_stage = n // pp
    stages = [list(range(k * per_stage, (k + 1) * per_stage)) for k in range(pp)]
    plan = Plan(model={"num_layers": n}, distribute_saved_activations=s["distribute"],
                meta={"source": "megatron", "recompute_granularity": s["granularity"],
                      "recompute_method": s["method"], "recompute_num_layers": s["num_layers"],
                      "layer_stage": [i // per_stage for i in range(n)]})
    full: list[int] = []
    cores: dict[int, tuple[str, ...]] = {}
    if s["granularity"] == "selective":  # Note: [keys per layer]: the core attention of each layer that has one
        cores = names.spread((names.attention_core(),), "--recompute-granularity", list(range(n)), key="selective")
    if s["granularity"] == "full" and s["method"] == "uniform":
        for stage in stages:
            for at in range(0, len(stage), s["num_layers"]):
                chunk = stage[at:at + s["num_layers"]]
                full.extend(chunk)
                if len(chunk) > 1:
                    plan.groups.append(chunk)
    elif s["granularity"] == "full":
        for stage in stages:
            full.extend(stage[:s["num_layers"]])
    log.info("Megatron recompute: granularity=%s method=%s recompute_num_layers=%d pipeline stages=%d%s",
             s["granularity"], s["method"], s["num_layers"], pp,
             " distribute_saved_activations" if s["distribute"] else "")
    for i in range(n):
        lp = names.layer_path(i)
        if i in full:
            plan.decisions[lp] = Decision(Action.RECOMPUTE)
            group = next((g for g in plan.groups if i in g), None)
            log.info("Set full recompute at layer %d%s", i,
                     f" (checkpoint unit: layers {group[0]}-{group[-1]})" if group else "")
        elif i in cores:
            plan.decisions[f"{lp}.{cores[i][0]}"] = Decision(Action.RECOMPUTE)
            log.info("Set select recompute at layer %d: %s", i, cores[i][0])
        else:
            log.info("Set no recompute at layer %d", i)
    return plan
