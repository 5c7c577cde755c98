"""``adaptive-mem estimate``: will a run fit on N GPUs, and its tokens/s per GPU and MFU (``adaptive_mem.estimate``)."""

from __future__ import annotations

import argparse
import json

import profiler
from search import fmt_bytes

from adaptive_mem._estimate import ESTIMATE_AC_MODES, EstimateResult, estimate
from adaptive_mem._model_spec import FORMS

from ._layout_args import add_layout_arguments, given_flags

NAME = "estimate"
HELP = ("predict one rank's peak memory (allocated and reserved), step time, tokens/s per GPU and MFU of a run on "
        "N GPUs, and whether it fits, from fake tensors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="SPEC", help=f"model spec: {FORMS}")
    parser.add_argument("--model-args", default=None, metavar="K=V,...", help="overrides of the model's config")
    parser.add_argument("--hardware", default="h100", metavar="NAME",
                        help=f"the device: {', '.join(profiler.HARDWARE)} (default h100)")
    parser.add_argument("--gpus", default="1", metavar="N",
                        help="devices of the run: tensor parallel x pipeline stages x data parallel (data parallel "
                             "is what is left when not given; default 1)")
    parser.add_argument("--precision", default="bf16", metavar="R",
                        help=f"precision recipe: {', '.join(profiler.PRECISIONS)} (default bf16)")
    parser.add_argument("--batch-size", default=None, metavar="B", help="micro-batch size (default: the spec's)")
    parser.add_argument("--seq-len", default=None, metavar="S", help="sequence length (default: the spec's)")
    parser.add_argument("--ac", default="none", metavar="MODE",
                        help=f"activation checkpointing: {', '.join(ESTIMATE_AC_MODES)} (ours: the fastest plan "
                             "under the device's memory; default none)")
    parser.add_argument("--solver", default="milp", metavar="NAME", help="the solver of --ac ours (default milp)")
    parser.add_argument("--compile", action="store_true",
                        help="every block compiled by inductor (torch.compile per block): saved bytes and times "
                             "modelled on the fake profile")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    add_layout_arguments(parser)


def render(result: EstimateResult, spec: str) -> list[str]:
    """The human-readable lines of an estimate."""
    lay = result.layout
    fit = (f"yes, {fmt_bytes(result.headroom_bytes)} to spare" if result.fits
           else f"no, {fmt_bytes(-result.headroom_bytes)} over")
    lines = [f"{spec} on {result.gpus} x {result.hardware} (TP{lay.tensor_parallel} PP{lay.pipeline_stages} "
             f"DP{lay.data_parallel}, ZeRO {lay.zero}, {result.precision}, ac {result.ac}"
             f"{', compiled' if result.compile else ''})",
             f"peak per rank       allocated {fmt_bytes(result.peak_allocated_bytes)}, reserved "
             f"{fmt_bytes(result.peak_reserved_bytes)} of {fmt_bytes(result.device_memory_bytes)}",
             f"fits                {fit}",
             f"step time           {result.step_time_s:.4f} s",
             f"tokens/s per GPU    {result.tokens_per_s_per_gpu:.1f}",
             f"MFU                 {100 * result.mfu:.2f} %"]
    if result.ac == "ours" and result.plan is not None:
        decisions = result.plan.decisions
        lines.append(f"plan                {len(decisions)} decisions" + (" (keep everything)" if not decisions else ""))
        lines += [f"  {target}: {d.action.value}" for target, d in decisions.items()]
    if result.note:
        lines.append(f"note                {result.note}")
    return lines


def run(args: argparse.Namespace) -> int:
    result = estimate(args.model, hardware=args.hardware, gpus=args.gpus, precision=args.precision,
                      batch_size=args.batch_size, seq_len=args.seq_len, ac=args.ac, model_args=args.model_args,
                      solver=args.solver, compile=args.compile, **given_flags(args))
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=False))
    else:
        print("\n".join(render(result, args.model)))
    return 0
