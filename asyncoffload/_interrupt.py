"""Ctrl-C in the command line: ``interrupted`` on stderr and exit status 130, wherever
it lands.

``python -m asyncoffload`` and the ``asyncoffload`` script import the whole package
(torch: a second or more) before :func:`asyncoffload.cli.main` runs, and a
``KeyboardInterrupt`` there would end the process with a traceback. So the package's
``__init__`` calls :func:`guard_startup` first: when this process is the command line and
SIGINT has Python's default handler, a SIGINT ends the process at once (:func:`exit_now`;
nothing is open yet). ``main`` hands SIGINT back to Python while it runs
(:func:`release`), so that a ``KeyboardInterrupt`` unwinds through the engine's clean-up,
catches it, and guards again until the process ends (:func:`hold`).

What no code of ours can cover: a SIGINT before the interpreter has installed its own
handler (the process dies of the signal) or while it imports ``site`` (the first tens of
milliseconds of the process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import FrameType

__all__ = ["exit_now", "guard_startup", "hold", "is_command_line", "release"]

#: What ``python -m`` names, and the console script's file name.
_NAME = "asyncoffload"


def is_command_line(argv: list[str] | None = None) -> bool:
    """Whether the interpreter was started as the command line: ``python [options] -m
    asyncoffload ...`` or the ``asyncoffload`` script (``argv``: ``sys.orig_argv``)."""
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] == _NAME
        if arg.startswith("-m"):
            return arg[2:] == _NAME
        if arg in ("-X", "-W"):  # options with a separate value
            i += 2
            continue
        if arg.startswith("-c") or arg == "-":
            return False
        if arg.startswith("-"):
            i += 1
            continue
        name = os.path.basename(arg)
        return name in (_NAME, f"{_NAME}.exe", f"{_NAME}-script.py")
    return False


def exit_now(signum: int = signal.SIGINT, frame: FrameType | None = None) -> None:
    """The SIGINT handler outside ``main``: what was printed goes out, then one line,
    ``interrupted``, and exit status 130 without unwinding (no traceback)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a flush the signal interrupted, a closed pipe
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, b"interrupted\n")
    os._exit(130)


def guard_startup() -> None:
    """Called first by the package's ``__init__``: in the command line, a SIGINT from
    here until ``main`` runs exits at once. Nothing changes in any other process, nor
    where SIGINT is ignored (``nohup``) or another handler was installed."""
    if is_command_line() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        hold()


def hold() -> None:
    """From now on, a SIGINT exits at once (:func:`exit_now`)."""
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGINT, exit_now)


def release() -> bool:
    """Give SIGINT back to Python's handler (``KeyboardInterrupt``) if :func:`hold` has
    it; whether it had."""
    if signal.getsignal(signal.SIGINT) is not exit_now:
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True
