"""``adaptive-mem`` command line: one module per subcommand, registered in ``SUBCOMMANDS``.

Each subcommand module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``. User errors (any ``ValueError``) print one line and exit 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS: tuple[str, ...] = (
    "adaptive_mem.cli._profile",
    "adaptive_mem.cli._demo",
    "adaptive_mem.cli._explain",
    "adaptive_mem.cli._units",
    "adaptive_mem.cli._search",
    "adaptive_mem.cli._simulate",
    "adaptive_mem.cli._estimate",
    "adaptive_mem.cli._pareto",
    "adaptive_mem.cli._run",
    "adaptive_mem.cli._bench",
)


def _modules() -> list[ModuleType]:
    return [importlib.import_module(name) for name in SUBCOMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptive-mem",
        description="Profile a training step, search a keep/recompute/swap plan under a memory budget, apply it.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    common.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _modules():
        child = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP, parents=[common])
        module.add_arguments(child)
        child.set_defaults(_run=module.run)
    return parser


def _one_line(exc: BaseException) -> str:
    """The refusal as one line, whatever raised it (a library's message may span lines, or be empty)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s - %(message)s",
                        stream=sys.stderr)
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        if args.debug:
            raise
        print(f"adaptive-mem {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
