"""How an engine binds to one event loop and thread, and refuses use from elsewhere.

:class:`LoopBinding` is the part of :class:`~asyncoffload.AsyncOffloadEngine` that checks,
on the path of every call, that the engine is open, in the process that made it, and
called from the thread and loop it is bound to; and binds it on first use (the
completion bridge opened, the tiers' lanes made, the event hub and summary started).
"""

from __future__ import annotations

import asyncio
import os
import threading

from asyncoffload.config import EngineConfig
from asyncoffload.copies import Copies
from asyncoffload.engine_tiers import LoopTiers
from asyncoffload.errors import EngineClosedError
from asyncoffload.events import EventHub
from asyncoffload.layout import KVLayout
from asyncoffload.stats import Summary
from asyncoffload.transfer import CompletionBridge

__all__ = ["LoopBinding"]


class LoopBinding:
    """The loop binding of an engine (see the module docstring)."""

    config: EngineConfig
    layout: KVLayout
    _copies: Copies
    _tiers: LoopTiers | None
    _hub: EventHub
    _summary: Summary | None
    _bridge: CompletionBridge | None
    _loop_thread: int | None
    _pid: int
    _closing: bool
    _forked: bool

    def _check_usable(self) -> None:
        if self._closing:
            raise EngineClosedError("the engine is closed")
        if self._forked:
            raise RuntimeError(
                f"this engine was created in process {self._pid} and is used in process "
                f"{os.getpid()} after os.fork(); its copy threads live in the parent: "
                "create a new engine in the child"
            )
        if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
            raise _wrong_thread()

    def _bound(self) -> bool:
        """Whether the engine is usable and bound to the running loop (a few checks, on
        the path of every call); else :meth:`_check_usable`, and False: the caller then
        binds with :meth:`_ensure_bridge` once its input is checked."""
        bridge = self._bridge
        if (
            bridge is not None
            and not self._closing
            and not self._forked
            and threading.get_ident() == self._loop_thread
            and asyncio._get_running_loop() is bridge.loop
        ):
            return True
        self._check_usable()
        return False

    def _ensure_bridge(self) -> CompletionBridge:
        loop = asyncio.get_running_loop()
        bridge = self._bridge
        if bridge is None:
            if self._hub.loop is not None and self._hub.loop is not loop:
                raise RuntimeError("the engine's events are read on another event loop")
            self._bridge = bridge = self._copies.open(loop, self.config, self.layout.block_bytes)
            if self._tiers is not None:
                self._tiers.bind(bridge)
            self._loop_thread = threading.get_ident()
            self._hub.loop = loop
            if self._summary is not None:
                self._summary.start(loop)
        elif bridge.loop is not loop:
            raise RuntimeError("the engine is bound to another event loop")
        return bridge


def _wrong_thread() -> RuntimeError:
    where = (
        "from another event loop"
        if asyncio._get_running_loop() is not None
        else "from a thread other than its event loop's"
    )
    return RuntimeError(
        f"the engine was called {where}; it is bound to the event loop of the thread "
        "that first used it, where its bookkeeping runs (hand calls to it with "
        "loop.call_soon_threadsafe)"
    )
