"""The native copy path (issue 25): the copy kernel JIT-compiled from PTX and launched in
one C call (``NativeCopy.launch``), and the natively submitted staged copy
(``NativeCopy.staged``), on the engine's CUDA backend and on the paged worker. Byte
exactness against the KV tensors, ordering after the caller's current stream, launches
split by the kernel-parameter space, staging chunks double-buffered across jobs, and the
switch that turns the path off."""

from __future__ import annotations

import random

import pytest
import torch

import asyncoffload as ao
from asyncoffload.transfer.cuda import CudaCopyBackend, NativeEvent
from asyncoffload.transfer.paged_cuda import CudaPagedEngine
from asyncoffload.transfer.paged_worker import PagedTransferWorker
from tests.gpu.conftest import (
    GPU,
    NATIVE_INNER,
    as_bytes,
    block_rows,
    cuda_backend,
    gpu_sleep,
    make_keys,
    needs_native,
    random_kv,
)

pytestmark = GPU

# --- the engine's backend ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 32])
async def test_small_engine_transfers_take_the_native_kernel_and_are_exact(n: int) -> None:
    kv = random_kv(4, 80, inner=NATIVE_INNER, seed=1)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=40))
    backend = cuda_backend(engine)
    needs_native(backend)
    assert backend.choose_method(n) == "kernel"
    src = random.Random(2).sample(range(80), n)
    dst = random.Random(3).sample([b for b in range(80) if b not in src], n)
    async with engine:
        want = block_rows(kv, src, True).cpu()
        keys = make_keys(n)
        h = await engine.prepare_store(keys, src)
        assert h is not None
        result = await h
        assert result.duration_s > 0
        await (await engine.prepare_load(keys, dst))
        torch.cuda.synchronize()
        assert torch.equal(block_rows(kv, dst, True).cpu(), want)
    used = engine.stats().backend_info["transfers_by_method"]
    assert isinstance(used, dict) and used["kernel"] == 2


async def test_a_native_store_reads_what_the_current_stream_wrote_before_it() -> None:
    kv = random_kv(2, 8, inner=NATIVE_INNER, seed=4)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=8))
    backend = cuda_backend(engine)
    needs_native(backend)
    async with engine:
        gpu_sleep(0.05)  # the fill below runs late on the current stream
        for t in kv:
            t[:, 5].fill_(3)
        h = await engine.prepare_store(make_keys(1), [5])
        assert h is not None
        await h
        slot = engine.manager.block_of(make_keys(1)[0])
        assert slot is not None
        assert backend.read_host_block(slot.block_id) == as_bytes(
            block_rows(kv, [5], True)[0].cpu()
        )


async def test_a_native_load_writes_after_the_current_streams_earlier_work() -> None:
    kv = random_kv(2, 8, inner=NATIVE_INNER, seed=5)
    engine = ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=8))
    needs_native(cuda_backend(engine))
    async with engine:
        want = block_rows(kv, [1], True).cpu()
        h = await engine.prepare_store(make_keys(1), [1])
        assert h is not None
        await h
        gpu_sleep(0.05)
        for t in kv:
            t[:, 6].fill_(9)  # queued before the load: the load must land after it
        await (await engine.prepare_load(make_keys(1), [6]))
        torch.cuda.synchronize()
        assert torch.equal(block_rows(kv, [6], True).cpu(), want)


def test_the_switch_turns_the_native_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(2, 8, inner=NATIVE_INNER, seed=6)
    layout = ao.KVLayout.infer(kv)
    monkeypatch.setenv("ASYNCOFFLOAD_NATIVE_COPY", "0")
    backend = CudaCopyBackend(kv, layout, 4)
    try:
        assert not backend.has_native
        assert backend.choose_method(1) != "kernel" or backend.has_kernel
    finally:
        backend.close()


def test_native_events_are_recycled_and_still_time() -> None:
    kv = random_kv(2, 8, inner=NATIVE_INNER, seed=7)
    backend = CudaCopyBackend(kv, ao.KVLayout.infer(kv), 4)
    try:
        needs_native(backend)
        for _ in range(3):  # events dropped by one job serve the next
            job = backend.submit_store([1], [2])
            event = getattr(job, "_event", None)
            assert isinstance(event, NativeEvent)
            event.synchronize()
            assert job.query()
            assert job.duration_s > 0
            del job, event
    finally:
        backend.close()


# --- the paged worker -----------------------------------------------------------------------


class AlignedKV:
    """``layers`` layers of K and V tensors, vLLM's canonical int8 views of
    ``[2, num_blocks, page]`` caches: every address and size 16-byte aligned."""

    def __init__(self, layers: int, num_blocks: int, page: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.raws = [
            torch.randint(-128, 128, (2, num_blocks, page), generator=gen, dtype=torch.int8).cuda()
            for _ in range(layers)
        ]
        self.tensors = [r[i] for r in self.raws for i in range(2)]
        self.page = page


def _worker(kv: AlignedKV, bpc: int, slots: int, **kw: object) -> PagedTransferWorker:
    refs = [[(t, kv.page) for t in range(len(kv.tensors))]]
    w = PagedTransferWorker(
        kv.tensors,
        [kv.page] * len(kv.tensors),
        refs,
        bpc,
        slots,
        **kw,  # type: ignore[arg-type]
    )
    engine = w.engine
    assert isinstance(engine, CudaPagedEngine)
    if engine._native is None:
        w.shutdown()
        pytest.skip("the native copy path is unavailable here")
    return w


@pytest.mark.parametrize("method", ["auto", "kernel", "staged"])
@pytest.mark.parametrize("bpc", [1, 4])
def test_paged_native_round_trip_is_byte_exact(method: str, bpc: int) -> None:
    kv = AlignedKV(layers=3, num_blocks=256, page=2048, seed=8)
    n = 64
    with _worker(kv, bpc, 64, staging_bytes=4 * 2 * 6 * 2048 * bpc) as worker:
        engine = worker.engine
        assert isinstance(engine, CudaPagedEngine)
        engine.primary_method = method
        rng = random.Random(bpc)
        src = rng.sample(range(128), n)
        dst = [128 + b for b in rng.sample(range(128), n)]
        slots = rng.sample(range(64), n // bpc)
        want = [t[src].cpu() for t in kv.tensors]
        worker.submit_store(1, src, [n], [0], slots)
        worker.wait({1})  # the slots are reused only once the store is done
        worker.submit_load(2, slots, dst, [n], [0])
        worker.wait({2})
        assert [f.job_id for f in worker.get_finished()] == [1, 2]
        for t, w in zip(kv.tensors, want):
            assert torch.equal(t[dst].cpu(), w)
        # The slot layout: per tensor, bpc sub-pages.
        raw = worker.read_slot(slots[0])
        for i, t in enumerate(kv.tensors):
            for sub in range(bpc):
                at = (i * bpc + sub) * kv.page
                assert raw[at : at + kv.page] == as_bytes(t[src[sub]].cpu().view(torch.uint8))
        used = {m: c for m, c in engine.jobs_by_method.items() if c}
        expected = "staged" if method == "auto" else method
        assert used == {expected: 2}
        assert engine._native_staging[0] is not None or expected != "staged"


def test_paged_native_kernel_handles_skips_and_groups() -> None:
    kv = AlignedKV(layers=2, num_blocks=64, page=1024, seed=9)
    bpc = 4
    # Group 0: every tensor; group 1: layer 0's K and V only (shares them with group 0).
    refs = [[(t, kv.page) for t in range(4)], [(0, kv.page), (1, kv.page)]]
    worker = PagedTransferWorker(kv.tensors, [kv.page] * 4, refs, bpc, 16)
    engine = worker.engine
    assert isinstance(engine, CudaPagedEngine)
    if engine._native is None:
        worker.shutdown()
        pytest.skip("the native copy path is unavailable here")
    with worker:
        # group 0: 5 blocks from logical index 2 (skip 2: 2 slots); group 1: 3 from 1.
        gpu = [3, 9, 12, 20, 21, 30, 31, 33]
        sizes, starts, slots = [5, 3], [2, 1], [0, 1, 2]
        want = [t.clone() for t in kv.tensors]
        worker.submit_store(1, gpu, sizes, starts, slots)
        worker.wait({1})
        assert engine.jobs_by_method["kernel"] == 1  # skips: the native kernel, not staged
        dst = [40, 41, 42, 43, 44, 50, 51, 52]
        worker.submit_load(2, slots, dst, sizes, starts)
        worker.wait({2})
        torch.cuda.synchronize()
        for t, w in zip(kv.tensors, want):
            assert torch.equal(t[dst[:5]], w[gpu[:5]])
        for t, w in zip(kv.tensors[:2], want[:2]):
            assert torch.equal(t[dst[5:]], w[gpu[5:]])


def test_paged_native_kernel_splits_launches_beyond_the_parameter_space() -> None:
    kv = AlignedKV(layers=1, num_blocks=4096, page=256, seed=10)
    with _worker(kv, 1, 2048) as worker:
        engine = worker.engine
        assert isinstance(engine, CudaPagedEngine)
        engine.primary_method = "kernel"
        n = 2000  # more ids than one launch's parameters hold
        src = random.Random(11).sample(range(2048), n)
        dst = [2048 + b for b in random.Random(12).sample(range(2048), n)]
        want = [t[src].cpu() for t in kv.tensors]
        worker.submit_store(1, src, [n], [0], list(range(n)))
        worker.wait({1})
        worker.submit_load(2, list(range(n)), dst, [n], [0])
        worker.wait({2})
        for t, w in zip(kv.tensors, want):
            assert torch.equal(t[dst].cpu(), w)


@pytest.mark.parametrize("method", ["kernel", "staged"])
def test_a_paged_native_store_reads_what_the_current_stream_wrote_before_it(method: str) -> None:
    kv = AlignedKV(layers=2, num_blocks=64, page=4096, seed=13)
    with _worker(kv, 1, 64) as worker:
        engine = worker.engine
        assert isinstance(engine, CudaPagedEngine)
        engine.primary_method = method
        blocks = list(range(8, 48))
        gpu_sleep(0.05)
        for t in kv.tensors:
            t[8:48].fill_(5)  # late on the current stream
        worker.submit_store(1, blocks, [40], [0], list(range(40)))
        worker.wait({1})
        assert worker.read_slot(39) == bytes([5]) * (4 * 4096)
        gpu_sleep(0.05)
        for t in kv.tensors:
            t[50].fill_(1)  # queued before the load: the load lands after it
        worker.submit_load(2, list(range(40)), [50, *range(10, 49)], [40], [0])
        worker.wait({2})
        torch.cuda.synchronize()
        assert all(bool((t[50] == 5).all()) for t in kv.tensors)
