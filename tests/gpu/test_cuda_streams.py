"""Stream ordering and completion on the CUDA backend.

A transfer's copy stream first waits for the work queued on the caller's current stream,
so a store copies what that work wrote and a load does not overwrite blocks it still
reads. Completion reaches the loop without the caller polling (a host function writing
the loop's eventfd, or a timer checking CUDA events), and callbacks run on the loop
thread in submission order per direction.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time

import pytest
import torch

import asyncoffload as ao
from asyncoffload.handles import Transfer
from tests.gpu.conftest import (
    ALL_METHODS,
    GPU,
    block_rows,
    cuda_backend,
    fill_blocks,
    gather_rows,
    gpu_sleep,
    host_slots,
    index,
    make_engine,
    make_keys,
    overwrite,
    random_kv,
    record_store_callbacks,
)

pytestmark = GPU

INNER = (16, 2, 64)  # 4 KiB fragments
NUM_BLOCKS = 32


def _kv(seed: int = 0) -> list[torch.Tensor]:
    return random_kv(2, NUM_BLOCKS, inner=INNER, seed=seed)


async def _warm_up(engine: ao.AsyncOffloadEngine, kv: list[torch.Tensor]) -> None:
    """One store and one load, and the test's own kernels once, so that one-time work (a
    Triton compile, CUDA's lazy module loading, which can synchronize the device) cannot
    serialize what a test means to overlap."""
    keys = make_keys(2, b"warm")
    blocks = [NUM_BLOCKS - 2, NUM_BLOCKS - 1]
    h = await engine.prepare_store(keys, blocks)
    assert h is not None
    await h
    await (await engine.prepare_load(keys, blocks))
    fill_blocks(kv, blocks, True, 0)
    gather_rows(kv, index(blocks), True)
    gpu_sleep(0.001)
    torch.cuda.synchronize()


@pytest.mark.parametrize("method", ALL_METHODS)
async def test_store_copies_writes_queued_on_the_current_stream(method: str) -> None:
    kv = _kv(1)
    engine = make_engine(kv, method, cpu_blocks=8)
    src, keys = [2, 5, 7, 11], make_keys(4)
    async with engine:
        await _warm_up(engine, kv)  # first-use costs must not hide a missing wait
        gpu_sleep(0.2)
        fill_blocks(kv, src, True, 0xA5)  # queued behind the sleep: not yet run
        h = await engine.prepare_store(keys, src)
        assert h is not None
        await h
        expected = bytes([0xA5]) * engine.layout.block_bytes
        for slot in host_slots(engine, keys):
            assert engine.backend.read_host_block(slot) == expected


@pytest.mark.parametrize("method", ALL_METHODS)
async def test_store_copies_writes_queued_on_a_side_stream_made_current(method: str) -> None:
    kv = _kv(2)
    engine = make_engine(kv, method, cpu_blocks=8)
    src, keys = [1, 3, 4], make_keys(3)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    async with engine:
        await _warm_up(engine, kv)  # first-use costs must not hide a missing wait
        with torch.cuda.stream(side):
            gpu_sleep(0.2)
            fill_blocks(kv, src, True, 0x3C)
            h = await engine.prepare_store(keys, src)
        assert h is not None
        await h
        expected = bytes([0x3C]) * engine.layout.block_bytes
        for slot in host_slots(engine, keys):
            assert engine.backend.read_host_block(slot) == expected


@pytest.mark.parametrize("method", ["batch", "gather", "auto"])
async def test_store_to_a_pageable_pool_copies_writes_queued_on_the_current_stream(
    method: str,
) -> None:
    kv = _kv(12)
    engine = make_engine(kv, method, cpu_blocks=8, pin_memory=False)
    assert engine.stats().backend_info["pageable_chunks"] == 1
    src, keys = [6, 9], make_keys(2)
    async with engine:
        await _warm_up(engine, kv)  # first-use costs must not hide a missing wait
        gpu_sleep(0.2)
        fill_blocks(kv, src, True, 0x5A)
        h = await engine.prepare_store(keys, src)
        assert h is not None
        await h
        expected = bytes([0x5A]) * engine.layout.block_bytes
        for slot in host_slots(engine, keys):
            assert engine.backend.read_host_block(slot) == expected


@pytest.mark.parametrize("method", ALL_METHODS)
async def test_load_waits_for_reads_queued_on_the_current_stream(method: str) -> None:
    kv = _kv(3)
    engine = make_engine(kv, method, cpu_blocks=8)
    keys, src, dst = make_keys(4), [0, 1, 2, 3], [8, 9, 10, 11]
    async with engine:
        await _warm_up(engine, kv)  # first-use costs must not hide a missing wait
        h = await engine.prepare_store(keys, src)
        assert h is not None
        await h
        stored = block_rows(kv, src, True)
        overwrite(kv, seed=33)
        before = block_rows(kv, dst, True)
        assert not torch.equal(before, stored)
        idx = index(dst)
        gpu_sleep(0.2)
        seen = gather_rows(kv, idx, True)  # reads the blocks the load will overwrite
        load = await engine.prepare_load(keys, dst)
        await load
        assert torch.equal(seen.cpu(), before), "the load overwrote blocks still being read"
        assert torch.equal(block_rows(kv, dst, True), stored)


@pytest.mark.parametrize("method", ALL_METHODS)
async def test_loaded_bytes_are_visible_on_the_current_stream_after_await(method: str) -> None:
    kv = _kv(4)
    engine = make_engine(kv, method, cpu_blocks=8)
    keys, src, dst = make_keys(5), [0, 2, 4, 6, 8], [20, 21, 22, 23, 24]
    async with engine:
        await _warm_up(engine, kv)  # first-use costs must not hide a missing wait
        h = await engine.prepare_store(keys, src)
        assert h is not None
        await h
        stored = block_rows(kv, src, True)
        overwrite(kv, seed=44)
        idx = index(dst)
        gpu_sleep(0.1)  # the load waits for this, so it ends well after submission
        load = await engine.prepare_load(keys, dst)
        await load
        after = gather_rows(kv, idx, True)  # queued on the current stream, no sync
        assert torch.equal(after.cpu(), stored)


@pytest.mark.parametrize("method", ALL_METHODS)
async def test_submission_returns_before_queued_gpu_work_runs(method: str) -> None:
    kv = _kv(5)
    engine = make_engine(kv, method, cpu_blocks=16)
    async with engine:
        await _warm_up(engine, kv)
        stored = make_keys(3, b"s")
        h = await engine.prepare_store(stored, [0, 1, 2])
        assert h is not None
        await h
        gpu_sleep(0.5)
        start = time.perf_counter()
        store = await engine.prepare_store(make_keys(3, b"t"), [3, 4, 5])
        load = await engine.prepare_load(stored, [6, 7, 8])
        elapsed = time.perf_counter() - start
        assert store is not None
        assert not store.done() and not load.done()
        assert elapsed < 0.25, f"submitting blocked the loop for {elapsed:.3f} s"
        await asyncio.gather(store, load)


async def test_completion_uses_eventfd_where_host_function_wakeups_exist() -> None:
    kv = _kv()
    engine = make_engine(kv, cpu_blocks=4)
    backend = cuda_backend(engine)
    assert backend.can_wake is backend.has_host_wake
    async with engine:
        assert engine.stats().completion == ("eventfd" if backend.has_host_wake else "poll")


async def test_host_function_wakeups_deliver_completions_without_polling() -> None:
    # With a one-second poll period, and the bridge's slower watchdog timer as the only
    # other way in, only the host function's eventfd write brings a completion to the
    # loop within a few milliseconds of the copy's end, every time.
    kv = _kv(6)
    engine = make_engine(kv, cpu_blocks=16, completion="eventfd", poll_interval_s=1.0)
    if not cuda_backend(engine).has_host_wake:
        pytest.skip("the native CUDA helper (cuLaunchHostFunc wake-ups) is unavailable here")
    async with engine:
        assert engine.stats().completion == "eventfd"
        await _warm_up(engine, kv)
        for i in range(10):
            gpu_sleep(0.01)  # still in flight when the engine starts watching it
            h = await engine.prepare_store(make_keys(1, bytes([i])), [i])
            assert h is not None
            await asyncio.wait_for(h, timeout=0.5)
        stats = engine.stats()
    assert stats.callback_latency_p99_us < 10_000, stats.callback_latency_p99_us


async def test_poll_mode_completes_cuda_transfers_exactly() -> None:
    kv = _kv(7)
    engine = make_engine(kv, cpu_blocks=8, completion="poll", poll_interval_s=0.001)
    keys, src, dst = make_keys(4), [1, 3, 5, 7], [2, 4, 6, 8]
    async with engine:
        assert engine.stats().completion == "poll"
        original = block_rows(kv, src, True)
        h = await engine.prepare_store(keys, src)
        assert h is not None
        await asyncio.wait_for(h, timeout=5)
        overwrite(kv, seed=77)
        await asyncio.wait_for(await engine.prepare_load(keys, dst), timeout=5)
        assert torch.equal(block_rows(kv, dst, True), original)


async def test_callbacks_run_on_the_loop_thread_before_the_handle_resolves() -> None:
    kv = _kv(8)
    engine = make_engine(kv, cpu_blocks=8)
    log: list[tuple[int, int]] = []
    record_store_callbacks(engine, log)
    async with engine:
        gpu_sleep(0.05)
        h = await engine.prepare_store(make_keys(3), [0, 1, 2])
        assert h is not None
        seen_at_resolve: list[int] = []
        h.add_done_callback(lambda _h: seen_at_resolve.append(len(log)))
        await h
    assert log == [(threading.get_ident(), 3)]
    assert seen_at_resolve == [1]


async def test_transfers_complete_in_submission_order_per_direction() -> None:
    kv = _kv(9)
    engine = make_engine(kv, cpu_blocks=32)
    stores: list[int] = []
    loads: list[int] = []
    async with engine:
        keys = [make_keys(2, bytes([i])) for i in range(8)]
        handles: list[Transfer] = []
        gpu_sleep(0.05)
        for i in range(8):
            # The first transfer of each direction is the largest.
            k = make_keys(16, b"big") if i == 0 else keys[i]
            blocks = list(range(16)) if i == 0 else [16 + 2 * i, 17 + 2 * i]
            h = await engine.prepare_store(k, blocks)
            assert h is not None
            h.add_done_callback(functools.partial(lambda i, _h: stores.append(i), i))
            handles.append(h)
        await asyncio.gather(*handles)
        handles.clear()
        for i in range(8):
            k = make_keys(16, b"big") if i == 0 else keys[i]
            blocks = list(range(16)) if i == 0 else [16 + 2 * i, 17 + 2 * i]
            load = await engine.prepare_load(k, blocks)
            load.add_done_callback(functools.partial(lambda i, _h: loads.append(i), i))
            handles.append(load)
        await asyncio.gather(*handles)
    assert stores == list(range(8))
    assert loads == list(range(8))


async def test_duration_and_callback_latency_are_consistent() -> None:
    # A transfer's duration lies within the wall time from submission to resolution, and
    # the callback latency (copy end, stamped by the host function, to callback) is
    # non-negative: the native stamp and time.perf_counter_ns share a clock.
    kv = _kv(10)
    engine = make_engine(kv, cpu_blocks=8)
    backend = cuda_backend(engine)
    async with engine:
        await _warm_up(engine, kv)
        gpu_sleep(0.05)
        start = time.perf_counter()
        h = await engine.prepare_store(make_keys(2), [0, 1])
        assert h is not None
        result = await h
        wall = time.perf_counter() - start
        stats = engine.stats()
    assert 0 < result.duration_s <= wall
    assert stats.store_seconds >= result.duration_s
    if backend.has_host_wake:
        assert 0 <= stats.callback_latency_p50_us <= stats.callback_latency_p99_us < 1e6
    else:  # only stamped completions are sampled; polled ones are not
        assert math.isnan(stats.callback_latency_p50_us)


@pytest.mark.parametrize("completion", ["auto", "poll"])
async def test_a_busy_loop_still_gets_completions(completion: str) -> None:
    kv = _kv(11)
    engine = make_engine(kv, cpu_blocks=16, completion=completion)
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
