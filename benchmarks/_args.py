"""What the benchmarks share: argument types — a count below its minimum is refused by argparse in one line naming the
option (``argument --rounds: must be at least 1, got 0``) before anything loads, instead of a traceback after the runs
(a median of no rounds, a ratio over no timed steps) — and the order of a round's sides."""

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


def round_order(sides: list, round_index: int) -> list:
    """The sides of round ``round_index`` in the order they run: reversed on odd rounds, so that no side always runs
    first (on a machine getting busier, or right after the other side's process) — the project's rule that rounds
    alternate."""
    return list(sides) if round_index % 2 == 0 else list(sides)[::-1]
