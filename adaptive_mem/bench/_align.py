"""The throughput table's profiles aligned to plain steps timed in paired rounds (Note: [aligned profiles]).

Each profiled batch size's plain model (no plan) is timed in one worker process, a step of each size per round
(Note: [paired rounds]); the median over rounds of a size's step time over the reference size's, with its
distribution-free 95 % interval, is what ``search.align_profiles`` scales that profile's times to.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable, Mapping

from ._paired import median_interval

__all__ = ["align_to_paired_steps", "format_alignment"]

log = logging.getLogger(__name__)


def align_to_paired_steps(profiles: Mapping[int, Any], *, reference: int, job: dict[str, Any], rounds: int,
                          spawn: Callable[[dict[str, Any]], dict[str, Any]]) -> tuple[dict[int, Any], dict[str, Any]]:
    """``job``: the plain model's worker job (policy ``none``), run as a paired job over the profiled sizes.
    Returns the aligned profiles and the record (per size: measured and profiled step ratio, the factor); when the
    job fails, the profiles unchanged (with a warning) and the error."""
    from search import align_profiles, keep_all_step_time

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
