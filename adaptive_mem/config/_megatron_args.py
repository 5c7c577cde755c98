"""``add_arguments(parser)``: Megatron's recompute flags on any argparse parser."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--recompute-*`` and ``--distribute-saved-activations`` (skipping any the parser already has).

    Pass the parsed namespace to ``adaptive_mem.optimize(model, config=args)`` or
    ``adaptive_mem.plan_from_config(args, model=model)``.
    """
    group = parser.add_argument_group("activation recompute (Megatron-LM flags)")
    have = set(getattr(parser, "_option_string_actions", {}))

    def add(flag: str, **kwargs) -> None:
        if flag not in have:
            group.add_argument(flag, **kwargs)

    add("--recompute-activations", action="store_true",
        help="same as --recompute-granularity selective: recompute the attention core of every layer")
    add("--recompute-granularity", default=None, choices=["full", "selective"],
        help="full: recompute whole layers (needs --recompute-method); selective: the attention core only")
    add("--recompute-method", default=None, choices=["uniform", "block"],
        help="uniform: checkpoint chunks of --recompute-num-layers layers; block: only the first "
             "--recompute-num-layers layers of each pipeline stage")
    add("--recompute-num-layers", type=int, default=1,
        help="uniform: layers per checkpoint chunk; block: layers recomputed per pipeline stage (default 1)")
    add("--distribute-saved-activations", action="store_true",
        help="shard the saved checkpoint inputs across the torch.distributed group (full granularity only)")
    return parser
