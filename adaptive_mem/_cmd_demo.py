"""``adaptive-mem demo``: the main job on the embedded default model.

Issue 2 form: profile ``llama-small`` on this CPU, print the summary and write
``<out>/profile.json``. Later issues add the plan search and a training run.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import profiler

from ._model_spec import build_model

NAME = "demo"
HELP = "profile the default model (llama-small) on this CPU and print the summary"

DEFAULT_MODEL = "llama-small"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="adaptive-mem-demo", metavar="DIR",
                        help="directory for the demo's files (default ./adaptive-mem-demo)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out={args.out!r}: exists and is not a directory")
    bundle = build_model(DEFAULT_MODEL)
    log.info("profiling %s (batch %d x seq %d) on cpu", DEFAULT_MODEL, bundle.batch_size, bundle.seq_len)
    result = profiler.profile_step(bundle)
    print(profiler.format_summary(result))
    out.mkdir(parents=True, exist_ok=True)
    result.save(out / "profile.json")
    log.info("profile written to %s", out / "profile.json")
    return 0
