"""The paged worker's vLLM 0.34 surface, without vLLM: device pointers as the KV side of a
transfer, the expedited load lane, jobs as ``IOCompletion``\\ s, and a failed load retried
one host slot at a time (the blocks of the slots that copy are kept)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import asyncoffload as ao
from asyncoffload.transfer.jobs import CopyJob
from asyncoffload.transfer.paged import CopyPlan
from asyncoffload.transfer.paged_engines import EXPEDITED, LOAD
from asyncoffload.transfer.paged_worker import JobCompletion, PagedTransferError
from tests.test_paged_worker import (
    ENGINES,
    KV,
    REFS,
    HostModel,
    Transfer,
    load,
    make_transfer,
    make_worker,
    store,
)


def pointers(kv: KV, transfer: Transfer) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """vLLM 0.34's DevicePointers of ``transfer``'s KV side, built as vLLM's
    ``resolve_device_pointers`` does: per group, per ref, per block, the row's address."""
    gpu, sizes, _, _ = transfer
    ptrs: list[int] = []
    nbytes: list[int] = []
    lo = 0
    for g, n in enumerate(sizes):
        if n:
            for t, size in REFS[g]:
                tensor = kv.tensors[t]
                for block in gpu[lo : lo + n]:
                    ptrs.append(tensor.data_ptr() + block * tensor.stride(0))
                    nbytes.append(size)
        lo += n
    return (
        np.array(ptrs, dtype=np.uint64),
        np.array(nbytes, dtype=np.uint64),
        list(sizes),
        [len(REFS[g]) for g in range(len(sizes))],
    )


def test_device_pointers_name_the_same_blocks_as_their_ids() -> None:
    kv = KV(seed=1)
    transfer = make_transfer([4, 2, 3], [1, 2, 0], 3, seed=2)
    with make_worker(kv, 3) as worker:
        ptrs, sizes, counts, refs = pointers(kv, transfer)
        ids = worker.layout.ids_from_pointers(ptrs, sizes, counts, refs)
        assert ids.tolist() == transfer[0]


def test_a_store_given_by_pointers_lands_byte_exact() -> None:
    kv = KV(seed=3)
    model = HostModel(3)
    transfer = make_transfer([4, 2, 3], [1, 2, 0], 3, seed=4)
    with make_worker(kv, 3) as worker:
        ptrs, sizes, counts, refs = pointers(kv, transfer)
        ids = worker.layout.ids_from_pointers(ptrs, sizes, counts, refs)
        worker.submit_store(7, ids, counts, transfer[2], transfer[3])
        model.store(kv, transfer)
        worker.wait({7})
        for slot in range(len(model.slots)):
            assert worker.read_slot(slot) == bytes(model.slots[slot])


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        ("outside", IndexError, r"group 0, ref 0 \(tensor 0\): 0x[0-9a-f]+ at block 1 is not "),
        ("inside", IndexError, r"not the start of a row"),
        ("other_ref", ValueError, r"group 0, ref 1 \(tensor 3\): .* at block 2 is not the row"),
        ("size", ValueError, r"group 0, ref 0 \(tensor 0\): size 9 at block 0"),
    ],
)
def test_pointers_outside_the_kv_rows_are_refused_naming_where(
    damage: str, error: type[Exception], match: str
) -> None:
    kv = KV(seed=5)
    transfer = make_transfer([4, 2, 3], [1, 2, 0], 3, seed=6)
    with make_worker(kv, 3) as worker:
        ptrs, sizes, counts, refs = pointers(kv, transfer)
        if damage == "outside":
            ptrs[1] = np.uint64(16)  # not in any KV tensor
        elif damage == "inside":
            ptrs[1] += np.uint64(8)  # inside a row, not its start
        elif damage == "other_ref":
            ptrs[4 + 2] += np.uint64(kv.tensors[3].stride(0))  # ref 1 names another row
        else:
            sizes[0] = np.uint64(9)
        with pytest.raises(error, match=match):
            worker.layout.ids_from_pointers(ptrs, sizes, counts, refs)


def test_pointers_of_another_shape_are_refused() -> None:
    kv = KV(seed=7)
    transfer = make_transfer([4, 2, 3], [1, 2, 0], 3, seed=8)
    with make_worker(kv, 3) as worker:
        ptrs, sizes, counts, refs = pointers(kv, transfer)
        layout = worker.layout
        with pytest.raises(ValueError, match="describe 2 groups"):
            layout.ids_from_pointers(ptrs, sizes, counts[:2], refs[:2])
        with pytest.raises(ValueError, match=r"group_data_ref_counts\[1\] = 3"):
            layout.ids_from_pointers(ptrs, sizes, counts, [2, 3, 2])
        with pytest.raises(ValueError, match="hold 17 pointers"):
            layout.ids_from_pointers(ptrs[:-1], sizes, counts, refs)
        with pytest.raises(TypeError, match="ptrs must hold unsigned 64-bit ints, got float64"):
            layout.ids_from_pointers(ptrs.astype(np.float64), sizes, counts, refs)


def test_expedited_loads_have_a_lane_of_their_own() -> None:
    kv = KV(seed=9)
    with make_worker(kv, 1) as worker:
        lanes = worker.engine._lanes  # type: ignore[attr-defined]
        assert lanes is not None
        assert lanes.handle(EXPEDITED) not in (lanes.handle(LOAD), lanes.handle(0))


@pytest.mark.parametrize("engine", ENGINES)
def test_an_expedited_load_is_not_queued_behind_a_stuck_load(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load lane that never finishes (its copy stuck) holds back no expedited load: it
    lands, is reported, and its completion says done while the other load waits."""
    kv = KV(seed=10)
    model = HostModel(1)
    stuck_transfer = make_transfer([1, 0, 0], [0, 0, 0], 1, seed=11, gpu_pool=[0, 1])
    transfer = make_transfer([2, 0, 0], [0, 0, 0], 1, seed=12, gpu_pool=[5, 6, 7, 8])
    with make_worker(kv, 1, engine) as worker:
        store(worker, 1, transfer)
        model.store(kv, transfer)
        worker.wait({1})
        assert [j.job_id for j in worker.get_finished()] == [1]
        real = worker.engine.submit_primary
        stuck = CopyJob(1, 1)  # a job that never ends

        def submit(direction: int, plan: CopyPlan) -> CopyJob:
            return stuck if direction == LOAD else real(direction, plan)

        monkeypatch.setattr(worker.engine, "submit_primary", submit)
        load(worker, 2, stuck_transfer)
        kv.scramble(seed=13)
        before = kv.snapshot()
        gpu, sizes, starts, slots = transfer
        worker.submit_load(3, slots, gpu, sizes, starts, expedited=True)
        done = worker.completion(3)
        assert done.result(timeout=30).job_id == 3
        assert done.done() and not worker.completion(2).done()
        assert [j.job_id for j in worker.get_finished()] == [3]
        assert kv.snapshot() == model.loaded(before, transfer)
        assert worker.stats().expedited.jobs == 1
        stuck.finish()  # let the stuck job end before the worker shuts down


def test_a_job_is_an_io_completion() -> None:
    kv = KV(seed=14)
    transfer = make_transfer([2, 1, 0], [0, 0, 0], 1, seed=15)
    with make_worker(kv, 1) as worker:
        store(worker, 4, transfer)
        completion = worker.completion(4)
        assert isinstance(completion, JobCompletion)
        finished = completion.result(timeout=30)
        assert completion.done()
        # Two blocks of group 0 and one of group 1, each moving its refs' bytes.
        expected = 2 * sum(n for _, n in REFS[0]) + sum(n for _, n in REFS[1])
        assert (finished.job_id, finished.nbytes) == (4, expected)
        assert "job 4 store done" in repr(completion)
        # Still reported once by get_finished.
        assert [j.job_id for j in worker.get_finished()] == [4]
        with pytest.raises(KeyError, match="job 4 is not in flight"):
            worker.completion(4)


def test_a_completion_waits_no_longer_than_told(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = KV(seed=16)
    transfer = make_transfer([1, 0, 0], [0, 0, 0], 1, seed=17)
    with make_worker(kv, 1) as worker:
        stuck = CopyJob(1, 1)
        monkeypatch.setattr(worker.engine, "submit_primary", lambda direction, plan: stuck)
        monkeypatch.setattr(worker.engine, "wait", _bounded_wait(stuck))
        store(worker, 5, transfer)
        completion = worker.completion(5)
        with pytest.raises(TimeoutError):
            completion.result(timeout=0.05)
        assert not completion.done()
        stuck.finish()
        assert completion.result(timeout=30).job_id == 5


def _bounded_wait(job: CopyJob):  # type: ignore[no-untyped-def]
    def wait(j: CopyJob, timeout: float | None = None) -> None:
        if not j.query():
            raise TimeoutError(f"{j!r} did not end within {timeout} s")

    return wait


@pytest.mark.parametrize("engine", ENGINES)
def test_a_load_failing_on_one_slot_keeps_the_blocks_of_the_others(engine: str) -> None:
    """A damaged host slot fails every copy touching it, on both paths: the load is retried
    slot by slot, the other slots' blocks land, and the error names only the blocks of
    the damaged slot."""
    kv = KV(seed=18)
    model = HostModel(2)
    transfer = make_transfer([5, 0, 0], [0, 0, 0], 2, seed=19)  # 3 slots: 2 + 2 + 1 blocks
    gpu, slots = transfer[0], transfer[3]
    with make_worker(kv, 2, engine) as worker:
        store(worker, 1, transfer)
        model.store(kv, transfer)
        worker.wait({1})
        worker.get_finished()
        kv.scramble(seed=20)
        before = kv.snapshot()
        worker.inject_faults(ao.FaultPlan(ao.Fault.slot_error([slots[1]], direction="load")))
        load(worker, 2, transfer)
        with pytest.raises(PagedTransferError, match="3 blocks landed, 2 did not") as caught:
            worker.wait({2})
        assert caught.value.failed_gpu_ids == gpu[2:4]
        # Slots 0 and 2 landed (blocks 0, 1 and 4); slot 1's blocks kept their bytes.
        landed = (gpu[:2] + gpu[4:], [3, 0, 0], [0, 0, 0], [slots[0], slots[2]])
        assert kv.snapshot() == model.loaded(before, landed)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_load_failing_everywhere_names_every_block(engine: str) -> None:
    kv = KV(seed=21)
    transfer = make_transfer([3, 0, 0], [0, 0, 0], 1, seed=22)
    with make_worker(kv, 1, engine) as worker:
        store(worker, 1, transfer)
        worker.wait({1})
        worker.inject_faults(ao.FaultPlan(ao.Fault.slot_error(transfer[3], direction="load")))
        load(worker, 2, transfer)
        with pytest.raises(PagedTransferError) as caught:
            worker.wait({2})
        assert caught.value.failed_gpu_ids == transfer[0]
        assert "landed" not in str(caught.value)


def test_slot_errors_apply_to_the_paged_worker_only() -> None:
    with pytest.raises(ValueError, match="slots: some for a slot_error"):
        ao.Fault("slot_error", rate=1.0)
    with pytest.raises(ValueError, match="host slot ids"):
        ao.Fault.slot_error([-1])
    kv = [torch.zeros(2, 4, 8, 2, 8)]
    backend = ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), 2)
    try:
        with pytest.raises(ValueError, match="PagedTransferWorker only"):
            backend.inject_faults(ao.FaultPlan(ao.Fault.slot_error([0])))
    finally:
        backend.close()
