"""The engine's interrupt hold: a step that updates the manager and hands a copy to a
lane runs whole, and a SIGINT that arrives meanwhile is raised at the step's end.

See :class:`InterruptsHeld` and docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["InterruptsHeld", "interrupts_held"]

# The C functions under ``signal.getsignal`` / ``signal.signal``: the wrappers convert
# handlers to enums, and a Python handler fails that lookup through an exception whose
# message formats the handler's repr (about 100 us per step, 6% of a busy tier's loop).
_getsignal: Callable[[int], Any] = signal.getsignal
_setsignal: Callable[[int, Any], Any] = signal.signal
with contextlib.suppress(ImportError):  # CPython
    _c_signal = importlib.import_module("_signal")
    _getsignal, _setsignal = _c_signal.getsignal, _c_signal.signal
_SIGINT = int(signal.SIGINT)


class InterruptsHeld:
    """While inside, a SIGINT is recorded instead of acted on; on leaving, the handler
    that was installed runs (``KeyboardInterrupt`` for Python's default one).

    The manager's bookkeeping is plain Python: a ``KeyboardInterrupt`` raised between two
    of its updates (a slot taken from the free list and not yet in the policy, a pin
    without its load) leaves it half updated, and no ``except`` can tell what to undo.
    So each engine step that changes the manager and hands a copy to a lane runs whole,
    and the interrupt comes at its end, where every slot is accounted for. Only the main
    thread runs Python signal handlers (and may set them); elsewhere this does nothing.
    Costs two ``sigaction`` calls per step.
    """

    __slots__ = ("_old",)

    def __enter__(self) -> None:
        self._old: Any = None
        if _held[0] or _get_ident() != _MAIN_THREAD:  # nested, or not the main thread
            return
        old = _getsignal(_SIGINT)
        if not callable(old):  # SIG_IGN or SIG_DFL: nothing raises in Python code
            return
        _hit[0] = False
        _setsignal(_SIGINT, _record)
        self._old = old
        _held[0] = True

    def __exit__(self, *exc: object) -> None:
        old = self._old
        if old is None:
            return
        _held[0] = False  # first: once the old handler is back, it may raise at any time
        _setsignal(_SIGINT, old)
        if _hit[0]:
            _hit[0] = False
            old(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt here


def interrupts_held() -> bool:
    """Whether a hold is active (a nested :class:`InterruptsHeld` would change nothing)."""
    return _held[0]


def _record(signum: int, frame: FrameType | None) -> None:
    """The SIGINT handler of a hold (one hold is active at a time: the outermost)."""
    _hit[0] = True


_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident
_held = [False]  # a hold is active (on the main thread)
_hit = [False]  # a SIGINT came during it
