"""Transfer: the awaitable handle of one store or load."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any, Literal, NamedTuple

from asyncoffload.keys import OffloadKey

__all__ = ["Transfer", "TransferResult"]


class TransferResult(NamedTuple):
    """What a completed transfer moved."""

    #: Blocks copied.
    num_blocks: int
    #: Bytes copied.
    nbytes: int
    #: Seconds the copy took. CUDA backend: device time between timing events around the
    #: copy (time spent waiting behind work queued before it is excluded). CPU backend:
    #: from submission to the end of the copy, queueing included. Never the wake-up.
    duration_s: float


class Transfer:
    """Handle of one store or load. ``await handle`` returns a :class:`TransferResult`
    once the copy has ended and its completion callback has run, or raises
    :class:`~asyncoffload.TransferError`.

    Any number of tasks may await one handle, and it works with ``asyncio.gather`` and
    ``asyncio.wait``. Cancelling an awaiting task cancels only that wait, never the copy:
    the engine keeps the blocks protected until the device is done with them.
    """

    __slots__ = ("_future", "evicted_keys", "keys", "keys_to_store", "kind")

    def __init__(
        self,
        future: asyncio.Future[TransferResult],
        kind: Literal["store", "load"],
        keys: list[OffloadKey],
        keys_to_store: list[OffloadKey] | None = None,
        evicted_keys: list[OffloadKey] | None = None,
    ) -> None:
        self._future = future
        self.kind = kind
        #: Every key of the call.
        self.keys = keys
        #: Keys actually written by a store (present ones and those held back by
        #: admission are left out); empty for a load.
        self.keys_to_store = keys_to_store if keys_to_store is not None else []
        #: Keys evicted to make room for this store.
        self.evicted_keys = evicted_keys if evicted_keys is not None else []

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return asyncio.shield(self._future).__await__()

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> TransferResult:
        """The result; ``asyncio.InvalidStateError`` while running, ``TransferError`` if
        it failed."""
        return self._future.result()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    def add_done_callback(self, fn: Callable[[Transfer], object]) -> None:
        """Call ``fn(self)`` on the loop once the transfer has ended."""
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        if not self._future.done():
            state = "running"
        elif self._future.exception() is not None:
            state = "failed"
        else:
            state = "done"
        n = len(self.keys_to_store) if self.kind == "store" else len(self.keys)
        return f"<Transfer {self.kind} {n} blocks {state}>"
