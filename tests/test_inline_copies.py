"""Small copies on the loop thread (``EngineConfig.inline_copy_bytes``, issue 25).

A copy of at most ``inline_copy_bytes`` whose lane is idle runs inside ``prepare_*``
and completes there: the handle it returns is resolved, its callback ran on the loop
thread, its events are published. Everything else goes to a lane as before. These tests
pin what that path keeps: byte-exact copies, completion order per direction, the
manager told exactly once (an interrupt or a failing callback included), and the
engine's input checks, which run in C (``mgrcore``) where they can, with the Python
checks' answers and messages.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pydantic
import pytest
import torch

import asyncoffload as ao
from asyncoffload import _checks
from asyncoffload._native import load_mgrcore
from tests.helpers import (
    InterruptOnce,
    block_bytes,
    make_engine,
    make_keys,
    random_kv,
    record_completions,
)

TIMEOUT_S = 10.0


async def test_a_small_copy_completes_inside_prepare_on_the_loop_thread() -> None:
    engine, kv = make_engine(cpu_blocks=4, gpu_blocks=8, policy="lru")
    log: list[tuple[str, int, tuple[bytes, ...]]] = []
    record_completions(engine, log)
    keys = make_keys(6)
    async with engine:
        sub = engine.events()
        first = await engine.prepare_store(keys[:4], [0, 1, 2, 3])
        assert first is not None and first.done()
        # Two more evict two: the removed event comes before the stored one.
        handle = await engine.prepare_store(keys[4:], [4, 5])
        assert handle is not None and handle.done() and handle.exception() is None
        assert handle.evicted_keys == keys[:2]
        assert engine.stats().in_flight == 0
        items = [sub.receive_nowait() for _ in range(3)]
        events = [e for e in items if isinstance(e, ao.OffloadingEvent)]
        assert [(e.removed, list(e.keys), e.seq) for e in events] == [
            (False, keys[:4], 1),
            (True, keys[:2], 2),
            (False, keys[4:], 3),
        ]
        load = await engine.prepare_load(keys[2:], [7, 6, 0, 1])
        assert load.done()
        result = await load
        assert result.num_blocks == 4
        for src, dst in ((2, 7), (3, 6), (4, 0), (5, 1)):
            assert block_bytes(kv, dst) == _original(src)
    loop_thread = threading.get_ident()
    assert [(kind, tid) for kind, tid, _ in log] == [
        ("store", loop_thread),
        ("store", loop_thread),
        ("load", loop_thread),
    ]


def _original(block: int) -> bytes:
    """The bytes make_engine's KV block ``block`` started with (random_kv, seed 0)."""
    return block_bytes(random_kv(2, 8), block)


@pytest.mark.parametrize("over", [0, 1])
async def test_the_threshold_is_inclusive_and_larger_copies_go_to_a_lane(over: int) -> None:
    probe, _ = make_engine()
    size = probe.layout.block_bytes
    await probe.aclose()
    engine, _ = make_engine(inline_copy_bytes=2 * size - over)
    async with engine:
        handle = await engine.prepare_store(make_keys(2), [0, 1])
        assert handle is not None
        # A lane's copy completes only once the loop runs again: never inside prepare.
        assert handle.done() is (over == 0)
        await asyncio.wait_for(handle, TIMEOUT_S)
        assert engine.lookup(make_keys(2)) == 2


async def test_a_small_copy_behind_a_lane_job_completes_after_it() -> None:
    probe, _ = make_engine()
    size = probe.layout.block_bytes
    await probe.aclose()
    engine, _ = make_engine(cpu_blocks=8, inline_copy_bytes=size)
    log: list[tuple[str, int, tuple[bytes, ...]]] = []
    record_completions(engine, log)
    async with engine:
        big = await engine.prepare_store(make_keys(4, b"b"), [0, 1, 2, 3])  # to a lane
        small = await engine.prepare_store(make_keys(1, b"s"), [4])  # fits the threshold
        assert big is not None and small is not None
        # Whether or not the lane had finished copying, the small copy's completion
        # waits for the big one's, which runs on the loop.
        assert not big.done() and not small.done()
        await asyncio.wait_for(asyncio.gather(big, small), TIMEOUT_S)
    assert [len(keys) for _, _, keys in log] == [4, 1]


def test_an_interrupt_in_an_inline_completion_fails_the_transfer_and_frees_its_slots() -> None:
    engine, _ = make_engine(cpu_blocks=4)
    loop = asyncio.new_event_loop()
    manager = engine.manager
    interrupted_once = InterruptOnce(manager.complete_store)
    manager.complete_store = interrupted_once  # type: ignore[method-assign]
    try:
        # The interrupt leaves prepare_store (the caller's step), after the rerun of
        # the callback told the manager the store failed.
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(engine.prepare_store(make_keys(2), [0, 1]))
        stats = manager.stats()
        assert (stats.write_pending, stats.ready, stats.free) == (0, 0, 4)
        assert engine.stats().in_flight == 0
        assert engine.stats().transfers_failed == 1
        assert interrupted_once.calls == 2  # told once more, never a third time

        async def store_again() -> int:
            handle = await engine.prepare_store(make_keys(2), [0, 1])
            assert handle is not None
            await handle
            return engine.lookup(make_keys(2))

        assert loop.run_until_complete(asyncio.wait_for(store_again(), TIMEOUT_S)) == 2
        loop.run_until_complete(engine.aclose())
    finally:
        loop.close()


async def test_a_failing_inline_completion_returns_a_failed_handle() -> None:
    engine, _ = make_engine()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("bookkeeping bug")

    async with engine:
        engine.manager.complete_store = broken  # type: ignore[method-assign]
        handle = await engine.prepare_store(make_keys(2), [0, 1])
        assert handle is not None and handle.done()
        with pytest.raises(ao.TransferError, match="bookkeeping bug"):
            await handle
        assert engine.stats().in_flight == 0


async def _one_step_workload(engine: ao.AsyncOffloadEngine) -> list[tuple[object, ...]]:
    """Stores that evict, loads and a refused copy (ids out of bounds); what each left."""
    seen: list[tuple[object, ...]] = []
    async with engine:
        sub = engine.events()
        keys = make_keys(6)
        for start, ids in ((0, [0, 1, 2, 3]), (4, [4, 5])):
            handle = await engine.prepare_store(keys[start : start + len(ids)], ids)
            assert handle is not None and handle.done()
            seen.append((handle.keys_to_store, handle.evicted_keys, (await handle).num_blocks))
        load = await engine.prepare_load(keys[2:], [7, 6, 0, 1])
        assert load.done()
        seen.append(((await load).num_blocks, (await load).nbytes))
        with pytest.raises(ao.BlockIdError):
            await engine.prepare_load(keys[2:3], [99])
        stats = engine.stats()
        seen.append((stats.stores, stats.loads, stats.bytes_stored, stats.bytes_loaded))
        seen.append((stats.transfers_failed, stats.blocks_stored, stats.blocks_loaded))
        seen.append((stats.store_duration.samples, stats.load_duration.samples))
        seen.append((stats.store_throughput.samples, stats.load_throughput.samples))
        seen.append(tuple(engine.manager.stats()))
        events = []
        while True:
            try:
                item = sub.receive_nowait()
            except asyncio.QueueEmpty:
                break
            assert isinstance(item, ao.OffloadingEvent)
            events.append((item.seq, item.removed, item.keys))
        seen.append(tuple(events))
    return seen


@pytest.mark.skipif(load_mgrcore() is None, reason="needs the native manager core")
@pytest.mark.parametrize("entry", ["one_step", "finish_step"])
async def test_the_cores_one_step_leaves_what_the_python_path_leaves(entry: str) -> None:
    """``mgrcore.one_step`` (the core copies too) and ``finish_step`` (after a backend's
    own ``copy_now``) make the same calls as Copies.now's Python path: the same handles,
    counters, histograms, manager state, events and bytes."""
    kv = random_kv(2, 8)
    fast, kv_fast = make_engine(4, 8, kv=[t.clone() for t in kv], policy="lru")
    slow, kv_slow = make_engine(4, 8, kv=[t.clone() for t in kv], policy="lru")
    copied_now: list[bool] = []
    backend = fast.backend
    assert isinstance(backend, ao.CpuCopyBackend)
    copy_now = backend.copy_now

    def spied(*args: Any) -> ao.CopyJob | None:
        copied_now.append(True)
        return copy_now(*args)

    backend.copy_now = spied  # type: ignore[method-assign,assignment]
    if entry == "finish_step":
        backend.copy_target = lambda store, n: None  # type: ignore[method-assign]
    core: Any = load_mgrcore()
    entered: list[str] = []

    class Spy:
        """The core's two entries, each noting that it ran."""

        def one_step(self, *args: Any) -> Any:
            entered.append("one_step")
            return core.one_step(*args)

        def finish_step(self, *args: Any) -> Any:
            entered.append("finish_step")
            return core.finish_step(*args)

    for store, touch in ((True, False), (False, True), (False, False)):
        fast._copies._how(store, touch)  # built now: _how sets the core only when it builds
    fast._copies._core = Spy()
    slow._copies._how = lambda store, touch: None  # type: ignore[method-assign]
    assert await _one_step_workload(fast) == await _one_step_workload(slow)
    assert bool(copied_now) == (entry == "finish_step")
    assert entered and set(entered) == {entry}, entered
    # Bytes, not values: random KV bytes hold NaNs.
    assert [block_bytes(kv_fast, b) for b in range(8)] == [
        block_bytes(kv_slow, b) for b in range(8)
    ]
    assert [block_bytes(kv_fast, b) for b in (0, 1)] != [block_bytes(kv, b) for b in (0, 1)]
    hosts = [bytes(e.backend.host.numpy().tobytes()) for e in (fast, slow)]  # type: ignore[attr-defined]
    assert hosts[0] == hosts[1]


async def test_a_failure_after_the_manager_was_told_fails_the_handle_once() -> None:
    """The stored event's publication raises inside a one-step store: the manager was
    told (the keys are loadable), the handle fails, nothing stays in flight."""
    engine, _ = make_engine()
    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("hub bug")

    engine._copies._publish = broken
    async with engine:
        handle = await engine.prepare_store(make_keys(2), [0, 1])
        assert handle is not None and handle.done()
        with pytest.raises(ao.TransferError, match="hub bug"):
            await handle
        assert calls == [1]
        assert engine.lookup(make_keys(2)) == 2
        assert engine.stats().in_flight == 0 and engine.stats().transfers_failed == 1


async def test_inline_copies_record_no_wake_up_latency() -> None:
    engine, _ = make_engine()
    async with engine:
        for i in range(3):
            handle = await engine.prepare_store(make_keys(1, bytes([i])), [i])
            assert handle is not None and handle.done()
        stats = engine.stats()
    assert stats.stores == 3
    assert stats.callback_latency.samples == 0  # only lane copies wait for a wake-up


@pytest.mark.parametrize("value", [-1, True, 1.5, "64k"])
def test_inline_copy_bytes_must_be_a_non_negative_int(value: object) -> None:
    with pytest.raises(pydantic.ValidationError, match="inline_copy_bytes"):
        ao.EngineConfig.model_validate({"inline_copy_bytes": value})


@pytest.mark.parametrize("value", [-1, True, 10_001, "fast", float("nan")])
def test_inline_wait_us_must_be_a_number_within_its_bound(value: object) -> None:
    with pytest.raises(pydantic.ValidationError, match="inline_wait_us"):
        ao.EngineConfig.model_validate({"inline_wait_us": value})
    assert ao.EngineConfig(inline_wait_us=0).inline_wait_us == 0  # 0: never wait


@pytest.mark.parametrize("value", [-1, True, 2.0])
def test_the_cpu_backend_refuses_a_bad_inline_bytes(value: Any) -> None:
    kv = random_kv(1, 4)
    with pytest.raises(ValueError, match="inline_bytes"):
        ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), 4, "native", inline_bytes=value)


@pytest.mark.parametrize("inline", [True, False])
def test_native_copies_check_the_ids_bounds_and_copy_nothing_out_of_them(inline: bool) -> None:
    kv = random_kv(1, 4)
    layout = ao.KVLayout.infer(kv)
    backend = ao.CpuCopyBackend(kv, layout, 4, "native", inline_bytes=1 << 20 if inline else 0)
    try:
        before = bytes(backend.read_host_block(0))
        with pytest.raises(IndexError, match=r"KV block ids must lie in \[0, 4\)"):
            backend.submit_store([1, 4], [0, 1])
        with pytest.raises(IndexError, match=r"host block ids must lie in \[0, 4\)"):
            backend.submit_store([0, 1], [0, -1])
        assert backend.read_host_block(0) == before
        # numpy ints (vLLM's block tables) take the conversion path, and copy right.
        job = backend.submit_store(list(np.array([2, 3], dtype=np.int64)), [0, 1])
        for _ in range(10_000):
            if job.query():
                break
            threading.Event().wait(0.001)
        assert job.query() and job.error is None
        assert job.inline is inline
        assert backend.read_host_block(0) == block_bytes(kv, 2)
        assert backend.read_host_block(1) == block_bytes(kv, 3)
    finally:
        backend.close()


def test_copy_now_copies_a_small_job_here_or_declines_and_changes_nothing() -> None:
    kv = random_kv(1, 4)
    layout = ao.KVLayout.infer(kv)
    backend = ao.CpuCopyBackend(kv, layout, 4, "native", inline_bytes=2 * layout.block_bytes)
    try:
        job = backend.copy_now(True, [2, 3], [0, 1])
        assert job is not None and job.inline and job.query() and job.error is None
        assert (job.num_blocks, job.nbytes) == (2, 2 * layout.block_bytes)
        assert backend.read_host_block(0) == block_bytes(kv, 2)
        assert backend.read_host_block(1) == block_bytes(kv, 3)
        kv[0].zero_()
        load = backend.copy_now(False, [1], [1])
        assert load is not None and block_bytes(kv, 1) == backend.read_host_block(1)
        before = [bytes(backend.read_host_block(i)) for i in range(4)]
        # Declined, nothing copied: over the threshold, a length mismatch.
        assert backend.copy_now(True, [0, 1, 2], [0, 1, 2]) is None
        assert backend.copy_now(True, [0, 1], [2]) is None
        # Out of bounds: raises, nothing copied.
        with pytest.raises(IndexError, match="KV block ids"):
            backend.copy_now(True, [0, 9], [2, 3])
        # A wrapped submit_* (a fault plan's, a test's) keeps every copy on it.
        backend.inject_faults(ao.FaultPlan(ao.Fault.slow_lane(0.001, rate=1.0, direction="store")))
        assert backend.copy_now(True, [0], [2]) is None
        assert backend.copy_now(False, [0], [2]) is None  # the plan wraps both
        backend.inject_faults(None)
        assert [bytes(backend.read_host_block(i)) for i in range(4)] == before
        assert backend.copy_now(True, [0], [2]) is not None
    finally:
        backend.close()
    assert backend.copy_now(True, [0], [2]) is None  # closed


def test_copy_now_declines_on_the_python_lanes_and_by_default() -> None:
    kv = random_kv(1, 4)
    layout = ao.KVLayout.infer(kv)
    backend = ao.CpuCopyBackend(kv, layout, 4, "threads", inline_bytes=1 << 20)
    try:
        assert backend.copy_now(True, [0], [0]) is None
    finally:
        backend.close()


async def test_a_wrapped_submission_is_used_even_for_a_small_copy() -> None:
    """The engine copies a small job itself only through the backend's own
    ``submit_*``: a wrapper installed on the instance sees every copy."""
    engine, _ = make_engine(cpu_blocks=4, gpu_blocks=8, policy="lru")
    seen: list[tuple[list[int], list[int]]] = []
    real = engine.backend.submit_store

    def submit_store(gpu_ids: Any, host_ids: Any) -> ao.CopyJob:
        seen.append((list(gpu_ids), list(host_ids)))
        return real(gpu_ids, host_ids)

    async with engine:
        handle = await engine.prepare_store(make_keys(2), [0, 1])
        assert handle is not None and not seen  # the backend's own: copied in the step
        await handle
        engine.backend.submit_store = submit_store  # type: ignore[method-assign]
        handle = await engine.prepare_store(make_keys(4)[2:], [2, 3])
        assert handle is not None
        await asyncio.wait_for(_awaited(handle), TIMEOUT_S)
        assert len(seen) == 1 and seen[0][0] == [2, 3]
        assert engine.lookup(make_keys(4)) == 4


def test_an_interrupt_in_the_touch_of_a_small_load_unpins_and_fails_it() -> None:
    """``touch_on_load``'s touch runs after the small copy, in the caller's step: an
    interrupt there (a fault injected where the hold cannot help) leaves nothing
    pinned and the handle failed, and the keys load again."""
    engine, kv = make_engine(cpu_blocks=4, gpu_blocks=8, policy="lru", touch_on_load=True)
    loop = asyncio.new_event_loop()
    manager = engine.manager
    keys = make_keys(2)
    try:
        handle = loop.run_until_complete(engine.prepare_store(keys, [0, 1]))
        assert handle is not None and handle.done()
        manager.touch = InterruptOnce(manager.touch)  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(engine.prepare_load(keys, [5, 6]))
        assert [b.ref_cnt for _, b in manager.policy.items()] == [0, 0]
        assert engine.stats().in_flight == 0
        load = loop.run_until_complete(engine.prepare_load(keys, [5, 6]))
        assert loop.run_until_complete(_awaited(load)).num_blocks == 2
        assert block_bytes(kv, 5) == block_bytes(kv, 0)
        loop.run_until_complete(engine.aclose())
    finally:
        loop.close()


async def _awaited(handle: ao.Transfer) -> ao.TransferResult:
    return await handle


# --- the native input checks answer as the Python ones ---------------------------------

_KEY = ao.make_offload_key(b"k" * 8)
BAD_CALLS: list[tuple[object, object]] = [
    ([_KEY, b"short"], [0, 1]),
    ([_KEY, "text"], [0, 1]),
    (b"one key", [0]),
    ([_KEY, bytearray(_KEY)], [0, 1]),
    ([_KEY], [8]),
    ([_KEY], [-1]),
    ([_KEY, _KEY + b"x"], [1, 1]),
    ([_KEY], [True]),
    ([_KEY], [1.0]),
    ([_KEY], [2**70]),
    ([_KEY, _KEY + b"x"], [0]),
    ([_KEY], torch.tensor([[0]])),
]
GOOD_CALLS: list[tuple[object, object]] = [
    ([], []),
    ([_KEY], [7]),
    ((_KEY, _KEY + b"x"), (3, 2)),
    ([_KEY, _KEY + b"x"], np.array([5, 6], dtype=np.int32)),
    ([_KEY, _KEY + b"x"], torch.tensor([1, 0])),
    ([_KEY, _KEY + b"x"], [np.int64(1), 0]),
]


def _outcome(keys: object, ids: object, native: object) -> object:
    saved = _checks._NATIVE
    _checks._NATIVE = native
    try:
        return _checks.check_call("prepare_load", keys, ids, None, 8, unique=True)  # type: ignore[arg-type]
    except Exception as exc:  # the answer compared is the exception's type and text
        return (type(exc), str(exc))
    finally:
        _checks._NATIVE = saved


needs_core = pytest.mark.skipif(
    load_mgrcore() is None, reason="the native manager core did not build here"
)


@needs_core
@pytest.mark.parametrize("keys, ids", BAD_CALLS + GOOD_CALLS)
def test_the_native_checks_answer_as_the_python_ones(keys: object, ids: object) -> None:
    assert _outcome(keys, ids, load_mgrcore()) == _outcome(keys, ids, False)


@needs_core
def test_distinct_keeps_first_seen_order_with_or_without_the_core() -> None:
    a, b, c = make_keys(3)
    for keys in ([a, b, c], [a, b, a, c, b], [], [a] * 40, make_keys(40)):
        saved = _checks._NATIVE
        try:
            _checks._NATIVE = load_mgrcore()
            native = _checks.distinct(list(keys))
            _checks._NATIVE = False
            python = _checks.distinct(list(keys))
        finally:
            _checks._NATIVE = saved
        assert native == python == list(dict.fromkeys(keys))


@needs_core
def test_call_blocks_refuses_what_it_cannot_convert() -> None:
    core = load_mgrcore()
    assert core is not None
    fn = tables = 1  # never called: the lists are refused first
    assert core.call_blocks(fn, tables, 0, [1, 2], [3]) is None
    assert core.call_blocks(fn, tables, 0, [1, True], [3, 4]) is None
    assert core.call_blocks(fn, tables, 0, [1, 2**64], [3, 4]) is None
    with pytest.raises(TypeError):
        core.call_blocks(fn, tables, 0, {1}, [3])  # a set: neither list nor tuple
    with pytest.raises(ValueError, match="null address"):
        core.call_blocks(0, tables, 0, [1], [3])
