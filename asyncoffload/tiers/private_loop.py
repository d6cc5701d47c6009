"""The private event loop on which a shared tier's client runs under a polling driver.

A polling driver of the tier core (vLLM's scheduler thread, a framework's I/O threads,
see :mod:`asyncoffload.tiers.polled`) runs no event loop, and a Python thread of our own
would starve under a busy caller (the GIL). So the shared tiers' client (``redis.asyncio``
or valkey-glide) runs on a private loop that is never run on a thread of its own and
never becomes the thread's current loop: :class:`PrivateLoop` *steps* it, a bounded
number of non-blocking iterations, from the driver's calls while something of ours is in
flight on it, or runs it while a caller that may block waits (:meth:`PrivateLoop.wait`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["PrivateLoop"]

log = logging.getLogger("asyncoffload.tiers")

#: Iterations of the private event loop per step of it (each runs what is ready, with
#: no wait for I/O); it stops sooner once nothing of ours is in flight on it.
_LOOP_ITERATIONS = 16

_T = TypeVar("_T")


@contextlib.contextmanager
def _outside_any_loop() -> Iterator[None]:
    """Runs the body with no event loop marked running in this thread, then restores
    the one that was: a private loop can only be stepped where no other loop runs, and
    the scheduler thread has none (unless a caller drives vLLM from a coroutine)."""
    outer = asyncio._get_running_loop()
    if outer is None:
        yield
        return
    asyncio._set_running_loop(None)
    try:
        yield
    finally:
        asyncio._set_running_loop(outer)


class PrivateLoop:
    """A private event loop, stepped from the caller's thread, and what of ours is in
    flight on it (:meth:`track`)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = asyncio.new_event_loop()
        self.on_loop: set[asyncio.Future[Any]] = set()

    def track(self, future: asyncio.Future[Any]) -> None:
        self.on_loop.add(future)
        future.add_done_callback(self.on_loop.discard)

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` to its end on the private loop (only what ends without waiting
        for I/O, or within a timeout: a submission, the start-up connection, a
        close)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            coro.close()
            raise RuntimeError("the shared tiers' event loop is closed")
        with _outside_any_loop():
            return loop.run_until_complete(coro)

    def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` called inside the private loop (it may create tasks on it)."""

        async def call() -> _T:
            return fn(*args)

        return self.run(call())

    def step(self) -> None:
        """Up to ``_LOOP_ITERATIONS`` iterations of the private loop, none waiting for
        I/O; fewer once nothing of ours is in flight on it."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        left = _LOOP_ITERATIONS
        busy = self.on_loop

        def again() -> None:
            nonlocal left
            left -= 1
            if left > 0 and busy:
                loop.call_soon(again)  # runs in the next iteration
            else:
                loop.stop()

        loop.call_soon(again)
        try:
            with _outside_any_loop():
                loop.run_forever()
        except RuntimeError as exc:  # a defect of ours: never raise into vLLM
            log.error("stepping the shared tiers' event loop failed: %s", exc)

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        """Run the private loop, blocking the caller, until something of ours on it ends,
        ``wake_fd`` (an eventfd the tiers' lanes write when a job ends) is readable (it is
        read, to reset it), or ``timeout_s`` passes: a caller that may block (a
        framework's I/O thread) waits here instead of spinning."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        waker: asyncio.Future[None] = loop.create_future()

        def wake(*_: object) -> None:
            if not waker.done():
                waker.set_result(None)

        def readable() -> None:
            assert wake_fd is not None
            with contextlib.suppress(BlockingIOError, InterruptedError):
                os.read(wake_fd, 8)
            wake()

        watched = list(self.on_loop)
        for future in watched:
            future.add_done_callback(wake)
        if wake_fd is not None:
            loop.add_reader(wake_fd, readable)
        timer = loop.call_later(max(timeout_s, 0.0), wake)
        try:
            with _outside_any_loop():
                loop.run_until_complete(waker)
        except RuntimeError as exc:  # a defect of ours: never raise into the caller
            log.error("running the shared tiers' event loop failed: %s", exc)
        finally:
            timer.cancel()
            if wake_fd is not None:
                loop.remove_reader(wake_fd)
            for future in watched:
                future.remove_done_callback(wake)

    def close(self) -> None:
        """Cancel what is left on the private loop, let it end, close the loop."""
        loop, self.loop = self.loop, None
        if loop is None or loop.is_closed():
            return
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            with _outside_any_loop():
                if left:
                    loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
        except Exception:
            log.exception("closing the shared tiers' event loop failed")
        finally:
            loop.close()
        self.on_loop.clear()
