"""Output that fits the terminal: its width, and two-column tables that wrap."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

__all__ = ["fitted_table", "terminal_columns", "two_column_table"]

#: Narrowest and widest layouts produced, whatever the terminal says.
MIN_COLUMNS, MAX_COLUMNS = 40, 120


def terminal_columns() -> int:
    """The terminal's width (``COLUMNS`` first, 80 when not a terminal), clamped to
    [40, 120]: wider output is no easier to read."""
    columns = shutil.get_terminal_size((80, 24)).columns
    return max(MIN_COLUMNS, min(MAX_COLUMNS, columns))


def two_column_table(
    rows: Sequence[tuple[str, str]], header: tuple[str, str], columns: int | None = None
) -> str:
    """``name  value`` rows under a header and a rule, every line shorter than
    ``columns`` (default: :func:`terminal_columns`; a line as wide as the terminal may
    wrap): values too long for the line wrap, indented under the value column."""
    columns = (terminal_columns() if columns is None else columns) - 1
    name_width = max(len(name) for name, _ in [header, *rows])
    value_width = max(columns - name_width - 2, 20)
    lines: list[str] = []
    widest = len(header[1])
    body: list[str] = []
    for name, value in rows:
        parts = textwrap.wrap(value, value_width, break_on_hyphens=False) or [""]
        widest = max(widest, *(len(p) for p in parts))
        body.append(f"{name:<{name_width}}  {parts[0]}")
        body.extend(f"{'':<{name_width}}  {part}" for part in parts[1:])
    lines.append(f"{header[0]:<{name_width}}  {header[1]}")
    lines.append("-" * name_width + "  " + "-" * widest)
    lines.extend(line.rstrip() for line in body)
    return "\n".join(lines)


def fitted_table(rows: Sequence[Sequence[str]], columns: int | None = None) -> str:
    """A right-aligned table (``rows[0]`` the header) with a rule under the header,
    every line shorter than ``columns`` (default: :func:`terminal_columns`). A table
    too wide is cut into stacked blocks of columns, each repeating the first column."""
    limit = (terminal_columns() if columns is None else columns) - 1
    n = len(rows[0])
    widths = [max(len(row[c]) for row in rows) for c in range(n)]
    blocks: list[list[int]] = []
    current: list[int] = []
    used = widths[0]
    for c in range(1, n):
        if current and used + 2 + widths[c] > limit:
            blocks.append(current)
            current, used = [], widths[0]
        current.append(c)
        used += 2 + widths[c]
    if current or not blocks:
        blocks.append(current)
    out: list[str] = []
    for block in blocks:
        cols = [0, *block]
        lines = ["  ".join(row[c].rjust(widths[c]) for c in cols) for row in rows]
        lines.insert(1, "  ".join("-" * widths[c] for c in cols))
        if out:
            out.append("")
        out.extend(lines)
    return "\n".join(out)
