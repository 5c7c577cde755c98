"""The parallel-layout flags shared by ``adaptive-mem profile`` and ``adaptive-mem search``."""

from __future__ import annotations

import argparse

from profiler import SCHEDULES, Layout, LayoutError

__all__ = ["SHARDING", "add_layout_arguments", "layout_from_args", "merge_layout"]

SHARDING = ("tensor_parallel", "sequence_parallel", "data_parallel", "zero")
"""Keys fixed when a profile is cut to one rank; the pipeline keys may still change at search time."""


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


def _given(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k, None) for k in ("tensor_parallel", "pipeline_stages", "virtual_pipeline_stages",
                                                "data_parallel", "sequence_parallel", "zero", "micro_batches",
                                                "schedule") if getattr(args, k, None) is not None}


def layout_from_args(args: argparse.Namespace, *, base: Layout | None = None) -> Layout:
    """The layout the flags name, on top of ``base`` (unnamed keys: ``base``'s, else the defaults)."""
    given = _given(args)
    if "schedule" not in given and str(given.get("virtual_pipeline_stages", "1")) != "1":
        given["schedule"] = "interleaved-1f1b"
    return Layout.from_flags(base=base, **given)


def merge_layout(recorded: dict | None, args: argparse.Namespace) -> Layout:
    """A profile's recorded layout with the flags given to ``search`` on top; the sharding keys must agree
    (the profile is already one rank's share)."""
    base = Layout.from_dict(recorded, where="profile.model.layout") if recorded is not None else Layout()
    named = _given(args)
    for key in SHARDING:
        if key not in named:
            continue
        value = getattr(Layout.from_flags(base=base, **{key: named[key]}), key)
        if value != getattr(base, key):
            flag = "--" + key.replace("_", "-")
            raise LayoutError(f"{flag}={named[key]!r}: the profile was cut to one rank with {key}="
                              f"{getattr(base, key)!r}; expected the same, or a profile made with "
                              f"`adaptive-mem profile {flag} ...`")
    return layout_from_args(args, base=base)
