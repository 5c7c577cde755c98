"""Write a bench's outputs: PNGs, then results.json (naming them), then report.md drawn from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._plots import write_figures
from ._report import render_report
from ._results import save_results

__all__ = ["write_outputs"]


def write_outputs(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """``results.json``, ``report.md`` and the figures in ``out``; returns name -> path."""
    out.mkdir(parents=True, exist_ok=True)
    results["figures"] = write_figures(results, out)
    save_results(results, out / "results.json")
    (out / "report.md").write_text(render_report(results))
    paths = {"results": out / "results.json", "report": out / "report.md"}
    paths.update({name: out / file for name, file in results["figures"].items()})
    return paths
