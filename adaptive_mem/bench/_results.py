"""``results.json``: the bench's single source of truth (the report and plots are drawn from it).

Top level: ``format``, ``version``, ``created``, ``command``, ``machine``, ``model``,
``settings``, ``runs`` and optionally ``simulated``. One run row per (policy, budget)::

    {"policy": "ours-milp", "label": "...", "budget": 0.5, "budget_bytes": 123, "status": "ok",
     "peak_bytes": 456, "median_step_time": 1.23, "tokens_per_s": 830.0,
     "repeats": [{"peak_bytes": 456, "median_step_time": 1.22, "step_times": [...]}],
     "predicted_peak_bytes": 440, "predicted_step_time": 1.1, "plan_layers": [...],
     "timeline_measured": [[t, bytes], ...], "timeline_predicted": [[t, bytes], ...], "info": {...}}

A row of ``ours-milp`` run at the measured peak of eager competitors (``adaptive-mem bench
--match``, the default) has ``budget`` null, ``match`` the competitors' names (e.g.
``"full, hf-gc"``), ``match_peak_bytes`` their measured peak and ``budget_bytes`` the budget the
plan was searched for (that peak in the simulator's terms, see ``_runner``).

``status`` is ``ok``, ``failed`` (``error`` says why), ``infeasible`` (the policy has no plan
under the budget) or ``skipped`` (not applicable to this model).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_FORMAT", "RESULTS_VERSION", "ResultsError", "load_results", "save_results", "merge_repeats",
           "STATUSES", "budget_label"]

RESULTS_FORMAT = "adaptive-mem-bench"
RESULTS_VERSION = 1
STATUSES = ("ok", "failed", "infeasible", "skipped")


class ResultsError(ValueError):
    """A results file that is not of the documented form."""


def budget_label(row: dict[str, Any]) -> str:
    """``0.5``; ``= full`` for a run at a competitor's measured peak; ``-`` without a budget."""
    if row.get("match"):
        return f"= {row['match']}"
    return "-" if row.get("budget") is None else f"{row['budget']:g}"


def save_results(results: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")


def load_results(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ResultsError(f"results file {str(path)!r}: cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"results file {str(path)!r}: not valid JSON (line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT:
        raise ResultsError(f"results file {str(path)!r}: format={data.get('format') if isinstance(data, dict) else None!r}; "
                           f"expected {RESULTS_FORMAT!r}")
    if data.get("version") != RESULTS_VERSION:
        raise ResultsError(f"results file {str(path)!r}: version={data.get('version')!r}; expected {RESULTS_VERSION}")
    runs = data.get("runs")
    if not isinstance(runs, list):
        raise ResultsError(f"results file {str(path)!r}: runs: expected a list")
    for k, run in enumerate(runs):
        if not isinstance(run, dict) or run.get("status") not in STATUSES:
            raise ResultsError(f"results file {str(path)!r}: runs[{k}].status: expected one of {', '.join(STATUSES)}")
        if run["status"] == "ok":
            for key in ("peak_bytes", "median_step_time"):
                if not isinstance(run.get(key), (int, float)) or isinstance(run.get(key), bool):
                    raise ResultsError(f"results file {str(path)!r}: runs[{k}].{key}={run.get(key)!r}: expected a number")
    return data


def merge_repeats(row: dict[str, Any], measured: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """Fold the worker results of one (policy, budget) into its row: medians over repeats."""
    ok = [m for m in measured if m.get("status") == "ok"]
    if not ok:
        failed = next((m for m in measured if m.get("status") == "failed"), {})
        return {**row, "status": "failed", "error": failed.get("error", "no result"),
                "traceback": failed.get("traceback", "")}
    median = statistics.median(m["median_step_time"] for m in ok)
    last = ok[-1]
    return {
        **row,
        "status": "ok",
        "failed_repeats": [m.get("error", "no result") for m in measured if m.get("status") != "ok"],
        "peak_bytes": int(statistics.median(m["peak_bytes"] for m in ok)),
        "median_step_time": median,
        "tokens_per_s": tokens / median,
        "repeats": [{k: m[k] for k in ("peak_bytes", "median_step_time", "step_times", "warmup_steps",
                                       "warmup_times", "first_loss", "last_loss") if k in m} for m in ok],
        "timeline_measured": last["timeline_measured"],
        "info": last.get("info", {}),
    }
