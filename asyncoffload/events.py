"""The event stream: a broadcast hub and its subscriptions (async iterators).

Semantics follow tokio's broadcast channel. Every subscription has its own bounded
buffer; publishing never blocks and never waits for a reader. When a buffer is full the
oldest event is dropped and the subscription's next item is ``Lagged(missed=n)``, after
which it continues with the oldest event it still holds; ``seq`` numbers let a consumer
see exactly where the gap was. Closing the hub ends every iteration after the events
already buffered have been read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import NamedTuple, Protocol

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import Medium, OffloadingEvent

__all__ = [
    "EventHub",
    "EventSource",
    "EventStream",
    "EventSubscription",
    "Lagged",
    "SubscriptionStats",
]


class Lagged(NamedTuple):
    """The subscription's buffer overflowed: ``missed`` events were dropped here."""

    missed: int


class SubscriptionStats(NamedTuple):
    #: Events waiting in the buffer (snapshot items included).
    buffered: int
    #: Buffer capacity.
    max_buffer: int
    #: Events dropped since the subscription was made.
    dropped: int
    #: Items handed to the reader (events and Lagged markers).
    delivered: int
    closed: bool


class EventSubscription:
    """One reader of an :class:`EventHub`. Use ``async for item in sub``.

    Items are :class:`OffloadingEvent` or :class:`Lagged`. The iteration ends when the
    hub closes (after the buffered events) or when :meth:`close` is called. Cancelling a
    task waiting in ``__anext__`` loses no event. A subscription has one reader: a second
    task waiting on it at the same time gets ``RuntimeError`` (subscribe once per reader).
    It is read on the engine's event loop; waiting on it from another loop (another
    thread's) raises ``RuntimeError``.
    """

    def __init__(self, hub: EventHub, max_buffer: int, initial: Iterable[OffloadingEvent]) -> None:
        self._hub = hub
        self._max_buffer = max_buffer
        self._snapshot: deque[OffloadingEvent] = deque(initial)
        self._buffer: deque[OffloadingEvent] = deque()
        self._missed = 0
        self._dropped = 0
        self._delivered = 0
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None

    # --- hub side ---

    def _push(self, events: Sequence[OffloadingEvent]) -> None:
        if self._closed:
            return
        buffer = self._buffer
        buffer.extend(events)
        over = len(buffer) - self._max_buffer
        if over > 0:  # the oldest go
            for _ in range(over):
                buffer.popleft()
            self._missed += over
            self._dropped += over
            self._hub.dropped += over
        waiter = self._waiter  # _wake(), in line: this runs for every publication
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _end(self) -> None:
        self._closed = True
        self._wake()

    # --- reader side ---

    def receive_nowait(self) -> OffloadingEvent | Lagged:
        """The next item; ``asyncio.QueueEmpty`` if none is buffered,
        ``StopAsyncIteration`` if the subscription has ended and is drained."""
        if self._snapshot:
            item: OffloadingEvent | Lagged = self._snapshot.popleft()
        elif self._missed:
            item, self._missed = Lagged(self._missed), 0
        elif self._buffer:
            item = self._buffer.popleft()
        elif self._closed:
            raise StopAsyncIteration
        else:
            raise asyncio.QueueEmpty
        self._delivered += 1
        return item

    async def receive(self) -> OffloadingEvent | Lagged:
        """The next item, waiting for one; ``StopAsyncIteration`` once ended."""
        while True:
            try:
                return self.receive_nowait()
            except asyncio.QueueEmpty:
                pass
            if self._waiter is not None:
                raise RuntimeError(
                    "another task is already waiting on this subscription; "
                    "call engine.events() once per reader"
                )
            loop = asyncio.get_running_loop()
            owner = self._hub.loop
            if owner is None:
                self._hub.loop = owner = loop
            elif loop is not owner:
                # The hub wakes readers from its own loop's thread, and a future may be
                # resolved only from its loop's: a foreign reader would wait forever.
                raise RuntimeError(
                    "this event subscription belongs to the engine's event loop; read it "
                    "there (or relay the events with loop.call_soon_threadsafe)"
                )
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def __aiter__(self) -> EventSubscription:
        return self

    async def __anext__(self) -> OffloadingEvent | Lagged:
        try:  # a buffered item without a second coroutine (a reader behind runs this)
            return self.receive_nowait()
        except asyncio.QueueEmpty:
            return await self.receive()

    def close(self) -> None:
        """Stop receiving: drop the buffer and end the iteration. Idempotent."""
        self._buffer.clear()
        self._snapshot.clear()
        self._missed = 0
        self._end()
        self._hub._unsubscribe(self)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> EventSubscription:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def statistics(self) -> SubscriptionStats:
        return SubscriptionStats(
            buffered=len(self._buffer) + len(self._snapshot),
            max_buffer=self._max_buffer,
            dropped=self._dropped,
            delivered=self._delivered,
            closed=self._closed,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<EventSubscription {state} [{len(self._buffer)}/{self._max_buffer} buffered, "
            f"{self._dropped} dropped, {self._delivered} delivered]>"
        )


class EventHub:
    """Broadcasts events to every live subscription. Loop thread only."""

    def __init__(self) -> None:
        # Weak: a subscription its reader has dropped stops costing anything (its
        # reference's callback takes it out). Not a WeakSet: iterating one runs Python
        # code per item, on every publication.
        self._subs: dict[int, weakref.ref[EventSubscription]] = {}
        self._closed = False
        #: Events published, and events dropped from overflowing subscriptions (one
        #: count per subscription that lost it).
        self.published = 0
        self.dropped = 0
        #: The event loop the hub publishes on; its subscriptions are read there only
        #: (set by the engine when it binds to a loop, or by the first reader).
        self.loop: asyncio.AbstractEventLoop | None = None

    def subscribe(
        self, max_buffer: int, initial: Iterable[OffloadingEvent] = ()
    ) -> EventSubscription:
        if isinstance(max_buffer, bool) or not isinstance(max_buffer, int) or max_buffer <= 0:
            raise ValueError(f"max_buffer must be a positive int, got {max_buffer!r}")
        sub = EventSubscription(self, max_buffer, initial)
        if self._closed:
            sub._end()
        else:
            subs, key = self._subs, id(sub)
            subs[key] = weakref.ref(
                sub, lambda ref: subs.pop(key) if subs.get(key) is ref else None
            )
        return sub

    def _unsubscribe(self, sub: EventSubscription) -> None:
        self._subs.pop(id(sub), None)

    def publish(self, event: OffloadingEvent) -> None:
        self.publish_all((event,))

    def publish_all(self, events: Sequence[OffloadingEvent]) -> None:
        """Publish ``events``, in order."""
        if not events:
            return
        self.published += len(events)
        # A copy of the references: a subscription collected meanwhile takes its own out.
        for ref in tuple(self._subs.values()):
            sub = ref()
            if sub is not None:
                sub._push(events)

    @property
    def subscribers(self) -> list[EventSubscription]:
        return [sub for ref in list(self._subs.values()) if (sub := ref()) is not None]

    def close(self) -> None:
        """End every subscription (after what it has buffered). Idempotent."""
        self._closed = True
        for sub in self.subscribers:
            sub._end()
        self._subs.clear()

    def __repr__(self) -> str:
        return f"<EventHub [{len(self._subs)} subscribers, {self.published} published]>"


class EventSource(Protocol):
    """A manager whose events a stream publishes: the CPU tier's or a lower tier's."""

    @property
    def medium(self) -> Medium: ...

    @property
    def last_seq(self) -> int: ...

    def take_events(self) -> list[OffloadingEvent]: ...

    def resident_keys(self) -> Iterator[OffloadKey]: ...


#: Keys per stored event of a snapshot.
SNAPSHOT_CHUNK = 4096


class EventStream:
    """One engine's event stream: the events of ``sources`` (the CPU tier's manager,
    then each lower tier's) published to one :class:`EventHub`, and snapshots of what
    they hold. With one source its events keep their own ``seq``; with several, the
    stream numbers them 1, 2, 3, ... in publication order."""

    def __init__(self, sources: Sequence[EventSource]) -> None:
        self.hub = EventHub()
        self._sources = list(sources)
        self._seq = 0

    def publish(self) -> None:
        """Publish every source's pending events."""
        sources = self._sources
        events = sources[0].take_events()
        if len(sources) == 1:
            if events:
                self.hub.publish_all(events)
            return
        for source in sources[1:]:
            events += source.take_events()
        if events:
            renumbered = []
            for event in events:
                self._seq += 1
                renumbered.append(dataclasses.replace(event, seq=self._seq))
            self.hub.publish_all(renumbered)

    def subscribe(self, max_buffer: int, snapshot: bool = False) -> EventSubscription:
        """A subscription to what is published from now on, first (``snapshot``) every
        resident key as stored events marked ``snapshot=True``, in chunks of
        :data:`SNAPSHOT_CHUNK` keys, carrying the ``seq`` of the last event published."""
        self.publish()
        initial: list[OffloadingEvent] = []
        if snapshot:
            sources = self._sources
            seq = self._seq if len(sources) > 1 else sources[0].last_seq
            for source in sources:
                keys = list(source.resident_keys())
                for i in range(0, len(keys), SNAPSHOT_CHUNK):
                    chunk = tuple(keys[i : i + SNAPSHOT_CHUNK])
                    initial.append(
                        OffloadingEvent(chunk, source.medium, False, seq, 0.0, snapshot=True)
                    )
        return self.hub.subscribe(max_buffer, initial)
