"""Event loops: uvloop where it is installed, asyncio's default elsewhere."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["new_event_loop", "run", "uvloop_available"]

_T = TypeVar("_T")


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop(use_uvloop: bool | None = None) -> asyncio.AbstractEventLoop:
    """A new loop: uvloop's if ``use_uvloop`` (default: when installed), else asyncio's."""
    if use_uvloop is None:
        use_uvloop = uvloop_available()
    if use_uvloop:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, _T], *, use_uvloop: bool | None = None) -> _T:
    """``asyncio.run(main)`` on :func:`new_event_loop`'s loop."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=lambda: new_event_loop(use_uvloop)) as runner:
            return runner.run(main)
    loop = new_event_loop(use_uvloop)  # pragma: no cover - Python 3.10
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
