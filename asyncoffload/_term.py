"""Output that fits the terminal: its width, and two-column tables that wrap."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

__all__ = ["terminal_columns", "two_column_table"]

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
