"""The bench's PNG figures, drawn from ``results.json`` only.

Figures are built as ``matplotlib.figure.Figure`` objects (no pyplot state): the tests inspect
the objects (titles, axis labels, legends) and the PNGs written from them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ._report import PLOTS
from ._results import budget_label

__all__ = ["build_figures", "write_figures", "have_matplotlib"]

log = logging.getLogger(__name__)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _ok(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if r["status"] == "ok"]


def pareto(results: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for r in _ok(results):
        by_policy.setdefault(r["policy"], []).append(r)
    for name, rows in by_policy.items():
        rows = sorted(rows, key=lambda r: r["peak_bytes"])
        xs = [r["peak_bytes"] / 2**20 for r in rows]
        ys = [r["median_step_time"] for r in rows]
        style = "-o" if len(rows) > 1 else "s"
        ax.plot(xs, ys, style, label=name, linewidth=2.5 if name.startswith("ours") else 1.2)
        for r, x, y in zip(rows, xs, ys):
            if r["budget"] is not None or r.get("match"):
                ax.annotate(budget_label(r), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_title(f"{results['model']['spec']}: measured step time vs peak memory per policy")
    ax.set_xlabel("measured peak device memory (MiB)")
    ax.set_ylabel("median step time (s)")
    ax.grid(alpha=0.3)
    ax.legend(title="policy (labels: budget)", fontsize=8)
    fig.tight_layout()
    return fig


def plan_layers(results: dict[str, Any], *, policy: str = "ours-milp") -> Any:
    from matplotlib.figure import Figure

    rows = [r for r in results["runs"] if r["policy"] == policy and r.get("plan_layers")]
    if not rows:
        rows = [r for r in results["runs"] if r.get("plan_layers")][:3]
    if not rows:
        return None
    fig = Figure(figsize=(8, 2.2 + 1.8 * len(rows)))
    axes = fig.subplots(len(rows), 1, squeeze=False)[:, 0]
    colors = {"keep": "tab:blue", "recompute": "tab:orange", "swap": "tab:purple"}
    for ax, r in zip(axes, rows):
        layers = r["plan_layers"]
        xs = [row["layer"] for row in layers]
        bottom = [0.0] * len(layers)
        for key, color in colors.items():
            vals = [row[key] / 2**20 for row in layers]
            ax.bar(xs, vals, bottom=bottom, color=color, label=key)
            bottom = [b + v for b, v in zip(bottom, vals)]
        where = "" if r["budget"] is None and not r.get("match") else f" at budget {budget_label(r)}"
        ax.set_title(f"{r['policy']}{where}: saved activations per layer by decision")
        ax.set_xlabel("layer")
        ax.set_ylabel("saved bytes (MiB)")
        ax.set_xticks(xs)
        ax.set_ylim(0, max(bottom + [1e-9]) * 1.3)  # headroom for the legend
        ax.legend(fontsize=7, loc="upper right", ncol=3)
    fig.tight_layout()
    return fig


def timeline(results: dict[str, Any], *, policy: str = "ours-milp") -> Any:
    from matplotlib.figure import Figure

    rows = [r for r in _ok(results) if r["policy"] == policy and r.get("timeline_predicted")]
    if not rows:
        rows = [r for r in _ok(results) if r.get("timeline_predicted")][:2]
    if not rows:
        return None
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for k, r in enumerate(rows):
        color = f"C{k}"
        tag = r["policy"] + ("" if r["budget"] is None and not r.get("match") else f"@{budget_label(r)}")
        for key, style, what in (("timeline_measured", "-", "measured"), ("timeline_predicted", "--", "predicted")):
            pts = r.get(key) or []
            if not pts:
                continue
            end = pts[-1][0] or 1.0
            ax.plot([t / end for t, _ in pts], [b / 2**20 for _, b in pts], style, color=color,
                    label=f"{tag} {what}", drawstyle="steps-post")
    ax.set_title(f"{results['model']['spec']}: device memory over one step, predicted vs measured")
    ax.set_xlabel("fraction of the step (forward, backward, optimizer)")
    ax.set_ylabel("device memory (MiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def predicted_pareto(curves: dict[str, list], *, title: str) -> Any:
    """Predicted step time vs peak memory, one line per solver; points are ``(budget, peak bytes,
    step seconds, ...)``. Shared with ``adaptive-mem pareto``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for name, pts in curves.items():
        if pts:
            pts = sorted(pts, key=lambda p: p[1])
            ax.plot([p[1] / 2**30 for p in pts], [p[2] for p in pts], "-o", label=name, markersize=3)
    ax.set_title(title)
    ax.set_xlabel("predicted peak device memory (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.grid(alpha=0.3)
    ax.legend(title="solver")
    fig.tight_layout()
    return fig


def simulated_pareto(results: dict[str, Any]) -> Any:
    sim = results.get("simulated") or {}
    curves = sim.get("pareto") or {}
    if not curves:
        return None
    return predicted_pareto(curves, title=f"{sim.get('pareto_model', '')} on {sim.get('hardware', '')}: "
                                          "predicted step time vs peak memory")


def build_figures(results: dict[str, Any]) -> dict[str, Any]:
    """name -> Figure for every figure the results can draw."""
    out = {}
    if results["runs"]:
        for name, fn in (("pareto", pareto), ("plan_layers", plan_layers), ("timeline", timeline)):
            fig = fn(results)
            if fig is not None:
                out[name] = fig
    fig = simulated_pareto(results)
    if fig is not None:
        out["simulated_pareto"] = fig
    return out


def write_figures(results: dict[str, Any], out: Path) -> dict[str, str]:
    """Write the PNGs into ``out``; name -> file name. Empty (with a log line) without matplotlib."""
    if not have_matplotlib():
        log.warning("matplotlib is not installed: report without figures (pip install matplotlib)")
        return {}
    written = {}
    for name, fig in build_figures(results).items():
        fig.savefig(out / PLOTS[name], dpi=110)
        written[name] = PLOTS[name]
    return written
