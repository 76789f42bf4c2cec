"""argparse value types shared by every `coordrl` subcommand."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1, or an argparse error naming the bad value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
