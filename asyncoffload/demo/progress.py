"""The demo's live tallies and the progress line drawn from them while it runs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Literal, TextIO

from asyncoffload._term import terminal_columns
from asyncoffload.demo.report import _GB

#: When :func:`~asyncoffload.demo.run_demo` draws its progress bar.
ProgressMode = Literal["auto", "always", "never"]


@dataclass
class _Progress:
    """What the run has done so far: the server counts into it, the progress line and
    the report read it."""

    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    computed_blocks: int = 0
    bytes_moved: int = 0
    stores_rejected: int = 0
    stores_cut: int = 0
    promotions_refused: int = 0
    verified_blocks: int = 0
    mismatches: int = 0
    latencies_s: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _render(p: _Progress, total: int, elapsed: float, columns: int = 80) -> str:
    """One progress line, shorter than ``columns`` (a line as wide as the terminal
    wraps, and then every update starts a new line)."""
    parts = [
        f"{p.done}/{total} requests",
        f"hit {p.hit_rate:4.0%}",
        f"{p.bytes_moved / _GB:6.2f} GB moved",
        f"{elapsed:5.1f} s",
    ]
    text = "  ".join(parts)
    while len(parts) > 1 and len(text) + 13 > columns - 1:  # room for a 10-wide bar
        parts.pop(2 if len(parts) > 2 else 1)
        text = "  ".join(parts)
    width = max(0, min(30, columns - 1 - len(text) - 3))
    if width < 10:
        return f"\r{text[: columns - 1]}"
    filled = width * p.done // total if total else width
    bar = "#" * filled + "." * (width - filled)
    return f"\r[{bar}] {text}"


async def _show_progress(
    p: _Progress, total: int, stream: TextIO, finished: asyncio.Event, interval: float = 0.2
) -> None:
    t0 = time.perf_counter()
    columns = terminal_columns()
    try:
        while not finished.is_set():
            stream.write(_render(p, total, time.perf_counter() - t0, columns))
            stream.flush()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(finished.wait(), interval)
    finally:
        stream.write(_render(p, total, time.perf_counter() - t0, columns) + "\n")
        stream.flush()
