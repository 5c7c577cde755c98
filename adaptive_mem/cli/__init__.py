"""The adaptive-mem command line: one module per subcommand, listed in ``_main.SUBCOMMANDS``."""

from ._main import build_parser, main

__all__ = ["build_parser", "main"]
