"""Logging: the package logger's level from the environment, and the command line's.

asyncoffload logs under the ``asyncoffload`` logger and, as a library, adds no handler.
``ASYNCOFFLOAD_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``, ``CRITICAL`` or a
number) sets that logger's level when the package is imported. The command line also
installs a handler on stderr, at ``WARNING`` unless the variable says otherwise, one step
more verbose per ``-v`` and one step quieter per ``-q``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

__all__ = ["LOG_LEVEL_ENV", "apply_env_level", "configure_cli", "level_from_env"]

LOG_LEVEL_ENV = "ASYNCOFFLOAD_LOG_LEVEL"
_STEPS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
_FORMAT = "asyncoffload: %(levelname)s: %(message)s"


def level_from_env() -> int | None:
    """The level ``ASYNCOFFLOAD_LOG_LEVEL`` names, ``None`` when unset or empty;
    ``ValueError`` naming the variable when it names no level."""
    raw = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if not raw:
        return None
    if raw.lstrip("-").isdigit():
        return int(raw)
    level = logging.getLevelName(raw.upper())
    if isinstance(level, int):
        return level
    names = ", ".join(logging.getLevelName(s) for s in _STEPS)
    raise ValueError(f"{LOG_LEVEL_ENV}={raw!r} is not a log level; use one of {names}")


def apply_env_level() -> None:
    """Set the ``asyncoffload`` logger's level from the environment (at import). A bad
    value is reported once on stderr rather than breaking the import."""
    try:
        level = level_from_env()
    except ValueError as exc:
        print(f"asyncoffload: {exc}", file=sys.stderr)
        return
    if level is not None:
        logging.getLogger("asyncoffload").setLevel(level)


def configure_cli(verbose: int = 0, quiet: int = 0) -> Callable[[], None]:
    """Log to stderr for a command-line run. Returns what undoes it (the package
    logger's handlers, level and propagation as they were), for a ``main`` called in
    a process that goes on (tests, embedding): its logging must not stay redirected."""
    base = level_from_env()
    base = logging.WARNING if base is None else base
    index = min(range(len(_STEPS)), key=lambda i: abs(_STEPS[i] - base))
    index = max(0, min(len(_STEPS) - 1, index - verbose + quiet))
    level = _STEPS[index]
    root = logging.getLogger("asyncoffload")
    saved = (list(root.handlers), root.level, root.propagate)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    for old in [h for h in root.handlers if getattr(h, "_asyncoffload_cli", False)]:
        root.removeHandler(old)
    handler._asyncoffload_cli = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False

    def restore() -> None:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        root.propagate = saved[2]

    return restore
