"""vLLM-compatible KV events over real ZMQ sockets on 127.0.0.1.

The consumer is examples/kv_index.py: its msgspec classes mirror vLLM's wire classes
independently of asyncoffload's, and its index must end equal to the engine's resident
set, through evictions, disconnections (replay), overflows (resync) and restarts.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pydantic
import pytest
import zmq

import asyncoffload as ao
from asyncoffload.integrations import kv_events
from asyncoffload.integrations.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventsConfig,
    _WarningLimiter,
    offset_endpoint,
    wire_events,
)
from tests.helpers import make_engine, make_keys, state_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import kv_index

LOCAL = "tcp://127.0.0.1:*"

#: How long a test waits for anything (a reply, a batch, a transfer) before it fails,
#: naming what it waited for: generous, so that a busy machine is slow, not a failure.
WAIT_S = 30.0

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: float, what: str) -> T:
    """``await awaitable``, failing after ``timeout`` seconds with a message naming
    ``what`` was awaited (it is cancelled then)."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"waited {timeout:g} s for {what}") from None


async def done(transfer: Awaitable[object], what: str = "a store to complete") -> None:
    await within(transfer, WAIT_S, what)


@pytest.fixture
def zctx() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    # Every socket closes without waiting for unsent messages, also one that a test left
    # to the garbage collector (ZMQ's default is to wait for ever, and destroy() below
    # closes only the sockets still alive).
    ctx.setsockopt(zmq.LINGER, 0)
    yield ctx
    ctx.destroy(linger=0)


def config(**kw: Any) -> KVEventsConfig:
    return KVEventsConfig.model_validate(
        {"endpoint": LOCAL, "replay_endpoint": LOCAL, "topic": "kv@pod@model", **kw}
    )


def resident(engine: ao.AsyncOffloadEngine) -> set[tuple[bytes, int]]:
    return {
        (ao.get_offload_block_hash(k), ao.get_offload_group_idx(k))
        for k in engine.manager.resident_keys()
    }


async def flushed(pub: KVEventPublisher) -> int:
    """Let the publisher take and send everything the engine has published; its last seq."""
    for _ in range(5):
        await asyncio.sleep(0)
    return pub.stats().last_seq


def subscriber(pub: KVEventPublisher, topic: str, ctx: zmq.Context[Any]) -> kv_index.Subscriber:
    """A consumer of ``pub`` that waits up to ``WAIT_S`` for each message of a replay
    (not kv_index's 2 s: the publisher shares a busy machine)."""
    return kv_index.Subscriber(
        pub.endpoint, pub.replay_endpoint, topic, context=ctx, replay_timeout_ms=int(WAIT_S * 1e3)
    )


async def catch_up(
    sub: kv_index.Subscriber, pub: KVEventPublisher, timeout: float = WAIT_S
) -> None:
    target = await flushed(pub)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    quiet = 0
    while sub.last_seq < target:
        assert loop.time() < deadline, (
            f"waited {timeout:g} s for the subscriber to catch up: at seq {sub.last_seq}, "
            f"the publisher at {target}"
        )
        got = await asyncio.to_thread(sub.poll, 50)
        quiet = 0 if got else quiet + 1
        if quiet == 20:  # a SUB that was still joining missed the last batches: ask
            await asyncio.to_thread(sub.replay, sub.last_seq + 1)


async def connect(sub: kv_index.Subscriber) -> None:
    await asyncio.to_thread(sub.connect)


class Workload:
    """Random conversations: prompts that extend earlier ones, in two KV groups, most
    stores describing their blocks (BlockTokens), some not; loads of the hits."""

    def __init__(self, engine: ao.AsyncOffloadEngine, seed: int, block_size: int = 4) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.histories: list[list[int]] = [[] for _ in range(6)]
        self.tokens: dict[tuple[bytes, int], list[int]] = {}
        self.pending: list[ao.Transfer] = []

    async def step(self) -> None:
        rng, bs = self.rng, self.block_size
        conv = rng.randrange(len(self.histories))
        history = self.histories[conv]
        history += [rng.randrange(50_000) for _ in range(bs * rng.randint(1, 5))]
        del history[: max(0, len(history) - 12 * bs)]  # prompts of at most 12 blocks
        group = conv % 2
        bt = ao.BlockTokens.from_tokens(history, bs, group)
        for i, key in enumerate(bt.keys):
            self.tokens[ao.get_offload_block_hash(key), group] = list(bt.tokens_of(i, i + 1))
        keys = list(bt.keys)
        ids = list(range(len(keys)))
        engine = self.engine
        n = engine.lookup(keys)
        if n:
            await done(await engine.prepare_load(keys[:n], ids[:n]), "a load to complete")
        if n < len(keys):
            ctx = ao.ReqContext(f"r{conv}", tokens=bt if rng.random() < 0.7 else None)
            handle = await engine.prepare_store(keys[n:], ids[n:], ctx)
            if handle is not None:
                if rng.random() < 0.5:
                    await done(handle)
                else:
                    self.pending.append(handle)

    async def run(self, steps: int) -> None:
        for _ in range(steps):
            await self.step()
        await self.finish()

    async def finish(self) -> None:
        for handle in self.pending:
            await done(handle)
        self.pending.clear()


def check_index(
    sub: kv_index.Subscriber, engine: ao.AsyncOffloadEngine, workload: Workload
) -> None:
    expected = resident(engine)
    assert expected, "the workload left nothing resident"
    assert sub.index.tiers.get("CPU", set()) == expected
    assert set(sub.index.tiers) <= {"CPU"}
    described = sub.index.tokens
    assert described, "no block was described by its tokens"
    for block, tokens in described.items():
        assert block in expected
        assert tokens == workload.tokens[block]


@pytest.fixture
async def engine() -> AsyncIterator[ao.AsyncOffloadEngine]:
    # LRU: the checks count on what the workload leaves resident.
    eng, _ = make_engine(cpu_blocks=24, gpu_blocks=32, policy="lru")
    async with eng:
        yield eng


# --- the wire ------------------------------------------------------------------------


def test_batches_are_vllm_positional_arrays_in_vllm_field_order() -> None:
    keys = make_keys(3, group=7)
    bt = ao.BlockTokens(keys, list(range(12)), 4, b"parent", lora_name="ad", lora_id=3)
    stored = ao.OffloadingEvent(tuple(keys), ao.Medium.CPU, False, 1, 0.0, tokens=bt)
    removed = ao.OffloadingEvent(tuple(keys[:1]), ao.Medium.CPU, True, 2, 0.0)
    events = [*wire_events(stored), *wire_events(removed), AllBlocksCleared()]
    payload = msgspec.msgpack.encode(KVEventBatch(1.5, events, 2))
    raw = msgspec.msgpack.decode(payload)
    hashes = [ao.get_offload_block_hash(k) for k in keys]
    assert raw == [
        1.5,
        [
            # tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
            # lora_name, extra_keys, group_idx, kv_cache_spec_kind,
            # kv_cache_spec_sliding_window (msgspec writes every field of an array)
            [
                "BlockStored",
                hashes,
                b"parent",
                list(range(12)),
                4,
                3,
                "CPU",
                "ad",
                None,
                7,
                None,
                None,
            ],
            ["BlockRemoved", hashes[:1], "CPU", 7],
            ["AllBlocksCleared"],
        ],
        2,
    ]
    batch = msgspec.msgpack.Decoder(kv_index.KVEventBatch).decode(payload)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]


def test_stored_events_split_into_chains_of_one_group() -> None:
    keys = make_keys(6)
    other = make_keys(2, prefix=b"g", group=1)
    bt = ao.BlockTokens(keys, list(range(24)), 4)
    # Keys 0-1 and 3-5 of the chain (2 was stored before), then two undescribed keys of
    # another group, in one event.
    event_keys = (keys[0], keys[1], keys[3], keys[4], keys[5], *other)
    event = ao.OffloadingEvent(event_keys, ao.Medium.CPU, False, 1, 0.0, tokens=bt)
    out = wire_events(event, block_size=16)
    assert all(isinstance(e, BlockStored) for e in out)
    h = [ao.get_offload_block_hash(k) for k in keys]
    first, second, third = out
    assert isinstance(first, BlockStored)
    assert isinstance(second, BlockStored)
    assert isinstance(third, BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (
        h[:2],
        None,
        list(range(8)),
    )
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == (
        h[3:],
        h[2],
        list(range(12, 24)),
    )
    assert (second.block_size, second.group_idx) == (4, 0)
    # vLLM's placeholders for blocks nothing describes.
    assert third.block_hashes == [ao.get_offload_block_hash(k) for k in other]
    assert (third.parent_block_hash, third.token_ids, third.block_size, third.group_idx) == (
        None,
        [],
        16,
        1,
    )
    removed = wire_events(ao.OffloadingEvent(event_keys, ao.Medium.CPU, True, 2, 0.0))
    assert [(type(e), e.group_idx, len(e.block_hashes)) for e in removed] == [  # type: ignore[union-attr]
        (BlockRemoved, 0, 5),
        (BlockRemoved, 1, 2),
    ]


def test_snapshot_events_carry_placeholders() -> None:
    keys = make_keys(2)
    bt = ao.BlockTokens(keys, list(range(8)), 4)
    event = ao.OffloadingEvent(tuple(keys), ao.Medium.CPU, False, 3, 0.0, True, bt)
    (out,) = wire_events(event)
    assert isinstance(out, BlockStored)
    assert (out.token_ids, out.parent_block_hash) == ([], None)


# --- publishing ------------------------------------------------------------------------


async def test_the_index_follows_a_random_workload_with_evictions(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any]
) -> None:
    async with KVEventPublisher(engine, config()) as pub:
        sub = subscriber(pub, "kv@pod@model", zctx)
        await connect(sub)
        work = Workload(engine, seed=1)
        for _ in range(8):
            await work.run(15)
            await catch_up(sub, pub)
            check_index(sub, engine, work)
        stats = engine.stats()
        assert stats.blocks_evicted > 50 and stats.blocks_loaded > 0
        assert pub.stats().events_dropped == 0
        sub.disconnect()


async def test_a_subscriber_that_was_away_fills_the_gap_by_replay(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any]
) -> None:
    async with KVEventPublisher(engine, config()) as pub:
        sub = subscriber(pub, "kv@pod@model", zctx)
        await connect(sub)
        work = Workload(engine, seed=2)
        await work.run(20)
        await catch_up(sub, pub)
        check_index(sub, engine, work)
        away_from = sub.last_seq

        sub.disconnect()
        await work.run(40)  # published while nobody listens
        assert await flushed(pub) > away_from + 1
        assert sub.index.tiers["CPU"] != resident(engine)

        await connect(sub)  # asks the ROUTER socket for everything after away_from
        assert sub.replayed >= pub.stats().last_seq - away_from
        await catch_up(sub, pub)
        check_index(sub, engine, work)
        assert sub.lost == 0
        assert pub.stats().batches_replayed >= sub.replayed
        # A gap noticed on a live batch is filled the same way.
        sub.disconnect()
        await work.run(10)
        await flushed(pub)
        sub.sub = zctx.socket(zmq.SUB)
        sub.sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.sub.connect(pub.endpoint)
        replayed = sub.replayed
        # The SUB joins asynchronously (a sleep would be a guess): publish until a live
        # batch reaches it, past the gap.
        for _ in range(100):
            await work.run(1)
            await flushed(pub)
            if await asyncio.to_thread(sub.sub.poll, 100):
                break
        else:
            pytest.fail("no live batch reached the SUB socket in 100 steps")
        await catch_up(sub, pub)
        assert sub.replayed > replayed
        check_index(sub, engine, work)
        sub.disconnect()


async def test_a_late_subscriber_rebuilds_everything_from_sequence_zero(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any]
) -> None:
    work = Workload(engine, seed=3)
    await work.run(30)  # before the publisher exists
    async with KVEventPublisher(engine, config()) as pub:
        await work.run(10)
        await flushed(pub)
        sub = subscriber(pub, "", zctx)
        await connect(sub)  # replays from 0: AllBlocksCleared + snapshot, then live
        await catch_up(sub, pub)
        check_index(sub, engine, work)
        sub.disconnect()


async def test_an_overflowing_subscription_resyncs_with_a_snapshot(
    zctx: zmq.Context[Any],
) -> None:
    eng, _ = make_engine(cpu_blocks=24, gpu_blocks=16)
    async with eng, KVEventPublisher(eng, config(subscription_buffer=2)) as pub:
        sub = subscriber(pub, "", zctx)
        await connect(sub)
        keys = make_keys(40)
        # Stores that each evict, with no await that yields between them: the engine
        # publishes a removed event per call, the publisher's buffer of 2 overflows.
        for i in range(0, 40, 4):
            handle = await eng.prepare_store(keys[i : i + 4], [0, 1, 2, 3])
            assert handle is not None
            await done(handle)
        burst = []
        for i in range(0, 24, 4):
            handle = await eng.prepare_store(make_keys(4, prefix=bytes([i])), [0, 1, 2, 3])
            assert handle is not None
            burst.append(handle)
        for handle in burst:
            await done(handle)
        await catch_up(sub, pub)
        stats = pub.stats()
        assert stats.resyncs >= 1 and stats.events_dropped >= 1
        assert sub.index.tiers["CPU"] == resident(eng)
        assert sub.lost == 0
        sub.disconnect()


async def test_malformed_replay_requests_get_an_error_and_the_publisher_goes_on(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any]
) -> None:
    async with KVEventPublisher(engine, config()) as pub:
        work = Workload(engine, seed=4)
        await work.run(5)
        await flushed(pub)
        assert pub.replay_endpoint is not None
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)

        async def ask(*frames: bytes) -> list[list[bytes]]:
            dealer.send_multipart(list(frames))
            replies = []
            while True:
                ready = await asyncio.to_thread(dealer.poll, int(WAIT_S * 1e3))
                assert ready, f"waited {WAIT_S:g} s for a reply to {list(frames)}"
                reply = dealer.recv_multipart()
                replies.append(reply)
                if reply[-2] == END_SEQ:
                    return replies

        for bad in ([b"", b"abc"], [b"", b"x" * 9], [b"", b"\0" * 8, b"extra"], [b""], [b"", b""]):
            (reply,) = await ask(*bad)
            assert reply[-2] == END_SEQ and reply[-1].startswith(b"error: ")
        # A DEALER without the empty delimiter frame is answered too.
        (reply,) = await ask(b"short")
        assert reply[-1].startswith(b"error: the start sequence must be 8 bytes")
        assert pub.stats().replay_errors == 6

        good = await ask(b"", (0).to_bytes(8, "big"))
        seqs = [int.from_bytes(r[1], "big") for r in good[:-1]]
        assert seqs == list(range(pub.stats().last_seq + 1))
        assert good[-1] == [b"", END_SEQ, b""]
        # Still publishing.
        before = pub.stats().batches_published
        await work.run(3)
        await flushed(pub)
        assert pub.stats().batches_published > before
        dealer.close(linger=0)


# vLLM's map format (since vllm-project/vllm#42892): events as maps tagged under "type".


class MapEvent(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[MapStored | MapCleared]
    data_parallel_rank: int | None = None


async def test_map_format_tags_each_event_under_type(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any]
) -> None:
    async with KVEventPublisher(engine, config(wire_format="map", replay_endpoint=None)) as pub:
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        # A SUB socket joins asynchronously: store until one of its batches arrives.
        for i in range(50):
            keys = make_keys(2, prefix=bytes([i]))
            bt = ao.BlockTokens(keys, list(range(8)), 4)
            handle = await engine.prepare_store(keys, [0, 1], tokens=bt)
            assert handle is not None
            await done(handle)
            await flushed(pub)
            if await asyncio.to_thread(sub.poll, 100):
                break
        else:
            pytest.fail("no batch reached the SUB socket")
        frames = sub.recv_multipart()
        batch = msgspec.msgpack.Decoder(MapBatch).decode(frames[2])
        raw = msgspec.msgpack.decode(frames[2])
        assert raw[1][-1]["type"] == "BlockStored"
        (event,) = [e for e in batch.events if isinstance(e, MapStored)]
        assert (event.token_ids, event.block_size, event.group_idx) == (list(range(8)), 4, 0)
        sub.close(linger=0)


@pytest.mark.parametrize(("max_batch_blocks", "removed_per_batch"), [(8192, [2]), (3, [1, 1])])
async def test_one_batch_per_loop_iteration_and_dp_rank_on_every_batch(
    zctx: zmq.Context[Any], max_batch_blocks: int, removed_per_batch: list[int]
) -> None:
    eng, _ = make_engine(cpu_blocks=8, gpu_blocks=16)
    cfg = config(data_parallel_rank=3, max_batch_blocks=max_batch_blocks)
    async with eng, KVEventPublisher(eng, cfg) as pub:
        sub = subscriber(pub, "", zctx)
        await connect(sub)
        handle = await eng.prepare_store(make_keys(8), list(range(8)))
        assert handle is not None
        await done(handle)
        start = await flushed(pub)
        # Two stores that each evict 4 blocks, with no await that yields between them:
        # their removed events are published in one loop iteration, so they go out in
        # one batch, unless max_batch_blocks closes it after the first.
        burst = [
            await eng.prepare_store(make_keys(4, prefix=bytes([i])), [0, 1, 2, 3]) for i in range(2)
        ]
        await flushed(pub)
        batches = [msgspec.msgpack.decode(p) for seq, p in pub._buffer if seq > start]
        removed = [sum(e[0] == "BlockRemoved" for e in b[1]) for b in batches]
        assert [n for n in removed if n] == removed_per_batch
        for handle in burst:
            assert handle is not None
            await done(handle)
        await catch_up(sub, pub)
        raw = [msgspec.msgpack.decode(payload) for _, payload in pub._buffer]
        assert all(batch[2] == 3 for batch in raw)
        assert sub.index.tiers["CPU"] == resident(eng)
        sub.disconnect()


async def test_the_last_events_go_out_when_the_engine_closes_and_replay_still_answers(
    zctx: zmq.Context[Any],
) -> None:
    eng, _ = make_engine(cpu_blocks=8, gpu_blocks=16)
    pub = KVEventPublisher(eng, config())
    async with eng:
        await pub.start()
        handle = await eng.prepare_store(make_keys(4), [0, 1, 2, 3])
        assert handle is not None
        await done(handle)
    # The engine is closed; the stored event was published; replay still works.
    await flushed(pub)
    sub = subscriber(pub, "", zctx)
    await connect(sub)
    assert sub.index.tiers["CPU"] == {(ao.get_offload_block_hash(k), 0) for k in make_keys(4)}
    sub.disconnect()
    await pub.aclose()
    await pub.aclose()  # idempotent
    assert "closed" in repr(pub)


# --- configuration and errors ----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("endpoint", "http://x:1", "must be 'tcp://host:port'"),
        ("replay_endpoint", "5558", "must be 'tcp://host:port'"),
        ("buffer_steps", 0, "buffer_steps"),
        ("wire_format", "json", "wire_format"),
        ("data_parallel_rank", -1, "data_parallel_rank"),
        ("bogus", 1, "bogus"),
    ],
)
def test_bad_settings_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        KVEventsConfig.model_validate({field: value})


def test_data_parallel_ranks_offset_the_endpoints_as_vllm_does() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://127.0.0.1:*", 2) == "tcp://127.0.0.1:*"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    pub = KVEventPublisher(
        make_engine()[0],
        KVEventsConfig(
            endpoint="tcp://*:6000", replay_endpoint="tcp://*:6001", data_parallel_rank=4
        ),
    )
    assert (pub.endpoint, pub.replay_endpoint) == ("tcp://*:6004", "tcp://*:6005")


async def test_a_failed_bind_names_the_endpoint_and_leaves_the_engine_alone(
    engine: ao.AsyncOffloadEngine,
) -> None:
    async with KVEventPublisher(engine, config(replay_endpoint=None)) as first:
        before = state_of(engine), engine.stats().subscribers
        taken = KVEventPublisher(engine, config(endpoint=first.endpoint, replay_endpoint=None))
        with pytest.raises(OSError, match=f"cannot bind the endpoint '{first.endpoint}'"):
            await taken.start()
        assert (state_of(engine), engine.stats().subscribers) == before
        with pytest.raises(RuntimeError, match="already started"):
            await taken.start()
        await taken.aclose()


def test_the_publisher_needs_an_engine() -> None:
    with pytest.raises(TypeError, match="AsyncOffloadEngine"):
        KVEventPublisher(object())  # type: ignore[arg-type]


async def test_tokens_must_describe_every_stored_key(engine: ao.AsyncOffloadEngine) -> None:
    keys = make_keys(3)
    bt = ao.BlockTokens(keys[:2], list(range(8)), 4)
    before = state_of(engine)
    with pytest.raises(ValueError, match=r"keys\[2\] is not one of the 2 keys"):
        await engine.prepare_store(keys, [0, 1, 2], tokens=bt)
    with pytest.raises(TypeError, match="not BlockTokens"):
        await engine.prepare_store(keys, [0, 1, 2], tokens=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keys\[2\]"):
        await engine.prepare_store(keys, [0, 1, 2], ao.ReqContext("r", tokens=bt))
    assert state_of(engine) == before


async def test_batch_interval_gathers_events_of_several_iterations(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any]
) -> None:
    # An interval that three stores fit in on a busy machine too (200 ms did not always).
    async with KVEventPublisher(engine, config(batch_interval_ms=1000)) as pub:
        start = pub.stats().last_seq
        assert start == 0  # the start-up batch (AllBlocksCleared + snapshot) went out at once
        for i in range(3):  # each store completes in an iteration of its own
            handle = await engine.prepare_store(make_keys(2, prefix=bytes([i])), [0, 1])
            assert handle is not None
            await done(handle)
        await until(lambda: pub.stats().last_seq > start, "the batch of the interval")
        assert pub.stats().last_seq == start + 1
        (_, payload) = pub._buffer[-1]
        batch = msgspec.msgpack.decode(payload)
        assert [e[0] for e in batch[1]] == ["BlockStored"] * 3


# --- the replay socket against peers that misbehave --------------------------------------


async def until(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Wait (polling: the publisher's counters have no event) until ``check()`` holds;
    fail after ``timeout`` seconds, naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, f"waited {timeout:g} s for {what}"
        await asyncio.sleep(0.005)


def dealer(ctx: zmq.Context[Any], endpoint: str | None, *, reads: bool = True) -> zmq.Socket[bytes]:
    """A replay client; ``reads=False``: one that never reads, so its queue in its own ZMQ
    (one message) and its kernel buffer fill and stay full."""
    assert endpoint is not None
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    if not reads:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock


async def replay_from(sock: zmq.Socket[bytes], start: int) -> list[list[bytes]]:
    """Every message of the reply to ``start``, the end marker last."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])

    def read() -> list[list[bytes]]:
        out = []
        while sock.poll(10_000):
            out.append(sock.recv_multipart())
            if out[-1][1] == END_SEQ:
                return out
        raise AssertionError(f"no end marker after {len(out)} messages")

    return await asyncio.to_thread(read)


async def publish_big_batches(engine: ao.AsyncOffloadEngine, pub: KVEventPublisher) -> int:
    """64 batches of about 650 KB (16 blocks of 8,192 token ids each): a reply from 0 (about
    42 MB) is far more than the socket buffers between a publisher and a peer hold. The
    number of batches buffered."""
    block_size = 8192
    tokens = list(range(100_000, 100_000 + 16 * block_size))  # 5 bytes each in msgpack
    for i in range(64):
        keys = make_keys(16, prefix=i.to_bytes(2, "big"))
        bt = ao.BlockTokens(keys, tokens, block_size)
        handle = await engine.prepare_store(keys, list(range(16)), tokens=bt)
        assert handle is not None
        await done(handle)
    return await flushed(pub) + 1


async def test_a_frame_over_the_request_limit_disconnects_its_peer_unread(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any]
) -> None:
    async with KVEventPublisher(engine, config()) as pub:
        big = dealer(zctx, pub.replay_endpoint)
        monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        big.send_multipart([b"", b"x" * (1 << 20)])  # over replay_max_request_bytes

        def first_news() -> str:
            poller = zmq.Poller()
            poller.register(big, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            ready = dict(poller.poll(10_000))
            return "a reply" if big in ready else "disconnected" if ready else "nothing"

        assert await asyncio.to_thread(first_news) == "disconnected"
        stats = pub.stats()
        assert (stats.replay_requests, stats.replay_errors, stats.replays_active) == (0, 0, 0)
        big.disable_monitor()
        monitor.close()
        big.close()


async def test_a_client_is_answered_after_a_peer_was_disconnected_for_a_big_frame(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any]
) -> None:
    async with KVEventPublisher(engine, config(replay_max_request_bytes=1024)) as pub:
        await Workload(engine, seed=5).run(5)
        last = await flushed(pub)
        big = dealer(zctx, pub.replay_endpoint)
        monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        big.send_multipart([b"", b"x" * 1025])
        assert await asyncio.to_thread(monitor.poll, 10_000), "the big frame's peer stayed"
        reply = await replay_from(dealer(zctx, pub.replay_endpoint), 0)
        assert [int.from_bytes(m[1], "big") for m in reply[:-1]] == list(range(last + 1))
        assert reply[-1] == [b"", END_SEQ, b""]
        assert pub.stats().replay_requests == 1
        big.disable_monitor()
        monitor.close()
        big.close()


async def test_a_dealer_replay_gets_every_buffered_batch_then_the_end_marker(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any]
) -> None:
    # More batches than a slice (256) and than the peer's reply queue (replay_hwm): the
    # reply goes out as the client reads.
    async with KVEventPublisher(engine, config(replay_hwm=8)) as pub:
        for i in range(300):  # a batch each at least
            handle = await engine.prepare_store(make_keys(2, prefix=i.to_bytes(2, "big")), [0, 1])
            assert handle is not None
            await done(handle)
        last = await flushed(pub)
        # The start-up batch and one a store: seq 300 at least. Each store's evictions go
        # out in a batch of their own only when the publisher runs before the copy's
        # completion does (on uvloop, a copy done by the loop's next poll comes first).
        assert last >= 300
        reply = await replay_from(dealer(zctx, pub.replay_endpoint), 0)
        assert [int.from_bytes(m[1], "big") for m in reply[:-1]] == list(range(last + 1))
        assert [m[2] for m in reply[:-1]] == [payload for _, payload in pub._buffer]
        assert reply[-1] == [b"", END_SEQ, b""]
        stats = pub.stats()
        assert (stats.batches_replayed, stats.replays_active) == (last + 1, 0)


SILENT_PEERS = 3


async def test_a_peer_has_one_reply_in_progress_and_its_extra_requests_are_dropped(
    zctx: zmq.Context[Any],
) -> None:
    eng, _ = make_engine(cpu_blocks=16, gpu_blocks=16, policy="lru")  # stores every batch
    async with eng, KVEventPublisher(eng, config(replay_hwm=4)) as pub:
        await publish_big_batches(eng, pub)
        peers = [dealer(zctx, pub.replay_endpoint, reads=False) for _ in range(SILENT_PEERS)]
        for peer in peers:
            for _ in range(5):
                peer.send_multipart([b"", (0).to_bytes(8, "big")])
        await until(lambda: pub.stats().replay_requests == 5 * SILENT_PEERS, "the requests")
        stats = pub.stats()
        assert stats.replays_active == SILENT_PEERS
        assert stats.replay_refused == 4 * SILENT_PEERS


async def test_peers_that_never_read_get_only_part_of_one_reply(zctx: zmq.Context[Any]) -> None:
    eng, _ = make_engine(cpu_blocks=16, gpu_blocks=16, policy="lru")  # stores every batch
    async with eng, KVEventPublisher(eng, config(replay_hwm=4)) as pub:
        batches = await publish_big_batches(eng, pub)
        peers = [dealer(zctx, pub.replay_endpoint, reads=False) for _ in range(SILENT_PEERS)]
        for peer in peers:
            for _ in range(5):
                peer.send_multipart([b"", (0).to_bytes(8, "big")])
        await until(lambda: pub.stats().replay_requests == 5 * SILENT_PEERS, "the requests")
        await until(lambda: pub.stats().batches_replayed >= SILENT_PEERS, "the replies")
        # What ZMQ holds for a peer is replay_hwm messages and what the sockets buffer;
        # the rest of its reply is a position in the replay buffer. No reply can finish.
        stats = pub.stats()
        assert stats.batches_replayed < SILENT_PEERS * batches
        assert stats.replays_active == SILENT_PEERS


async def test_a_reading_peer_is_answered_while_others_never_read(
    zctx: zmq.Context[Any],
) -> None:
    eng, _ = make_engine(cpu_blocks=16, gpu_blocks=16, policy="lru")  # stores every batch
    async with eng, KVEventPublisher(eng, config(replay_hwm=4)) as pub:
        batches = await publish_big_batches(eng, pub)
        peers = [dealer(zctx, pub.replay_endpoint, reads=False) for _ in range(SILENT_PEERS)]
        for peer in peers:
            peer.send_multipart([b"", (0).to_bytes(8, "big")])
        await until(lambda: pub.stats().replays_active == SILENT_PEERS, "the silent replies")
        reply = await replay_from(dealer(zctx, pub.replay_endpoint), 0)
        assert [int.from_bytes(m[1], "big") for m in reply[:-1]] == list(range(batches))
        assert reply[-1] == [b"", END_SEQ, b""]
        assert pub.stats().replays_active == SILENT_PEERS


async def test_a_reply_to_a_peer_that_left_is_abandoned(zctx: zmq.Context[Any]) -> None:
    eng, _ = make_engine(cpu_blocks=16, gpu_blocks=16, policy="lru")  # stores every batch
    async with eng, KVEventPublisher(eng, config(replay_hwm=4)) as pub:
        await publish_big_batches(eng, pub)
        peer = dealer(zctx, pub.replay_endpoint, reads=False)
        peer.send_multipart([b"", (0).to_bytes(8, "big")])
        await until(lambda: pub.stats().batches_replayed > 0, "the reply to start")
        peer.close(linger=0)
        await until(lambda: pub.stats().replays_active == 0, "the reply to be given up")
        assert pub.stats().replays_abandoned == 1


async def test_closing_as_a_request_wakes_the_reply_sender_stops_it(
    engine: ao.AsyncOffloadEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclose() cancels the reply sender while it waits for a full peer queue to drain
    or for a new request. When a request woke it in the same loop iteration,
    ``asyncio.wait_for`` (Python before 3.12) returned the wake-up and dropped the
    cancellation: the sender went on retrying and aclose() waited for it forever (the
    hang of test_a_peer_has_one_reply_in_progress_... on a busy machine)."""
    monkeypatch.setattr(kv_events, "_RETRY_MIN_S", 30.0)  # no retry timer in the way
    pub = KVEventPublisher(engine, config())
    await pub.start()
    # Every peer's queue is full: the sender finds nothing it can send.
    monkeypatch.setattr(pub, "_send_replies_nowait", lambda: False)
    start = (0).to_bytes(8, "big")
    pub._request([b"peer-a", b"", start])  # as _serve_replay hands a request over
    for _ in range(5):  # the sender wakes, sends nothing, waits for a request or 30 s
        await asyncio.sleep(0)
    pub._request([b"peer-b", b"", start])  # wakes the sender ...
    closing = asyncio.create_task(pub.aclose())  # ... as aclose() cancels it
    try:
        await within(asyncio.shield(closing), 10, "aclose() to stop the reply sender")
    finally:
        for task in pub._tasks:  # a sender that dropped the cancellation: cancel it again
            task.cancel()
        await within(closing, 10, "aclose() once its tasks were cancelled again")


async def test_a_cancelled_aclose_is_cancelled_and_closes_the_sockets(
    engine: ao.AsyncOffloadEngine,
) -> None:
    """aclose() awaited its tasks under suppress(CancelledError), which swallowed a
    cancellation of aclose() itself (a caller's timeout): with a task slow to stop it
    went on waiting. Cancelled, it stops, and the sockets are closed all the same."""
    pub = KVEventPublisher(engine, config())
    await pub.start()
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # a task that takes its time to stop

    pub._tasks.append(asyncio.create_task(slow_to_stop()))
    await asyncio.sleep(0)
    closing = asyncio.create_task(pub.aclose())
    await asyncio.sleep(0)  # aclose() cancelled the tasks and waits for them
    closing.cancel()
    try:
        finished, _ = await asyncio.wait({closing}, timeout=WAIT_S)
        assert finished, f"waited {WAIT_S:g} s for the cancelled aclose() to stop"
        assert closing.cancelled()
        assert (pub._router, pub._pub) == (None, None)
    finally:
        release.set()
        await within(asyncio.wait({closing}), WAIT_S, "aclose() once the task stopped")
    await pub.aclose()  # closed already: nothing to do


async def test_warnings_about_malformed_replay_requests_are_rate_limited(
    engine: ao.AsyncOffloadEngine, zctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncoffload.kv_events")
    async with KVEventPublisher(
        engine, config(replay_warnings_per_minute=3, replay_max_in_flight=32)
    ) as pub:
        peer = dealer(zctx, pub.replay_endpoint)
        for _ in range(20):
            peer.send_multipart([b"", b"bad"])
        await until(lambda: pub.stats().replay_requests == 20, "the requests")
        assert pub.stats().replay_errors == 20
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncoffload.kv_events"]
    assert len([m for m in lines if "malformed replay request" in m]) == 3
    (summary,) = [m for m in lines if "suppressed" in m]
    assert summary.startswith("more replay warnings than 3 in 60 s: the rest are suppressed")
    assert len(lines) == 4, lines


def test_suppressed_replay_warnings_are_counted_when_the_next_window_opens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="test.limiter")
    now = [0.0]
    limiter = _WarningLimiter(logging.getLogger("test.limiter"), 2, 60.0, lambda: now[0])
    for i in range(7):
        limiter.warning("bad %d", i)
    now[0] = 61.0
    limiter.warning("bad %d", 7)
    assert [r.getMessage() for r in caplog.records] == [
        "bad 0",
        "bad 1",
        "more replay warnings than 2 in 60 s: the rest are suppressed for up to 60 s "
        "(the publisher's stats() count every request)",
        "5 replay warnings were suppressed in the last 61 s",
        "bad 7",
    ]


def test_the_default_endpoints_stay_on_this_host() -> None:
    """Stored events can carry prompt token ids: nothing is open to the network unless
    asked for."""
    cfg = KVEventsConfig()
    assert cfg.endpoint.startswith("tcp://127.0.0.1:")
    assert cfg.replay_endpoint is None
