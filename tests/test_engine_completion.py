"""Completion callbacks run on the loop thread, in order, before the handle wakes anyone."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import pytest

import asyncoffload as ao
from asyncoffload.handles import Transfer
from tests.helpers import GatedBackend, make_engine, make_keys, record_completions


async def test_callbacks_run_on_loop_thread_before_handle_resolves() -> None:
    engine, _ = make_engine(inline_copy_bytes=0)  # copies on a lane thread
    log: list[tuple[str, int, tuple[bytes, ...]]] = []
    record_completions(engine, log)
    keys = make_keys(4)
    async with engine:
        handle = await engine.prepare_store(keys, [0, 1, 2, 3])
        assert handle is not None
        seen_at_resolve: list[int] = []
        handle.add_done_callback(lambda _h: seen_at_resolve.append(len(log)))
        await handle
        load = await engine.prepare_load(keys, [4, 5, 6, 7])
        await load
    loop_thread = threading.get_ident()
    assert [(kind, tid) for kind, tid, _ in log] == [("store", loop_thread), ("load", loop_thread)]
    assert seen_at_resolve == [1]  # complete_store had run when the future resolved


async def test_completion_needs_no_polling_in_eventfd_mode() -> None:
    # A one-second poll period would make any poll-driven completion take >= 1 s; the
    # eventfd wake-up must deliver it without the timer.
    engine, _ = make_engine(completion="eventfd", poll_interval_s=1.0)
    async with engine:
        handle = await engine.prepare_store(make_keys(2), [0, 1])
        assert handle is not None
        await asyncio.wait_for(handle, timeout=0.5)
        assert engine.stats().completion in ("eventfd", "pipe")


async def test_poll_mode_completes_transfers() -> None:
    engine, _ = make_engine(completion="poll", poll_interval_s=0.001)
    async with engine:
        assert engine.stats().completion == "poll"
        handle = await engine.prepare_store(make_keys(2), [0, 1])
        assert handle is not None
        await handle
        assert engine.lookup(make_keys(2)) == 2


async def test_transfers_complete_in_submission_order_per_direction() -> None:
    engine, _ = make_engine(cpu_blocks=64, backend_cls=GatedBackend)
    backend = engine.backend
    assert isinstance(backend, GatedBackend)
    order: list[int] = []
    async with engine:
        backend.store_gate.clear()
        handles: list[Transfer] = []
        for i in range(8):
            h = await engine.prepare_store(make_keys(2, prefix=bytes([i])), [2 * i, 2 * i + 1])
            assert h is not None
            h.add_done_callback(functools.partial(lambda i, _h: order.append(i), i))
            handles.append(h)
        backend.store_gate.set()
        await asyncio.gather(*handles)
    assert order == list(range(8))


async def test_handle_can_be_awaited_by_several_tasks() -> None:
    engine, _ = make_engine(backend_cls=GatedBackend)
    backend = engine.backend
    assert isinstance(backend, GatedBackend)
    async with engine:
        backend.store_gate.clear()
        handle = await engine.prepare_store(make_keys(3), [0, 1, 2])
        assert handle is not None

        async def waiter() -> ao.TransferResult:
            return await handle

        tasks = [asyncio.create_task(waiter()) for _ in range(5)]
        await asyncio.sleep(0)
        assert not any(t.done() for t in tasks)
        backend.store_gate.set()
        results = await asyncio.gather(*tasks)
        assert len({r.nbytes for r in results}) == 1
        assert results[0].num_blocks == 3
        assert handle.result() == results[0]


async def test_handles_work_with_asyncio_wait() -> None:
    engine, _ = make_engine()
    async with engine:
        h1 = await engine.prepare_store(make_keys(2, b"a"), [0, 1])
        h2 = await engine.prepare_store(make_keys(2, b"b"), [2, 3])
        assert h1 is not None and h2 is not None
        futs: list[Any] = [asyncio.ensure_future(h1), asyncio.ensure_future(h2)]
        done, pending = await asyncio.wait(futs)
        assert not pending and len(done) == 2
        assert h1.done() and h2.done()


async def test_empty_and_already_stored_calls_resolve_immediately() -> None:
    engine, _ = make_engine()
    keys = make_keys(2)
    async with engine:
        first = await engine.prepare_store(keys, [0, 1])
        assert first is not None
        await first
        again = await engine.prepare_store(keys, [0, 1])
        assert again is not None
        assert again.done() and again.keys_to_store == []
        assert (await again).num_blocks == 0
        nothing = await engine.prepare_load([], [])
        assert (await nothing).nbytes == 0


async def test_callback_latency_is_recorded() -> None:
    engine, _ = make_engine(inline_copy_bytes=0)  # copies on a lane thread
    async with engine:
        for i in range(5):
            h = await engine.prepare_store(make_keys(1, bytes([i])), [i])
            assert h is not None
            await h
        stats = engine.stats()
    assert stats.callback_latency_p50_us > 0
    assert stats.callback_latency_p99_us >= stats.callback_latency_p50_us


@pytest.mark.parametrize("mode", ["eventfd", "poll"])
async def test_busy_loop_still_gets_completions(mode: str) -> None:
    # A loop busy with Python work between yields must still run completions promptly:
    # the wake-up is handled on the loop itself, not by a thread that needs the GIL.
    engine, _ = make_engine(completion=mode)
    stop = False

    async def busy() -> None:
        while not stop:
            x = 0
            for i in range(20_000):
                x += i
            await asyncio.sleep(0)

    async with engine:
        spinner = asyncio.create_task(busy())
        try:
            for i in range(10):
                h = await engine.prepare_store(make_keys(1, bytes([i])), [i])
                assert h is not None
                await asyncio.wait_for(h, timeout=5)
        finally:
            stop = True
            await spinner
