"""Shared pieces of the ``search``, ``simulate`` and ``pareto`` subcommands: profile, hardware, stages."""

from __future__ import annotations

import argparse

import profiler
from profiler import HardwareSpec, Profile
from search import Stage, StepModel, split_stages

from ._profile import positive_int as positive

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
