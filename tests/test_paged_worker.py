"""PagedTransferWorker on CPU tensors: byte-exact copies between vLLM-style canonical KV
tensors and block-major host slots, checked against a reference model of the host layout
written out here with plain loops (independent of asyncoffload.transfer.paged)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import pytest
import torch

from asyncoffload import _native
from asyncoffload.errors import TransferError
from asyncoffload.transfer.base import CopyJob, FailedJob
from asyncoffload.transfer.paged import CopyPlan, PageLayout
from asyncoffload.transfer.paged_worker import (
    CpuCopyEngine,
    PagedTransferError,
    PagedTransferWorker,
)

HAS_NATIVE = _native.load_copy_engine() is not None
ENGINES = [
    pytest.param(
        "native", marks=pytest.mark.skipif(not HAS_NATIVE, reason="no native copy engine")
    ),
    "threads",
]

# Four tensors with different page sizes. Tensor 0's rows are 96 bytes apart but its
# pages are 64 bytes (a packed layout); the others are contiguous.
PAGES = (64, 48, 40, 64)
ROWS = (96, 48, 40, 64)
# Group 0: K and V of one layer; group 1: two layers whose refs move less than their
# padded page; group 2 shares tensors 0 and 1 with groups 0 and 1.
REFS = [[(0, 64), (3, 64)], [(1, 40), (2, 40)], [(0, 50), (1, 48)]]
NUM_BLOCKS = 24
NUM_SLOTS = 16

Transfer = tuple[list[int], list[int], list[int], list[int]]


class KV:
    """The test's KV tensors: ``bases`` own the bytes (padding included), ``tensors`` are
    the ``(num_blocks, page)`` views handed to the worker."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.int8) -> None:
        self.bases = [torch.empty((NUM_BLOCKS, row), dtype=dtype) for row in ROWS]
        self.scramble(seed)
        self.tensors = [b[:, :p] for b, p in zip(self.bases, PAGES)]

    def scramble(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for b in self.bases:
            raw = torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8)
            b.copy_(raw.view(b.dtype))

    def snapshot(self) -> list[bytes]:
        return [_bytes(b) for b in self.bases]

    def row(self, t: int, block: int, nbytes: int) -> bytes:
        return _bytes(self.tensors[t][block, :nbytes])


def _bytes(t: torch.Tensor) -> bytes:
    c = t.contiguous()
    return ctypes.string_at(c.data_ptr(), c.numel() * c.element_size())


class HostModel:
    """The host layout as the brief defines it: slot = for each tensor t, bpc sub-pages of
    PAGES[t] bytes; logical block j of a group sits in slot ids[(skip + j) // bpc],
    sub-page (skip + j) % bpc."""

    def __init__(self, bpc: int, refs: Sequence[Sequence[tuple[int, int]]] = REFS) -> None:
        self.bpc = bpc
        self.refs = refs
        self.slot_bytes = bpc * sum(PAGES)
        self.slots = [bytearray(self.slot_bytes) for _ in range(NUM_SLOTS)]

    def places(self, transfer: Transfer) -> Iterator[tuple[int, int, int, int, int]]:
        """(tensor, gpu block, nbytes, slot, offset in slot) of every copy."""
        gpu_ids, sizes, starts, slot_ids = transfer
        bpc = self.bpc
        gi = si = 0
        for g, (n, start) in enumerate(zip(sizes, starts)):
            skip = start % bpc
            for j in range(n):
                slot = slot_ids[si + (skip + j) // bpc]
                sub = (skip + j) % bpc
                for t, nbytes in self.refs[g]:
                    offset = bpc * sum(PAGES[:t]) + sub * PAGES[t]
                    yield t, gpu_ids[gi + j], nbytes, slot, offset
            gi += n
            si += (n + skip + bpc - 1) // bpc if n else 0

    def store(self, kv: KV, transfer: Transfer) -> None:
        for t, block, nbytes, slot, offset in self.places(transfer):
            self.slots[slot][offset : offset + nbytes] = kv.row(t, block, nbytes)

    def loaded(self, before: list[bytes], transfer: Transfer) -> list[bytes]:
        """The KV bytes (``bases``) after loading ``transfer`` over ``before``."""
        out = [bytearray(b) for b in before]
        for t, block, nbytes, slot, offset in self.places(transfer):
            start = block * ROWS[t]
            out[t][start : start + nbytes] = self.slots[slot][offset : offset + nbytes]
        return [bytes(b) for b in out]

    def nbytes(self, transfer: Transfer) -> int:
        return sum(nbytes for _, _, nbytes, _, _ in self.places(transfer))


def make_transfer(
    sizes: list[int], starts: list[int], bpc: int, seed: int, gpu_pool: Sequence[int] | None = None
) -> Transfer:
    """Distinct GPU blocks (from ``gpu_pool``) and distinct slots, in random order."""
    gen = torch.Generator().manual_seed(seed)
    pool = list(range(NUM_BLOCKS)) if gpu_pool is None else list(gpu_pool)
    perm = torch.randperm(len(pool), generator=gen).tolist()
    gpu = [pool[i] for i in perm[: sum(sizes)]]
    chunks = sum((n + s % bpc + bpc - 1) // bpc for n, s in zip(sizes, starts) if n)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:chunks].tolist()
    return gpu, sizes, starts, slots


def make_worker(kv: KV, bpc: int, engine: str = "native", **kwargs: Any) -> PagedTransferWorker:
    copy_engine = cast(CpuCopyEngine, engine)
    return PagedTransferWorker(
        kv.tensors, PAGES, REFS, bpc, NUM_SLOTS, copy_engine=copy_engine, **kwargs
    )


def store(worker: PagedTransferWorker, job_id: int, transfer: Transfer) -> None:
    gpu, sizes, starts, slots = transfer
    worker.submit_store(job_id, gpu, sizes, starts, slots)


def load(worker: PagedTransferWorker, job_id: int, transfer: Transfer) -> None:
    gpu, sizes, starts, slots = transfer
    worker.submit_load(job_id, slots, gpu, sizes, starts)


def host_matches(worker: PagedTransferWorker, model: HostModel) -> None:
    for slot in range(NUM_SLOTS):
        assert worker.read_slot(slot) == bytes(model.slots[slot]), f"slot {slot}"


# (group_sizes, block_indices) per blocks_per_chunk: unaligned starts, an empty group.
SHAPES = {
    1: [([3, 2, 4], [0, 4, 2]), ([2, 0, 3], [5, 9, 1])],
    3: [([4, 2, 5], [1, 3, 5]), ([3, 0, 1], [2, 0, 4]), ([6, 3, 3], [0, 3, 6])],
}
CASES = [(bpc, sizes, starts) for bpc, shapes in SHAPES.items() for sizes, starts in shapes]


# --- byte-exact round trips ----------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("bpc", "sizes", "starts"), CASES)
def test_store_writes_each_block_into_its_slot_and_sub_page(
    engine: str, bpc: int, sizes: list[int], starts: list[int]
) -> None:
    kv = KV(seed=1)
    model = HostModel(bpc)
    transfer = make_transfer(sizes, starts, bpc, seed=2)
    with make_worker(kv, bpc, engine) as worker:
        store(worker, 1, transfer)
        worker.wait({1})
        model.store(kv, transfer)
        host_matches(worker, model)  # skipped sub-pages and other slots stay zero


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("bpc", "sizes", "starts"), CASES)
def test_load_writes_each_block_from_its_slot_and_nothing_else(
    engine: str, bpc: int, sizes: list[int], starts: list[int]
) -> None:
    kv = KV(seed=3)
    model = HostModel(bpc)
    stored = make_transfer(sizes, starts, bpc, seed=4)
    with make_worker(kv, bpc, engine) as worker:
        store(worker, 1, stored)
        worker.wait({1})
        model.store(kv, stored)
        kv.scramble(seed=5)
        before = kv.snapshot()
        # The same slots into other blocks, in another order.
        target = make_transfer(sizes, starts, bpc, seed=6)
        target = (target[0], sizes, starts, stored[3])
        load(worker, 2, target)
        worker.wait({2})
        assert kv.snapshot() == model.loaded(before, target)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_load_may_start_inside_a_chunk(engine: str) -> None:
    bpc = 3
    kv = KV(seed=7)
    model = HostModel(bpc)
    # Logical blocks 0..5 of each group fill two chunks each...
    stored = make_transfer([6, 6, 6], [0, 0, 0], bpc, seed=8)
    with make_worker(kv, bpc, engine) as worker:
        store(worker, 1, stored)
        model.store(kv, stored)
        worker.wait({1})
        # ... and a load of logical blocks 1..4 (group 0), 4..5 (group 1) and 2 (group 2)
        # skips the first sub-blocks of the first chunk it names.
        slots = stored[3]
        target = make_transfer([4, 2, 1], [1, 4, 2], bpc, seed=9)
        target = (target[0], [4, 2, 1], [1, 4, 2], [slots[0], slots[1], slots[3], slots[4]])
        kv.scramble(seed=10)
        before = kv.snapshot()
        load(worker, 2, target)
        worker.wait({2})
        assert kv.snapshot() == model.loaded(before, target)


@pytest.mark.parametrize("engine", ENGINES)
def test_round_trip_restores_the_original_blocks(engine: str) -> None:
    kv = KV(seed=11)
    original = kv.snapshot()
    transfer = make_transfer([5, 4, 3], [2, 0, 1], 3, seed=12)
    with make_worker(kv, 3, engine) as worker:
        store(worker, 1, transfer)
        worker.wait({1})
        kv.scramble(seed=13)
        expected = [bytearray(b) for b in kv.snapshot()]
        load(worker, 2, transfer)
        worker.wait({2})
    for t, block, nbytes, _, _ in HostModel(3).places(transfer):
        row = slice(block * ROWS[t], block * ROWS[t] + nbytes)
        expected[t][row] = original[t][row]
    assert kv.snapshot() == [bytes(b) for b in expected]


def test_uint8_tensors_work_like_int8() -> None:
    kv = KV(seed=14, dtype=torch.uint8)
    model = HostModel(1)
    transfer = make_transfer([2, 1, 1], [0, 0, 0], 1, seed=15)
    with make_worker(kv, 1, "threads") as worker:
        store(worker, 1, transfer)
        worker.wait({1})
        model.store(kv, transfer)
        host_matches(worker, model)


@pytest.mark.parametrize("kind", ["list", "numpy", "tensor", "int32-tensor"])
def test_ids_may_be_lists_numpy_arrays_or_tensors(kind: str) -> None:
    kv = KV(seed=16)
    model = HostModel(3)
    gpu, sizes, starts, slots = make_transfer([4, 2, 1], [1, 0, 2], 3, seed=17)
    convert: Callable[[list[int]], Any]
    if kind == "numpy":
        np = pytest.importorskip("numpy")
        convert = lambda ids: np.array(ids, dtype=np.int32)  # noqa: E731
    elif kind == "tensor":
        convert = lambda ids: torch.tensor(ids)  # noqa: E731
    elif kind == "int32-tensor":
        convert = lambda ids: torch.tensor(ids, dtype=torch.int32)  # noqa: E731
    else:
        convert = list
    with make_worker(kv, 3, "threads") as worker:
        worker.submit_store(1, convert(gpu), convert(sizes), convert(starts), convert(slots))
        worker.wait({1})
        model.store(kv, (gpu, sizes, starts, slots))
        host_matches(worker, model)


def test_a_transfer_of_empty_groups_moves_nothing_and_finishes() -> None:
    kv = KV(seed=18)
    with make_worker(kv, 2, "threads") as worker:
        worker.submit_store(1, [], [0, 0, 0], [3, 0, 1], [])
        (job,) = worker.get_finished()
        assert (job.job_id, job.nbytes) == (1, 0)
        assert all(worker.read_slot(s) == bytes(worker.slot_bytes) for s in range(NUM_SLOTS))


def test_finished_jobs_report_the_unpadded_bytes_they_moved() -> None:
    kv = KV(seed=19)
    transfer = make_transfer([3, 2, 1], [0, 0, 0], 1, seed=20)
    with make_worker(kv, 1, "threads") as worker:
        store(worker, 1, transfer)
        (job,) = worker.get_finished()
    assert job.job_id == 1
    assert job.nbytes == HostModel(1).nbytes(transfer) == 3 * 128 + 2 * 80 + 1 * 98
    assert job.seconds >= 0


def test_slot_layout_is_block_major_per_tensor() -> None:
    kv = KV(seed=21)
    layout = PageLayout(kv.tensors, PAGES, REFS, 3)
    assert layout.slot_bytes == 3 * sum(PAGES)
    assert layout.tensor_offset == (0, 3 * 64, 3 * (64 + 48), 3 * (64 + 48 + 40))
    assert layout.group_block_bytes == (128, 80, 98)


def test_plan_has_one_descriptor_per_block_and_ref() -> None:
    a = torch.zeros((4, 16), dtype=torch.int8)
    b = torch.zeros((4, 8), dtype=torch.int8)
    layout = PageLayout([a, b], [16, 8], [[(0, 16), (1, 6)]], 2)
    plan = layout.plan([2, 0, 3], [3], [1], [5, 6], num_slots=8, store=True)
    # Logical blocks 1, 2, 3 -> (slot 5, sub 1), (slot 6, sub 0), (slot 6, sub 1).
    assert plan.kv_block.tolist() == [2, 0, 3, 2, 0, 3]
    assert plan.host_slot.tolist() == [5, 6, 6, 5, 6, 6]
    assert plan.host_offset.tolist() == [16, 0, 16, 32 + 8, 32, 32 + 8]
    assert plan.size.tolist() == [16, 16, 16, 6, 6, 6]
    assert plan.kv_addr.tolist() == [
        a.data_ptr() + 32,
        a.data_ptr(),
        a.data_ptr() + 48,
        b.data_ptr() + 16,
        b.data_ptr(),
        b.data_ptr() + 24,
    ]
    assert plan.nbytes == 3 * 22


# --- engines -------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_NATIVE, reason="no native copy engine")
def test_auto_picks_the_native_lanes_with_torch_as_fallback() -> None:
    with make_worker(KV(seed=22), 1, "auto") as worker:
        stats = worker.stats()
        assert (stats.engine, stats.fallback) == ("cpu-native", "cpu-torch")


def test_without_native_helpers_torch_copies_are_primary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_NO_NATIVE", "1")
    _native.load_copy_engine.cache_clear()
    try:
        kv = KV(seed=23)
        model = HostModel(3)
        transfer = make_transfer([4, 2, 2], [2, 1, 0], 3, seed=24)
        with make_worker(kv, 3, "auto") as worker:
            assert (worker.stats().engine, worker.stats().fallback) == ("cpu-torch", "cpu-torch")
            store(worker, 1, transfer)
            assert [j.job_id for j in worker.get_finished()] == [1]
            model.store(kv, transfer)
            host_matches(worker, model)
        with pytest.raises(RuntimeError, match="native"):
            make_worker(kv, 3, "native")
    finally:
        _native.load_copy_engine.cache_clear()


@pytest.mark.skipif(not HAS_NATIVE, reason="no native copy engine")
def test_native_lane_wait_gives_up_after_its_timeout_on_an_unfinished_job() -> None:
    lib = _native.load_copy_engine()
    assert lib is not None
    lane = lib.ao_lane_create(-1)
    status = (ctypes.c_int64 * 3)()  # a job that was never queued: it never ends
    try:
        assert lib.ao_lane_wait(lane, ctypes.addressof(status), 1_000_000) == 0
    finally:
        lib.ao_lane_destroy(lane)


@pytest.mark.skipif(not HAS_NATIVE, reason="no native copy engine")
def test_native_lane_copies_descriptors_and_stamps_the_job() -> None:
    lib = _native.load_copy_engine()
    assert lib is not None
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    srcs = torch.tensor([src.data_ptr() + 8, src.data_ptr()])
    dsts = torch.tensor([dst.data_ptr(), dst.data_ptr() + 32])
    sizes = torch.tensor([16, 4])
    status = (ctypes.c_int64 * 3)()
    lane = lib.ao_lane_create(-1)
    try:
        rc = lib.ao_lane_submit_copies(
            lane, 2, srcs.data_ptr(), dsts.data_ptr(), sizes.data_ptr(), ctypes.addressof(status)
        )
        assert rc == 0
        assert lib.ao_lane_wait(lane, ctypes.addressof(status), -1) == 1
    finally:
        lib.ao_lane_destroy(lane)
    assert dst[:16].tolist() == list(range(8, 24))
    assert dst[32:36].tolist() == [0, 1, 2, 3]
    assert status[1] >= status[2] > 0  # end and start, CLOCK_MONOTONIC ns


# --- completion: order, wait, get_finished ----------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_jobs_of_one_direction_finish_in_submission_order(engine: str) -> None:
    kv = KV(seed=25)
    with make_worker(kv, 1, engine) as worker:
        # Every job writes slot 0: the last one's bytes must be what stays.
        for job_id in range(40):
            worker.submit_store(job_id, [job_id % NUM_BLOCKS], [1, 0, 0], [0, 0, 0], [0])
        worker.wait({39})
        assert [j.job_id for j in worker.get_finished()] == list(range(40))
        model = HostModel(1)
        model.store(kv, ([39 % NUM_BLOCKS], [1, 0, 0], [0, 0, 0], [0]))
        host_matches(worker, model)


@pytest.mark.parametrize("engine", ENGINES)
def test_get_finished_keeps_each_directions_order(engine: str) -> None:
    kv = KV(seed=26)
    with make_worker(kv, 1, engine) as worker:
        for i in range(10):
            worker.submit_store(i, [i], [1, 0, 0], [0, 0, 0], [i])
            worker.submit_load(100 + i, [i], [NUM_BLOCKS - 1 - i], [1, 0, 0], [0, 0, 0])
        worker.wait(set(range(10)) | {100 + i for i in range(10)})
        ids = [j.job_id for j in worker.get_finished()]
    assert sorted(ids) == list(range(10)) + [100 + i for i in range(10)]
    assert [i for i in ids if i < 100] == list(range(10))
    assert [i for i in ids if i >= 100] == [100 + i for i in range(10)]


@pytest.mark.parametrize("engine", ENGINES)
def test_wait_returns_once_the_bytes_have_landed(engine: str) -> None:
    kv = KV(seed=27)
    model = HostModel(3)
    transfer = make_transfer([6, 6, 6], [0, 0, 0], 3, seed=28)
    with make_worker(kv, 3, engine) as worker:
        store(worker, 9, transfer)
        worker.wait({9})
        model.store(kv, transfer)
        host_matches(worker, model)


def test_a_waited_job_is_still_reported_once_by_get_finished() -> None:
    kv = KV(seed=29)
    with make_worker(kv, 1, "threads") as worker:
        worker.submit_store(1, [0], [1, 0, 0], [0, 0, 0], [0])
        worker.wait([1])
        assert [j.job_id for j in worker.get_finished()] == [1]
        assert worker.get_finished() == []


def test_wait_ignores_ids_not_in_flight() -> None:
    kv = KV(seed=30)
    with make_worker(kv, 1, "threads") as worker:
        worker.submit_store(1, [0], [1, 0, 0], [0, 0, 0], [0])
        worker.get_finished()
        worker.wait({1, 12345})  # reported already, never submitted


def test_a_job_id_may_be_reused_once_reported() -> None:
    kv = KV(seed=31)
    with make_worker(kv, 1, "threads") as worker:
        worker.submit_store(1, [0], [1, 0, 0], [0, 0, 0], [0])
        assert [j.job_id for j in worker.get_finished()] == [1]
        worker.submit_load(1, [0], [1], [1, 0, 0], [0, 0, 0])
        assert [j.job_id for j in worker.get_finished()] == [1]


def test_a_job_id_in_flight_is_refused() -> None:
    kv = KV(seed=32)
    with make_worker(kv, 1, "threads") as worker:
        worker.submit_store(1, [0], [1, 0, 0], [0, 0, 0], [0])
        with pytest.raises(ValueError, match="job id 1 is already in flight"):
            worker.submit_load(1, [0], [1], [1, 0, 0], [0, 0, 0])
        assert worker.stats().load.in_flight == 0


# --- bad input ------------------------------------------------------------------------------

# (description, direction, gpu_ids, group_sizes, block_indices, slot_ids, error, match)
BAD_CALLS: list[tuple[str, str, Any, Any, Any, Any, type[Exception], str]] = [
    ("groups", "store", [0], [1, 0], [0, 0], [0], ValueError, "group_sizes has 2 entries"),
    ("indices", "store", [0], [1, 0, 0], [0, 0], [0], ValueError, "block_indices has 2"),
    ("sum", "store", [0, 1], [1, 0, 0], [0, 0, 0], [0], ValueError, "gpu_ids has 2 entries"),
    ("slots", "store", [0, 1], [2, 0, 0], [1, 0, 0], [0], ValueError, "slot_ids has 1 entries"),
    ("gpu-range", "store", [0, 24], [2, 0, 0], [0, 0, 0], [0, 1], IndexError, r"gpu_ids\[1\] = 24"),
    ("gpu-neg", "load", [-1], [1, 0, 0], [0, 0, 0], [0], IndexError, r"gpu_ids\[0\] = -1"),
    ("slot-range", "load", [0], [1, 0, 0], [0, 0, 0], [16], IndexError, r"slot_ids\[0\] = 16"),
    ("neg-size", "store", [0], [2, -1, 0], [0, 0, 0], [0], ValueError, "group_sizes"),
    ("neg-index", "store", [0], [1, 0, 0], [0, -3, 0], [0], ValueError, "block_indices"),
    ("float", "store", [0.5], [1, 0, 0], [0, 0, 0], [0], TypeError, "gpu_ids must hold integers"),
    ("2d", "store", [[0]], [1, 0, 0], [0, 0, 0], [0], TypeError, "gpu_ids must be 1-D"),
    ("str", "store", [0], "100", [0, 0, 0], [0], TypeError, "group_sizes"),
    ("dup-slot", "store", [0, 1], [1, 1, 0], [0, 0, 0], [3, 3], ValueError, "repeat a slot"),
    ("dup-gpu", "load", [4, 4], [1, 0, 1], [0, 0, 0], [0, 1], ValueError, "repeat a block"),
    ("dup-gpu-1", "load", [5, 5], [2, 0, 0], [0, 0, 0], [0, 1], ValueError, "repeat a block"),
]


@pytest.mark.parametrize(
    ("direction", "gpu", "sizes", "starts", "slots", "error", "match"),
    [c[1:] for c in BAD_CALLS],
    ids=[c[0] for c in BAD_CALLS],
)
def test_bad_ids_raise_naming_the_argument_and_queue_nothing(
    direction: str,
    gpu: Any,
    sizes: Any,
    starts: Any,
    slots: Any,
    error: type[Exception],
    match: str,
) -> None:
    kv = KV(seed=33)
    before = kv.snapshot()
    with make_worker(kv, 1, "threads") as worker:
        with pytest.raises(error, match=match):
            if direction == "store":
                worker.submit_store(1, gpu, sizes, starts, slots)
            else:
                worker.submit_load(1, slots, gpu, sizes, starts)
        assert worker.get_finished() == []
        assert worker.stats().store == worker.stats().load == (0, 0, 0, 0, 0)
        assert all(worker.read_slot(s) == bytes(worker.slot_bytes) for s in range(NUM_SLOTS))
    assert kv.snapshot() == before


def test_a_load_may_read_one_slot_twice_and_a_store_write_a_block_twice() -> None:
    kv = KV(seed=34)
    with make_worker(kv, 1, "threads") as worker:
        worker.submit_store(1, [3, 3], [1, 1, 0], [0, 0, 0], [0, 1])
        worker.submit_load(2, [0, 0], [5, 6], [1, 0, 1], [0, 0, 0])
        assert [j.job_id for j in worker.get_finished()] == [1, 2]


# (what, tensors, page_bytes, group_refs, blocks_per_chunk, error, match)
_T = torch.zeros((4, 16), dtype=torch.int8)
BAD_LAYOUTS: list[tuple[str, Any, Any, Any, Any, type[Exception], str]] = [
    ("tensor", _T, [16], [[(0, 16)]], 1, TypeError, "list of"),
    ("empty", [], [], [[(0, 16)]], 1, ValueError, "tensors is empty"),
    ("3d", [torch.zeros((4, 4, 4), dtype=torch.int8)], [16], [[(0, 16)]], 1, ValueError, "shape"),
    ("float", [_T.float()], [16], [[(0, 16)]], 1, TypeError, "byte view"),
    ("cols", [_T.t()], [4], [[(0, 4)]], 1, ValueError, "not contiguous"),
    ("pages", [_T], [16, 8], [[(0, 16)]], 1, ValueError, "page_bytes has 2 entries"),
    ("page", [_T], [17], [[(0, 16)]], 1, ValueError, r"page_bytes\[0\] = 17"),
    ("ref-idx", [_T], [16], [[(1, 16)]], 1, IndexError, r"group_refs\[0\]\[0\] names tensor 1"),
    ("ref-size", [_T], [16], [[(0, 20)]], 1, ValueError, "moves 20 bytes"),
    ("ref-pair", [_T], [16], [[0]], 1, TypeError, r"group_refs\[0\]\[0\]"),
    ("groups", [_T], [16], [], 1, ValueError, "group_refs is empty"),
    ("bpc", [_T], [16], [[(0, 16)]], 0, ValueError, "blocks_per_chunk must be >= 1"),
    ("bpc-type", [_T], [16], [[(0, 16)]], 2.0, TypeError, "blocks_per_chunk must be an int"),
]


@pytest.mark.parametrize(
    ("tensors", "pages", "refs", "bpc", "error", "match"),
    [c[1:] for c in BAD_LAYOUTS],
    ids=[c[0] for c in BAD_LAYOUTS],
)
def test_bad_layouts_raise_saying_what_is_wrong(
    tensors: Any, pages: Any, refs: Any, bpc: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        PagedTransferWorker(tensors, pages, refs, bpc, 4)


def test_num_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        PagedTransferWorker([_T], [16], [[(0, 16)]], 1, 0)


# --- failures and retries -------------------------------------------------------------------


def _raise(message: str) -> Callable[..., CopyJob]:
    def fail(direction: int, plan: CopyPlan) -> CopyJob:
        raise RuntimeError(message)

    return fail


def _ends_in_error(message: str) -> Callable[..., CopyJob]:
    def submit(direction: int, plan: CopyPlan) -> CopyJob:
        return FailedJob(plan.num_copies, RuntimeError(message))

    return submit


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_submission_that_fails_is_run_on_the_fallback_path(
    engine: str, direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = KV(seed=35)
    model = HostModel(3)
    transfer = make_transfer([4, 2, 3], [1, 2, 0], 3, seed=36)
    with make_worker(kv, 3, engine) as worker:
        if direction == "store":
            monkeypatch.setattr(worker.engine, "submit_primary", _raise("injected"))
        store(worker, 1, transfer)
        model.store(kv, transfer)
        worker.wait({1})
        kv.scramble(seed=37)
        before = kv.snapshot()
        if direction == "load":
            monkeypatch.setattr(worker.engine, "submit_primary", _raise("injected"))
        load(worker, 2, transfer)
        worker.wait({2})
        assert [j.job_id for j in worker.get_finished()] == [1, 2]
        host_matches(worker, model)
        assert kv.snapshot() == model.loaded(before, transfer)
        stats = getattr(worker.stats(), direction)
        assert (stats.jobs, stats.retries, stats.failures) == (1, 1, 0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_copy_that_ends_in_error_is_retried_on_the_fallback_path(
    engine: str, direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = KV(seed=38)
    model = HostModel(1)
    transfer = make_transfer([3, 3, 2], [0, 0, 0], 1, seed=39)
    with make_worker(kv, 1, engine) as worker:
        if direction == "store":
            monkeypatch.setattr(worker.engine, "submit_primary", _ends_in_error("dma broke"))
        store(worker, 1, transfer)
        model.store(kv, transfer)
        worker.wait({1})  # wait() retries too
        assert [j.job_id for j in worker.get_finished()] == [1]
        kv.scramble(seed=40)
        before = kv.snapshot()
        if direction == "load":
            monkeypatch.setattr(worker.engine, "submit_primary", _ends_in_error("dma broke"))
        load(worker, 2, transfer)
        worker.wait({2})
        assert [j.job_id for j in worker.get_finished()] == [2]
        host_matches(worker, model)
        assert kv.snapshot() == model.loaded(before, transfer)
        assert getattr(worker.stats(), direction).retries == 1


@pytest.mark.skipif(not HAS_NATIVE, reason="no native copy engine")
def test_a_job_the_native_lane_refuses_is_retried_with_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = KV(seed=41)
    model = HostModel(3)
    transfer = make_transfer([4, 1, 2], [1, 0, 2], 3, seed=42)
    with make_worker(kv, 3, "native") as worker:
        # Null host addresses: the lane checks every descriptor first and copies nothing.
        monkeypatch.setattr(
            worker.engine, "host_addresses", lambda plan: torch.zeros_like(plan.host_slot)
        )
        store(worker, 1, transfer)
        worker.wait({1})
        model.store(kv, transfer)
        host_matches(worker, model)
        assert worker.stats().store.retries == 1


def test_both_paths_failing_at_submission_raises_naming_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = KV(seed=43)
    with make_worker(kv, 1, "threads") as worker:
        monkeypatch.setattr(worker.engine, "submit_primary", _raise("primary broke"))
        monkeypatch.setattr(worker.engine, "submit_fallback", _raise("fallback broke"))
        with pytest.raises(PagedTransferError) as info:
            worker.submit_store(5, [7, 8], [2, 0, 0], [0, 0, 0], [3, 4])
        err = info.value
        assert isinstance(err, TransferError)
        assert (err.job_id, err.direction, err.gpu_ids, err.slot_ids) == (
            5,
            "store",
            [7, 8],
            [3, 4],
        )
        message = str(err)
        for part in ("store job 5", "[7, 8]", "[3, 4]", "primary broke", "fallback broke"):
            assert part in message
        assert worker.stats().store == (0, 0, 1, 1, 0)
        assert worker.get_finished() == []


def test_both_paths_failing_at_completion_raises_from_get_finished_and_keeps_other_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = KV(seed=44)
    with make_worker(kv, 1, "threads") as worker:
        worker.submit_store(1, [0], [1, 0, 0], [0, 0, 0], [0])
        monkeypatch.setattr(worker.engine, "submit_primary", _ends_in_error("dma broke"))
        monkeypatch.setattr(worker.engine, "submit_fallback", _raise("fallback broke"))
        worker.submit_load(2, [0], [9], [1, 0, 0], [0, 0, 0])
        with pytest.raises(PagedTransferError, match=r"load job 2.*dma broke.*fallback broke"):
            worker.get_finished()
        assert [j.job_id for j in worker.get_finished()] == [1]
        assert worker.get_finished() == []
        assert worker.stats().load == (0, 0, 1, 1, 0)


def test_both_paths_failing_raises_from_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = KV(seed=45)
    with make_worker(kv, 1, "threads") as worker:
        monkeypatch.setattr(worker.engine, "submit_primary", _ends_in_error("dma broke"))
        monkeypatch.setattr(worker.engine, "submit_fallback", _ends_in_error("again"))
        worker.submit_store(3, [0], [1, 0, 0], [0, 0, 0], [0])
        with pytest.raises(PagedTransferError, match="store job 3"):
            worker.wait({3})
        assert worker.get_finished() == []


# --- shutdown -------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_shutdown_finishes_queued_copies(engine: str) -> None:
    kv = KV(seed=46)
    worker = make_worker(kv, 1, engine)
    for job_id in range(20):
        worker.submit_store(job_id, [job_id], [1, 0, 0], [0, 0, 0], [job_id % NUM_SLOTS])
    worker.shutdown()
    stats = worker.stats()
    assert (stats.store.jobs, stats.store.in_flight) == (20, 0)


def test_shutdown_twice_is_harmless() -> None:
    worker = make_worker(KV(seed=47), 1, "threads")
    worker.shutdown()
    worker.shutdown()
    assert "shut down" in repr(worker)


CALLS_AFTER_SHUTDOWN: dict[str, Callable[[PagedTransferWorker], object]] = {
    "submit_store": lambda w: w.submit_store(1, [0], [1, 0, 0], [0, 0, 0], [0]),
    "submit_load": lambda w: w.submit_load(1, [0], [0], [1, 0, 0], [0, 0, 0]),
    "get_finished": lambda w: w.get_finished(),
    "wait": lambda w: w.wait({1}),
    "read_slot": lambda w: w.read_slot(0),
}


@pytest.mark.parametrize("call", CALLS_AFTER_SHUTDOWN)
def test_calls_after_shutdown_raise_runtime_error(call: str) -> None:
    worker = make_worker(KV(seed=48), 1, "threads")
    worker.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        CALLS_AFTER_SHUTDOWN[call](worker)


def test_shutdown_raises_for_a_job_that_failed_on_both_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = make_worker(KV(seed=49), 1, "threads")
    monkeypatch.setattr(worker.engine, "submit_primary", _ends_in_error("dma broke"))
    monkeypatch.setattr(worker.engine, "submit_fallback", _ends_in_error("again"))
    worker.submit_store(4, [0], [1, 0, 0], [0, 0, 0], [0])
    with pytest.raises(PagedTransferError, match="store job 4"):
        worker.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.get_finished()


def test_repr_summarises_jobs_in_flight() -> None:
    with make_worker(KV(seed=50), 1, "threads") as worker:
        worker.submit_store(1, [0], [1, 0, 0], [0, 0, 0], [0])
        assert repr(worker) == (
            "<PagedTransferWorker cpu-torch [store: 1 in flight | load: 0 in flight | "
            f"expedited: 0 in flight] 16 slots of {sum(PAGES)} B>"
        )
