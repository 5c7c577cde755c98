"""``adaptive-mem explain``: the per-layer plan a MindFormers YAML (or Megatron flags) gives a model, no training."""

from __future__ import annotations

import argparse

from search import Action, Plan

from adaptive_mem.config._megatron_args import add_arguments as add_megatron_flags
from adaptive_mem.config import ConfigError, plan_from_config
from adaptive_mem.config._megatron import MEGATRON_DESTS
from adaptive_mem.config._names import LayerNames, layer_names

NAME = "explain"
HELP = "show what a MindFormers recompute_config/swap_config does to each layer of a model (no training)"



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model spec: a preset (llama-tiny), hf:<family> or "
                        "package.module:factory")
    parser.add_argument("--model-args", default=None, help="model overrides key=value,... (e.g. num_layers=48)")
    parser.add_argument("--config", default=None, help="MindFormers training YAML with recompute_config / "
                        "swap_config (or give Megatron flags instead)")
    add_megatron_flags(parser)


def _cell(parts: list[str]) -> str:
    return ", ".join(parts) if parts else "-"


def explain_rows(plan: Plan, names: LayerNames, num_layers: int) -> list[tuple[str, ...]]:
    """One row per layer: index, pipeline stage, recompute, swap (from the plan's decisions)."""
    stages = plan.meta.get("layer_stage") or [0] * num_layers
    rows = []
    for i in range(num_layers):
        lp = names.layer_path(i)
        recompute, swap = [], []
        for target, decision in plan.decisions.items():
            if target != lp and not target.startswith(lp + "."):
                continue
            local = target[len(lp) + 1:] or "whole layer"
            if decision.action is Action.RECOMPUTE:
                recompute.append(local)
            elif decision.action is Action.SWAP:
                swap.append(f"{local} (prefetch {decision.backward_prefetch})")
        group = next((g for g in plan.groups if i in g), None)
        if group:
            recompute = [f"whole layer (with layers {group[0]}-{group[-1]})"]
        rows.append((str(i), str(stages[i]), _cell(recompute), _cell(swap)))
    return rows


def format_table(rows: list[tuple[str, ...]]) -> str:
    header = ("layer", "stage", "recompute", "swap")
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from adaptive_mem._model_spec import build_model

    bundle = build_model(args.model, model_args=args.model_args, device="meta")
    names = layer_names(bundle.model)
    megatron = any(getattr(args, d) not in (None, False) for d in MEGATRON_DESTS if d != "recompute_num_layers")
    if (args.config is None) == (not megatron):
        raise ConfigError("--config: expected either a MindFormers YAML (--config train.yaml) or Megatron "
                          "--recompute-* flags, not both or neither")
    plan = plan_from_config(args.config if args.config is not None else args, model=bundle.model)
    print(format_table(explain_rows(plan, names, names.count)))
    inactive = plan.meta.get("inactive") or []
    if inactive:
        print(f"accepted but inactive here: {', '.join(inactive)}")
    if plan.distribute_saved_activations:
        print("saved checkpoint inputs are sharded across the torch.distributed group")
    return 0
