"""The parallel-layout flags shared by ``adaptive-mem profile`` and ``adaptive-mem search``."""

from __future__ import annotations

import argparse

from profiler import SCHEDULES, Layout

from adaptive_mem.config._layout import layout_from_given

__all__ = ["add_layout_arguments", "given_flags", "layout_from_args"]

def add_layout_arguments(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """``skip``: flags the caller defines itself (``search`` has ``--pipeline-stages``, ``--micro-batches``)."""
    group = parser.add_argument_group("parallel layout (one rank's share, planned without the ranks)")
    for flag, meta, text in (
            ("--tensor-parallel", "T", "tensor-parallel ranks: attention/MLP activations, FLOPs and weights split "
                                       "T ways, an all-reduce after each row-parallel linear (default 1)"),
            ("--pipeline-stages", "P", "pipeline stages (default 1)"),
            ("--virtual-pipeline-stages", "V", "model chunks per pipeline rank, with --schedule interleaved-1f1b "
                                               "(default 1)"),
            ("--data-parallel", "D", "data-parallel ranks: the ZeRO stage shards over them (default 1)"),
            ("--micro-batches", "M", "micro-batches per step (default 1)")):
        if flag not in skip:
            group.add_argument(flag, default=None, metavar=meta, help=text)
    group.add_argument("--sequence-parallel", action="store_true", default=None,
                       help="Megatron sequence parallel: the activations tensor parallel leaves whole (norms, "
                            "residuals) split along the sequence too")
    group.add_argument("--zero", default=None, metavar="{0,1,2,3}",
                       help="ZeRO stage over the data-parallel ranks: 1 optimizer state, 2 + gradients, "
                            "3 + parameters (= FSDP) (default 0)")
    group.add_argument("--schedule", default=None, metavar="NAME",
                       help=f"pipeline schedule: {', '.join(SCHEDULES)} (default 1f1b, interleaved-1f1b when "
                            "--virtual-pipeline-stages > 1)")


def given_flags(args: argparse.Namespace) -> dict:
    """The layout keys the command line names (flags not given are left out)."""
    return {k: getattr(args, k, None) for k in ("tensor_parallel", "pipeline_stages", "virtual_pipeline_stages",
                                                "data_parallel", "sequence_parallel", "zero", "micro_batches",
                                                "schedule") if getattr(args, k, None) is not None}


def layout_from_args(args: argparse.Namespace, *, base: Layout | None = None) -> Layout:
    """The layout the flags name, on top of ``base`` (unnamed keys: ``base``'s, else the defaults)."""
    return layout_from_given(given_flags(args), base=base)
