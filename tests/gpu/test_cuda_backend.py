"""The CUDA backend moves bytes exactly: every copy method, both layouts, several dtypes,
small fragments, a chunked host pool, a pageable one, and transfers larger than the
gather path's staging buffer."""

from __future__ import annotations

import mmap
import random

import pytest
import torch

import asyncoffload as ao
from asyncoffload.transfer.cuda import CopyMethod, CudaCopyBackend
from tests.gpu.conftest import (
    ALL_METHODS,
    DTYPES,
    GPU,
    METHODS,
    as_bytes,
    block_rows,
    cuda_backend,
    host_slots,
    make_engine,
    make_keys,
    methods_used,
    overwrite,
    random_kv,
    require_method,
)

pytestmark = GPU


async def _round_trip(
    engine: ao.AsyncOffloadEngine,
    kv: list[torch.Tensor],
    kv_split: bool,
    src: list[int],
    dst: list[int],
) -> None:
    """Store ``src``, check the host slots, overwrite the KV, load the keys into ``dst``
    in reverse order and check every KV block, loaded or not, bit for bit."""
    num_blocks = engine.layout.num_blocks
    original = block_rows(kv, src, kv_split)
    keys = make_keys(len(src))
    store = await engine.prepare_store(keys, src)
    assert store is not None and store.keys_to_store == keys
    result = await store
    assert result.num_blocks == len(src)
    assert result.nbytes == len(src) * engine.layout.block_bytes
    backend = engine.backend
    for i, slot in enumerate(host_slots(engine, keys)):
        assert backend.read_host_block(slot) == as_bytes(original[i]), f"slot {slot}"

    overwrite(kv, seed=len(src) + 99)
    fresh = block_rows(kv, range(num_blocks), kv_split)
    assert engine.lookup(keys) == len(keys)
    load = await engine.prepare_load(keys[::-1], dst)
    assert (await load).nbytes == result.nbytes
    after = block_rows(kv, range(num_blocks), kv_split)
    for block, i in zip(dst, reversed(range(len(src)))):
        assert torch.equal(after[block], original[i]), f"KV block {block}"
    untouched = [b for b in range(num_blocks) if b not in set(dst)]
    assert torch.equal(after[untouched], fresh[untouched]), "a block outside the load changed"


def _assert_methods(engine: ao.AsyncOffloadEngine, method: str, transfers: int) -> None:
    used = methods_used(engine)
    assert sum(used.values()) == transfers
    if method != "auto":
        assert used[method] == transfers, used


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("kv_split", [True, False], ids=["kv_split", "unsplit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_bytes_round_trip_exactly(method: str, kv_split: bool, dtype: torch.dtype) -> None:
    kv = random_kv(3, 16, kv_split=kv_split, dtype=dtype, seed=7)
    engine = make_engine(kv, method, cpu_blocks=8)
    assert engine.layout.kv_split is kv_split
    async with engine:
        await _round_trip(engine, kv, kv_split, [3, 11, 0, 15, 8, 12], [14, 1, 9, 5, 2, 6])
    _assert_methods(engine, method, 2)


@pytest.mark.parametrize("method", ALL_METHODS)
async def test_small_fragments_of_many_layers_round_trip(method: str) -> None:
    # 32 layers of 4 KiB fragments: 64 fragments a block, where the kernel shines.
    kv = random_kv(32, 48, inner=(16, 1, 128), seed=3)
    engine = make_engine(kv, method, cpu_blocks=40)
    assert engine.layout.fragment_bytes == 4096
    src = random.Random(1).sample(range(48), 40)
    dst = random.Random(2).sample(range(48), 40)
    async with engine:
        await _round_trip(engine, kv, True, src, dst)
    _assert_methods(engine, method, 2)


@pytest.mark.parametrize("load_method", METHODS)
@pytest.mark.parametrize("store_method", METHODS)
async def test_copy_methods_agree_on_the_host_layout(
    store_method: CopyMethod, load_method: CopyMethod
) -> None:
    # Stored with one method, loaded with another (per-direction overrides).
    kv = random_kv(3, 16, kv_split=False, seed=14)
    require_method(kv, store_method)
    require_method(kv, load_method)
    engine = make_engine(kv, cpu_blocks=8)
    cuda_backend(engine).method_by_direction = [store_method, load_method]
    async with engine:
        await _round_trip(engine, kv, False, [4, 0, 9, 15], [2, 13, 7, 3])
    used = methods_used(engine)
    assert used[store_method] >= 1 and used[load_method] >= 1
    assert sum(used.values()) == 2


@pytest.mark.parametrize("rows_per_chunk", [3, 1], ids=["3_rows", "1_row"])
@pytest.mark.parametrize("method", ALL_METHODS)
async def test_host_pool_in_several_chunks_round_trips(method: str, rows_per_chunk: int) -> None:
    kv = random_kv(2, 32, inner=(16, 2, 64), seed=5)  # 4 KiB fragments, 16 KiB blocks
    block = 4 * 4096
    # Not a whole number of blocks, and (for one row) smaller than one block.
    chunk = rows_per_chunk * block + 100 if rows_per_chunk > 1 else block // 2
    engine = make_engine(kv, method, cpu_blocks=20, host_chunk_bytes=chunk)
    backend = cuda_backend(engine)
    assert backend.pool.rows_per_chunk == rows_per_chunk
    chunks = -(-20 // rows_per_chunk)
    info = engine.stats().backend_info
    assert (info["pinned_chunks"], info["pageable_chunks"]) == (chunks, 0)
    assert info["host_bytes"] == 20 * block
    # Fresh slots are handed out in order: the 20 blocks cover every chunk, and each
    # transfer crosses every chunk boundary.
    src = random.Random(4).sample(range(32), 20)
    dst = random.Random(6).sample(range(32), 20)
    async with engine:
        await _round_trip(engine, kv, True, src, dst)
    _assert_methods(engine, method, 2)


@pytest.mark.parametrize("method", ["batch", "gather", "auto"])
async def test_pageable_host_pool_round_trips(method: str) -> None:
    kv = random_kv(2, 24, inner=(16, 2, 64), seed=8)
    engine = make_engine(kv, method, cpu_blocks=12, pin_memory=False, host_chunk_bytes=5 * 16384)
    info = engine.stats().backend_info
    assert (info["pinned_chunks"], info["pageable_chunks"]) == (0, 3)
    assert info["copy_kernel"] is False  # UVA needs pinned memory
    async with engine:
        await _round_trip(engine, kv, True, list(range(0, 24, 2)), list(range(23, 11, -1)))
    _assert_methods(engine, method, 2)


def test_kernel_method_is_refused_for_a_pageable_pool() -> None:
    kv = random_kv(1, 8, inner=(16, 2, 64))
    config = ao.EngineConfig(cpu_blocks=4, copy_method="kernel", pin_memory=False)
    with pytest.raises(RuntimeError, match="not available"):
        ao.AsyncOffloadEngine(kv, config)


@pytest.mark.parametrize("method", METHODS)
async def test_transfer_larger_than_the_staging_buffer_round_trips(method: CopyMethod) -> None:
    # A 4-block staging buffer: the gather path runs 5 sub-batches through it,
    # and the 3-row chunks split each sub-batch's host ranges.
    kv = random_kv(2, 40, inner=(16, 2, 64), seed=9)
    require_method(kv, method)
    layout = ao.KVLayout.infer(kv)
    backend = CudaCopyBackend(
        kv,
        layout,
        20,
        copy_method=method,
        chunk_bytes=3 * layout.block_bytes,
        staging_bytes=4 * layout.block_bytes,
    )
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=20), backend=backend)
    src = random.Random(10).sample(range(40), 20)
    dst = random.Random(11).sample(range(40), 20)
    async with engine:
        await _round_trip(engine, kv, True, src, dst)
    _assert_methods(engine, method, 2)


async def test_auto_chooses_the_method_per_transfer() -> None:
    kv = random_kv(4, 40, inner=(16, 1, 128), seed=12)  # 4 KiB fragments, 8 a block
    engine = make_engine(kv, "auto", cpu_blocks=32)
    backend = cuda_backend(engine)
    expected = {"batch": 0, "kernel": 0, "staged": 0, "gather": 0}
    async with engine:
        for i, n in enumerate([1, 7, 8, 32]):  # 8, 56, 64 and 256 fragments
            expected[backend.choose_method(n)] += 1
            h = await engine.prepare_store(make_keys(n, bytes([i])), list(range(n)))
            assert h is not None
            await h
    assert methods_used(engine) == expected
    chosen = [backend.choose_method(n) for n in (1, 7, 8, 32)]
    if backend.has_kernel:
        small = "batch" if backend.has_batch else "kernel"
        assert chosen == [small, small, "kernel", "kernel"]
    else:
        assert chosen == ["batch" if backend.has_batch else "gather"] * 4


async def test_stats_describe_the_cuda_backend() -> None:
    kv = random_kv(1, 8, inner=(16, 2, 64))
    engine = make_engine(kv, cpu_blocks=4)
    backend = cuda_backend(engine)
    info = engine.stats().backend_info
    assert info["device"] == str(kv[0].device)
    assert info["batch_memcpy"] is backend.has_batch
    assert info["copy_kernel"] is backend.has_kernel
    assert info["host_function_wakeups"] is backend.has_host_wake
    assert info["copy_method"] == "auto"
    assert engine.stats().backend == "cuda"
    await engine.aclose()


async def test_a_chunk_that_cannot_be_pinned_falls_back_without_poisoning_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Make pinning fail: every chunk the pool maps is already registered with CUDA.
    kv = random_kv(1, 8, inner=(16, 2, 64), seed=13)
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    registered: list[int] = []
    real_mmap = mmap.mmap

    def registered_mmap(fileno: int, length: int) -> mmap.mmap:
        mm = real_mmap(fileno, length)
        ptr = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
        assert int(cudart.cudaHostRegister(ptr, length, 0)) == 0
        registered.append(ptr)
        return mm

    monkeypatch.setattr(mmap, "mmap", registered_mmap)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=4, copy_method="gather"))
    monkeypatch.undo()
    try:
        assert engine.stats().backend_info["pageable_chunks"] == 1
        doubled = torch.ones(8, device="cuda") * 2  # an unrelated kernel launch
        assert doubled.sum().item() == 16
        async with engine:
            await _round_trip(engine, kv, True, [0, 1], [6, 7])
    finally:
        for ptr in registered:
            cudart.cudaHostUnregister(ptr)
        await engine.aclose()
