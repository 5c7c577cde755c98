"""Run the bench: profile once, prepare every (policy, budget), run each in its own process.

Runs are interleaved across repeats (policy A, B, C, A, B, C, ...) so machine noise hits all
policies alike; each run is a fresh ``python -m adaptive_mem.bench._worker`` process.

With ``match`` (the default) the first repeat of every eager competitor runs first; its measured
peak (exact, the same in every repeat) sets the memory budget of one more ``ours-milp`` row, so
every competitor is compared with a plan of ours searched for its own memory. The budget is in
the simulator's terms: the competitor's predicted peak when it is a plan the simulator knows
(full, megatron-selective, hf-gc), else its measured peak scaled by the simulator's median
predicted/measured ratio on those competitors. Those rows then join the interleaved repeats.
Likewise ``ours-milp+compile`` (planned on the profile of the model compiled whole) is searched and
run at each ``compile`` and ``full+compile`` row's measured peak, in whole-model terms (Note: [whole-model
offset] in ``_compiled_match.py``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import statistics
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._compiled_match import whole_model_offset
from ._policies import get_policy
from ._prepare import PrepareContext
from ._results import RESULTS_FORMAT, RESULTS_VERSION, budget_label, merge_repeats

__all__ = ["BenchConfig", "run_bench"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    spec: str
    """Model spec (preset, hf:<family>, module:factory)."""
    budgets: tuple[float, ...]
    """Activation budgets: fractions of the unoptimized activation memory (as ``search --activation-budget``)."""
    policies: tuple[str, ...]
    """Policy names, see ``adaptive-mem bench --help``."""
    out: Path
    """Output directory (results.json, report.md, PNGs, plans/, profile.json)."""
    model_args: str | None = None
    """Overrides of the model config (``key=value,...``)."""
    batch_size: int | None = None
    """Micro-batch size (default: the spec's)."""
    seq_len: int | None = None
    """Sequence length (default: the spec's)."""
    steps: int = 5
    """Timed steps per run (after warm-up and the memory-tracked step)."""
    warmup: int = 1
    """Warm-up steps per run (at least one; adaptive mode warms up until it converges)."""
    repeats: int = 1
    """Processes per (policy, budget); the row holds the median of their median step times."""
    threads: int = 1
    """torch intra-op threads in each worker (the same for every policy)."""
    timeout: float = 1800.0
    """Seconds a single run may take before it is recorded as failed."""
    seed: int = 0
    """Weights and batches seed (the same for every policy)."""
    calibrate: bool = True
    """Measure how much compute a swap costs here (``adaptive_mem.calibrate``) before planning."""
    match: bool = True
    """Also run ``ours-milp`` at each eager competitor's measured peak (needs ``ours-milp`` in policies)."""
    command: str = ""
    """The command line, recorded in results.json."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend of the ``compile`` and ``ours-milp+compile`` runs (``inductor``, ``aot_eager``)."""
    paired_rounds: int = 15
    """Throughput table: paired rounds of ours' top three in one process (Note: [paired rounds]; 0: none)."""


def _machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in load]}


def _spawn(job: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=workdir, delete=False) as f:
        json.dump(job, f)
        job_path = Path(f.name)
    result_path = job_path.with_suffix(".result.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])}
    try:
        proc = subprocess.run([sys.executable, "-m", "adaptive_mem.bench._worker", str(job_path), str(result_path)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {timeout:g} s"}
    finally:
        job_path.unlink(missing_ok=True)
    if not result_path.exists():
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return {"status": "failed", "error": f"worker died: {tail[0]}"}
    result = json.loads(result_path.read_text())
    result_path.unlink(missing_ok=True)
    return result


def _job(config: BenchConfig, name: str, budget: float | None, prepared: dict[str, Any]) -> dict[str, Any]:
    return {"spec": config.spec, "model_args": config.model_args, "batch_size": config.batch_size,
            "seq_len": config.seq_len, "seed": config.seed, "steps": config.steps, "warmup": config.warmup,
            "threads": config.threads, "policy": name, "budget": budget, "compile_backend": config.compile_backend,
            **prepared}


def _predicted(row: dict[str, Any], prepared: dict[str, Any]) -> dict[str, Any]:
    for key in ("predicted_peak_bytes", "predicted_step_time", "plan_layers", "timeline_predicted", "plan",
                "predicted_peak_bytes_simulated", "planned_for", "whole_model_offset_bytes"):
        if key in prepared:
            row[key] = prepared[key]
    return row


_WHOLE_KEYS = ("predicted_peak_bytes_simulated", "planned_for")


def _competitors(rows: list[tuple[dict[str, Any], dict[str, Any] | None]], *, compiled: bool = False) -> list[int]:
    """Rows ours is matched against: the eager competitors, or (``compiled``) the ``compile`` and ``full+compile`` rows."""
    if compiled:
        return [k for k, (row, job) in enumerate(rows) if job is not None and row["policy"] in ("compile", "full+compile")]
    return [k for k, (row, job) in enumerate(rows)
            if job is not None and row["eager"] and not row["ours"] and row["policy"] != "none"]


def _matched_rows(config: BenchConfig, ctx: PrepareContext, rows: list, measured: list,
                  competitors: list[int], ours: str = "ours-milp", calibrators: list[int] = (),
                  offset: int | None = None) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """One ``ours`` row per distinct measured peak of the competitors' first runs; ``calibrators``: further
    rows whose first runs (with predictions on ``ctx``'s profile) give the predicted/measured ratio; ``offset``:
    ours + compile's whole-model offset (Note: [whole-model offset]), tried first."""
    from search import InfeasibleBudgetError

    from ._compiled_match import whole_model_prediction

    def ok(indices: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [(rows[k][0], measured[k][0]) for k in indices if measured[k] and measured[k][0].get("status") == "ok"]

    firsts = ok(competitors)
    ratios = [row["predicted_peak_bytes"] / first["peak_bytes"] for row, first in firsts + ok(calibrators)
              if row.get("predicted_peak_bytes") and (first.get("info") or {}).get("compile") != "whole-model"]
    calibration = statistics.median(ratios) if ratios else 1.0
    peaks: dict[int, tuple[int, list[str]]] = {}
    for row, first in firsts:
        label = row["policy"] + ("" if row["budget"] is None else f"@{row['budget']:g}")
        measured_peak = int(first["peak_bytes"])
        budget = int(row.get("predicted_peak_bytes") or measured_peak * calibration)
        peaks.setdefault(measured_peak, (budget, []))[1].append(label)
    policy = get_policy(ours)
    out = []
    for measured_peak, (budget, names) in sorted(peaks.items()):
        match = ", ".join(names)
        row = {"policy": policy.name, "label": policy.label_for(config.compile_backend), "budget": None,
               "budget_bytes": budget, "match": match,
               "match_peak_bytes": measured_peak, "eager": policy.eager, "ours": policy.ours}
        tag = f"{policy.name}-match-{names[0].replace('@', '-')}"
        try:
            whole = None if offset is None else whole_model_prediction(
                ctx.predict("milp", policy.name, budget=None, limit=measured_peak + offset, tag=tag), offset)
        except InfeasibleBudgetError:
            whole = None
        if whole is not None:
            row["budget_bytes"] = measured_peak + offset
            out.append((_predicted(row, whole), _job(config, policy.name, None, whole)))
            continue
        try:
            prepared = ctx.predict("milp", policy.name, budget=None, limit=budget, tag=tag)
        except InfeasibleBudgetError as exc:
            out.append(({**row, "status": "infeasible", "error": str(exc)}, None))
            continue
        out.append((_predicted(row, prepared), _job(config, policy.name, None, prepared)))
    return out


def _fit_matched(k: int, rows: list, measured: list, execute: Any, config: BenchConfig, ctx: PrepareContext,
                 bar: Any, *, tries: int = 3) -> None:
    """Note: [matched at no more memory]. A matched row must hold no more than the competitor's measured peak;
    the simulator's error (about 2 % on compiled blocks) can put it above. Its first run comes now: over the
    peak, the plan is searched again at the budget scaled by target / measured and run again (measured peaks
    are exact and repeat), at most ``tries`` runs; when none fits, the one with the lowest peak is kept. When no
    plan of ours fits lower (below full recompute's own prediction), the row keeps its run and says so in
    ``over_match`` (tests/test_bench_compile.py)."""
    from search import InfeasibleBudgetError

    from ._compiled_match import whole_model_prediction

    row, job = rows[k]
    best: tuple[int, tuple, list] | None = None  # the lowest peak run so far: (peak, (row, job), its results)
    for attempt in range(tries):
        execute([k])
        result = measured[k][-1]
        target = row["match_peak_bytes"]
        if result.get("status") != "ok" or result["peak_bytes"] <= target:
            return
        if best is None or result["peak_bytes"] < best[0]:
            best = (result["peak_bytes"], rows[k], list(measured[k]))
        if attempt == tries - 1:
            rows[k], measured[k][:] = best[1], best[2]  # over the peak: the run closest to it is kept
            return
        budget = int(row["budget_bytes"] * target / result["peak_bytes"]) - 1
        plan_ctx = ctx.compiled if row["policy"] == "ours-milp+compile" else ctx
        try:
            prepared = plan_ctx.predict("milp", row["policy"], budget=None, limit=budget,
                                        tag=f"{row['policy']}-match-{k}-fit{attempt + 1}")
        except InfeasibleBudgetError:
            log.info("%s matched to %s: measured %d B over its %d B, and no plan of ours fits lower", row["policy"],
                     row["match"], result["peak_bytes"] - target, target)
            rows[k] = ({**row, "over_match": "no plan of ours fits lower"}, job)
            return
        log.info("%s matched to %s: measured %d B over its %d B; searching again at %d B", row["policy"],
                 row["match"], result["peak_bytes"] - target, target, budget)
        prepared = whole_model_prediction(prepared, row.get("whole_model_offset_bytes")) or prepared
        row = _predicted({key: v for key, v in row.items() if key not in _WHOLE_KEYS} | {"budget_bytes": budget}, prepared)
        job = _job(config, row["policy"], None, prepared)
        rows[k] = (row, job)
        measured[k].clear()
        bar.total += 1
        bar.refresh()


def _rows(config: BenchConfig, ctx: PrepareContext) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(row, job or None) for every (policy, budget); jobs are None for runs that cannot start."""
    from search import InfeasibleBudgetError

    out = []
    for name in config.policies:
        policy = get_policy(name)
        budgets = config.budgets if policy.budgeted else (None,)
        reason = policy.unavailable(config.spec)
        for budget in budgets:
            row = {"policy": name, "label": policy.label_for(config.compile_backend), "budget": budget,
                   "budget_bytes": ctx.budget_bytes(budget),
                   "eager": policy.eager, "ours": policy.ours}
            if reason is not None:
                out.append(({**row, "status": "skipped", "error": reason}, None))
                continue
            try:
                prepared = policy.prepare(ctx, budget)
            except InfeasibleBudgetError as exc:
                out.append(({**row, "status": "infeasible", "error": str(exc)}, None))
                continue
            out.append((_predicted(row, prepared), _job(config, name, budget, prepared)))
    return out


def run_bench(config: BenchConfig, *, progress: bool = True, profile: Any = None) -> dict[str, Any]:
    """Profile (unless ``profile`` is given), prepare and run every (policy, budget); returns the
    results dict (not yet saved)."""
    config.out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)  # the profile's times are taken as the workers run
    try:
        return _run(config, progress, profile)
    finally:
        torch.set_num_threads(threads)


def _run(config: BenchConfig, progress: bool, profile: Any) -> dict[str, Any]:
    from adaptive_mem._model_spec import build_model

    bundle = build_model(config.spec, model_args=config.model_args, batch_size=config.batch_size,
                         seq_len=config.seq_len, seed=config.seed)
    profile, ctx = _profiles(config, bundle, profile)
    tokens = bundle.batch_size * bundle.seq_len
    rows = _rows(config, ctx)
    measured = _measure(config, ctx, rows, progress)
    runs = [row if job is None else merge_repeats(row, measured[k], tokens) for k, (row, job) in enumerate(rows)]
    model = ctx.model
    match = config.match and ("ours-milp" in config.policies or "ours-milp+compile" in config.policies)
    return {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": config.command,
        "machine": {**_machine(), "threads_per_run": config.threads},
        "model": {"spec": config.spec, "model_args": config.model_args, "batch_size": bundle.batch_size,
                  "seq_len": bundle.seq_len, "dtype": str(bundle.dtype).removeprefix("torch."),
                  "tokens_per_step": tokens, "num_layers": profile.num_layers,
                  "static_bytes": profile.static.total, "base_bytes": model.base,
                  "predicted_unoptimized_peak_bytes": ctx.unoptimized_peak},
        "settings": {"budgets": list(config.budgets), "policies": list(config.policies), "steps": config.steps,
                     "warmup": config.warmup, "repeats": config.repeats, "seed": config.seed,
                     "match": match, "compile_backend": config.compile_backend},
        "runs": runs,
    }


def _profiles(config: BenchConfig, bundle: Any, profile: Any) -> tuple[Any, PrepareContext]:
    """The profile the plans are searched on (made and calibrated unless given), saved in ``config.out``, and
    the prepare context; with a policy that plans on the compiled model, its compiled profile too."""
    import profiler

    from adaptive_mem.adaptive._calibrate import calibrate

    if profile is None:
        log.info("profiling %s (batch %d x seq %d) for the predictions and plans", config.spec, bundle.batch_size,
                 bundle.seq_len)
        profile = profiler.profile_step(bundle, optimizer="adam")
        if config.calibrate:
            profile = calibrate(bundle, profile)  # Note: [swap compute]
    profile.save(config.out / "profile.json")
    ctx = PrepareContext(profile, config.out)
    if any(get_policy(name).compiled_profile for name in config.policies):
        log.info("profiling %s with every block compiled and the whole model's graph (%s)", config.spec,
                 config.compile_backend)
        compiled = profiler.profile_compiled(bundle, profile, backend=config.compile_backend, layout="whole-model")
        compiled.save(config.out / "profile-compiled.json")
        ctx.compiled = PrepareContext(compiled, config.out)
    return profile, ctx


def _measure(config: BenchConfig, ctx: PrepareContext, rows: list, progress: bool) -> list[list[dict[str, Any]]]:
    """Run every row's job ``config.repeats`` times, each in its own worker; the results per row.

    The competitors' peaks run first; the matched rows searched at them are appended to ``rows``."""
    from tqdm import tqdm

    measured: list[list[dict[str, Any]]] = [[] for _ in rows]
    match = config.match and "ours-milp" in config.policies
    match_compiled = config.match and "ours-milp+compile" in config.policies
    eager_first = _competitors(rows) if match else []
    compiled_first = _competitors(rows, compiled=True) if match_compiled else []
    # ours + compile's own budget rows run first too: compile rows have no prediction to put the matched
    # budget in the compiled profile's terms, ours + compile's predicted/measured ratio does
    compiled_calibrators = [k for k, (row, job) in enumerate(rows)
                            if match_compiled and job is not None and row["policy"] == "ours-milp+compile"]
    first = eager_first + compiled_first + compiled_calibrators
    jobs = sum(job is not None for _, job in rows)
    workdir = config.out / "jobs"
    workdir.mkdir(exist_ok=True)
    with tqdm(total=jobs * config.repeats, desc="bench runs", unit="run", file=sys.stderr,
              disable=not progress) as bar:

        def execute(todo: list[int]) -> None:
            for k in todo:
                row, job = rows[k]
                bar.set_postfix_str(f"{row['policy']}@{budget_label(row)}")
                result = _spawn(job, workdir, config.timeout)
                if result.get("status") != "ok":
                    log.warning("%s at budget %s: %s", row["policy"], budget_label(row), result.get("error"))
                measured[k].append(result)
                bar.update(1)

        execute(first)  # the competitors' peaks, for the matched rows
        if match or match_compiled:
            extra = _matched_rows(config, ctx, rows, measured, eager_first) if match else []
            if match_compiled:
                offset = whole_model_offset(ctx.compiled, rows, measured)
                extra += _matched_rows(config, ctx.compiled, rows, measured, compiled_first, "ours-milp+compile",
                                       compiled_calibrators, offset)
            _run_matched(extra, rows, measured, execute, config, ctx, bar, first)
        done_first = set(first)
        execute([k for r in range(config.repeats) for k, (_, job) in enumerate(rows)
                 if job is not None and not (r == 0 and k in done_first)])
    try:
        workdir.rmdir()
    except OSError:
        pass
    return measured


def _run_matched(extra: list, rows: list, measured: list, execute: Any, config: BenchConfig, ctx: PrepareContext,
                 bar: Any, first: list[int]) -> None:
    """Append the matched rows and run each once, fitted to its competitor's peak; they count as run first."""
    start = len(rows)
    rows += extra
    measured += [[] for _ in extra]
    bar.total += config.repeats * sum(job is not None for _, job in extra)
    bar.refresh()
    log.info("matched rows: ours at %d competitor peaks", len(extra))
    for k in range(start, len(rows)):
        if rows[k][1] is not None:
            _fit_matched(k, rows, measured, execute, config, ctx, bar)
            first.append(k)
