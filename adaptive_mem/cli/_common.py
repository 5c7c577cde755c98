"""Shared pieces of the ``search``, ``simulate`` and ``pareto`` subcommands: profile, hardware, stages."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import profiler
from profiler import HardwareSpec, Profile
from search import StepModel
from search.planning import Stage, split_stages

from adaptive_mem.config._layout import positive_int as positive

HARDWARE_NAMES = (*profiler.HARDWARE, "cpu")


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="Profile JSON written by `adaptive-mem profile`")
    parser.add_argument("--hardware", default=None, metavar="NAME",
                        help=f"link bandwidth from this spec instead of the profile's: {', '.join(HARDWARE_NAMES)}")


def load(args: argparse.Namespace) -> tuple[Profile, HardwareSpec | None]:
    """The profile and the hardware override (validated before any loading work)."""
    hardware = None
    if args.hardware is not None:
        hardware = profiler.hardware_spec(args.hardware)
    return Profile.load(args.profile), hardware


def stages_of(profile: Profile, hardware: HardwareSpec | None, stages: int, micro_batches: int) -> list[Stage]:
    if stages == 1:
        return [Stage(0, range(profile.num_layers), 1, StepModel.build(profile, hardware=hardware))]
    return split_stages(profile, stages=stages, micro_batches=micro_batches, hardware=hardware)


def check_output_path(path: str, *, flag: str) -> None:
    """Refuse an output path that cannot be written, before any work is done."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag}={path!r}: is a directory; expected a file path")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag}={path!r}: folder {str(parent)!r} does not exist; expected a path in an existing folder")


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the file is the user's output
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
