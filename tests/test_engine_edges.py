"""The engine at its edges: interrupts, foreign loops and threads, forks, bad input.

Each test pins one defect found by adversarial testing (issue 11): it failed (hung,
leaked or crashed) before the fix. Tests that drive an interrupt run their own event
loop, so a ``KeyboardInterrupt`` leaves ``run_until_complete`` as it would in a server.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import warnings
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

import pytest
import torch

import asyncoffload as ao
from asyncoffload.transfer.completion import LatencyWindow
from tests.helpers import (
    FailingBackend,
    InterruptOnce,
    block_bytes,
    make_engine,
    make_keys,
    state_of,
)

STORE_TIMEOUT_S = 10.0


def _run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on ``loop``, failing (not hanging) if it takes longer than 10 s."""
    return loop.run_until_complete(asyncio.wait_for(coro, STORE_TIMEOUT_S))


def _interrupted(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> None:
    """Run ``coro`` (one task, no wrapper that would outlive it) and expect the
    KeyboardInterrupt it lets out."""
    with pytest.raises(KeyboardInterrupt):
        loop.run_until_complete(coro)


async def _settled(engine: ao.AsyncOffloadEngine) -> None:
    """Until nothing is in flight (an interrupted transfer's fence included)."""
    while engine.stats().in_flight:  # noqa: ASYNC110 - a fence resolves on the loop, no event to wait on
        await asyncio.sleep(0.001)


# --- interrupts (defect 3) -----------------------------------------------------------------


def test_interrupt_in_a_completion_callback_still_resolves_the_handle() -> None:
    engine, _ = make_engine(inline_copy_bytes=0)  # the callback runs from the loop
    loop = asyncio.new_event_loop()
    try:
        keys = make_keys(2)
        engine.manager.complete_store = InterruptOnce(  # type: ignore[method-assign]
            engine.manager.complete_store
        )

        async def store() -> ao.Transfer:
            handle = await engine.prepare_store(keys, [0, 1])
            assert handle is not None
            await handle
            return handle

        task = loop.create_task(store())
        with pytest.raises(KeyboardInterrupt):  # out of the completion callback
            loop.run_until_complete(task)
        # The interrupted completion resolved its handle (with an error): closing the
        # engine does not wait for it forever, and the waiting task learns of it.
        _run(loop, engine.aclose())
        assert task.done() and isinstance(task.exception(), ao.TransferError)
        assert engine.stats().in_flight == 0
        assert engine.stats().transfers_failed == 1
    finally:
        loop.close()


def test_interrupt_at_submission_frees_the_reserved_slots() -> None:
    engine, _ = make_engine(cpu_blocks=4)
    loop = asyncio.new_event_loop()
    try:
        keys = make_keys(2)
        engine.backend.submit_store = InterruptOnce(  # type: ignore[method-assign]
            engine.backend.submit_store
        )
        _interrupted(loop, engine.prepare_store(keys, [0, 1]))
        # No copy may have been queued, but the engine cannot know: the slots come back
        # once the lane is past a fence.
        _run(loop, _settled(engine))
        assert engine.manager.stats().write_pending == 0
        assert engine.manager.num_free == 4
        # The keys can be stored again, and the tier can be reset.
        handle = _run(loop, engine.prepare_store(keys, [0, 1]))
        assert handle is not None and handle.keys_to_store == keys
        _run(loop, _await(handle))
        assert engine.lookup(keys) == 2
        _run(loop, engine.aclose())
        engine.manager.reset_cache()
    finally:
        loop.close()


async def _await(handle: ao.Transfer) -> ao.TransferResult:
    return await handle


def test_interrupt_after_the_lane_took_the_copy_frees_slots_only_behind_it() -> None:
    """The interrupt comes just after the copy was queued: the slots must not be handed
    out again before the lane is past that copy (a fence), and the bytes that do land
    are the ones stored next."""
    engine, kv = make_engine(cpu_blocks=2)
    loop = asyncio.new_event_loop()
    try:
        real = engine.backend.submit_store

        def queued_then_interrupted(gpu: Sequence[int], host: Sequence[int]) -> ao.CopyJob:
            real(gpu, host)
            engine.backend.submit_store = real  # type: ignore[method-assign]
            raise KeyboardInterrupt

        engine.backend.submit_store = queued_then_interrupted  # type: ignore[method-assign,assignment]
        a, b = make_keys(2, prefix=b"a"), make_keys(2, prefix=b"b")
        _interrupted(loop, engine.prepare_store(a, [0, 1]))

        async def store_b() -> None:
            handle = await engine.prepare_store(b, [2, 3])
            while handle is None:  # the interrupted store's slots return behind the fence
                await asyncio.sleep(0.001)
                handle = await engine.prepare_store(b, [2, 3])
            await handle

        _run(loop, store_b())
        assert engine.lookup(a) == 0
        assert engine.lookup(b) == 2
        backend = engine.backend
        assert isinstance(backend, ao.CpuCopyBackend)
        for slot, block in zip(engine.manager.prepare_load(b).block_ids, (2, 3), strict=True):
            assert backend.read_host_block(slot) == block_bytes(kv, block)
        engine.manager.complete_load(b)
        _run(loop, engine.aclose())
    finally:
        loop.close()


def test_interrupted_load_unpins_its_blocks() -> None:
    engine, _ = make_engine(cpu_blocks=4)
    loop = asyncio.new_event_loop()
    try:
        keys = make_keys(2)

        async def store() -> None:
            handle = await engine.prepare_store(keys, [0, 1])
            assert handle is not None
            await handle

        _run(loop, store())
        engine.backend.submit_load = InterruptOnce(  # type: ignore[method-assign]
            engine.backend.submit_load
        )
        _interrupted(loop, engine.prepare_load(keys, [4, 5]))
        _run(loop, _settled(engine))
        assert engine.manager.stats().pinned == 0
        _run(loop, engine.aclose())
    finally:
        loop.close()


# --- loops, threads and forks (defects 4, 5, 6, 15) ---------------------------------------


def _in_thread(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn`` in a new thread; the exception it raised, if any."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported to the test
            caught.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(STORE_TIMEOUT_S)
    assert not t.is_alive(), "the call hung"
    return caught[0] if caught else None


async def test_aclose_on_another_loop_is_refused() -> None:
    engine, _ = make_engine()
    handle = await engine.prepare_store(make_keys(1), [0])
    assert handle is not None
    await handle
    error = _in_thread(lambda: asyncio.run(engine.aclose()))
    assert isinstance(error, RuntimeError)
    assert "event loop" in str(error)
    await engine.aclose()


async def test_events_read_from_another_threads_loop_are_refused() -> None:
    engine, _ = make_engine()
    async with engine:
        sub = engine.events()
        error = _in_thread(lambda: asyncio.run(sub.receive()))
        assert isinstance(error, RuntimeError)
        assert "engine's event loop" in str(error)
        # The subscription still works where it belongs.
        handle = await engine.prepare_store(make_keys(1), [0])
        assert handle is not None
        await handle
        event = await asyncio.wait_for(sub.receive(), STORE_TIMEOUT_S)
        assert isinstance(event, ao.OffloadingEvent)


async def test_lookup_and_touch_from_another_thread_are_refused() -> None:
    engine, _ = make_engine(policy="arc")
    async with engine:
        keys = make_keys(2)
        handle = await engine.prepare_store(keys, [0, 1])
        assert handle is not None
        await handle
        before = state_of(engine)
        for call in (lambda: engine.lookup(keys), lambda: engine.touch(keys)):
            error = _in_thread(call)
            assert isinstance(error, RuntimeError)
            assert "thread other than its event loop's" in str(error)
        assert state_of(engine) == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_a_clear_error_and_closes_at_once() -> None:
    engine, _ = make_engine()
    loop = asyncio.new_event_loop()
    try:

        async def store() -> None:
            handle = await engine.prepare_store(make_keys(1), [0])
            assert handle is not None
            await handle

        _run(loop, store())
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            code = 1
            try:
                child_loop = asyncio.new_event_loop()
                try:
                    child_loop.run_until_complete(engine.prepare_store(make_keys(1, b"c"), [1]))
                    message = b"no error"
                except RuntimeError as exc:
                    message = str(exc).encode()
                child_loop.run_until_complete(asyncio.wait_for(engine.aclose(), 5))
                os.write(write_fd, message + b"|closed")
                code = 0
            finally:
                os._exit(code)
        os.close(write_fd)
        _, status = os.waitpid(pid, 0)
        report = os.read(read_fd, 4096).decode()
        os.close(read_fd)
        assert os.WEXITSTATUS(status) == 0, report
        assert "after os.fork()" in report and "create a new engine" in report
        assert report.endswith("|closed")
        _run(loop, engine.aclose())  # the parent's engine is untouched
    finally:
        loop.close()


# --- bad input (defects 8, 14) ------------------------------------------------------------


@pytest.mark.parametrize("bad", [b"", b"\x00\x00\x00\x00"])
async def test_keys_shorter_than_a_group_suffix_are_refused(bad: bytes) -> None:
    engine, _ = make_engine(policy="kv")
    async with engine:
        good = make_keys(2)
        handle = await engine.prepare_store(good, [0, 1])
        assert handle is not None
        await handle
        before = state_of(engine)
        keys = cast(list[ao.OffloadKey], [good[0], bad, good[1]])
        with pytest.raises(ValueError, match=r"keys\[1\] has \d bytes"):
            await engine.prepare_store(keys, [2, 3, 4])
        for sync_call in (engine.lookup, engine.touch):
            with pytest.raises(ValueError, match=r"keys\[1\]"):
                sync_call(keys)
        assert state_of(engine) == before


async def test_a_context_of_the_wrong_type_is_named() -> None:
    engine, _ = make_engine()
    async with engine:
        with pytest.raises(TypeError, match=r"ctx must be an asyncoffload\.ReqContext"):
            await engine.prepare_store(make_keys(1), [0], "r1")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"ctx must be an asyncoffload\.ReqContext"):
            await engine.prepare_load([], [], 42)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ctx must be"):
            engine.lookup(make_keys(1), "r1")  # type: ignore[arg-type]


async def test_block_ids_on_the_meta_device_are_refused() -> None:
    engine, _ = make_engine()
    async with engine:
        ids = torch.empty(1, dtype=torch.int64, device="meta")
        with pytest.raises(ao.BlockIdError, match="meta device"):
            await engine.prepare_store(make_keys(1), ids)


@pytest.mark.parametrize("field", ["cpu_blocks", "store_threshold", "event_buffer"])
def test_a_bool_is_not_a_count(field: str) -> None:
    with pytest.raises(ValueError, match="expected an integer, got True"):
        ao.EngineConfig.model_validate({field: True})


# --- counters (defects 9, 12) -------------------------------------------------------------


async def test_in_flight_drops_as_soon_as_the_handle_is_done() -> None:
    engine, _ = make_engine(inline_copy_bytes=0)  # in flight until a lane is done
    async with engine:
        handle = await engine.prepare_store(make_keys(2), [0, 1])
        assert handle is not None
        seen = []
        while not handle.done():
            await asyncio.sleep(0)
            seen.append(engine.stats().in_flight if handle.done() else None)
        assert seen[-1] == 0


def test_latency_percentiles_follow_the_window_within_two_percent() -> None:
    window = LatencyWindow(size=1000)
    gen = torch.Generator().manual_seed(0)
    samples = (torch.rand(5000, generator=gen) * 2e6 + 1e3).long().tolist()
    for value in samples:
        window.add(value)
    recent = sorted(samples[-1000:])
    for q in (1, 50, 90, 99):
        exact = recent[round(q / 100 * 999)] / 1e3
        assert window.percentile_us(q) == pytest.approx(exact, rel=0.02)
    assert window.count == 5000
    assert window.histogram.snapshot().samples == 5000


def test_latency_window_forgets_samples_that_left_it() -> None:
    window = LatencyWindow(size=4)
    for value in (1_000_000, 1_000_000, 1_000_000, 1_000_000, 10, 10, 10, 10):
        window.add(value)
    assert window.percentile_us(100) == pytest.approx(0.01)


# --- leaks (defect 7, engine side) ---------------------------------------------------------


def test_an_engine_never_closed_warns_even_if_never_used() -> None:
    engine, _ = make_engine()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del engine
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)


def test_an_engine_used_and_dropped_releases_its_wakeup_fd() -> None:
    engine, _ = make_engine()
    loop = asyncio.new_event_loop()
    try:

        async def store(target: ao.AsyncOffloadEngine) -> None:
            handle = await target.prepare_store(make_keys(1), [0])
            assert handle is not None
            await handle

        _run(loop, store(engine))
        bridge = engine._bridge
        assert bridge is not None and bridge.wake_fd is not None
        fd = bridge.wake_fd
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del engine, bridge
            gc.collect()
        with pytest.raises(OSError):
            os.fstat(fd)
    finally:
        loop.close()


def test_a_failed_submission_leaves_no_cycle_holding_the_closed_engine() -> None:
    """Found by the soak: the error's traceback held the engine, and the handle's error
    led back to it; a closed engine kept its host pool until a full collection."""
    import weakref

    engine, _ = make_engine(backend_cls=FailingBackend)
    assert isinstance(engine.backend, FailingBackend)
    engine.backend.fail_submit = True
    loop = asyncio.new_event_loop()
    try:

        async def fail_once(target: ao.AsyncOffloadEngine) -> None:
            handle = await target.prepare_store(make_keys(1), [0])
            assert handle is not None
            ended = asyncio.Event()
            handle.add_done_callback(lambda _h: ended.set())
            await ended.wait()  # not `await handle`: its raise would put a cycle here
            assert isinstance(handle.exception(), ao.TransferError)
            await target.aclose()

        _run(loop, fail_once(engine))
        alive = weakref.ref(engine)
        gc.collect()
        gc.disable()
        try:
            del engine
            assert alive() is None, "a reference cycle keeps the closed engine"
        finally:
            gc.enable()
    finally:
        loop.close()


def test_a_real_sigint_inside_the_managers_update_waits_for_the_step_to_end() -> None:
    """A SIGINT landing between two of the manager's updates used to leave it half
    updated (a slot off the free list and in no policy). The engine holds it until the
    step (manager update and copy hand-off) is whole, then raises KeyboardInterrupt."""
    import signal

    engine, kv = make_engine(cpu_blocks=4)
    manager = engine.manager
    real = manager._allocate

    def allocate_then_signal(n: int) -> list[int]:
        ids = real(n)
        signal.raise_signal(signal.SIGINT)  # the default handler would raise right here
        return ids

    loop = asyncio.new_event_loop()
    try:
        manager._allocate = allocate_then_signal  # type: ignore[method-assign]
        keys = make_keys(2)
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(engine.prepare_store(keys, [0, 1]))
        manager._allocate = real  # type: ignore[method-assign]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        _run(loop, _settled(engine))
        # The store went through whole: both keys loadable, every slot accounted for.
        assert engine.lookup(keys) == 2
        stats = manager.stats()
        assert stats.ready == 2 and stats.free == 2 and stats.write_pending == 0

        async def load_back() -> None:
            handle = await engine.prepare_load(keys, [5, 6])
            await handle

        _run(loop, load_back())
        assert block_bytes(kv, 5) == block_bytes(kv, 0)
        _run(loop, engine.aclose())
    finally:
        loop.close()


# --- first contact (issue 12) ----------------------------------------------------------


async def test_numpy_and_torch_block_ids_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    engine, kv = make_engine()
    async with engine:
        keys = make_keys(3)
        handle = await engine.prepare_store(keys, np.array([0, 1, 2]))
        assert handle is not None
        await handle
        load = await engine.prepare_load(keys, np.array([7, 8, 9], dtype=np.int32))
        await load
        assert block_bytes(kv, 8) == block_bytes(kv, 1)
        more = make_keys(2, prefix=b"m")
        handle = await engine.prepare_store(more, [np.int64(3), torch.tensor(4)])
        assert handle is not None
        await handle
        before = state_of(engine)
        for bad in (np.array([0.0, 1.0]), np.array([[0, 1]]), [np.float64(1.0), 2]):
            with pytest.raises(ao.BlockIdError):
                await engine.prepare_store(make_keys(2, prefix=b"x"), bad)
        assert state_of(engine) == before


async def test_a_store_larger_than_the_tier_raises_capacity_error_with_both_numbers() -> None:
    """The documented contract (docs/api.md, prepare_store): ``CapacityError``, a
    ``ValueError`` carrying both numbers, nothing changed; a prefix that fits stores."""
    engine, _ = make_engine(cpu_blocks=4, gpu_blocks=8)
    async with engine:
        before = state_of(engine)
        with pytest.raises(
            ao.CapacityError, match=r"5 keys to store, more than the 4 blocks"
        ) as err:
            await engine.prepare_store(make_keys(5), [0, 1, 2, 3, 4])
        assert isinstance(err.value, ValueError)
        assert (err.value.new_keys, err.value.num_blocks) == (5, 4)
        assert state_of(engine) == before
        # What a caller does with it: store the front that fits.
        keys = make_keys(5)[: err.value.num_blocks]
        handle = await engine.prepare_store(keys, [0, 1, 2, 3])
        assert handle is not None and handle.keys_to_store == keys
        await handle
        assert engine.lookup(make_keys(5)) == 4
        # Only new keys count: 4 stored + 1 new is refused (every key of a call is
        # protected, so nothing can go), but as None, not CapacityError.
        assert await engine.prepare_store(make_keys(5), [0, 1, 2, 3, 4]) is None
    # The load below must stay in flight: copies go to a lane thread.
    engine, _ = make_engine(cpu_blocks=4, gpu_blocks=8, inline_copy_bytes=0)
    async with engine:
        # Room right now is another matter: None, as before.
        pinned = make_keys(4, prefix=b"p")
        handle = await engine.prepare_store(pinned, [0, 1, 2, 3])
        assert handle is not None
        await handle
        load = await engine.prepare_load(pinned, [4, 5, 6, 7])
        assert await engine.prepare_store(make_keys(1, prefix=b"q"), [0]) is None
        await load
