"""The event stream: ordering, fan-out, lag, snapshots, and exact replay."""

from __future__ import annotations

import asyncio
import random

import pytest

import asyncoffload as ao
from tests.helpers import GatedBackend, make_engine, make_keys


def _drain(sub: ao.EventSubscription) -> list[ao.OffloadingEvent | ao.Lagged]:
    items: list[ao.OffloadingEvent | ao.Lagged] = []
    while True:
        try:
            items.append(sub.receive_nowait())
        except asyncio.QueueEmpty:
            return items


def _apply(resident: set[bytes], items: list[ao.OffloadingEvent | ao.Lagged]) -> None:
    for item in items:
        assert isinstance(item, ao.OffloadingEvent), item
        if item.removed:
            resident.difference_update(item.keys)
        else:
            resident.update(item.keys)


async def _store(engine: ao.AsyncOffloadEngine, keys: list[ao.OffloadKey], first: int) -> None:
    h = await engine.prepare_store(keys, list(range(first, first + len(keys))))
    assert h is not None
    await h


async def test_removed_event_at_eviction_then_stored_after_copy() -> None:
    engine, _ = make_engine(cpu_blocks=4, backend_cls=GatedBackend)
    backend = engine.backend
    assert isinstance(backend, GatedBackend)
    old, new = make_keys(4, b"old"), make_keys(2, b"new")
    async with engine:
        await _store(engine, old, 0)
        sub = engine.events()
        backend.store_gate.clear()
        h = await engine.prepare_store(new, [4, 5])
        assert h is not None
        removed = _drain(sub)
        assert len(removed) == 1
        ev = removed[0]
        assert isinstance(ev, ao.OffloadingEvent)
        assert ev.removed and set(ev.keys) == set(h.evicted_keys) and len(ev.keys) == 2
        assert ev.medium is ao.Medium.CPU
        await asyncio.sleep(0)
        assert _drain(sub) == []  # no stored event while the copy runs
        backend.store_gate.set()
        await h
        stored = _drain(sub)
        assert len(stored) == 1
        ev2 = stored[0]
        assert isinstance(ev2, ao.OffloadingEvent)
        assert not ev2.removed and ev2.keys == tuple(new) and ev2.seq == ev.seq + 1
        assert ev2.ts >= ev.ts


async def test_two_subscribers_see_identical_gap_free_sequences() -> None:
    engine, _ = make_engine(cpu_blocks=8, gpu_blocks=64)
    async with engine:
        a, b = engine.events(), engine.events()
        for i in range(12):
            await _store(engine, make_keys(3, bytes([i])), (3 * i) % 60)
        ea, eb = _drain(a), _drain(b)
    assert ea == eb
    seqs = [e.seq for e in ea if isinstance(e, ao.OffloadingEvent)]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert any(e.removed for e in ea if isinstance(e, ao.OffloadingEvent))


async def test_stalled_subscriber_gets_lagged_and_blocks_nobody() -> None:
    engine, _ = make_engine(cpu_blocks=4, gpu_blocks=64)
    async with engine:
        stalled = engine.events(max_buffer=3)
        live = engine.events()
        for i in range(10):
            await _store(engine, make_keys(2, bytes([i])), 2 * i)
        live_items = _drain(live)
        assert all(isinstance(e, ao.OffloadingEvent) for e in live_items)
        total = len(live_items)
        stalled_items = _drain(stalled)
        assert isinstance(stalled_items[0], ao.Lagged)
        assert stalled_items[0].missed == total - 3
        assert stalled_items[1:] == live_items[-3:]
        assert stalled.statistics().dropped == total - 3
        # It keeps going after the lag.
        await _store(engine, make_keys(1, b"after"), 40)
        assert _drain(stalled) == _drain(live)


async def test_iteration_with_async_for_ends_at_close() -> None:
    engine, _ = make_engine()
    got: list[ao.OffloadingEvent | ao.Lagged] = []
    await engine.__aenter__()
    sub = engine.events()

    async def consume() -> None:
        async for item in sub:
            got.append(item)

    task = asyncio.create_task(consume())
    await _store(engine, make_keys(2), 0)
    await engine.aclose()
    await asyncio.wait_for(task, timeout=5)
    assert len(got) == 1


async def test_cancelled_reader_loses_no_event() -> None:
    engine, _ = make_engine()
    async with engine:
        sub = engine.events()
        reader = asyncio.create_task(sub.receive())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await _store(engine, make_keys(1), 0)
        item = await asyncio.wait_for(sub.receive(), timeout=5)
        assert isinstance(item, ao.OffloadingEvent)


async def test_closed_subscription_stops_receiving() -> None:
    engine, _ = make_engine()
    async with engine:
        async with engine.events() as sub:
            await _store(engine, make_keys(1), 0)
        assert sub.statistics().closed
        with pytest.raises(StopAsyncIteration):
            sub.receive_nowait()
        assert engine.stats().subscribers == 0


async def test_snapshot_then_live_events_replay_to_the_resident_set() -> None:
    rng = random.Random(11)
    engine, _ = make_engine(cpu_blocks=24, gpu_blocks=64)
    async with engine:
        early = engine.events(max_buffer=100_000)
        late: ao.EventSubscription | None = None
        universe = make_keys(80)
        for step in range(120):
            if step == 50:
                late = engine.events(snapshot=True, max_buffer=100_000)
            keys = rng.sample(universe, rng.randint(1, 6))
            n = engine.lookup(keys)
            if n and rng.random() < 0.5:
                await (await engine.prepare_load(keys[:n], list(range(40, 40 + n))))
            h = await engine.prepare_store(keys, rng.sample(range(40), len(keys)))
            if h is not None:
                await h
        assert late is not None
        resident = {k for k in universe if engine.lookup([k]) == 1}
        assert resident == set(engine.manager.resident_keys())
        assert engine.stats().blocks_evicted > 0

        replay_early: set[bytes] = set()
        _apply(replay_early, _drain(early))
        assert replay_early == resident

        late_items = _drain(late)
        snapshot = [e for e in late_items if isinstance(e, ao.OffloadingEvent) and e.snapshot]
        assert snapshot and late_items[: len(snapshot)] == snapshot
        replay_late: set[bytes] = set()
        _apply(replay_late, late_items)
        assert replay_late == resident
        live = [e for e in late_items if isinstance(e, ao.OffloadingEvent) and not e.snapshot]
        assert live[0].seq == snapshot[-1].seq + 1


async def test_subscription_repr_and_statistics() -> None:
    engine, _ = make_engine()
    async with engine:
        sub = engine.events(max_buffer=8)
        await _store(engine, make_keys(1), 0)
        assert repr(sub) == "<EventSubscription open [1/8 buffered, 0 dropped, 0 delivered]>"
        sub.receive_nowait()
        stats = sub.statistics()
        assert (stats.buffered, stats.delivered, stats.max_buffer) == (0, 1, 8)


async def test_events_rejects_bad_buffer_size() -> None:
    engine, _ = make_engine()
    async with engine:
        with pytest.raises(ValueError, match="max_buffer"):
            engine.events(max_buffer=0)


async def test_second_concurrent_reader_is_refused() -> None:
    engine, _ = make_engine()
    async with engine:
        sub = engine.events()
        first = asyncio.create_task(sub.receive())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="once per reader"):
            await sub.receive()
        await _store(engine, make_keys(1), 0)
        assert isinstance(await asyncio.wait_for(first, timeout=5), ao.OffloadingEvent)
