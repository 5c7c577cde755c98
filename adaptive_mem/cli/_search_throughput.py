"""``adaptive-mem search --maximize throughput``: the micro-batch size and the plan chosen together.

Profiles come from the PROFILE arguments (one model at one or more batch sizes) and, with ``--model
SPEC``, from profiling every other requested batch size the way the first profile was made (measured
on this CPU, or on fake tensors for its hardware); a batch size with no profile is scaled from the two
nearest (Note: [batch scaling] in ``search/_scaling.py``) and its row says "extrapolated". With three
or more profiles, the scaling rule is checked against each beyond the two smallest.
"""

from __future__ import annotations

import argparse
import logging
from typing import Callable

from profiler import Profile
from search import Budget, fmt_bytes, fmt_seconds, maximize_throughput, parse_batch_sizes, scaling_error, solver_names
from search._budget import DeviceMemoryError, device_capacity

from ._common import check_output_path, positive

log = logging.getLogger("adaptive_mem.cli._search")

MAXIMIZE = ("throughput",)


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--maximize", default=None, metavar="WHAT",
                        help="throughput: choose the micro-batch size among --batch-sizes together with the plan, "
                             "for the most tokens per second under --budget (default: the fastest plan at the "
                             "profile's batch size)")
    parser.add_argument("--batch-sizes", default=None, metavar="LIST",
                        help="with --maximize throughput: micro-batch sizes to compare, e.g. 1,2,4,8 or 1-16")
    parser.add_argument("--model", default=None, metavar="SPEC",
                        help="with --maximize throughput: profile each batch size that no PROFILE covers with this "
                             "model spec (else those are extrapolated from the profiles)")
    parser.add_argument("--model-args", default=None, metavar="K=V,...", help="with --model: the model's overrides")


def _structure(profile: Profile) -> str | None:
    fingerprint = profile.model.get("fingerprint")
    return fingerprint.partition("-")[0] if isinstance(fingerprint, str) else None


def _load_profiles(paths: list[str]) -> dict[int, Profile]:
    out: dict[int, Profile] = {}
    for path in paths:
        profile = Profile.load(path)
        batch = profile.model.get("batch_size")
        if batch is None:
            raise ValueError(f"profile={path!r}: profile.model.batch_size is missing; expected the batch size it "
                             "was made at (throughput mode scales by it)")
        if batch in out:
            raise ValueError(f"profile={path!r}: a second profile at batch size {batch}; expected one per batch size")
        if out:
            first = next(iter(out.values()))
            if _structure(profile) != _structure(first) or profile.num_layers != first.num_layers:
                raise ValueError(f"profile={path!r}: another model than the first profile's; expected profiles of "
                                 "one model at different batch sizes")
        out[batch] = profile
    return out


def _profile_more(args: argparse.Namespace, profiles: dict[int, Profile], sizes: list[int]) -> None:
    """Profile the requested batch sizes no PROFILE covers, as the first profile was made."""
    import dataclasses

    import profiler

    from adaptive_mem._model_spec import build_model

    ref = next(iter(profiles.values()))
    device = "cpu" if ref.measured else "meta"
    for b in sizes:
        if b in profiles:
            continue
        log.info("profiling %s at batch size %d on %s", args.model, b, device)
        bundle = build_model(args.model, model_args=args.model_args, batch_size=b, seq_len=ref.model.get("seq_len"),
                             dtype=ref.model.get("dtype", "float32"), device=device)
        prof = profiler.profile_step(bundle, hardware=None if ref.measured else ref.hardware,
                                     optimizer=ref.static.optimizer)
        if _structure(prof) != _structure(ref):
            raise ValueError(f"--model={args.model!r}: another model than the profile's (structure fingerprint "
                             f"{_structure(prof)} vs {_structure(ref)}); expected the spec the profile was made from")
        if ref.measured:  # the calibrated costs of swaps and SAC policies carry over
            prof = dataclasses.replace(prof, hardware=ref.hardware)
        profiles[b] = prof


def run_throughput(args: argparse.Namespace, *, write: Callable[..., None]) -> int:
    if args.maximize not in MAXIMIZE:
        raise ValueError(f"--maximize={args.maximize!r}: expected one of {', '.join(MAXIMIZE)}")
    if args.batch_sizes is None:
        raise ValueError("--maximize throughput without --batch-sizes: expected e.g. --batch-sizes 1,2,4,8 or 1-16")
    sizes = parse_batch_sizes(args.batch_sizes)
    if args.activation_budget is not None:
        raise ValueError(f"--activation-budget={args.activation_budget!r} with --maximize throughput: a fraction of "
                         "the keep-all activations differs per batch size; expected --budget SIZE")
    for flag, value in (("--pipeline-stages", args.pipeline_stages), ("--micro-batches", args.micro_batches)):
        if value is not None and positive(flag, value) != 1:
            raise ValueError(f"{flag}={value!r} with --maximize throughput: expected 1 (one stage, one micro-batch)")
    for key in ("tensor_parallel", "virtual_pipeline_stages", "data_parallel", "sequence_parallel", "zero", "schedule"):
        if getattr(args, key, None) is not None:
            raise ValueError(f"--{key.replace('_', '-')}={getattr(args, key)!r} with --maximize throughput: expected "
                             "no parallel layout (throughput mode plans one device)")
    if args.model_args is not None and args.model is None:
        raise ValueError(f"--model-args={args.model_args!r} without --model: expected both")
    if args.format not in ("plan", "mindformers", "megatron"):
        raise ValueError(f"--format={args.format!r}: expected one of plan, mindformers, megatron")
    if args.solver not in solver_names():
        raise ValueError(f"--solver={args.solver!r}: unknown solver; expected one of {', '.join(solver_names())}")
    budget = Budget.parse(budget=args.budget)
    check_output_path(args.output, flag="--output")
    hardware = None
    if args.hardware is not None:
        import profiler

        hardware = profiler.hardware_spec(args.hardware)
    profiles = _load_profiles(args.profile)
    ref = next(iter(profiles.values()))
    cap = device_capacity(hardware or ref.hardware)
    if cap is not None and budget.total is not None and budget.total > cap:
        raise DeviceMemoryError(f"--budget={args.budget!r}: {fmt_bytes(budget.total)} is more than the device's "
                                f"{fmt_bytes(cap)}; expected at most {cap >> 20}MiB")
    if args.model is not None:
        _profile_more(args, profiles, sizes)
    for check in scaling_error(profiles):
        (print if check.ok else log.warning)(check.describe())
    result = maximize_throughput(profiles=profiles, batch_sizes=sizes, budget=budget, solver=args.solver,
                                 hardware=hardware)
    print(f"throughput under --budget {args.budget} ({args.solver}):")
    print(result.table())
    batch, best = result.best
    print(f"best: batch size {batch}, {result.best_row.tokens_per_second:,.1f} {result.unit}, "
          f"step {fmt_seconds(best.cost.step_time)}, peak {fmt_bytes(result.best_row.peak_bytes)} ({result.best_row.source})")
    plan = best.plan
    plan.meta["budget_spec"] = budget.describe()
    plan.meta["maximize"] = "throughput"
    write(plan, args.format, args.output, ref.num_layers)
    print(f"wrote {args.output} ({args.format}, batch size {batch}, {len(plan.decisions)} decisions)")
    return 0
