"""The throughput table's profiles aligned to plain steps timed in paired rounds (Note: [aligned profiles]).

Each profiled batch size's plain model (no plan) is timed in one worker process, a step of each size per round
(Note: [paired rounds]); the median over rounds of a size's step time over the reference size's, with its
distribution-free 95 % interval, is what ``align_profiles`` scales that profile's times to.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from typing import Any, Callable, Mapping

from profiler import Profile

from ._paired import median_interval

__all__ = ["align_profiles", "align_to_paired_steps", "format_alignment", "retime_profile"]

log = logging.getLogger(__name__)


def align_to_paired_steps(profiles: Mapping[int, Any], *, reference: int, job: dict[str, Any], rounds: int,
                          spawn: Callable[[dict[str, Any]], dict[str, Any]]) -> tuple[dict[int, Any], dict[str, Any]]:
    """``job``: the plain model's worker job (policy ``none``), run as a paired job over the profiled sizes.
    Returns the aligned profiles and the record (per size: measured and profiled step ratio, the factor); when the
    job fails, the profiles unchanged (with a warning) and the error."""
    from search.planning import keep_all_step_time

    sizes = sorted(profiles)
    result = spawn({**job, "kind": "paired", "rounds": rounds, "candidates": [{"batch_size": b} for b in sizes]})
    if result.get("status") != "ok":
        log.warning("throughput: the profiles are not aligned (the plain steps in paired rounds failed: %s)",
                    result.get("error"))
        return dict(profiles), {"status": result.get("status"), "error": result.get("error"), "rounds": rounds}
    times = dict(zip(sizes, result["step_times"]))
    n = min(len(t) for t in times.values())
    per_round = {b: [times[b][r] / times[reference][r] for r in range(n)] for b in sizes}
    ratios = {b: statistics.median(v) for b, v in per_round.items()}
    aligned = align_profiles(profiles, ratios, reference=reference)
    base = keep_all_step_time(profiles[reference])
    record = []
    for b in sizes:
        profiled = keep_all_step_time(profiles[b]) / base
        record.append({"batch_size": b, "measured_ratio": ratios[b], "profiled_ratio": profiled,
                       "interval": None if b == reference else median_interval(per_round[b]),
                       "factor": ratios[b] / profiled})
    return aligned, {"status": "ok", "error": None, "rounds": n, "reference": reference, "sizes": record,
                     "step_times": [times[b][:n] for b in sizes]}


def format_alignment(record: Mapping[str, Any]) -> list[str]:
    """The record as text lines (the profiles' step times against the paired plain steps)."""
    if record.get("status") != "ok":
        return [f"ours' profiles not aligned: the plain steps in paired rounds failed: {record.get('error')}"]
    lines = [f"ours' profiles aligned to plain steps timed in one process, {record['rounds']} paired rounds "
             f"(step time relative to batch {record['reference']}, median and its 95 % interval):"]
    for s in record["sizes"]:
        if s["batch_size"] == record["reference"]:
            continue
        span = f" [{s['interval'][0]:.4f}, {s['interval'][1]:.4f}]" if s["interval"] else ""
        lines.append(f"  batch {s['batch_size']}: measured {s['measured_ratio']:.4f}{span}, profiled "
                     f"{s['profiled_ratio']:.4f}: times x {s['factor']:.4f}")
    return lines


def retime_profile(profile: Profile, factor: float) -> Profile:
    """``profile`` with every compute time (ops, units, the step, the time outside the ops, the optimizer step)
    ``factor`` times longer; bytes and the hardware's link figures unchanged."""
    if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor < float("inf")):
        raise ValueError(f"factor={factor!r}: expected a positive finite number")
    return replace(profile, ops=[replace(o, fwd_time=o.fwd_time * factor, bwd_time=o.bwd_time * factor)
                                 for o in profile.ops],
                   units=[replace(u, fwd_time=u.fwd_time * factor, bwd_time=u.bwd_time * factor) for u in profile.units],
                   step_time=profile.step_time * factor, unattributed_time=profile.unattributed_time * factor,
                   optimizer_time=profile.optimizer_time * factor)


def align_profiles(profiles: Mapping[int, Profile], step_ratios: Mapping[int, float], *,
                   reference: int) -> dict[int, Profile]:
    """``profiles`` with each one's times scaled so that its keep-all step time relative to the ``reference``
    profile's is ``step_ratios[batch]`` (a plain step at that batch over one at ``reference``, measured); sizes
    without a ratio, and the reference, unchanged.

    Note: [aligned profiles] profiles of different batch sizes are measured one after another, and the load on a
    shared machine changes between them: their relative step times carry a few per cent of noise, more than the
    true differences in tokens/s among neighbouring batch sizes. Plain steps of every profiled size timed in one
    process, a step of each per round, measure those relative times far more closely (Note: [paired rounds]);
    a profile's own times keep their proportions (what recomputing one op costs against another)."""
    if reference not in profiles:
        raise ValueError(f"reference={reference!r}: expected one of the profiled batch sizes "
                         f"{', '.join(map(str, sorted(profiles)))}")
    for batch, ratio in step_ratios.items():
        if batch not in profiles:
            raise ValueError(f"step_ratios[{batch!r}]: no profile at batch {batch!r}; expected one of "
                             f"{', '.join(map(str, sorted(profiles)))}")
        if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio < float("inf")):
            raise ValueError(f"step_ratios[{batch}]={ratio!r}: expected a positive finite step time ratio")
    from search.planning import keep_all_step_time

    base = keep_all_step_time(profiles[reference])
    return {b: p if b == reference or b not in step_ratios
            else retime_profile(p, step_ratios[b] * base / keep_all_step_time(p)) for b, p in profiles.items()}
