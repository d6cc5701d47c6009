"""Cancellation, injected failures, closing, and rejected input."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

import asyncoffload as ao
from tests.helpers import FailingBackend, GatedBackend, make_engine, make_keys, state_of


async def _spin(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_cancelling_a_store_waiter_does_not_cancel_the_copy() -> None:
    engine, _ = make_engine(cpu_blocks=4, backend_cls=GatedBackend)
    backend = engine.backend
    assert isinstance(backend, GatedBackend)
    keys = make_keys(4)
    async with engine:
        backend.store_gate.clear()
        handle = await engine.prepare_store(keys, [0, 1, 2, 3])
        assert handle is not None

        async def wait() -> None:
            await handle

        task = asyncio.create_task(wait())
        await _spin()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not handle.done()
        assert engine.manager.stats().write_pending == 4
        # In-flight blocks cannot be evicted: a store needing room is refused.
        assert await engine.prepare_store(make_keys(1, b"other"), [5]) is None
        backend.store_gate.set()
        await handle
        stats = engine.manager.stats()
        assert (stats.write_pending, stats.pinned, stats.ready) == (0, 0, 4)
        assert engine.lookup(keys) == 4
    assert engine.stats().in_flight == 0


async def test_cancelling_a_load_waiter_keeps_slots_pinned_until_the_copy_ends() -> None:
    engine, _ = make_engine(cpu_blocks=4, backend_cls=GatedBackend)
    backend = engine.backend
    assert isinstance(backend, GatedBackend)
    keys = make_keys(4)
    async with engine:
        first = await engine.prepare_store(keys, [0, 1, 2, 3])
        assert first is not None
        await first
        backend.load_gate.clear()
        load = await engine.prepare_load(keys, [10, 11, 12, 13])
        task = asyncio.create_task(asyncio.wait_for(load, timeout=10))
        await _spin()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.manager.stats().pinned == 4
        assert await engine.prepare_store(make_keys(1, b"other"), [5]) is None
        backend.load_gate.set()
        await load
        assert engine.manager.stats().pinned == 0
        # Now they are idle and evictable again.
        again = await engine.prepare_store(make_keys(1, b"other"), [5])
        assert again is not None and len(again.evicted_keys) == 1
        await again


async def test_nothing_leaks_after_mixed_cancelled_work() -> None:
    engine, _ = make_engine(cpu_blocks=32, gpu_blocks=64)
    async with engine:

        async def request(i: int) -> None:
            keys = make_keys(4, prefix=bytes([i % 7]))
            n = engine.lookup(keys)
            if n:
                await (await engine.prepare_load(keys[:n], list(range(32, 32 + n))))
            h = await engine.prepare_store(keys[n:], list(range(4 * (i % 8), 4 * (i % 8) + 4 - n)))
            if h is not None:
                await h

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


async def test_failed_store_frees_slots_publishes_nothing_and_raises() -> None:
    engine, _ = make_engine(cpu_blocks=8, backend_cls=FailingBackend)
    backend = engine.backend
    assert isinstance(backend, FailingBackend)
    async with engine:
        sub = engine.events()
        backend.fail_store = True
        handle = await engine.prepare_store(make_keys(3), [0, 1, 2])
        assert handle is not None
        with pytest.raises(ao.TransferError, match="injected store failure"):
            await handle
        assert isinstance(handle.exception(), ao.TransferError)
        assert engine.lookup(make_keys(3)) == 0
        assert engine.manager.stats().free == 8
        assert engine.manager.stats().write_pending == 0
        assert engine.stats().transfers_failed == 1
        with pytest.raises(asyncio.QueueEmpty):
            sub.receive_nowait()
        # The engine keeps working.
        backend.fail_store = False
        ok = await engine.prepare_store(make_keys(3), [0, 1, 2])
        assert ok is not None
        await ok
        assert engine.lookup(make_keys(3)) == 3
        event = sub.receive_nowait()
        assert isinstance(event, ao.OffloadingEvent) and not event.removed


async def test_failed_submission_is_reported_through_the_handle() -> None:
    engine, _ = make_engine(cpu_blocks=8, backend_cls=FailingBackend)
    backend = engine.backend
    assert isinstance(backend, FailingBackend)
    async with engine:
        backend.fail_submit = True
        handle = await engine.prepare_store(make_keys(2), [0, 1])
        assert handle is not None
        with pytest.raises(ao.TransferError, match="injected submission failure"):
            await handle
        assert engine.manager.stats().free == 8


async def test_failed_load_unpins_and_raises() -> None:
    engine, _ = make_engine(cpu_blocks=8, backend_cls=FailingBackend)
    backend = engine.backend
    assert isinstance(backend, FailingBackend)
    keys = make_keys(2)
    async with engine:
        h = await engine.prepare_store(keys, [0, 1])
        assert h is not None
        await h
        backend.fail_load = True
        load = await engine.prepare_load(keys, [4, 5])
        with pytest.raises(ao.TransferError):
            await load
        assert engine.manager.stats().pinned == 0
        assert engine.lookup(keys) == 2  # the stored copy is still good
        backend.fail_load = False
        await (await engine.prepare_load(keys, [4, 5]))


async def test_aclose_waits_for_in_flight_copies_then_ends_subscriptions() -> None:
    engine, _ = make_engine(backend_cls=GatedBackend)
    backend = engine.backend
    assert isinstance(backend, GatedBackend)
    await engine.__aenter__()
    sub = engine.events()
    received: list[object] = []

    async def consume() -> None:
        async for item in sub:
            received.append(item)

    consumer = asyncio.create_task(consume())
    backend.store_gate.clear()
    handle = await engine.prepare_store(make_keys(2), [0, 1])
    assert handle is not None
    closer = asyncio.create_task(engine.aclose())
    await _spin()
    assert not closer.done() and not consumer.done()
    with pytest.raises(ao.EngineClosedError):
        await engine.prepare_store(make_keys(1, b"late"), [3])
    backend.store_gate.set()
    await closer
    assert handle.done() and handle.exception() is None
    await asyncio.wait_for(consumer, timeout=5)
    assert len(received) == 1  # the stored event was delivered before the end


def _bad_calls(
    engine: ao.AsyncOffloadEngine, keys: list[ao.OffloadKey], other: list[ao.OffloadKey]
) -> list[tuple[str, Callable[[], Coroutine[Any, Any, object]], type[Exception]]]:
    n = engine.layout.num_blocks
    return [
        ("load unknown key", lambda: engine.prepare_load(other, [0]), ao.UnknownKeyError),
        ("load partly unknown", lambda: engine.prepare_load([keys[0], other[0]], [0, 1]), KeyError),
        ("load block out of range", lambda: engine.prepare_load(keys[:1], [n]), ao.BlockIdError),
        ("load negative block", lambda: engine.prepare_load(keys[:1], [-1]), ValueError),
        (
            "load length mismatch",
            lambda: engine.prepare_load(keys[:2], [0]),
            ao.LengthMismatchError,
        ),
        (
            "load duplicate keys",
            lambda: engine.prepare_load([keys[0], keys[0]], [0, 1]),
            ao.DuplicateKeyError,
        ),
        ("load duplicate dst", lambda: engine.prepare_load(keys[:2], [3, 3]), ao.BlockIdError),
        ("store length mismatch", lambda: engine.prepare_store(other, [0, 1]), ValueError),
        ("store block out of range", lambda: engine.prepare_store(other, [n + 5]), ao.BlockIdError),
        (
            "store duplicate keys",
            lambda: engine.prepare_store([other[0], other[0]], [0, 1]),
            ao.DuplicateKeyError,
        ),
        ("store float block id", lambda: engine.prepare_store(other, [1.0]), ao.BlockIdError),  # type: ignore[list-item]
        ("store non-bytes key", lambda: engine.prepare_store(["k"], [1]), TypeError),  # type: ignore[list-item]
        (
            "store float tensor ids",
            lambda: engine.prepare_store(other, torch.tensor([1.0])),
            ao.BlockIdError,
        ),
    ]


async def test_rejected_calls_raise_clear_errors_and_change_nothing() -> None:
    engine, _ = make_engine(cpu_blocks=4, backend_cls=GatedBackend)
    backend = engine.backend
    assert isinstance(backend, GatedBackend)
    keys = make_keys(3)
    other = make_keys(1, b"other")
    async with engine:
        h = await engine.prepare_store(keys, [0, 1, 2])
        assert h is not None
        await h
        backend.store_gate.clear()
        pending = await engine.prepare_store(make_keys(1, b"pending"), [3])
        assert pending is not None
        before = state_of(engine)
        for what, call, exc in _bad_calls(engine, keys, other):
            with pytest.raises(exc) as info:
                await call()
            assert str(info.value), what
            assert state_of(engine) == before, what
        with pytest.raises(ao.KeyNotReadyError, match="still being stored"):
            await engine.prepare_load(make_keys(1, b"pending"), [5])
        assert state_of(engine) == before
        backend.store_gate.set()
        await pending


async def test_error_messages_name_the_problem() -> None:
    engine, _ = make_engine(gpu_blocks=8)
    async with engine:
        with pytest.raises(ao.BlockIdError, match=r"block id 9 at index 1 is outside \[0, 8\)"):
            await engine.prepare_store(make_keys(2), [0, 9])
        with pytest.raises(ao.UnknownKeyError, match="is not stored"):
            await engine.prepare_load(make_keys(1), [0])
        with pytest.raises(ao.LengthMismatchError, match="2 keys but 1 block ids"):
            await engine.prepare_store(make_keys(2), [0])


async def test_use_after_close_raises_engine_closed() -> None:
    engine, _ = make_engine()
    async with engine:
        pass
    with pytest.raises(ao.EngineClosedError):
        engine.lookup(make_keys(1))
    with pytest.raises(ao.EngineClosedError):
        await engine.prepare_store(make_keys(1), [0])
    with pytest.raises(ao.EngineClosedError):
        await engine.prepare_load(make_keys(1), [0])
    with pytest.raises(ao.EngineClosedError):
        engine.events()
    await engine.aclose()  # idempotent


async def test_repr_summarises_live_state() -> None:
    engine, _ = make_engine(cpu_blocks=8, backend_cls=GatedBackend)
    backend = engine.backend
    assert isinstance(backend, GatedBackend)
    async with engine:
        backend.store_gate.clear()
        h = await engine.prepare_store(make_keys(2), [0, 1])
        assert h is not None
        assert "0 ready, 0 pinned, 2 writing, 6 free | 1 in flight" in repr(engine)
        assert repr(h) == "<Transfer store 2 blocks running>"
        backend.store_gate.set()
        await h
        assert "2 ready, 0 pinned, 0 writing, 6 free | 0 in flight" in repr(engine)
        assert repr(h) == "<Transfer store 2 blocks done>"
    assert repr(engine).startswith("<AsyncOffloadEngine closed")


async def test_engine_refuses_a_second_loop() -> None:
    engine, _ = make_engine()
    await engine.__aenter__()
    try:

        def other_loop() -> None:
            async def use() -> None:
                await engine.prepare_store(make_keys(1), [0])

            asyncio.run(use())

        with pytest.raises(RuntimeError, match="another event loop"):
            await asyncio.to_thread(other_loop)
    finally:
        await engine.aclose()


def test_threads_copy_engine_when_native_is_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncoffload import _native

    monkeypatch.setenv("ASYNCOFFLOAD_NO_NATIVE", "1")
    _native.load_copy_engine.cache_clear()
    try:
        engine, _ = make_engine()
        assert engine.backend.name == "cpu-threads"
        with pytest.raises(RuntimeError, match="native"):
            make_engine(copy_engine="native")
    finally:
        _native.load_copy_engine.cache_clear()


async def test_threads_copy_engine_round_trips() -> None:
    engine, kv = make_engine(copy_engine="threads")
    assert engine.backend.name == "cpu-threads"
    async with engine:
        h = await engine.prepare_store(make_keys(2), [0, 1])
        assert h is not None
        await h
        await (await engine.prepare_load(make_keys(2), [5, 6]))
    for t in kv:
        assert torch.equal(t[:, 5:7].view(torch.int16), t[:, 0:2].view(torch.int16))


async def test_unclosed_engine_warns() -> None:
    engine, _ = make_engine()
    await engine.__aenter__()
    with pytest.warns(ResourceWarning, match="unclosed"):
        engine.__del__()
    await engine.aclose()


async def test_a_failing_completion_callback_still_resolves_the_handle() -> None:
    engine, _ = make_engine(inline_copy_bytes=0)  # completes after prepare_store returns
    manager = engine.manager

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("bookkeeping bug")

    async with engine:
        h = await engine.prepare_store(make_keys(2), [0, 1])
        assert h is not None
        manager.complete_store = broken  # type: ignore[method-assign]
        with pytest.raises(ao.TransferError, match="bookkeeping bug"):
            await asyncio.wait_for(h, timeout=5)
    # aclose did not hang


async def test_lookups_are_counted() -> None:
    engine, _ = make_engine()
    async with engine:
        h = await engine.prepare_store(make_keys(2), [0, 1])
        assert h is not None
        await h
        assert engine.lookup(make_keys(3)) == 2
        stats = engine.stats()
        assert (stats.lookups, stats.lookup_keys, stats.lookup_hits) == (1, 3, 2)


@pytest.mark.parametrize("mode", ["slab", "files"])
async def test_a_closed_engine_with_a_lower_tier_is_freed_without_the_cyclic_gc(
    tmp_path: Any, mode: str
) -> None:
    """An engine with any lower tier sat in a reference cycle (engine -> LoopTiers ->
    lambda -> engine, and copies <-> tiers): after aclose() and del, its host memory
    (with Mooncake, a memfd charged as Shmem) stayed until the cyclic GC ran; 8
    open/close cycles of a 256 MiB tier held 1.25 GiB at once (issue 37, D8)."""
    import gc
    import weakref

    from tests.test_tiers import config, keys, kv_caches, store_to_disk_only

    gc.collect()
    gc.disable()
    try:
        for round_ in range(3):
            eng = ao.AsyncOffloadEngine(kv_caches(), config(tmp_path / str(round_), mode))
            ks = keys(2)
            await store_to_disk_only(eng, ks, [0, 1])
            await asyncio.wait_for(await eng.prepare_load(ks, [10, 11]), 10)
            await asyncio.wait_for(eng.aclose(), 10)
            refs: dict[str, weakref.ref[Any]] = {
                "engine": weakref.ref(eng),
                "backend": weakref.ref(eng.backend),
                "tier": weakref.ref(eng.tiers[0]),
            }
            del eng
            alive = [name for name, ref in refs.items() if ref() is not None]
            assert alive == [], f"round {round_}: {alive} kept alive by a reference cycle"
    finally:
        gc.enable()


async def test_a_closed_engine_with_a_shared_tier_is_freed_without_the_cyclic_gc() -> None:
    """The same with the Redis / Valkey tier (its jobs run as tasks of the loop)."""
    import gc
    import weakref

    from tests.hostile_resp import hostile_server
    from tests.test_remote import config, keys, kv_caches, store

    async with hostile_server() as server:
        gc.collect()
        gc.disable()
        try:
            eng = ao.AsyncOffloadEngine(kv_caches(), config(server.url))
            await store(eng, keys(2), [0, 1])
            assert eng.stats().tiers[0].blocks_written == 2
            await asyncio.wait_for(eng.aclose(), 10)
            refs: list[weakref.ref[Any]] = [
                weakref.ref(eng),
                weakref.ref(eng.backend),
                weakref.ref(eng.tiers[0]),
            ]
            del eng
            assert [ref() is None for ref in refs] == [True] * 3
        finally:
            gc.enable()
