"""Cancellation, injected failures and closing, on the CUDA backend.

Long transfers are made by queueing a sleep kernel on the current stream: every copy
stream waits for it, so a transfer submitted after it stays in flight until it ends.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import asyncoffload as ao
from asyncoffload.transfer.cuda import CopyMethod
from tests.gpu.conftest import (
    ALL_METHODS,
    GPU,
    FailingCudaBackend,
    as_bytes,
    block_rows,
    cuda_backend,
    gpu_sleep,
    host_slots,
    make_engine,
    make_keys,
    overwrite,
    random_kv,
    require_method,
    spin,
)

pytestmark = GPU

INNER = (16, 2, 64)  # 4 KiB fragments, 16 KiB blocks
NUM_BLOCKS = 32


def _kv(seed: int = 0) -> list[torch.Tensor]:
    return random_kv(2, NUM_BLOCKS, inner=INNER, seed=seed)


def _failing_engine(
    kv: list[torch.Tensor], method: CopyMethod, cpu_blocks: int = 8
) -> tuple[ao.AsyncOffloadEngine, FailingCudaBackend]:
    require_method(kv, method)
    backend = FailingCudaBackend(kv, ao.KVLayout.infer(kv), cpu_blocks, copy_method=method)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=cpu_blocks), backend=backend)
    return engine, backend


# --- cancellation -------------------------------------------------------------------------


async def test_cancelling_a_store_waiter_does_not_cancel_the_copy() -> None:
    kv = _kv(1)
    engine = make_engine(kv, cpu_blocks=4)
    keys, src = make_keys(4), [0, 1, 2, 3]
    original = block_rows(kv, src, True)
    async with engine:
        gpu_sleep(0.3)
        handle = await engine.prepare_store(keys, src)
        assert handle is not None

        async def wait() -> None:
            await handle

        task = asyncio.create_task(wait())
        await spin()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not handle.done()
        assert engine.manager.stats().write_pending == 4
        # In-flight slots cannot be evicted: a store needing room is refused.
        assert await engine.prepare_store(make_keys(1, b"other"), [5]) is None
        await handle
        stats = engine.manager.stats()
        assert (stats.write_pending, stats.pinned, stats.ready) == (0, 0, 4)
        assert engine.lookup(keys) == 4
        for i, slot in enumerate(host_slots(engine, keys)):
            assert engine.backend.read_host_block(slot) == as_bytes(original[i])
    assert engine.stats().in_flight == 0


async def test_cancelling_a_load_waiter_keeps_slots_pinned_until_the_copy_ends() -> None:
    kv = _kv(2)
    engine = make_engine(kv, cpu_blocks=4)
    keys, src, dst = make_keys(4), [0, 1, 2, 3], [10, 11, 12, 13]
    async with engine:
        first = await engine.prepare_store(keys, src)
        assert first is not None
        await first
        original = block_rows(kv, src, True)
        overwrite(kv, seed=22)
        gpu_sleep(0.3)
        load = await engine.prepare_load(keys, dst)
        task = asyncio.create_task(asyncio.wait_for(load, timeout=10))
        await spin()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not load.done()
        assert engine.manager.stats().pinned == 4
        assert await engine.prepare_store(make_keys(1, b"other"), [5]) is None
        await load
        assert engine.manager.stats().pinned == 0
        assert torch.equal(block_rows(kv, dst, True), original)
        # Now they are idle and evictable again.
        again = await engine.prepare_store(make_keys(1, b"other"), [5])
        assert again is not None and len(again.evicted_keys) == 1
        await again


async def test_nothing_leaks_after_mixed_cancelled_work() -> None:
    kv = random_kv(2, 64, inner=INNER, seed=3)
    engine = make_engine(kv, cpu_blocks=32)
    async with engine:

        async def request(i: int) -> None:
            keys = make_keys(4, prefix=bytes([i % 7]))
            n = engine.lookup(keys)
            if n:
                await (await engine.prepare_load(keys[:n], list(range(32, 32 + n))))
            first = 4 * (i % 8)
            h = await engine.prepare_store(keys[n:], list(range(first, first + 4 - n)))
            if h is not None:
                await h

        gpu_sleep(0.05)
        tasks = [asyncio.create_task(request(i)) for i in range(40)]
        await asyncio.sleep(0)
        for t in tasks[::3]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    stats = engine.manager.stats()
    assert stats.pinned == 0
    assert stats.write_pending == 0
    assert engine.stats().in_flight == 0
    assert stats.ready + stats.free == stats.num_blocks
    assert stats.ready > 0


# --- injected failures --------------------------------------------------------------------


@pytest.mark.parametrize("method", ALL_METHODS)
async def test_failed_store_frees_slots_publishes_nothing_and_raises(method: CopyMethod) -> None:
    kv = _kv(4)
    engine, backend = _failing_engine(kv, method)
    async with engine:
        sub = engine.events()
        backend.fail = {0}
        handle = await engine.prepare_store(make_keys(3), [0, 1, 2])
        assert handle is not None
        with pytest.raises(ao.TransferError, match="injected CUDA error"):
            await handle
        assert isinstance(handle.exception(), ao.TransferError)
        assert engine.lookup(make_keys(3)) == 0
        stats = engine.manager.stats()
        assert (stats.free, stats.write_pending, stats.ready) == (8, 0, 0)
        assert engine.stats().transfers_failed == 1
        with pytest.raises(asyncio.QueueEmpty):
            sub.receive_nowait()


@pytest.mark.parametrize("method", ALL_METHODS)
async def test_failed_load_unpins_and_raises(method: CopyMethod) -> None:
    kv = _kv(5)
    engine, backend = _failing_engine(kv, method)
    keys = make_keys(2)
    async with engine:
        h = await engine.prepare_store(keys, [0, 1])
        assert h is not None
        await h
        before = block_rows(kv, [4, 5], True)
        backend.fail = {1}
        load = await engine.prepare_load(keys, [4, 5])
        with pytest.raises(ao.TransferError, match="injected CUDA error"):
            await load
        assert engine.manager.stats().pinned == 0
        assert engine.lookup(keys) == 2  # the stored copy is still good
        assert torch.equal(block_rows(kv, [4, 5], True), before)


@pytest.mark.parametrize("method", ALL_METHODS)
async def test_engine_keeps_working_after_an_injected_failure(method: CopyMethod) -> None:
    kv = _kv(6)
    engine, backend = _failing_engine(kv, method)
    keys, src, dst = make_keys(3), [0, 1, 2], [7, 8, 9]
    async with engine:
        sub = engine.events()
        backend.fail = {0, 1}
        failed = await engine.prepare_store(keys, src)
        assert failed is not None
        with pytest.raises(ao.TransferError):
            await failed
        backend.fail = set()
        original = block_rows(kv, src, True)
        ok = await engine.prepare_store(keys, src)
        assert ok is not None
        await ok
        assert engine.lookup(keys) == 3
        event = sub.receive_nowait()
        assert isinstance(event, ao.OffloadingEvent) and not event.removed
        assert set(event.keys) == set(keys)
        overwrite(kv, seed=66)
        await (await engine.prepare_load(keys, dst))
        assert torch.equal(block_rows(kv, dst, True), original)
    assert engine.stats().transfers_failed == 1


# --- closing ------------------------------------------------------------------------------


async def test_aclose_waits_for_an_in_flight_store() -> None:
    kv = _kv(7)
    engine = make_engine(kv, cpu_blocks=8)
    await engine.__aenter__()
    sub = engine.events()
    received: list[object] = []

    async def consume() -> None:
        async for item in sub:
            received.append(item)

    consumer = asyncio.create_task(consume())
    gpu_sleep(0.3)
    handle = await engine.prepare_store(make_keys(2), [0, 1])
    assert handle is not None
    closer = asyncio.create_task(engine.aclose())
    await spin()
    assert not closer.done() and not handle.done()
    with pytest.raises(ao.EngineClosedError):
        await engine.prepare_store(make_keys(1, b"late"), [3])
    await closer
    assert handle.done() and handle.exception() is None
    assert engine.manager.stats().ready == 2
    await asyncio.wait_for(consumer, timeout=5)
    assert len(received) == 1  # the stored event was delivered before the end


async def test_aclose_waits_for_an_in_flight_load() -> None:
    kv = _kv(8)
    engine = make_engine(kv, cpu_blocks=8)
    keys, src, dst = make_keys(3), [0, 1, 2], [20, 21, 22]
    await engine.__aenter__()
    h = await engine.prepare_store(keys, src)
    assert h is not None
    await h
    original = block_rows(kv, src, True)
    overwrite(kv, seed=88)
    gpu_sleep(0.3)
    load = await engine.prepare_load(keys, dst)
    closer = asyncio.create_task(engine.aclose())
    await spin()
    assert not closer.done() and not load.done()
    await closer
    assert load.done() and load.exception() is None
    assert engine.manager.stats().pinned == 0
    assert torch.equal(block_rows(kv, dst, True), original)


async def test_aclose_releases_the_pinned_host_pool() -> None:
    kv = _kv(9)
    engine = make_engine(kv, cpu_blocks=8, host_chunk_bytes=3 * 16384)
    backend = cuda_backend(engine)
    assert backend.pool.pinned and backend.pool.pinned_chunks == 3
    async with engine:
        h = await engine.prepare_store(make_keys(2), [0, 1])
        assert h is not None
        await h
    assert backend.pool.chunks == []
    backend.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        backend.submit_store([0], [0])
