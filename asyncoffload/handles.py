"""Transfer: the awaitable handle of one store or load."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any, Literal, NamedTuple

from asyncoffload.keys import OffloadKey

__all__ = ["Completion", "Transfer", "TransferResult"]


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


class Completion(asyncio.Future[TransferResult]):
    """The engine's future of one transfer. Ending it also ends, in the same call, the
    private waiter of each task awaiting the :class:`Transfer`, so an awaiting task
    resumes at the loop's next pass. (``asyncio.shield``, the obvious way to keep an
    awaiter's cancellation from cancelling the transfer, takes two passes: one to run its
    done callback, one to wake the task; a busy loop makes each pass milliseconds.)"""

    _waiters: list[asyncio.Future[None]] | None = None

    def set_result(self, result: TransferResult) -> None:
        super().set_result(result)
        if self._waiters:
            self._wake()

    def set_exception(self, exception: type | BaseException) -> None:
        super().set_exception(exception)
        # Failures are reported through the handle and logged: a fire-and-forget store
        # that failed must not also print "exception was never retrieved".
        super().exception()
        self._wake()

    def cancel(self, msg: Any | None = None) -> bool:
        cancelled = super().cancel(msg)
        self._wake()
        return cancelled

    def waiter(self) -> asyncio.Future[None]:
        """A future that ends when this one does; cancelling it cancels only itself."""
        waiter: asyncio.Future[None] = self.get_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        return waiter

    def forget(self, waiter: asyncio.Future[None]) -> None:
        if self._waiters and waiter in self._waiters:
            self._waiters.remove(waiter)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)


class Transfer:
    """Handle of one store or load. ``await handle`` returns a :class:`TransferResult`
    once the copy has ended and its completion callback has run, or raises
    :class:`~asyncoffload.TransferError`.

    Any number of tasks may await one handle, and it works with ``asyncio.gather`` and
    ``asyncio.wait``. Cancelling an awaiting task cancels only that wait, never the copy:
    the engine keeps the blocks protected until the device is done with them.
    """

    __slots__ = ("_future", "declined_keys", "evicted_keys", "keys", "keys_to_store", "kind")

    def __init__(
        self,
        future: asyncio.Future[TransferResult],
        kind: Literal["store", "load"],
        keys: list[OffloadKey],
        keys_to_store: list[OffloadKey] | None = None,
        evicted_keys: list[OffloadKey] | None = None,
        declined_keys: list[OffloadKey] | None = None,
    ) -> None:
        self._future = future
        self.kind = kind
        #: Every key of the call.
        self.keys = keys
        #: Keys this store writes, loadable once it resolves (the others are
        #: :attr:`skipped_keys`); empty for a load.
        self.keys_to_store = keys_to_store if keys_to_store is not None else []
        #: Keys evicted to make room for this store.
        self.evicted_keys = evicted_keys if evicted_keys is not None else []
        #: Keys of a store that the CPU tier declined (the policy's own admission, the
        #: admission filter or ``store_threshold``): not stored by this call nor by any
        #: other, so not loadable unless a lower tier holds them already.
        self.declined_keys = declined_keys if declined_keys is not None else []

    @property
    def skipped_keys(self) -> list[OffloadKey]:
        """Keys of a store that it does not write, each once, in the call's order: those
        stored already or being stored by another call (loadable once that store ends),
        and the :attr:`declined_keys`. Empty for a load."""
        if self.kind != "store" or len(self.keys_to_store) == len(self.keys):
            return []
        written = set(self.keys_to_store)
        return [key for key in dict.fromkeys(self.keys) if key not in written]

    def __await__(self) -> Generator[Any, None, TransferResult]:
        fut = self._future
        if fut.done():  # the future's own iterator: no generator of ours to run
            return fut.__await__()
        return self._wait(fut)

    def _wait(self, fut: asyncio.Future[TransferResult]) -> Generator[Any, None, TransferResult]:
        if not isinstance(fut, Completion):
            return (yield from asyncio.shield(fut).__await__())
        waiter = fut.waiter()
        try:
            yield from waiter.__await__()
        except BaseException:  # this wait was cancelled: the transfer goes on
            fut.forget(waiter)
            raise
        return fut.result()

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
        if self.kind == "load":
            return f"<Transfer load {len(self.keys)} blocks {state}>"
        skipped = len(self.skipped_keys)
        declined = f", {len(self.declined_keys)} declined" if self.declined_keys else ""
        extra = f" ({skipped} skipped{declined})" if skipped else ""
        return f"<Transfer store {len(self.keys_to_store)} blocks{extra} {state}>"
