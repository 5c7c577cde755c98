"""``adaptive-mem bench --throughput BATCHES``: tokens per second at a fixed memory, the batch size free.

The memory is the measured peak of the plain model (``none``) at the bench's batch size. Each of no plan,
full recompute and ``torch.compile`` with its activation memory budget climbs the batch sizes (each run a
fresh worker process, as the bench's other runs) until its measured peak exceeds that memory; its row is
its largest batch that fits and the tokens per second there. ``torch.compile``'s budget at batch ``b`` is
the fraction of the keep-all activations that the memory leaves (from the profile scaled to ``b``). Ours:
``search.maximize_throughput`` chooses the batch size and the plan together, on profiles measured at the bench's
batch, at the smallest and largest of the batch sizes and doubling from the bench's batch (``profiled_sizes``);
the others are interpolated between the two around them (Note: [bracketing profiles]: a CPU step's efficiency
changes with the batch, neither proportionally nor along one line); the chosen pair and the two next-best predicted batches
are run and measured like the others (the predicted table is kept too).

Note: [ours measured to fit] ours' row, like the others', is measured to fit: it is the first of the three predicted
best whose measured peak is within the memory. The search plans up to the memory's edge and the peak model errs by a
fraction of a percent either way (a layer's backward gradient workspace is not modelled on its own), so the predicted
best can measure a few KB over; it is then listed as over the memory (``over_memory``), kept out of the ranking and
the paired rounds, and the predicted best is not the measured best.

With ``repeats`` (the bench's ``--repeats``), each of the three predicted best runs that many times, round robin
(b1, b2, b3, b1, ...: load on the machine hits all three alike), each run a fresh worker; they are ranked by the
median tokens/s, and the ranking is "resolved" only when the gap between the measured best and second is larger
than either one's spread (max - min of its runs). The other policies' rows take the median of ``repeats`` runs at
their largest batch that fits.

Runs in separate processes spread by 2-5 % here, more than the predicted tokens/s of the top three differ. With
``rounds``, the three are also timed in one process, a step of each per round (Note: [paired rounds]); that
measurement, when it ran, decides whether the predicted best is the measured best (``bench._paired``). Before the
search, the plain model at every profiled size is timed the same way, and the profiles' times are scaled to those
step ratios (Note: [aligned profiles], ``bench._align``): profiles taken one after another differ by the load.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any, Callable

from ._align import align_to_paired_steps, format_alignment

__all__ = ["throughput_section"]

log = logging.getLogger(__name__)

POLICIES = (("no plan", "none"), ("full recompute", "full"), ("torch.compile memory budget", "compile"))


def _compile_fraction(profiles: dict[int, Any], batch: int, memory: int) -> float:
    from search import StepModel, profile_for_batch
    from search.planning import activation_peak
    from search.planning import keep_all

    model = StepModel.build(profile_for_batch(profiles, batch))
    act = activation_peak(model, keep_all(model))
    return min(1.0, max(0.0, (memory - model.base) / act)) if act else 1.0


def throughput_section(*, profile: Any, batch_sizes: list[int], job: Callable[..., dict[str, Any]],
                       spawn: Callable[[dict[str, Any]], dict[str, Any]], out: Path, seq_len: int,
                       more_profiles: dict[int, Any] | None = None, repeats: int = 1,
                       rounds: int = 0) -> dict[str, Any]:
    """``job(policy, batch_size, **prepared)`` makes a worker job, ``spawn(job)`` runs it; returns the section.
    ``more_profiles`` (batch size -> profile): with ``profile``, what other batch sizes are scaled from (affine
    between the two around them, ``search.profile_for_batch``). ``repeats``: runs per measured row (medians).
    ``rounds``: paired rounds of ours' top three in one process (0: none)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: expected a positive integer")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds={rounds!r}: expected a non-negative integer")
    from search import InfeasibleBudgetError, maximize_throughput

    base = int(profile.model["batch_size"])
    profiles = {base: profile, **(more_profiles or {})}
    reference = spawn(job("none", base))
    if reference.get("status") != "ok":
        return {"error": f"the plain model at batch {base} failed: {reference.get('error')}"}
    memory = int(reference["peak_bytes"])
    alignment = None
    if rounds and len(profiles) > 1:
        profiles, alignment = align_to_paired_steps(profiles, reference=base, job=job("none", base), rounds=rounds,
                                                    spawn=spawn)
    rows = [_policy_row(label, name, profiles=profiles, batch_sizes=batch_sizes, base=base, reference=reference,
                        memory=memory, job=job, spawn=spawn, repeats=repeats) for label, name in POLICIES]
    head = {"memory_bytes": memory, "memory_from": f"measured peak of no plan at batch {base}",
            "batch_sizes": batch_sizes, "seq_len": seq_len, "repeats": repeats, "rows": rows}
    try:
        result = maximize_throughput(profiles=profiles, batch_sizes=batch_sizes, budget=memory)
    except InfeasibleBudgetError as exc:
        rows.append({"policy": "ours (batch and plan together)", "name": "ours-milp", "largest_batch": None,
                     "tokens_per_s": None, "peak_bytes": None, "error": str(exc)})
        return {**head, "ours_predicted": [], "profile_alignment": alignment}
    section, plans, process_best = _ours(result, head, profiles=profiles, memory=memory, job=job, spawn=spawn,
                                         out=out, repeats=repeats)
    section["profile_alignment"] = alignment
    checked = section["ours_top_predicted"]
    fitting = [k for k, c in enumerate(checked) if c["fits"]]  # Note: [ours measured to fit]
    if rounds and len(fitting) > 1 and all(c["status"] == "ok" for c in checked):
        batch, first = result.best[0], fitting[0]
        section["ours_paired"] = _paired(job("ours-milp", checked[first]["batch_size"], plan=plans[first]),
                                         [checked[k] for k in fitting], [plans[k] for k in fitting], rounds, spawn)
        if section["ours_paired"]["status"] == "ok":  # the paired rounds' ranking replaces the processes'
            paired = section["ours_paired"]
            section.update(predicted_best_is_measured_best=paired["measured_best"] == batch,
                           ours_ranking=paired["ranking"], ours_measured_gap=paired["gap"],
                           ranking_from="paired rounds", process_ranking=section["ours_ranking"],
                           process_gap=section["ours_measured_gap"], process_best=process_best)
    return section


def _policy_row(label: str, name: str, *, profiles: dict[int, Any], batch_sizes: list[int], base: int,
                reference: dict[str, Any], memory: int, job: Callable[..., dict[str, Any]],
                spawn: Callable[[dict[str, Any]], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """One competitor's row: the batch sizes tried in order up to the first that does not fit under ``memory``,
    the largest that fits run ``repeats`` times in all (medians)."""
    tried = []
    for b in batch_sizes:
        extra = {"budget": _compile_fraction(profiles, b, memory)} if name == "compile" else {}
        result = reference if (name == "none" and b == base) else spawn(job(name, b, **extra))
        fits = result.get("status") == "ok" and result["peak_bytes"] <= memory
        tried.append({"batch_size": b, "status": result.get("status"), "peak_bytes": result.get("peak_bytes"),
                      "tokens_per_s": result.get("tokens_per_s"), "fits": fits, **extra})
        if not fits:
            break  # a larger batch holds more
    best = max((t for t in tried if t["fits"]), key=lambda t: t["batch_size"], default=None)
    row = {"policy": label, "name": name, "largest_batch": best and best["batch_size"],
           "tokens_per_s": best and best["tokens_per_s"], "peak_bytes": best and best["peak_bytes"], "tried": tried}
    if best is not None:
        args = {"budget": best["budget"]} if name == "compile" else {}
        more = _interleaved([lambda: job(name, best["batch_size"], **args)], repeats - 1, spawn)[0]
        runs = _summary([best] + more)
        row.update(tokens_per_s=runs["tokens_per_s"], peak_bytes=runs["peak_bytes"], error=runs["error"],
                   runs_tokens_per_s=runs["runs_tokens_per_s"], spread=runs["spread"])
    return row


def _ours(result: Any, head: dict[str, Any], *, profiles: dict[int, Any], memory: int,
          job: Callable[..., dict[str, Any]], spawn: Callable[[dict[str, Any]], dict[str, Any]], out: Path,
          repeats: int) -> tuple[dict[str, Any], list[str], int | None]:
    """Ours' row and the section: the three predicted best (batch, plan) pairs saved and run interleaved,
    ``repeats`` times each, ranked by their process medians."""
    from search import fmt_bytes, scaling_error

    batch, solved = result.best
    path = out / "plans" / "throughput-ours.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    solved.plan.save(path)
    ranked = _top_predicted(result, 3)
    plans = [str(path)]
    for row in ranked[1:]:  # the predicted best must be the measured best of the three ranked highest
        other = out / "plans" / f"throughput-ours-batch{row.batch_size}.yaml"
        row.result.plan.save(other)
        plans.append(str(other))
    makers = [lambda b=row.batch_size, p=plan: job("ours-milp", b, plan=p) for row, plan in zip(ranked, plans)]
    checked = [{"batch_size": row.batch_size, "predicted_tokens_per_s": row.tokens_per_second, **_summary(runs)}
               for row, runs in zip(ranked, _interleaved(makers, repeats, spawn))]
    for c in checked:
        c["fits"] = c["status"] == "ok" and c["peak_bytes"] <= memory
    # Note: [ours measured to fit]: those that ran and measured over the memory are left out (a failure stays)
    ranked_ones = [c for c in checked if c["fits"] or c["status"] != "ok"]
    chosen = ranked_ones[0] if ranked_ones else checked[0]
    k = checked.index(chosen)
    head["rows"].append({"policy": "ours (batch and plan together)", "name": "ours-milp",
                         "largest_batch": chosen["batch_size"], "tokens_per_s": chosen["tokens_per_s"],
                         "peak_bytes": chosen["peak_bytes"], "runs_tokens_per_s": chosen["runs_tokens_per_s"],
                         "spread": chosen["spread"], "fits": chosen["fits"], "error": chosen["error"],
                         "predicted_tokens_per_s": ranked[k].tokens_per_second, "plan": plans[k],
                         "over_memory": [{"batch_size": c["batch_size"], "peak_bytes": c["peak_bytes"]}
                                         for c in checked[:k]]})
    predicted = [{"batch_size": r.batch_size, "source": r.source, "fits": r.fits, "step_time": r.step_time,
                  "tokens_per_s": r.tokens_per_second, "peak_bytes": r.peak_bytes, "note": r.note}
                 for r in result.rows]
    log.info("throughput at %s:\n%s", fmt_bytes(memory), result.table())
    best_measured = max((c for c in ranked_ones if c["tokens_per_s"] is not None), key=lambda c: c["tokens_per_s"],
                        default=None)
    ranking, gap = _ranking(ranked_ones)
    section = {**head, "ours_predicted": predicted, "ours_top_predicted": checked, "profiled_sizes": sorted(profiles),
               "scaling_checks": [c.describe() for c in scaling_error(profiles)],
               "predicted_best_is_measured_best": best_measured is not None and best_measured["batch_size"] == batch,
               "ours_ranking": ranking, "ours_measured_gap": gap, "ranking_from": "processes"}
    return section, plans, best_measured and best_measured["batch_size"]


def _paired(base: dict[str, Any], checked: list[dict[str, Any]], plans: list[str], rounds: int,
            spawn: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """The top three timed in one process, ``rounds`` paired rounds (Note: [paired rounds]), ranked by
    ``bench._paired.paired_ranking`` against the predicted best."""
    from ._paired import paired_ranking

    sizes = [c["batch_size"] for c in checked]
    result = spawn({**base, "kind": "paired", "rounds": rounds,
                    "candidates": [{"batch_size": b, "plan": p} for b, p in zip(sizes, plans)]})
    if result.get("status") != "ok":
        return {"status": result.get("status"), "error": result.get("error"), "rounds": rounds}
    ranked = paired_ranking(result["step_times"], result["tokens_per_step"])
    for c, tokens, ratio, interval in zip(checked, ranked["tokens_per_s"], ranked["ratio"], ranked["ratio_interval"]):
        c.update(paired_tokens_per_s=tokens, paired_ratio=ratio, paired_interval=interval)
    return {"status": "ok", "error": None, "rounds": ranked["rounds"], "measured_best": sizes[ranked["measured_best"]],
            "second": sizes[ranked["second"]], "gap": ranked["gap"], "lead_interval": ranked["lead_interval"],
            "ranking": ranked["ranking"], "step_times": result["step_times"]}


def _interleaved(makers: list[Callable[[], dict[str, Any]]], repeats: int,
                 spawn: Callable[[dict[str, Any]], dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``repeats`` runs of each job, round robin, a fresh job (and worker) per run; a job that failed is not rerun."""
    runs: list[list[dict[str, Any]]] = [[] for _ in makers]
    for _ in range(repeats):
        for k, make in enumerate(makers):
            if not runs[k] or runs[k][-1].get("status") == "ok":
                runs[k].append(spawn(make()))
    return runs


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one job: every run's tokens/s, their median, the spread (max - min) / median and the largest
    peak; failed when any run failed (a failure is no noise to take a median over)."""
    failed = next((r for r in runs if r.get("status") != "ok"), None)
    if failed is not None:
        return {"status": failed.get("status"), "error": failed.get("error"), "tokens_per_s": None,
                "runs_tokens_per_s": [r.get("tokens_per_s") for r in runs], "spread": None, "peak_bytes": None}
    tokens = [float(r["tokens_per_s"]) for r in runs]
    median = statistics.median(tokens)
    return {"status": "ok", "error": None, "tokens_per_s": median, "runs_tokens_per_s": tokens,
            "spread": (max(tokens) - min(tokens)) / median if median else 0.0,
            "peak_bytes": max(int(r["peak_bytes"]) for r in runs)}


def _ranking(checked: list[dict[str, Any]]) -> tuple[str, float | None]:
    """Whether the measurement resolves the measured best from the second, and their gap (relative to the second).

    Note: [ranking resolved] "resolved" needs the gap between the two medians larger, in tokens/s, than the range
    (max - min) of either one's runs; with one run each there is no range, so nothing is claimed."""
    measured = sorted((c for c in checked if c["tokens_per_s"] is not None), key=lambda c: -c["tokens_per_s"])
    if len(measured) < 2:
        return "fewer than two measured", None
    best, second = measured[:2]
    gap = best["tokens_per_s"] - second["tokens_per_s"]
    relative = gap / second["tokens_per_s"] if second["tokens_per_s"] else None
    if min(len(best["runs_tokens_per_s"]), len(second["runs_tokens_per_s"])) < 2:
        return "noise not measured (one run each)", relative
    noise = max(c["spread"] * c["tokens_per_s"] for c in (best, second))
    return ("resolved" if gap > noise else "within noise"), relative


def _top_predicted(result: Any, n: int) -> list[Any]:
    """The ``n`` fitting batch sizes with the most predicted tokens/s, the chosen one first."""
    fitting = [r for r in result.rows if r.fits and r.result is not None and r is not result.best_row]
    fitting.sort(key=lambda r: (-r.tokens_per_second, r.batch_size))
    return [result.best_row] + fitting[: n - 1]


def format_throughput(section: dict[str, Any]) -> str:
    """The section as a text table (largest batch that fits and tokens/s per policy)."""
    if "error" in section:
        return f"throughput: {section['error']}"
    repeats = section.get("repeats", 1)
    medians = f"; tokens/s: medians of {repeats} runs" if repeats > 1 else ""
    lines = [f"throughput at {section['memory_bytes'] / 2**20:.1f} MiB ({section['memory_from']}{medians}):",
             f"{'policy':>32}  {'largest batch':>13}  {'tokens/s':>10}  {'peak MiB':>9}"]
    for r in section["rows"]:
        if r["largest_batch"] is None or r["tokens_per_s"] is None:
            lines.append(f"{r['policy']:>32}  {'-':>13}  {'does not fit' if not r.get('error') else r['error']}")
            continue
        lines.append(f"{r['policy']:>32}  {r['largest_batch']:>13}  {r['tokens_per_s']:>10.1f}  "
                     f"{r['peak_bytes'] / 2**20:>9.1f}")
        lines += [f"{'':>32}  (batch {o['batch_size']}, predicted better, measured {o['peak_bytes'] / 2**20:.3f} MiB: "
                  "over the memory)" for o in r.get("over_memory") or []]
    if section.get("profiled_sizes"):
        lines.append(f"ours' profiles: batches {', '.join(map(str, section['profiled_sizes']))} measured, the others "
                     "interpolated between the two around them (or extrapolated beyond them)")
    lines += [f"  {check}" for check in section.get("scaling_checks") or []]
    if section.get("profile_alignment"):
        lines += format_alignment(section["profile_alignment"])
    top = section.get("ours_top_predicted") or []
    if top:
        lines.append(f"ours, the batches predicted best, {repeats} run(s) each, interleaved:")
        for c in top:
            runs = ", ".join("failed" if t is None else f"{t:.1f}" for t in c.get("runs_tokens_per_s") or [])
            measured = (f"median {c['tokens_per_s']:.1f} measured, spread {100 * c['spread']:.1f} %"
                        if c["tokens_per_s"] is not None else f"failed: {c.get('error')}")
            measured += "" if c.get("fits", True) or c["tokens_per_s"] is None else ", over the memory"
            lines.append(f"  batch {c['batch_size']}: {c['predicted_tokens_per_s']:.1f} predicted / {measured} "
                         f"(runs {runs})")
        paired = section.get("ours_paired")
        by_rounds = paired is not None and paired["status"] == "ok"
        best, ranking, gap = ((section.get("process_best") == top[0]["batch_size"], section.get("process_ranking"),
                               section.get("process_gap")) if by_rounds else
                              (section.get("predicted_best_is_measured_best"), section.get("ours_ranking"),
                               section.get("ours_measured_gap")))
        lines.append(_verdict("by process medians: " if by_rounds else "", best, gap, ranking))
        if paired is not None and not by_rounds:
            lines.append(f"  paired rounds in one process: failed: {paired.get('error')}")
        elif by_rounds:
            timed = [c for c in top if "paired_ratio" in c]  # those within the memory
            lines.append(f"ours, the same batches timed in one process, {paired['rounds']} paired rounds "
                         f"(tokens/s relative to batch {timed[0]['batch_size']}, median and its 95 % interval):")
            for c in timed:
                interval = c["paired_interval"]
                span = f" [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else ""
                lines.append(f"  batch {c['batch_size']}: median {c['paired_tokens_per_s']:.1f} tokens/s, "
                             f"ratio {c['paired_ratio']:.4f}{span}")
            lines.append(_verdict("by paired rounds: ", section["predicted_best_is_measured_best"],
                                  section["ours_measured_gap"], section["ours_ranking"]))
    return "\n".join(lines)


def _verdict(prefix: str, best: bool | None, gap: float | None, ranking: str | None) -> str:
    gap_text = f"gap best to second {100 * gap:.1f} %: " if gap is not None else ""
    return f"  {prefix}the predicted best {'is' if best else 'is NOT'} the measured best; {gap_text}{ranking}"


def profiled_sizes(base: int, batch_sizes: list[int]) -> list[int]:
    """The batch sizes profiled besides ``base``: doubling from it up to the largest, and the smallest and largest
    of ``batch_sizes``, so every other size is interpolated (Note: [bracketing profiles]): 1-8 from 2 gives 1, 4, 8."""
    lo, hi = min(batch_sizes), max(batch_sizes)
    sizes = {lo, hi}
    size = 2 * base
    while size < hi:
        sizes.add(size)
        size *= 2
    return sorted(sizes - {base})


def run_throughput(config: Any, batch_sizes: list[int]) -> dict[str, Any]:
    """The section for a :class:`~adaptive_mem.bench._runner.BenchConfig`: reuses ``out/profile.json`` when the
    bench's runs wrote it (and ``out/profile-batchN.json`` of an earlier run), else profiles and calibrates the model
    at the bench's batch size and at ``profiled_sizes``."""
    import profiler
    import torch

    from adaptive_mem._model_spec import build_model
    from adaptive_mem.adaptive._calibrate import calibrate

    from ._runner import _job, _spawn

    config.out.mkdir(parents=True, exist_ok=True)
    first = build_model(config.spec, model_args=config.model_args, batch_size=config.batch_size,
                        seq_len=config.seq_len, seed=config.seed)
    base = first.batch_size
    profiles = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)  # the profiles' times are taken as the workers run
    try:
        for size in [base, *profiled_sizes(base, batch_sizes)]:
            path = config.out / ("profile.json" if size == base else f"profile-batch{size}.json")
            loaded = profiler.Profile.load(path) if path.exists() else None
            if loaded is None or loaded.model.get("batch_size") != size:
                bundle = first if size == base else build_model(config.spec, model_args=config.model_args,
                                                                 batch_size=size, seq_len=config.seq_len,
                                                                 seed=config.seed)
                loaded = calibrate(bundle, profiler.profile_step(bundle, optimizer="adam"))
                loaded.save(path)
            profiles[size] = loaded
    finally:
        torch.set_num_threads(threads)
    profile = profiles.pop(base)
    workdir = config.out / "jobs"
    workdir.mkdir(exist_ok=True)

    def job(policy: str, batch: int, **extra: Any) -> dict[str, Any]:
        return {**_job(config, policy, None, {}), "batch_size": batch, **extra}

    return throughput_section(profile=profile, batch_sizes=batch_sizes, job=job,
                              spawn=lambda j: _spawn(j, workdir, config.timeout), out=config.out,
                              seq_len=first.seq_len, more_profiles=profiles, repeats=config.repeats,
                              rounds=config.paired_rounds)
