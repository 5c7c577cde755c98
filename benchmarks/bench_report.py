"""Redraw a bench's report.md and PNG figures from its results.json (nothing is re-measured).

    python benchmarks/bench_report.py DIR [DIR ...]

The report is a pure function of results.json (``adaptive_mem.bench.render_report``), so a
results file from an earlier run can be re-rendered after the report format changes, and
a person can check that every figure in report.md comes from the recorded runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from adaptive_mem.bench import load_results, write_outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="bench output directories (holding results.json)")
    args = parser.parse_args()
    for out in args.dirs:
        results = load_results(out / "results.json")
        for name, path in write_outputs(results, out).items():
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
