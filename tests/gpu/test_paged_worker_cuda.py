"""PagedTransferWorker on CUDA tensors: vLLM-style canonical int8 views of FlashAttention-like
KV caches (K and V split into tensors, contiguous and block-interleaved layouts, pages of
different sizes, several groups sharing tensors, blocks_per_chunk > 1), copied byte for
byte to pinned host slots and back, on the primary and the fallback paths."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from asyncoffload.transfer.base import CopyJob, FailedJob
from asyncoffload.transfer.paged import CopyPlan
from asyncoffload.transfer.paged_worker import CudaPagedEngine, PagedTransferWorker
from tests.gpu.conftest import GPU, gpu_sleep

pytestmark = GPU

NUM_BLOCKS = 32
NUM_SLOTS = 24
BLOCK_SIZE, HEADS, HEAD_DIM = 16, 2, 64
PAGE = BLOCK_SIZE * HEADS * HEAD_DIM * 2  # bf16 K (or V) of one block of one layer: 4 KiB
STATE = 1000  # a Mamba-like state page
ODD, ODD_ROW, ODD_MOVED = 1008, 1016, 1001  # strided rows; refs move an unaligned size

Transfer = tuple[list[int], list[int], list[int], list[int]]


class CanonicalKV:
    """Four attention layers and one state tensor, as vLLM's canonical views see them.

    Layers 0 and 1 are ``[2, num_blocks, block_size, heads, head_dim]`` (K then V, each
    contiguous); layers 2 and 3 are ``[num_blocks, 2, ...]`` (K and V interleaved per
    block: rows 2 pages apart). Tensors: L0K L0V L1K L1V L2K L2V L3K L3V, state, and an
    odd tensor (pages of ODD bytes, rows ODD_ROW apart, ODD_MOVED bytes moved).
    """

    def __init__(self, seed: int) -> None:
        self.raws: list[torch.Tensor] = []
        self.tensors: list[torch.Tensor] = []
        for layer in range(4):
            if layer < 2:
                raw = torch.empty(
                    (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM),
                    dtype=torch.bfloat16,
                    device="cuda",
                )
                pages = raw.view(torch.int8).view(2, NUM_BLOCKS, PAGE)
                k, v = pages[0], pages[1]
            else:
                raw = torch.empty(
                    (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM),
                    dtype=torch.bfloat16,
                    device="cuda",
                )
                pages = raw.view(torch.int8).view(NUM_BLOCKS, 2, PAGE)
                k, v = pages[:, 0], pages[:, 1]
            self.raws.append(raw)
            self.tensors += [k, v]
        state = torch.empty((NUM_BLOCKS, STATE), dtype=torch.int8, device="cuda")
        self.raws.append(state)
        self.tensors.append(state)
        odd = torch.empty((NUM_BLOCKS, ODD_ROW), dtype=torch.int8, device="cuda")
        self.raws.append(odd)
        self.tensors.append(odd[:, :ODD])
        self.scramble(seed)

    def scramble(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for raw in self.raws:
            b = raw.view(-1).view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))
        torch.cuda.synchronize()

    def snapshot(self) -> list[bytes]:
        torch.cuda.synchronize()
        return [_bytes(raw.view(-1).view(torch.uint8).cpu()) for raw in self.raws]

    def locate(self, t: int, block: int) -> tuple[int, int]:
        """(raw index, byte offset in it) of row ``block`` of tensor ``t``."""
        r = t // 2 if t < 8 else t - 4
        tensor = self.tensors[t]
        return r, tensor.data_ptr() - self.raws[r].data_ptr() + block * tensor.stride(0)


PAGES = [PAGE] * 8 + [STATE, ODD]
# Group 0: layers 0 and 2 in full; group 1: layers 1 and 3 moving 3 KiB of their 4 KiB
# pages (un-padded size), the state and the odd tensor; group 2 shares layer 0's tensors
# with group 0.
REFS = [
    [(0, PAGE), (1, PAGE), (4, PAGE), (5, PAGE)],
    [(2, 3072), (3, 3072), (6, 3072), (7, 3072), (8, STATE), (9, ODD_MOVED)],
    [(0, PAGE), (1, PAGE)],
]


def _bytes(t: torch.Tensor) -> bytes:
    c = t.contiguous()
    return ctypes.string_at(c.data_ptr(), c.numel() * c.element_size())


class HostModel:
    """The host layout, written out with loops: slot = per tensor t, bpc sub-pages of
    PAGES[t] bytes; logical block j of a group is in slot ids[(skip + j) // bpc],
    sub-page (skip + j) % bpc."""

    def __init__(self, bpc: int) -> None:
        self.bpc = bpc
        self.slots = [bytearray(bpc * sum(PAGES)) for _ in range(NUM_SLOTS)]

    def places(self, transfer: Transfer) -> Iterator[tuple[int, int, int, int, int]]:
        gpu_ids, sizes, starts, slot_ids = transfer
        bpc = self.bpc
        gi = si = 0
        for g, (n, start) in enumerate(zip(sizes, starts)):
            skip = start % bpc
            for j in range(n):
                slot = slot_ids[si + (skip + j) // bpc]
                sub = (skip + j) % bpc
                for t, nbytes in REFS[g]:
                    yield t, gpu_ids[gi + j], nbytes, slot, bpc * sum(PAGES[:t]) + sub * PAGES[t]
            gi += n
            si += (n + skip + bpc - 1) // bpc if n else 0

    def store(self, kv: CanonicalKV, transfer: Transfer) -> None:
        snap = kv.snapshot()
        for t, block, nbytes, slot, offset in self.places(transfer):
            r, at = kv.locate(t, block)
            self.slots[slot][offset : offset + nbytes] = snap[r][at : at + nbytes]

    def loaded(self, kv: CanonicalKV, before: list[bytes], transfer: Transfer) -> list[bytes]:
        out = [bytearray(b) for b in before]
        for t, block, nbytes, slot, offset in self.places(transfer):
            r, at = kv.locate(t, block)
            out[r][at : at + nbytes] = self.slots[slot][offset : offset + nbytes]
        return [bytes(b) for b in out]


def make_transfer(sizes: list[int], starts: list[int], bpc: int, seed: int) -> Transfer:
    gen = torch.Generator().manual_seed(seed)
    gpu = torch.randperm(NUM_BLOCKS, generator=gen)[: sum(sizes)].tolist()
    chunks = sum((n + s % bpc + bpc - 1) // bpc for n, s in zip(sizes, starts) if n)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:chunks].tolist()
    return gpu, sizes, starts, slots


def make_worker(kv: CanonicalKV, bpc: int, **kwargs: Any) -> PagedTransferWorker:
    return PagedTransferWorker(kv.tensors, PAGES, REFS, bpc, NUM_SLOTS, **kwargs)


def cuda_engine(worker: PagedTransferWorker) -> CudaPagedEngine:
    engine = worker.engine
    assert isinstance(engine, CudaPagedEngine), engine
    return engine


def force_method(worker: PagedTransferWorker, method: str) -> None:
    """Make ``method`` the primary path (skip the test if it is unavailable here)."""
    engine = cuda_engine(worker)
    if method == "batch" and not engine.has_batch:
        pytest.skip("cuMemcpyBatchAsync unavailable (driver 12.8+ and the native helper)")
    if method == "each" and not engine.has_each:
        pytest.skip("the native CUDA helper (cuMemcpyAsync) is unavailable")
    if method in ("kernel", "staged", "auto") and not engine.has_kernel:
        pytest.skip("the Triton copy kernels are unavailable (Triton, pinned pool)")
    if method == "staged" and not engine.has_staged:
        pytest.skip("the staged method is unavailable (Triton and the native helper)")
    engine.primary_method = method


def round_trip(worker: PagedTransferWorker, kv: CanonicalKV, bpc: int, transfer: Transfer) -> None:
    """Store ``transfer``, check every slot, scramble the KV, load the same slots into
    other blocks, and check every KV byte (padding and untouched blocks included)."""
    model = HostModel(bpc)
    gpu, sizes, starts, slots = transfer
    worker.submit_store(1, gpu, sizes, starts, slots)
    worker.wait({1})
    model.store(kv, transfer)
    for slot in range(NUM_SLOTS):
        assert worker.read_slot(slot) == bytes(model.slots[slot]), f"slot {slot}"
    kv.scramble(seed=99)
    before = kv.snapshot()
    target = (make_transfer(sizes, starts, bpc, seed=1234)[0], sizes, starts, slots)
    worker.submit_load(2, slots, target[0], sizes, starts)
    worker.wait({2})
    assert kv.snapshot() == model.loaded(kv, before, target)
    done = worker.get_finished()
    assert [j.job_id for j in done] == [1, 2]
    assert all(j.seconds >= 0 for j in done)


SHAPES = [
    (1, [5, 3, 2], [0, 7, 3]),
    (4, [5, 3, 2], [1, 6, 3]),
    (4, [6, 0, 4], [3, 0, 2]),
]


@pytest.mark.parametrize(("bpc", "sizes", "starts"), SHAPES)
def test_round_trip_is_byte_exact(bpc: int, sizes: list[int], starts: list[int]) -> None:
    kv = CanonicalKV(seed=1)
    with make_worker(kv, bpc) as worker:
        round_trip(worker, kv, bpc, make_transfer(sizes, starts, bpc, seed=2))


METHODS = ["staged", "kernel", "auto", "batch", "each", "torch"]


@pytest.mark.parametrize("method", METHODS)
def test_every_copy_method_is_byte_exact(method: str) -> None:
    kv = CanonicalKV(seed=3)
    with make_worker(kv, 4) as worker:
        force_method(worker, method)
        round_trip(worker, kv, 4, make_transfer([5, 3, 2], [1, 6, 3], 4, seed=4))
        assert cuda_engine(worker).jobs_by_method.get(method, 2) == 2


KERNEL_SHAPES = [
    (1, [5, 3, 2], [0, 7, 3]),
    (1, [0, 6, 0], [0, 2, 0]),
    (3, [5, 3, 2], [1, 5, 2]),
    (3, [7, 0, 4], [2, 0, 4]),
    (3, [1, 1, 1], [2, 1, 0]),
]


@pytest.mark.parametrize("method", ["staged", "kernel"])
@pytest.mark.parametrize(("bpc", "sizes", "starts"), KERNEL_SHAPES)
def test_kernel_methods_are_byte_exact_for_every_shape(
    method: str, bpc: int, sizes: list[int], starts: list[int]
) -> None:
    """Pages of several sizes (an unaligned ref among them), strided rows, groups sharing
    tensors, empty groups, chunks entered at unaligned block_indices."""
    kv = CanonicalKV(seed=30 + bpc)
    with make_worker(kv, bpc) as worker:
        force_method(worker, method)
        round_trip(worker, kv, bpc, make_transfer(sizes, starts, bpc, seed=31 + sum(sizes)))


@pytest.mark.parametrize("bpc", [1, 3])
def test_a_job_larger_than_staging_is_double_buffered(bpc: int) -> None:
    """Staging of two rows per buffer: a job of many slots goes through it in pieces,
    and jobs queued back to back reuse the buffers only once the last user is done."""
    kv = CanonicalKV(seed=40)
    with make_worker(kv, bpc) as worker:
        engine = cuda_engine(worker)
        force_method(worker, "staged")
        engine.staging_bytes = 4 * engine.row_stride + 1  # 2 rows a buffer
        model = HostModel(bpc)
        sizes, starts = [3, 2, 2], [1, 2, 0]
        jobs = []
        used: set[int] = set()
        for seed in range(3):
            gpu, _, _, slots = make_transfer(sizes, starts, bpc, seed=41 + seed)
            gen = torch.Generator().manual_seed(seed)
            free = [s for s in torch.randperm(NUM_SLOTS, generator=gen).tolist() if s not in used]
            slots = free[: len(slots)]
            used.update(slots)
            jobs.append((gpu, sizes, starts, slots))
        gpu_sleep(0.05)  # everything below queues behind this
        for job_id, transfer in enumerate(jobs):
            worker.submit_store(job_id, *transfer)
        worker.wait({2})
        for transfer in jobs:
            model.store(kv, transfer)
        for slot in range(NUM_SLOTS):
            assert worker.read_slot(slot) == bytes(model.slots[slot]), f"slot {slot}"
        assert engine._staging[0] is not None and engine._staging[0][0].shape[0] == 2
        kv.scramble(seed=43)
        expected = kv.snapshot()
        targets = []
        gen = torch.Generator().manual_seed(44)
        perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        n = sum(sizes)
        for i, (_, _, _, slots) in enumerate(jobs[:2]):  # 2 x 7 blocks: distinct targets
            targets.append((perm[i * n : (i + 1) * n], sizes, starts, slots))
        gpu_sleep(0.05)
        for i, (gpu, _, _, slots) in enumerate(targets):
            worker.submit_load(10 + i, slots, gpu, sizes, starts)
        worker.wait({11})
        for transfer in targets:
            expected = model.loaded(kv, expected, transfer)
        assert kv.snapshot() == expected
        assert [j.job_id for j in worker.get_finished()] == [0, 1, 2, 10, 11]
        assert engine.jobs_by_method["staged"] == 5


def test_auto_chooses_by_descriptor_count_and_page_size() -> None:
    kv = CanonicalKV(seed=50)
    with make_worker(kv, 1) as worker:
        engine = cuda_engine(worker)
        if not engine.has_staged:
            pytest.skip("the Triton copy kernels are unavailable")
        layout = worker.layout
        tiny = layout.plan([1], [1, 0, 0], [0, 0, 0], [0], num_slots=NUM_SLOTS, store=True)
        big = layout.plan(list(range(20)), [20, 0, 0], [0, 0, 0], list(range(20)),
                          num_slots=NUM_SLOTS, store=True)  # fmt: skip
        assert engine.choose_method(tiny) == engine.base_method
        assert engine.choose_method(big) == "kernel"  # 4 KiB pages
        engine.kernel_max_fragment_bytes = 1024
        assert engine.choose_method(big) == "staged"


def test_unaligned_slots_use_the_byte_kernels() -> None:
    """Slots of an odd size (no 8-byte alignment through UVA) and a 13-byte page."""
    gen = torch.Generator().manual_seed(60)
    raw = torch.randint(0, 256, (NUM_BLOCKS, 64 + 16), generator=gen, dtype=torch.uint8)
    raw = raw.to("cuda")
    tensors = [raw[:, :64], raw[:, 64:77]]
    for method in ("kernel", "staged"):
        with PagedTransferWorker(tensors, [64, 13], [[(0, 64), (1, 13)]], 3, 8) as worker:
            force_method(worker, method)
            gpu = [3, 9, 1, 4, 20]
            worker.submit_store(1, gpu, [5], [1], [6, 2])
            worker.wait({1})
            host = raw.cpu()
            for j, block in enumerate(gpu):
                slot, sub = [6, 2][(1 + j) // 3], (1 + j) % 3
                data = worker.read_slot(slot)
                assert data[sub * 64 : sub * 64 + 64] == _bytes(host[block, :64])
                at = 3 * 64 + sub * 13
                assert data[at : at + 13] == _bytes(host[block, 64:77])
            assert worker.read_slot(6)[:64] == bytes(64)  # sub-page 0 of slot 6: untouched
            before = raw.clone()
            worker.submit_load(2, [6, 2], [30, 31, 5, 6, 7], [5], [1])
            worker.wait({2})
            for src, dst in zip(gpu, [30, 31, 5, 6, 7]):
                before[dst, :77] = before[src, :77]
            assert torch.equal(raw, before)
            worker.get_finished()


@pytest.mark.parametrize("method", ["batch", "each", "torch", "kernel", "staged"])
def test_slots_spread_over_host_chunks(method: str) -> None:
    kv = CanonicalKV(seed=5)
    slot_bytes = 4 * sum(PAGES)
    with make_worker(kv, 4, chunk_bytes=3 * slot_bytes) as worker:
        assert len(cuda_engine(worker).pool.chunks) == NUM_SLOTS // 3
        force_method(worker, method)
        round_trip(worker, kv, 4, make_transfer([6, 5, 4], [2, 1, 0], 4, seed=6))


def test_a_pageable_host_pool_still_copies_exactly() -> None:
    kv = CanonicalKV(seed=7)
    with make_worker(kv, 4, pin=False) as worker:
        assert not cuda_engine(worker).pool.pinned
        round_trip(worker, kv, 4, make_transfer([5, 3, 2], [1, 6, 3], 4, seed=8))


@pytest.mark.parametrize("method", ["auto", "staged", "kernel"])
def test_a_store_reads_what_the_current_stream_wrote_before_it(method: str) -> None:
    kv = CanonicalKV(seed=9)
    with make_worker(kv, 1) as worker:
        force_method(worker, method)
        transfer: Transfer = ([3], [1, 0, 0], [0, 0, 0], [0])
        gpu_sleep(0.05)  # the fill below runs late on the current stream
        for t in (0, 1, 4, 5):
            kv.tensors[t][3].fill_(7)
        worker.submit_store(1, *transfer)
        worker.wait({1})
        slot = worker.read_slot(0)
        for t in (0, 1, 4, 5):
            offset = sum(PAGES[:t])
            assert slot[offset : offset + PAGE] == bytes([7]) * PAGE, t


@pytest.mark.parametrize("method", ["auto", "staged", "kernel"])
def test_a_load_writes_after_the_current_streams_earlier_work(method: str) -> None:
    kv = CanonicalKV(seed=10)
    with make_worker(kv, 1) as worker:
        force_method(worker, method)
        worker.submit_store(1, [5], [1, 0, 0], [0, 0, 0], [0])
        worker.wait({1})
        expected = _bytes(kv.tensors[0][5].cpu())
        gpu_sleep(0.05)
        kv.tensors[0][6].fill_(1)  # queued before the load: the load must land after it
        worker.submit_load(2, [0], [6], [1, 0, 0], [0, 0, 0])
        worker.wait({2})
        assert _bytes(kv.tensors[0][6].cpu()) == expected


def test_jobs_of_one_direction_finish_in_submission_order() -> None:
    kv = CanonicalKV(seed=11)
    with make_worker(kv, 1) as worker:
        for job_id in range(30):
            worker.submit_store(job_id, [job_id], [1, 0, 0], [0, 0, 0], [0])
        worker.wait({29})
        assert [j.job_id for j in worker.get_finished()] == list(range(30))
        expected = _bytes(kv.tensors[0][29].cpu())
        assert worker.read_slot(0)[:PAGE] == expected  # the last store's bytes stay


def test_get_finished_does_not_block_on_a_running_copy() -> None:
    kv = CanonicalKV(seed=12)
    with make_worker(kv, 1) as worker:
        gpu_sleep(0.2)  # the store waits for this
        worker.submit_store(1, [0], [1, 0, 0], [0, 0, 0], [0])
        assert worker.get_finished() == []
        worker.wait({1})
        assert [j.job_id for j in worker.get_finished()] == [1]


def _raise(message: str) -> Callable[..., CopyJob]:
    def fail(direction: int, plan: CopyPlan) -> CopyJob:
        raise RuntimeError(message)

    return fail


def _ends_in_error(message: str) -> Callable[..., CopyJob]:
    def submit(direction: int, plan: CopyPlan) -> CopyJob:
        return FailedJob(plan.num_copies, RuntimeError(message))

    return submit


@pytest.mark.parametrize("how", ["at-submission", "at-completion"])
def test_failed_copies_are_retried_on_the_fallback_path(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = CanonicalKV(seed=13)
    with make_worker(kv, 4) as worker:
        fake = _raise("injected") if how == "at-submission" else _ends_in_error("injected")
        monkeypatch.setattr(worker.engine, "submit_primary", fake)
        round_trip(worker, kv, 4, make_transfer([5, 3, 2], [1, 6, 3], 4, seed=14))
        stats = worker.stats()
        assert (stats.store.retries, stats.load.retries) == (1, 1)
        assert (stats.store.failures, stats.load.failures) == (0, 0)


def test_a_batch_the_driver_refuses_is_retried_one_copy_at_a_time() -> None:
    """A real driver error at enqueue: cuMemcpyBatchAsync given an invalid source access
    order (validated by the driver before anything is queued)."""
    kv = CanonicalKV(seed=15)
    with make_worker(kv, 4) as worker:
        engine = cuda_engine(worker)
        force_method(worker, "batch")
        if not engine.has_each:
            pytest.skip("no cuMemcpyAsync fallback")
        assert engine.fallback_name == "cuda-each"
        engine.batch_attributes = ((99, 0), (99, 0))
        round_trip(worker, kv, 4, make_transfer([5, 3, 2], [1, 6, 3], 4, seed=16))
        stats = worker.stats()
        assert (stats.store.retries, stats.load.retries) == (1, 1)


@pytest.mark.parametrize("method", ["staged", "kernel"])
def test_a_kernel_job_that_fails_is_retried_on_the_fallback(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staged DMA refused by the driver (invalid attributes, after the gather kernel
    was queued), or the kernel launch failing: the job runs again, one cuMemcpyAsync per
    descriptor, byte-exact."""
    from asyncoffload.transfer import _triton_paged

    kv = CanonicalKV(seed=18)
    with make_worker(kv, 4) as worker:
        engine = cuda_engine(worker)
        force_method(worker, method)
        if not (engine.has_each and engine.has_batch):
            pytest.skip("no cuMemcpyBatchAsync or no cuMemcpyAsync fallback")
        assert engine.fallback_name == "cuda-each"
        if method == "staged":
            engine.batch_attributes = ((99, 0), (99, 0))
        else:

            def refuse(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("injected launch failure")

            monkeypatch.setattr(_triton_paged, "launch_copy_pages", refuse)
        round_trip(worker, kv, 4, make_transfer([5, 3, 2], [1, 6, 3], 4, seed=19))
        stats = worker.stats()
        assert (stats.store.retries, stats.load.retries) == (1, 1)
        assert engine.jobs_by_method["each"] == 2


def test_shutdown_finishes_queued_copies_and_unpins() -> None:
    kv = CanonicalKV(seed=17)
    worker = make_worker(kv, 1)
    pool = cuda_engine(worker).pool
    gpu_sleep(0.05)
    for job_id in range(8):
        worker.submit_store(job_id, [job_id], [1, 0, 0], [0, 0, 0], [job_id])
    worker.shutdown()
    assert worker.stats().store.jobs == 8
    assert pool.chunks == []
    worker.shutdown()
