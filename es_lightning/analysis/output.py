"""Tables and files every analysis writes: a fixed-width table for the terminal, the same table in Markdown, JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from es_lightning.cli_errors import spoken


def _cell(value: Any, digits: int) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if _signed(value):  # a change: fixed point, so a column of changes lines up
            return f"{value:+.{digits}f}"
        if value != 0 and (abs(value) < 10 ** -digits or abs(value) >= 1e6):
            return f"{value:.2e}"
        return f"{value:.{digits}f}"
    return str(value)


class Signed(float):
    """A float printed with its sign (score changes: ``+0.031``)."""


def _signed(value: float) -> bool:
    return isinstance(value, Signed)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> str:
    """Right-aligned columns (first column left-aligned), a rule under the header."""
    cells = [[_cell(v, digits) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    left = [i == 0 or (bool(rows) and all(isinstance(r[i], str) for r in rows)) for i in range(len(headers))]
    line = lambda values: "  ".join(  # noqa: E731
        v.ljust(w) if left[i] else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))
    )
    head = line(list(headers))
    return "\n".join([head, "-" * len(head), *(line(r) for r in cells)])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> str:
    """The same table as GitHub Markdown."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(_cell(v, digits) for v in row) + " |" for row in rows]
    return "\n".join(out)


def check_out_dir(out_dir: str | Path) -> None:
    """Refuse, before any model is loaded or trained, an ``--out_dir`` that cannot be written (``ValueError``: the
    analysis commands print it as one line)."""
    from es_lightning.run_dirs import unwritable

    problem = unwritable(out_dir)
    if problem:
        given = spoken(f"--out_dir {str(out_dir)!r}", f"out_dir={str(out_dir)!r}")
        fix = spoken("choose another with --out_dir /a/writable/dir", "pass another: out_dir='/a/writable/dir'")
        raise ValueError(f"{given} cannot be written: {problem}; {fix}")


def write_json(path: str | Path, payload: Any) -> Path:
    """Write ``payload`` as indented JSON (NaN written as ``NaN``, as Python's json does), creating the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))
    return path
