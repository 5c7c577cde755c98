"""``report.md`` from ``results.json``: a pure function of the results (a test regenerates and compares).

Every figure in the report is read from the results; nothing is measured here.
"""

from __future__ import annotations

from typing import Any

from ._align import format_alignment
from ._results import budget_label

__all__ = ["render_report", "compare", "compile_landing", "TIME_TOLERANCE", "PLOTS"]

TIME_TOLERANCE = 0.02
"""Our plan may be this much slower than a competitor at equal or lower memory (acceptance: 2%)."""

PLOTS = {"pareto": "pareto.png", "plan_layers": "plan_layers.png", "timeline": "timeline.png",
         "simulated_pareto": "simulated_pareto.png"}


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.4f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _budget(b: float | None) -> str:
    return "-" if b is None else f"{b:g}"


def _ok(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if r["status"] == "ok"]


def _find(results: dict[str, Any], policy: str) -> dict[str, Any] | None:
    return next((r for r in _ok(results) if r["policy"] == policy and r["budget"] is None), None)


def compare(results: dict[str, Any], *, ours: str = "ours-milp", against: str | None = None) -> list[dict[str, Any]]:
    """For each eager competitor run (``against``: each run of that policy): our fastest run at equal or lower
    measured peak, and the verdict.

    ``verdict``: ``pass`` (ours no slower beyond TIME_TOLERANCE), ``fail``, or ``no-match`` (every run
    of ours used more memory than the competitor; nothing to compare at equal memory).
    """
    mine = [r for r in _ok(results) if r["policy"] == ours]
    out = []
    for c in _ok(results):
        if against is not None and c["policy"] != against:
            continue
        if against is None and (not c.get("eager") or c["policy"] == "none" or c.get("ours")):
            continue
        fits = [r for r in mine if r["peak_bytes"] <= c["peak_bytes"]]
        if not fits:
            out.append({"competitor": c["policy"], "budget": c["budget"], "peak_bytes": c["peak_bytes"],
                        "step_time": c["median_step_time"], "verdict": "no-match"})
            continue
        best = min(fits, key=lambda r: r["median_step_time"])
        ratio = best["median_step_time"] / c["median_step_time"]
        out.append({"competitor": c["policy"], "budget": c["budget"], "peak_bytes": c["peak_bytes"],
                    "step_time": c["median_step_time"], "ours_budget": best["budget"],
                    "ours_budget_label": budget_label(best) + (
                        f" ({best['info']['compile']})" if (best.get("info") or {}).get("compile") else ""),
                    "ours_peak_bytes": best["peak_bytes"], "ours_step_time": best["median_step_time"],
                    "ratio": ratio, "verdict": "pass" if ratio <= 1 + TIME_TOLERANCE else "fail"})
    return out


def compile_landing(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Where torch.compile's activation_memory_budget lands: measured activation share vs asked."""
    none = _find(results, "none")
    if none is None:
        return []
    base = results["model"]["base_bytes"]
    span = none["peak_bytes"] - base
    out = []
    for r in _ok(results):
        if r["policy"] != "compile" or span <= 0:
            continue
        out.append({"budget": r["budget"], "peak_bytes": r["peak_bytes"],
                    "measured_fraction": (r["peak_bytes"] - base) / span, "step_time": r["median_step_time"]})
    return out


def _runs_table(results: dict[str, Any]) -> list[str]:
    none = _find(results, "none")
    full = _find(results, "full")
    lines = ["| policy | budget | status | measured peak (MiB) | vs no checkpointing | median step (s) | "
             "vs full recompute | tokens/s | predicted peak (MiB) | predicted step (s) | peak error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        if r["status"] != "ok":
            lines.append(f"| {r['policy']} | {budget_label(r)} | {r['status']} | - | - | - | - | - | - | - | - |")
            continue
        mem = None if none is None else r["peak_bytes"] / none["peak_bytes"] - 1
        time = None if full is None else r["median_step_time"] / full["median_step_time"] - 1
        pred = r.get("predicted_peak_bytes")
        err = None if pred is None else pred / r["peak_bytes"] - 1
        layout = (r.get("info") or {}).get("compile")
        name = r["policy"] + (f" ({layout})" if layout else "")
        lines.append(f"| {name} | {budget_label(r)} | ok | {_mib(r['peak_bytes'])} | {_pct(mem)} | "
                     f"{_s(r['median_step_time'])} | {_pct(time)} | {r['tokens_per_s']:.0f} | {_mib(pred)} | "
                     f"{_s(r.get('predicted_step_time'))} | {_pct(err)} |")
    return lines


def _comparison(results: dict[str, Any]) -> list[str]:
    rows = compare(results)
    if not rows:
        return ["No eager competitor and `ours-milp` run both succeeded: nothing to compare."]
    passed = sum(r["verdict"] == "pass" for r in rows)
    failed = sum(r["verdict"] == "fail" for r in rows)
    lines = [f"For each eager competitor run, our fastest `ours-milp` run whose measured peak is equal or lower "
             f"(budget `= name`: the plan searched for that competitor's own measured peak); "
             f"it passes when its median step time is at most {1 + TIME_TOLERANCE:.2f}x the competitor's. "
             f"**{passed} pass, {failed} fail, {len(rows) - passed - failed} without a run of ours at equal or "
             f"lower memory.**", "",
             "| competitor | its budget | its peak (MiB) | its step (s) | ours at budget | our peak (MiB) | "
             "our step (s) | ours / its | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    return lines + _verdict_rows(rows, named=True)


def _verdict_rows(rows: list[dict[str, Any]], *, named: bool) -> list[str]:
    """One table row per competitor run against our fastest run at equal or lower memory."""
    lines = []
    for r in rows:
        theirs = (f"| {r['competitor']} " if named else "") + \
            f"| {_budget(r['budget'])} | {_mib(r['peak_bytes'])} | {_s(r['step_time'])} |"
        if r["verdict"] == "no-match":
            lines.append(f"{theirs} - | - | - | - | no run of ours at <= its memory |")
            continue
        lines.append(f"{theirs} {r['ours_budget_label']} | {_mib(r['ours_peak_bytes'])} | {_s(r['ours_step_time'])} | "
                     f"{r['ratio']:.3f} | {r['verdict']} |")
    return lines


def _compiled_comparison(results: dict[str, Any]) -> list[str]:
    rows = compare(results, ours="ours-milp+compile", against="compile")
    if not rows:
        return []
    lines = ["", "## Ours + compile against compile alone", "",
             "For each `compile` run, our fastest `ours-milp+compile` run whose measured peak is equal or lower "
             "(budget `= compile@F`: the plan searched for that run's measured peak).", "",
             "| compile budget | its peak (MiB) | its step (s) | ours at budget | our peak (MiB) | our step (s) | "
             "ours / its | verdict |", "|---|---|---|---|---|---|---|---|"]
    return lines + _verdict_rows(rows, named=False)


def _compile(results: dict[str, Any]) -> list[str]:
    rows = compile_landing(results)
    if not rows:
        return []
    lines = ["", "## Where torch.compile's budget lands", "",
             "`torch._functorch.config.activation_memory_budget` asks the min-cut partitioner for a share of "
             "the activation memory it would save. Measured share = (peak - B) / (no-checkpointing peak - B), "
             "B = parameters + optimizer state + inputs (held the whole step); our `ours-milp` runs at the same "
             "budgets are in the table above for comparison:", "", "| asked | measured peak (MiB) | measured share | median step (s) |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {_budget(r['budget'])} | {_mib(r['peak_bytes'])} | {r['measured_fraction']:.2f} | "
                     f"{_s(r['step_time'])} |")
    return lines


def _detail(r: dict[str, Any]) -> str | None:
    info = r.get("info") or {}
    warm = (r.get("repeats") or [{}])[0]
    if r["policy"] == "sac-ilp" and "checkpointed_layers" in info:
        return (f"sac_milp checkpointed {info['checkpointed_layers']} layer(s) under "
                f"{_mib(info.get('sac_milp_budget_bytes'))} MiB (its model: parameters, gradients, activations; "
                f"no optimizer state); estimators + MILP took {info.get('solve_seconds', 0):.1f} s")
    if r["policy"] == "ours-adaptive" and "adaptive_summary" in info:
        return f"{info['adaptive_summary']} ({warm.get('warmup_steps', '?')} warm-up steps before measuring)"
    if r["policy"] in ("compile", "full+compile", "ours-milp+compile") and info.get("backend"):
        what = f"backend {info['backend']}" + (f", compiled {info['compile']}" if info.get("compile") else "")
        return f"{what}; first (compiling) step took {warm.get('warmup_times', ['?'])[0]} s" \
            if warm.get("warmup_times") else what
    return None


def _details(results: dict[str, Any]) -> list[str]:
    lines = []
    for r in _ok(results):
        text = _detail(r)
        if text:
            lines.append(f"- `{r['policy']}` at budget {budget_label(r)}: {text}")
        if r.get("failed_repeats"):
            lines.append(f"- `{r['policy']}` at budget {budget_label(r)}: {len(r['failed_repeats'])} of "
                         f"{len(r['failed_repeats']) + len(r.get('repeats', []))} processes failed "
                         f"({r['failed_repeats'][0]}); the row holds the others")
    return ["", "## Run details", ""] + lines if lines else []


def _problems(results: dict[str, Any]) -> list[str]:
    bad = [r for r in results["runs"] if r["status"] != "ok"]
    if not bad:
        return []
    lines = ["", "## Runs that did not complete", ""]
    for r in bad:
        lines.append(f"- `{r['policy']}` at budget {budget_label(r)}: **{r['status']}**: {r.get('error', '')}")
    return lines


def _simulated(results: dict[str, Any]) -> list[str]:
    sim = results.get("simulated")
    if not sim:
        return []
    lines = ["", f"## Simulated on {sim['hardware']} (fake-tensor profiles)", "", sim.get("method", ""), ""]
    lines += ["| model | policy | configuration | devices | TFLOPs per device | gain over full recompute |",
              "|---|---|---|---|---|---|"]
    for r in sim["rows"]:
        tflops = "does not fit" if r.get("tflops") is None else f"{r['tflops']:.1f}"
        gain = "-" if r.get("gain") is None else f"{r['gain']:.2%}"
        lines.append(f"| {r['model']} | {r['policy']} | {r['configuration']} | {r['devices']} | {tflops} | {gain} |")
    notes = [r for r in sim["rows"] if r.get("note")]
    if notes:
        lines.append("")
        lines += [f"- {r['model']} {r['policy']} ({r['configuration']}): {r['note']}" for r in notes]
    if sim.get("plot"):
        lines += ["", f"![simulated Pareto]({sim['plot']})"]
    return lines


def _throughput(results: dict[str, Any]) -> list[str]:
    section = results.get("throughput")
    if not section:
        return []
    if "error" in section:
        return ["", "## Throughput at a fixed memory", "", f"Not measured: {section['error']}"]
    lines = ["", "## Throughput at a fixed memory", "",
             f"Memory {_mib(section['memory_bytes'])} MiB ({section['memory_from']}), seq {section['seq_len']}, "
             f"batch sizes tried {section['batch_sizes']}: each policy's largest batch whose measured peak fits, "
             "and its measured tokens/s; ours chooses the batch and the plan together "
             "(`search.maximize_throughput`), its row the first of its three predicted best whose measured peak "
             "fits.", "",
             "| policy | largest batch | tokens/s | peak (MiB) | predicted tokens/s |", "|---|---|---|---|---|"]
    for r in section["rows"]:
        if r["largest_batch"] is None or r["tokens_per_s"] is None:
            lines.append(f"| {r['policy']} | - | {r.get('error') or 'does not fit'} | - | - |")
            continue
        predicted = r.get("predicted_tokens_per_s")
        lines.append(f"| {r['policy']} | {r['largest_batch']} | {r['tokens_per_s']:.1f} | {_mib(r['peak_bytes'])} | "
                     f"{f'{predicted:.1f}' if predicted else '-'} |")
    predicted = section.get("ours_predicted") or []
    if predicted:
        lines += ["", "Ours, predicted per batch size:", "", "| batch | source | fits | step (s) | tokens/s | peak (MiB) |",
                  "|---|---|---|---|---|---|"]
        for r in predicted:
            lines.append(f"| {r['batch_size']} | {r['source']} | {'yes' if r['fits'] else 'no'} | {_s(r['step_time'])} | "
                         f"{r['tokens_per_s'] or 0:.1f} | {_mib(r['peak_bytes'])} |")
    if section.get("profile_alignment"):
        head, *sizes = format_alignment(section["profile_alignment"])
        lines += ["", head[0].upper() + head[1:], ""] + [f"- {line.strip()}" for line in sizes]
    return lines + _top_three(section)


def _top_three(section: dict[str, Any]) -> list[str]:
    """Ours' three predicted best batches as measured: separate processes, and paired rounds in one process."""
    top = section.get("ours_top_predicted") or []
    if not top:
        return []
    paired = section.get("ours_paired") or {}
    rounds = paired.get("rounds") if paired.get("status") == "ok" else None
    lines = ["", f"Ours' three predicted best batches, measured: {section.get('repeats', 1)} separate process(es) each "
                 f"(median, spread)" + (f"; {rounds} paired rounds in one process (median tokens/s, ratio to the "
                                        f"predicted best with its 95 % interval)" if rounds else "") + ":", "",
             "| batch | predicted tokens/s | processes: tokens/s | spread | paired: tokens/s | ratio |",
             "|---|---|---|---|---|---|"]
    for c in top:
        measured = f"{c['tokens_per_s']:.1f}" if c["tokens_per_s"] is not None else f"failed: {c.get('error')}"
        measured += "" if c.get("fits", True) or c["tokens_per_s"] is None else " (over the memory)"
        spread = f"{100 * c['spread']:.1f} %" if c.get("spread") is not None else "-"
        interval = c.get("paired_interval")
        ratio = (f"{c['paired_ratio']:.4f}" + (f" [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else "")
                 if c.get("paired_ratio") is not None else "-")
        tokens = f"{c['paired_tokens_per_s']:.1f}" if c.get("paired_tokens_per_s") is not None else "-"
        lines.append(f"| {c['batch_size']} | {c['predicted_tokens_per_s']:.1f} | {measured} | {spread} | {tokens} | "
                     f"{ratio} |")
    gap = section.get("ours_measured_gap")
    verdict = "is" if section.get("predicted_best_is_measured_best") else "is **not**"
    lines += ["", f"The predicted best {verdict} the measured best (by {section.get('ranking_from', 'processes')}"
                  + (f", gap best to second {100 * gap:.1f} %" if gap is not None else "")
                  + f"): {section.get('ours_ranking')}."]
    if paired and paired.get("status") != "ok":
        lines.append(f"Paired rounds in one process failed: {paired.get('error')}.")
    return lines


def render_report(results: dict[str, Any]) -> str:
    """The report as markdown; ``results["figures"]`` (name -> PNG next to the report) are embedded."""
    plots = results.get("figures") or {}
    m = results["model"]
    machine = results["machine"]
    s = results["settings"]
    lines = [f"# adaptive-mem bench: {m.get('spec', '(simulated only)')}", ""]
    if results["runs"]:
        lines += [f"Model `{m['spec']}`" + (f" ({m['model_args']})" if m.get("model_args") else "") +
                  f", batch {m['batch_size']} x seq {m['seq_len']}, {m['dtype']}, {m['num_layers']} layers, Adam. "
                  f"Machine: {machine['platform']}, {machine['cpus']} CPUs, torch {machine['torch']}, "
                  f"{machine.get('threads_per_run', '?')} thread(s) per run, load average at start "
                  f"{machine['load_average_at_start'][0]}. Created {results['created']}.", "",
                  f"Command: `{results.get('command') or '(API)'}`", "",
                  f"Each policy ran in its own process on the same model, weights and batches: {s['warmup']} "
                  f"warm-up step(s), one step under the memory tracker (peak device bytes, exact on CPU), then "
                  f"{s['steps']} timed steps (median), {s['repeats']} process(es) per row. Budgets are fractions of "
                  f"the unoptimized activation memory, as in `adaptive-mem search --activation-budget` "
                  f"(predicted unoptimized peak {_mib(m['predicted_unoptimized_peak_bytes'])} MiB, static + inputs "
                  f"{_mib(m['base_bytes'])} MiB).", "", "## Runs", ""]
        lines += _runs_table(results)
        lines += ["", "## Our plan against the eager competitors", ""]
        lines += _comparison(results)
        lines += _compiled_comparison(results)
        lines += _compile(results)
        figures = [(k, plots[k]) for k in ("pareto", "plan_layers", "timeline") if k in plots]
        if figures:
            lines += ["", "## Figures", ""]
            lines += [f"![{k}]({path})" for k, path in figures]
        elif not plots:
            lines += ["", "_No figures: matplotlib is not installed (pip install matplotlib)._"]
        lines += _details(results)
        lines += _problems(results)
        lines += ["", "## Policies", ""]
        seen = {}
        for r in results["runs"]:
            seen.setdefault(r["policy"], r.get("label", ""))
        lines += [f"- `{k}`: {v}" for k, v in seen.items()]
    lines += _throughput(results)
    lines += _simulated(results)
    return "\n".join(lines) + "\n"
