"""The `coordrl` command: every subcommand's flags and its entry point, and nothing below it holds
argparse code. `main` runs it; ``python -m coordrl.cli`` does the same."""

from coordrl.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
