"""Argument types the benchmarks share: a count below its minimum is refused by argparse in one line naming the option
(``argument --rounds: must be at least 1, got 0``) before anything loads, instead of a traceback after the runs (a
median of no rounds, a ratio over no timed steps)."""

from __future__ import annotations

import argparse


def at_least(minimum: int):
    """An ``int`` argument type that refuses values below ``minimum``."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return count
