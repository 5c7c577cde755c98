"""``adaptive-mem simulate``: predicted peak memory, step time and stalls of a plan on a profile.

A plan file with a plan per sequence-length bucket (Note: [plan buckets]) is simulated with the plan of the bucket the
profile's sequence length falls in, as ``run --plan`` picks it per step; a length no bucket covers is refused.
"""

from __future__ import annotations

import argparse
import logging

from profiler import Layout, is_cuda_hardware
from search import Plan, SeqLenBucketError, StepModel, fmt_bytes, seq_len_bucket, simulate
from search.planning import busiest_stage, device_shortfall
from search.planning import check_plan_matches

from adaptive_mem.runtime._buckets import plan_for_seq_len

from ._common import add_profile_arguments, check_output_path, load

NAME = "simulate"
HELP = "predict peak device memory, step time and stalls of a plan on a profile (no training)"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument("plan", help="plan YAML/JSON")
    parser.add_argument("--timeline", default=None, metavar="PNG", help="also draw the step's timeline here")


def _bucket_of(plan: Plan, seq_len: int | None, path: str) -> Plan:
    """The plan of the bucket ``seq_len`` (the profile's) falls in; ``plan`` without buckets or without a length."""
    if not plan.buckets or seq_len is None:
        return plan
    lengths = tuple(s for s, _ in plan.buckets)
    try:
        bucket = seq_len_bucket(int(seq_len), lengths)
    except SeqLenBucketError:
        raise SeqLenBucketError(f"plan file {path!r}: the profile's seq_len={seq_len} is above every bucket "
                                f"({','.join(map(str, lengths))}); expected a profile of at most {max(lengths)} "
                                "tokens or a plan with a longer bucket") from None
    log.info("plan file %s: the plan of bucket %d for the profile's %s tokens", path, bucket, seq_len)
    return plan_for_seq_len(plan, bucket)


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    profile, hardware = load(args)
    plan = _bucket_of(plan, profile.model.get("seq_len"), args.plan)
    check_plan_matches(plan, profile, source=f"plan file {args.plan!r}")
    if args.timeline:
        check_output_path(args.timeline, flag="--timeline")
    layout = profile.model.get("layout") or {}
    if layout.get("pipeline_stages", 1) * layout.get("virtual_pipeline_stages", 1) > 1:
        log.warning("profile %s is of a pipelined layout (%s stages x %s chunks): simulated here as one stage holding "
                    "every layer, one micro-batch; the per-stage figures are in the plan's meta.pipeline "
                    "(adaptive-mem search)", args.profile, layout.get("pipeline_stages"),
                    layout.get("virtual_pipeline_stages", 1))
    model = StepModel.build(profile, hardware=hardware)
    sim = simulate(model, plan, record=args.timeline is not None)
    print(f"peak device memory  {fmt_bytes(sim.peak_bytes)} ({sim.peak_bytes} bytes)")
    if is_cuda_hardware(model.hardware.name):  # the caching allocator's reserve: Note: [allocator reserve]
        print(f"peak reserved       {fmt_bytes(sim.peak_reserved_bytes)} ({sim.peak_reserved_bytes} bytes)")
    print(f"step time           {sim.step_time:.6f} s")
    print(f"stall time          {sim.stall_time:.6f} s")
    print(f"recompute time      {sim.recompute_time:.6f} s")
    print(f"swapped per step    {fmt_bytes(sim.swapped_bytes)}")
    shortfall, where = device_shortfall(model.hardware, static=model.static_bytes, peak=sim.peak_bytes), ""
    if layout.get("pipeline_stages", 1) > 1:  # the whole-model peak is no rank's: judge the busiest rank's static
        busiest = busiest_stage(profile, Layout.from_dict(layout))
        where = f"one rank of {busiest.describe(layout['pipeline_stages'])}, the busiest: "
        shortfall = device_shortfall(model.hardware, static=busiest.static.total)
    if shortfall:
        log.warning("%s%s", where, shortfall)
    if args.timeline:
        assert sim.timeline is not None
        sim.timeline.plot(args.timeline, title=f"simulated step: {args.plan}")
        print(f"wrote {args.timeline}")
    return 0
