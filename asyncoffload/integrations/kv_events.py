"""KV events that vLLM's consumers read: the engine's event stream over ZMQ.

:class:`KVEventPublisher` subscribes to an engine's event stream and publishes it the
way vLLM's ``ZmqEventPublisher`` does (``vllm/distributed/kv_events.py``), so KV-aware
routers that index vLLM servers (llm-d, Dynamo, ...) index asyncoffload's tiers too:

- **PUB socket**, bound to ``endpoint``; each batch is three frames: ``topic``, the
  batch's sequence number (8 bytes, big-endian, from 0, one per batch), the payload.
- **Payload**: msgpack of ``KVEventBatch(ts, events, data_parallel_rank)``; each event a
  ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared`` tagged by its class name.
  ``wire_format="array"`` (the default) encodes events as arrays in vLLM's field order,
  as vLLM did until vllm-project/vllm#42892 (June 2026), and as the consumers that
  decode vLLM's positional events expect; ``"map"`` encodes each event as a map with its
  tag under ``"type"`` (the outer batch stays an array), as vLLM does since. The
  structures below mirror vLLM's at the version with ``lora_name``, ``extra_keys``,
  ``group_idx`` and ``kv_cache_spec_*`` (fields after ``group_idx`` are left unset).
- **ROUTER replay socket** on ``replay_endpoint``: a DEALER client sends a start
  sequence number (8 bytes, big-endian); the publisher answers with every buffered batch
  from it on, ``[seq, payload]`` each, then the end marker ``[-1 as 8 bytes, b""]``. A
  malformed request gets ``[-1, b"error: <what was wrong>"]``: the same end marker with
  the reason as payload, so a client stops either way. A reply is many messages, so a
  REQ socket cannot replay: it takes the first batch and discards the rest of the
  reply, end marker included (a further receive fails with EFSM).
  Peers are not trusted: a frame over ``replay_max_request_bytes`` makes libzmq drop
  the connection before the frame is read, a peer has at most
  ``replay_max_in_flight`` replies in progress (further requests are dropped and
  counted), a reply waits in ZMQ for at most ``replay_hwm`` messages per peer (the rest
  is sent as the peer reads), and the warnings peers cause are rate-limited.

A pin change of the engine's stream (``OffloadingEvent.retention``: pinned, expired,
unpinned) is not published: vLLM's events have no such type, and the blocks stay stored.

What goes in the events:

- ``medium`` is the tier (``"CPU"``); ``block_hashes`` the block-hash part of each
  :data:`~asyncoffload.OffloadKey` (bytes), ``group_idx`` its group (an event never mixes
  groups).
- Stored events go out only once the copy completed (the engine publishes them from
  the completion callback). A store whose request context (or ``prepare_store(...,
  tokens=)``) carried a :class:`~asyncoffload.BlockTokens` becomes self-describing
  ``BlockStored`` events: one per run of consecutive blocks of its chain, with their
  token ids, the parent block hash, the block size and the LoRA. Other blocks get vLLM's
  placeholders: no parent, no token ids, ``block_size`` from the config (0 by default,
  as vLLM's offloading connector sends).
- The publisher never loses state silently: when its subscription overflows
  (:class:`~asyncoffload.Lagged`), it publishes ``AllBlocksCleared`` followed by a
  snapshot of every resident block (``BlockStored`` with placeholders), after which the
  live events continue. It does the same when it starts (``snapshot_on_start``), so an
  index built from sequence 0 is exact even when the publisher joined a running engine.

Everything runs on the engine's event-loop thread: events are encoded there (msgspec)
and handed to ZMQ with non-blocking sends (ZMQ's own I/O thread does the network). A
send never waits: a PUB socket drops messages for a subscriber whose queue is full
(``hwm``), and that subscriber sees the gap in the sequence numbers and fills it from
the replay buffer. Replies to replay requests are sent in slices between which the loop
runs other work, and never wait for a peer: one that does not read stalls only its own
reply.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Literal, NamedTuple

import msgspec
import zmq
import zmq.asyncio
from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncoffload.engine import AsyncOffloadEngine
from asyncoffload.errors import EngineClosedError
from asyncoffload.events import EventSubscription, Lagged
from asyncoffload.integrations import check_endpoint, shift_tcp_port
from asyncoffload.keys import (
    BlockTokens,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)
from asyncoffload.manager import OffloadingEvent

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventsConfig",
    "PublisherStats",
    "WireEvent",
    "decode_batch",
    "offset_endpoint",
    "wire_events",
]

log = logging.getLogger("asyncoffload.kv_events")

#: The replay end marker's sequence frame: -1, 8 bytes big-endian.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Replies to replay requests go out this many messages at a time, then the loop runs.
_REPLAY_SLICE = 256
# When every peer with a reply in progress has a full queue, the replies are tried again
# after this long, doubling up to the maximum while none drains (ZMQ tells when a ROUTER
# can send to some peer, not to which).
_RETRY_MIN_S = 0.001
_RETRY_MAX_S = 0.1
# Warnings caused by replay peers: at most replay_warnings_per_minute per this window.
_WARN_WINDOW_S = 60.0


# --- vLLM's wire structures -------------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode an array-format payload (``msgspec.ValidationError`` / ``DecodeError`` if it
    is not one)."""
    return _DECODER.decode(payload)


# --- configuration ----------------------------------------------------------------------


class KVEventsConfig(BaseModel):
    """Settings of a :class:`KVEventPublisher` (names follow vLLM's ``KVEventsConfig``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoint: str = Field(
        "tcp://127.0.0.1:5557",
        description="Where the PUB socket binds ('tcp://host:port', 'ipc://path', "
        "'inproc://name'; port '*' picks a free one). Loopback by default: stored events "
        "can carry prompt token ids. 'tcp://*:5557' (or an interface's address) opens it "
        "to the network. Offset by data_parallel_rank as vLLM does: tcp ports + rank, "
        "other transports '_dp<rank>'.",
    )
    replay_endpoint: str | None = Field(
        None, description="Where the ROUTER replay socket binds; None: no replay."
    )
    topic: str = Field("", description="First frame of every message, e.g. 'kv@pod@model'.")
    data_parallel_rank: int = Field(0, ge=0, description="Set on every batch.")
    buffer_steps: int = Field(10_000, gt=0, description="Batches kept for replay.")
    hwm: int = Field(
        100_000, ge=0, description="The PUB socket's send high-water mark, in messages."
    )
    batch_interval_ms: float = Field(
        0.0,
        ge=0,
        description="0: one batch per event-loop iteration (what the engine published "
        "since the last); > 0: gather events for this long before each batch.",
    )
    max_batch_blocks: int = Field(
        8192, gt=0, description="A batch closes once its events name this many blocks."
    )
    subscription_buffer: int = Field(
        65_536, gt=0, description="Engine events the publisher's subscription holds."
    )
    wire_format: Literal["array", "map"] = Field(
        "array", description="Events as positional arrays (vLLM until mid-2026) or maps."
    )
    block_size: int = Field(
        0, ge=0, description="block_size of BlockStored events without BlockTokens."
    )
    snapshot_on_start: bool = Field(
        True, description="Begin with AllBlocksCleared and every resident block."
    )
    linger_ms: int = Field(500, ge=0, description="How long closing waits for unsent messages.")
    replay_max_request_bytes: int = Field(
        256,
        gt=0,
        description="ZMQ_MAXMSGSIZE of the replay socket: libzmq disconnects a peer that "
        "sends a larger frame before reading it (a request is 8 bytes).",
    )
    replay_max_in_flight: int = Field(
        1,
        gt=0,
        description="Replies in progress per replay peer; its further requests are "
        "dropped (counted in replay_refused) until one finishes.",
    )
    replay_hwm: int = Field(
        1000,
        gt=0,
        description="Reply messages ZMQ holds per replay peer (ZMQ_SNDHWM); the rest of a "
        "reply waits, as a position in the replay buffer, until the peer reads.",
    )
    replay_warnings_per_minute: int = Field(
        10,
        ge=0,
        description="Warnings logged for malformed or refused replay requests, at most, "
        "per minute; then one line says more were suppressed. All are counted.",
    )

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _known_transport(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)


def offset_endpoint(endpoint: str, rank: int) -> str:
    """``endpoint`` for data-parallel ``rank`` (vLLM's convention): a tcp port moves up by
    ``rank``, other transports get the suffix ``_dp<rank>``; rank 0 and port ``*`` stay."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        return shift_tcp_port(endpoint, rank) or endpoint
    return f"{endpoint}_dp{rank}"


# --- events -> wire ---------------------------------------------------------------------


def _runs(keys: Sequence[OffloadKey], tokens: BlockTokens | None) -> Iterator[tuple[int, int, int]]:
    """Split ``keys`` into runs ``(start, stop, position in tokens of keys[start] or -1)``
    of one group each, either not described by ``tokens`` or consecutive blocks of its
    chain (so each run is a chain: every block the child of the one before)."""
    groups = [get_offload_group_idx(k) for k in keys]
    where = [-1] * len(keys)
    if tokens is not None:
        for i, key in enumerate(keys):
            at = tokens.index(key)
            if at is not None:
                where[i] = at
    start = 0
    for i in range(1, len(keys) + 1):
        if (
            i == len(keys)
            or groups[i] != groups[i - 1]
            or (where[i] < 0) != (where[i - 1] < 0)
            or (where[i] >= 0 and where[i] != where[i - 1] + 1)
        ):
            yield start, i, where[start]
            start = i


def wire_events(event: OffloadingEvent, block_size: int = 0) -> list[WireEvent]:
    """vLLM events for one engine event (see the module docstring)."""
    keys = event.keys
    medium = event.medium.value
    out: list[WireEvent] = []
    if event.retention is not None:  # a pin change: vLLM's events have none (the blocks stay)
        return out
    if event.removed:
        for start, stop, _ in _runs(keys, None):
            run = keys[start:stop]
            hashes: list[bytes | int] = [get_offload_block_hash(k) for k in run]
            out.append(BlockRemoved(hashes, medium, get_offload_group_idx(run[0])))
        return out
    tokens = None if event.snapshot else event.tokens
    for start, stop, first in _runs(keys, tokens):
        run = keys[start:stop]
        hashes = [get_offload_block_hash(k) for k in run]
        group = get_offload_group_idx(run[0])
        if first < 0 or tokens is None:
            out.append(BlockStored(hashes, None, [], block_size, None, medium, None, None, group))
            continue
        out.append(
            BlockStored(
                hashes,
                tokens.parent_of(first),
                list(tokens.tokens_of(first, first + len(run))),
                tokens.block_size,
                tokens.lora_id,
                medium,
                tokens.lora_name,
                None,
                group,
            )
        )
    return out


def _blocks(event: WireEvent) -> int:
    return len(event.block_hashes) if isinstance(event, (BlockStored, BlockRemoved)) else 1


def _as_map(event: WireEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in msgspec.structs.fields(event):
        value = getattr(event, f.name)
        if f.default is msgspec.NODEFAULT or value != f.default:
            out[f.name] = value
    return out


# --- the publisher ----------------------------------------------------------------------


class PublisherStats(NamedTuple):
    """Counters of a :class:`KVEventPublisher`, from its start."""

    #: Batches sent on the PUB socket, and the wire events (BlockStored, BlockRemoved,
    #: AllBlocksCleared) in them.
    batches_published: int
    events_published: int
    #: Engine events the publisher lost: its subscription overflowed (each loss is
    #: followed by a resync: AllBlocksCleared, then a snapshot), or a send failed (the
    #: batch stays in the replay buffer).
    events_dropped: int
    resyncs: int
    #: Replay requests received (malformed and refused ones included), those that were
    #: malformed (answered with an error end marker), batches sent in replies.
    replay_requests: int
    replay_errors: int
    batches_replayed: int
    #: Sequence number of the last batch published (-1 before the first).
    last_seq: int
    #: Batches held for replay.
    replay_buffered: int
    #: Engine events waiting in the publisher's subscription.
    lag: int
    #: Replay requests dropped unanswered: their peer already had
    #: ``replay_max_in_flight`` replies in progress.
    replay_refused: int = 0
    #: Replies in progress (accepted, end marker not yet handed to ZMQ), over all peers.
    replays_active: int = 0
    #: Replies given up because their peer went away before the end.
    replays_abandoned: int = 0


class _Reply:
    """A reply in progress: batches ``next`` to ``stop`` (exclusive) still to send to the
    peer ``envelope`` names, then the end marker with payload ``end``."""

    __slots__ = ("end", "envelope", "next", "stop")

    def __init__(self, envelope: list[bytes], start: int, stop: int, end: bytes = b"") -> None:
        self.envelope = envelope
        self.next = start
        self.stop = stop
        self.end = end


class _WarningLimiter:
    """Logs at most ``limit`` warnings per ``window`` seconds. The first one held back in a
    window says so; the first one logged in a later window says how many were."""

    __slots__ = ("_clock", "_limit", "_logged", "_logger", "_opened", "_suppressed", "_window")

    def __init__(
        self,
        logger: logging.Logger,
        limit: int,
        window: float = _WARN_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._limit = limit
        self._window = window
        self._clock = clock
        self._opened = clock()
        self._logged = self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        if now - self._opened >= self._window:
            if self._suppressed:
                self._logger.warning(
                    "%d replay warnings were suppressed in the last %.0f s",
                    self._suppressed,
                    now - self._opened,
                )
            self._opened = now
            self._logged = self._suppressed = 0
        if self._logged < self._limit:
            self._logged += 1
            self._logger.warning(msg, *args)
            return
        self._suppressed += 1
        if self._suppressed == 1:
            self._logger.warning(
                "more replay warnings than %d in %.0f s: the rest are suppressed for up to "
                "%.0f s (the publisher's stats() count every request)",
                self._limit,
                self._window,
                self._window - (now - self._opened),
            )


class KVEventPublisher:
    """Publishes an engine's events as vLLM KV events (see the module docstring).

    ``async with KVEventPublisher(engine, config):`` binds the sockets and starts
    publishing; leaving the block (or :meth:`aclose`) publishes what is pending and
    closes the sockets. When the engine closes, the publisher sends its last events and
    keeps answering replay requests until it is closed. All methods run on the
    engine's event loop. ``context``: a ZMQ context to use (default: one of its own,
    terminated on close).
    """

    def __init__(
        self,
        engine: AsyncOffloadEngine,
        config: KVEventsConfig | None = None,
        *,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if not isinstance(engine, AsyncOffloadEngine):
            raise TypeError(f"engine must be an AsyncOffloadEngine, got {type(engine).__name__}")
        self.engine = engine
        self.config = config if config is not None else KVEventsConfig()
        cfg = self.config
        self._own_context = context is None
        self._ctx: zmq.Context[Any] = context if context is not None else zmq.Context()
        self._topic = cfg.topic.encode()
        self._rank = cfg.data_parallel_rank
        self._encode = msgspec.msgpack.Encoder().encode
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._sub: EventSubscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: list[WireEvent] = []
        self._pending_blocks = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = -1
        self._started = self._closed = False
        self._batches = self._events = self._dropped = self._resyncs = 0
        self._replay_requests = self._replay_errors = self._replayed = 0
        self._replay_refused = self._replays_abandoned = self._replays_active = 0
        #: Replies in progress by peer identity, oldest first; peers in turn.
        self._replies: dict[bytes, deque[_Reply]] = {}
        self._replies_waiting = asyncio.Event()
        self._warn = _WarningLimiter(log, cfg.replay_warnings_per_minute).warning
        self.endpoint = offset_endpoint(cfg.endpoint, self._rank)
        self.replay_endpoint = (
            offset_endpoint(cfg.replay_endpoint, self._rank) if cfg.replay_endpoint else None
        )

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the sockets, subscribe to the engine and start publishing.

        Raises ``RuntimeError`` if started twice or closed, ``OSError`` naming the
        endpoint when a socket cannot bind (nothing is left open then)."""
        if self._started or self._closed:
            raise RuntimeError("the publisher was already started")
        cfg = self.config
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.set_hwm(cfg.hwm)
            pub.setsockopt(zmq.LINGER, cfg.linger_ms)
            self._pub = pub
            self.endpoint = _bind(pub, self.endpoint, "endpoint")
            if self.replay_endpoint is not None:
                router = zmq.asyncio.Socket(self._ctx, zmq.ROUTER)
                router.setsockopt(zmq.MAXMSGSIZE, cfg.replay_max_request_bytes)
                router.setsockopt(zmq.SNDHWM, cfg.replay_hwm)
                # A send to a peer whose queue is full fails (EAGAIN) instead of being
                # dropped silently, and one to a peer that left fails (EHOSTUNREACH).
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                router.setsockopt(zmq.LINGER, 0)
                self._router = router
                self.replay_endpoint = _bind(router, self.replay_endpoint, "replay_endpoint")
            self._sub = self.engine.events(
                snapshot=cfg.snapshot_on_start, max_buffer=cfg.subscription_buffer
            )
        except BaseException:
            self._close_sockets(linger=0)
            self._closed = True
            raise
        self._started = True
        if cfg.snapshot_on_start:  # the first batch: AllBlocksCleared and the snapshot
            self._add(AllBlocksCleared())
            self._drain()
            self._flush()
        self._tasks.append(asyncio.create_task(self._pump(), name="kv-events-publish"))
        if self._router is not None:
            self._tasks.append(asyncio.create_task(self._serve_replay(), name="kv-events-replay"))
            self._tasks.append(
                asyncio.create_task(self._send_replies(), name="kv-events-replay-send")
            )
        log.info(
            "publishing KV events on %s (replay %s, topic %r)",
            self.endpoint,
            self.replay_endpoint,
            cfg.topic,
        )

    async def aclose(self) -> None:
        """Publish what the engine has already sent, stop, close the sockets. Idempotent.

        Cancelled, it stops waiting for the publisher's tasks, and still closes the
        sockets (the pending events are not published then)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        term: asyncio.Future[None] | None = None
        try:
            # asyncio.wait, not `await task` under suppress(CancelledError), which would
            # swallow a cancellation of aclose() itself as well.
            if self._tasks:
                await asyncio.wait(self._tasks)
            for task in self._tasks:
                failure = None if task.cancelled() else task.exception()
                if failure is not None:  # a bug in the publisher: not to pass unseen
                    raise failure
            if self._started:
                self._drain()
                self._flush()
        finally:
            if self._sub is not None:
                self._sub.close()
            self._replies.clear()
            self._replays_active = 0
            self._close_sockets(term=False)
            if self._own_context:
                # Terminating waits up to linger_ms for unsent messages: off the loop,
                # and started even when aclose() was cancelled.
                loop = asyncio.get_running_loop()
                term = loop.run_in_executor(None, self._ctx.term)
        if term is not None:
            await term

    async def __aenter__(self) -> KVEventPublisher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _close_sockets(self, linger: int | None = None, term: bool = True) -> None:
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._pub is not None:
            self._pub.close(linger=linger)
            self._pub = None
        if term and self._own_context:
            self._ctx.term()

    # --- publishing --------------------------------------------------------------------

    async def _pump(self) -> None:
        interval = self.config.batch_interval_ms / 1e3
        while self._sub is not None:
            try:
                item = await self._sub.receive()
            except StopAsyncIteration:  # the engine closed: everything was read
                break
            self._take(item)
            if interval:
                await asyncio.sleep(interval)
            self._drain()
            self._flush()
        self._flush()

    def _drain(self) -> None:
        """Take every item the subscription holds now."""
        while self._sub is not None:
            try:
                item = self._sub.receive_nowait()
            except (asyncio.QueueEmpty, StopAsyncIteration):
                return
            self._take(item)

    def _take(self, item: OffloadingEvent | Lagged) -> None:
        if isinstance(item, Lagged):
            self._dropped += item.missed
            self._resync()
            return
        for event in wire_events(item, self.config.block_size):
            self._add(event)

    def _resync(self) -> None:
        """The subscription lost events: start again from a snapshot."""
        assert self._sub is not None
        self._sub.close()
        self._sub = None
        self._pending.clear()
        self._pending_blocks = 0
        self._resyncs += 1
        try:
            self._sub = self.engine.events(
                snapshot=True, max_buffer=self.config.subscription_buffer
            )
        except EngineClosedError:  # nothing more will come; the index is stale anyway
            log.warning("KV events lost while the engine closed; no snapshot possible")
            return
        log.warning("KV event subscription overflowed: resyncing (AllBlocksCleared + snapshot)")
        self._add(AllBlocksCleared())

    def _add(self, event: WireEvent) -> None:
        self._pending.append(event)
        self._pending_blocks += _blocks(event)
        if self._pending_blocks >= self.config.max_batch_blocks:
            self._flush()

    def _flush(self) -> None:
        events = self._pending
        if not events or self._pub is None:
            return
        self._pending = []
        self._pending_blocks = 0
        payload = self._payload(events)
        self._seq += 1
        seq = self._seq
        self._buffer.append((seq, payload))
        self._batches += 1
        self._events += len(events)
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # kept for replay: subscribers see the gap and fill it
            self._dropped += len(events)
            log.warning("KV event batch %d not sent (%s); it stays replayable", seq, exc)

    def _payload(self, events: list[WireEvent]) -> bytes:
        ts = time.time()
        if self.config.wire_format == "map":
            return self._encode([ts, [_as_map(e) for e in events], self._rank])
        return self._encode(KVEventBatch(ts, events, self._rank))

    # --- replay ------------------------------------------------------------------------

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            self._request(await router.recv_multipart())

    def _request(self, frames: list[bytes]) -> None:
        """Accept (or refuse) one replay request; :meth:`_send_replies` sends the reply."""
        self._replay_requests += 1
        # [identity, b"", start] from DEALER clients that send the delimiter as vLLM's
        # do; [identity, start] from a bare DEALER.
        if len(frames) >= 2 and frames[1] == b"":
            envelope, body = frames[:2], frames[2:]
        else:
            envelope, body = frames[:1], frames[1:]
        problem = None
        if len(body) != 1:
            problem = f"expected one frame (the start sequence), got {len(body)}"
        elif len(body[0]) != 8:
            problem = f"the start sequence must be 8 bytes big-endian, got {len(body[0])}"
        if problem is not None:
            self._replay_errors += 1
            self._warn("malformed replay request: %s", problem)
        queue = self._replies.get(frames[0])
        if queue is None:
            queue = self._replies[frames[0]] = deque()
        elif len(queue) >= self.config.replay_max_in_flight:
            self._replay_refused += 1
            self._warn("replay request dropped: its peer has %d replies in progress", len(queue))
            return
        if problem is not None:
            queue.append(_Reply(envelope, 0, 0, b"error: " + problem.encode()))
        else:
            queue.append(_Reply(envelope, int.from_bytes(body[0], "big"), self._seq + 1))
        self._replays_active += 1
        self._replies_waiting.set()

    async def _send_replies(self) -> None:
        """Send the replies in progress as their peers read them, never waiting for one."""
        delay = _RETRY_MIN_S
        while True:
            if not self._replies:
                self._replies_waiting.clear()
                await self._replies_waiting.wait()
            elif self._send_replies_nowait():
                delay = _RETRY_MIN_S
                await asyncio.sleep(0)  # one slice at a time: the loop runs between
            else:  # every peer's queue is full: look again later, or on a new request
                self._replies_waiting.clear()
                # A timer sets the event, not asyncio.wait_for: before Python 3.12 that
                # returns a wake-up that races with a cancellation and drops the
                # cancellation, and aclose() then waited for this task forever.
                retry = asyncio.get_running_loop().call_later(delay, self._replies_waiting.set)
                try:
                    await self._replies_waiting.wait()
                finally:
                    retry.cancel()
                delay = min(2 * delay, _RETRY_MAX_S)

    def _send_replies_nowait(self) -> bool:
        """Hand ZMQ up to ``_REPLAY_SLICE`` messages of the replies in progress, a peer
        at a time (those served go to the back); whether any went."""
        budget = _REPLAY_SLICE
        for peer in list(self._replies):
            if budget <= 0:
                break
            queue = self._replies.pop(peer)
            try:
                while queue and budget > 0:
                    sent, done = self._send_reply(queue[0], budget)
                    budget -= sent
                    if not done:
                        break
                    queue.popleft()
                    self._replays_active -= 1
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer went away mid-reply
                self._replays_abandoned += len(queue)
                self._replays_active -= len(queue)
                self._warn("replay to a peer abandoned: %s", exc)
                continue
            if queue:
                self._replies[peer] = queue
        return budget < _REPLAY_SLICE

    def _send_reply(self, reply: _Reply, budget: int) -> tuple[int, bool]:
        """Send what ``reply``'s peer takes now, at most ``budget`` messages: how many
        went, and whether the end marker did."""
        buffer = self._buffer
        first = buffer[0][0] if buffer else reply.stop
        reply.next = max(reply.next, first)  # batches gone from the buffer: a gap
        envelope = reply.envelope
        sent = 0
        count = min(budget, max(0, reply.stop - reply.next))
        at = reply.next - first
        for seq, payload in itertools.islice(buffer, at, at + count):
            if not self._send_nowait([*envelope, seq.to_bytes(8, "big"), payload]):
                return sent, False
            reply.next = seq + 1
            sent += 1
            self._replayed += 1
        if reply.next < reply.stop or sent == budget:
            return sent, False
        if not self._send_nowait([*envelope, END_SEQ, reply.end]):
            return sent, False
        return sent + 1, True

    def _send_nowait(self, frames: list[bytes]) -> bool:
        """Queue one message in ZMQ; False when its peer's queue is full (ZMQError when
        the peer went away)."""
        assert self._router is not None
        # NOBLOCK: resolved at once (zmq.asyncio sends without waiting when no send waits).
        sent = self._router.send_multipart(frames, zmq.NOBLOCK)
        assert isinstance(sent, asyncio.Future) and sent.done()
        exc = sent.exception()
        if exc is None:
            return True
        if isinstance(exc, zmq.Again):
            return False
        raise exc

    # --- introspection -----------------------------------------------------------------

    def stats(self) -> PublisherStats:
        sub = self._sub
        return PublisherStats(
            batches_published=self._batches,
            events_published=self._events,
            events_dropped=self._dropped,
            resyncs=self._resyncs,
            replay_requests=self._replay_requests,
            replay_errors=self._replay_errors,
            batches_replayed=self._replayed,
            last_seq=self._seq,
            replay_buffered=len(self._buffer),
            lag=sub.statistics().buffered if sub is not None else 0,
            replay_refused=self._replay_refused,
            replays_active=self._replays_active,
            replays_abandoned=self._replays_abandoned,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._started else "new"
        return (
            f"<KVEventPublisher {state} {self.endpoint} replay={self.replay_endpoint} "
            f"[{self._batches} batches, last seq {self._seq}]>"
        )


def _bind(sock: zmq.Socket[Any], endpoint: str, what: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind the {what} {endpoint!r}: {exc}") from exc
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else endpoint
