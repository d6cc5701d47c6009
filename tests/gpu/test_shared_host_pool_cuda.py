"""The vLLM disk tier's CUDA path: PagedTransferWorker with its host pool in a shared
file (``host_file=``), each chunk of it pinned with cudaHostRegister; the scheduler side
(:class:`~asyncoffload.integrations.vllm.tiers.SchedulerTiers`) maps the same file and
moves slots to and from a disk tier. No vLLM needed: the worker and the scheduler side
are driven by hand, as vLLM's connector drives them (tests/vllm/test_tiers_vllm.py does
the same on CPU tensors with vLLM's own classes)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import asyncoffload as ao
from asyncoffload.integrations.vllm.tiers import SchedulerTiers, host_pool_path
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.format import Namespace
from asyncoffload.transfer.paged_engines import SharedHostFile
from asyncoffload.transfer.paged_worker import PagedTransferWorker
from tests.gpu.conftest import GPU

pytestmark = GPU


@pytest.fixture
def shm() -> Iterator[Path]:
    """A folder in /dev/shm: the kernel pins shared memory (tmpfs) for CUDA, but refuses
    long-term pins of writable mappings of files on other file systems."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="ao-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


PAGE = 4096
TENSORS = 4  # two layers, K and V apart
SLOT = TENSORS * PAGE
NUM_BLOCKS = 16
NUM_SLOTS = 8


def _worker(
    path: Path, device: str = "cuda", **kw: object
) -> tuple[PagedTransferWorker, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen).to(device)
        for _ in range(TENSORS)
    ]
    refs = [[(t, PAGE) for t in range(TENSORS)]]
    worker = PagedTransferWorker(
        kv,
        [PAGE] * TENSORS,
        refs,
        1,
        NUM_SLOTS,
        host_file=path,
        **kw,  # type: ignore[arg-type]
    )
    return worker, kv


def _block(kv: list[torch.Tensor], b: int) -> list[bytes]:
    return [t[b].cpu().numpy().tobytes() for t in kv]


def _copy(
    worker: PagedTransferWorker, job: int, store: bool, gpu: list[int], slots: list[int]
) -> None:
    if store:
        worker.submit_store(job, gpu, [len(gpu)], [0], slots)
    else:
        worker.submit_load(job, slots, gpu, [len(gpu)], [0])
    worker.wait({job})
    assert [f.job_id for f in worker.get_finished()] == [job]


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 3 * SLOT])
def test_the_shared_pool_is_pinned_and_seen_by_the_other_side(shm: Path, chunk_bytes: int) -> None:
    path = shm / "pool"
    worker, kv = _worker(path, chunk_bytes=chunk_bytes)
    pool = worker.engine.pool  # type: ignore[attr-defined]
    assert pool.pinned and len(pool.chunks) == -(-NUM_SLOTS // max(1, chunk_bytes // SLOT))
    assert (path.stat().st_mode & 0o777) == 0o600
    _copy(worker, 1, True, [2, 5, 7], [0, 4, 7])
    other = SharedHostFile.open(path, NUM_SLOTS, SLOT)
    view = other.tensor()
    assert view.data_ptr() % 4096 == 0
    for slot, b in zip([0, 4, 7], [2, 5, 7]):
        assert view[slot].numpy().tobytes() == b"".join(_block(kv, b))
    # Bytes the other side writes into a slot reach the GPU through the worker.
    view[3].copy_(view[4])
    _copy(worker, 2, False, [11], [3])
    assert _block(kv, 11) == _block(kv, 5)
    del view
    other.close()
    worker.shutdown()  # unregisters every chunk, then unlinks
    assert not path.exists()


def _tier(tmp_path: Path) -> object:
    ns = Namespace(model="gpu-test", kv_dtype="int8", layout="t4", block_bytes=SLOT)
    return DiskTier(tmp_path / "disk", "4MiB", "slab", admission=None).open(ns, "disk0")


def _settle(tiers: SchedulerTiers, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    tiers.flush()
    while tiers.pending():
        assert time.monotonic() < deadline
        tiers.poll()
        tiers.flush()
        time.sleep(0.001)


@pytest.mark.parametrize("device", ["cuda"])
def test_blocks_go_to_disk_and_come_back_to_the_gpu_byte_exact(
    tmp_path: Path, shm: Path, device: str
) -> None:
    path = host_pool_path(shm, "engine-gpu", 0)
    worker, kv = _worker(path, device)
    cpu = CPUOffloadingManager(NUM_SLOTS, "lru")
    store = _tier(tmp_path)
    tiers = SchedulerTiers(cpu, [store], path, NUM_SLOTS, SLOT)  # type: ignore[list-item]
    keys = [ao.make_offload_key(bytes([i]) * 32) for i in range(4)]
    expected = [_block(kv, b) for b in range(4)]
    out = cpu.prepare_store(keys)
    assert out is not None
    _copy(worker, 1, True, [0, 1, 2, 3], list(out.store_spec.block_ids))
    cpu.complete_store(keys)
    tiers.write_through(keys)
    _settle(tiers)
    assert tiers.pool_mapped and not path.exists()
    if device == "cuda":
        assert worker.engine.pool.pinned  # type: ignore[attr-defined]
    (stats,) = tiers.stats()
    assert stats.blocks_written == 4 and stats.failures == {}
    assert tiers.drain()
    cpu.reset_cache(force=True)  # the CPU tier forgets them; the disk keeps them
    for key in keys:
        assert tiers.promote(key)
    _settle(tiers)
    assert cpu.lookup_prefix(keys) == 4
    spec = cpu.prepare_load(keys)
    _copy(worker, 2, False, [10, 11, 12, 13], list(spec.block_ids))
    cpu.complete_load(keys)
    assert [_block(kv, b) for b in (10, 11, 12, 13)] == expected
    # A read that fails never reaches the GPU: a miss, dropped from the tier.
    tiers.drain()
    cpu.reset_cache(force=True)
    store.pool.set_fault(False, 1, errno.EIO)  # type: ignore[attr-defined]
    before = _block(kv, 14)
    assert tiers.promote(keys[0])
    _settle(tiers)
    assert cpu.block_of(keys[0]) is None
    assert not tiers.promote(keys[0])  # never offered again
    (stats,) = tiers.stats()
    assert stats.failures == {"EIO": 1} and stats.dropped == 1
    assert _block(kv, 14) == before
    tiers.close()
    worker.shutdown()
    assert os.listdir(shm) == []
    assert os.listdir(tmp_path / "disk") == []  # the slab was unlinked at open


# --- tensor parallelism: two ranks' slices, one value per block ----------------------


def _rank_worker(path: Path, seed: int) -> tuple[PagedTransferWorker, list[torch.Tensor]]:
    """A rank's worker: its own KV bytes (``seed``), its own pool file."""
    gen = torch.Generator().manual_seed(seed)
    kv = [
        torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen).cuda()
        for _ in range(TENSORS)
    ]
    refs = [[(t, PAGE) for t in range(TENSORS)]]
    worker = PagedTransferWorker(kv, [PAGE] * TENSORS, refs, 1, NUM_SLOTS, host_file=path)
    return worker, kv


def test_tp2_slices_go_to_disk_as_one_value_and_come_back_to_each_rank(
    tmp_path: Path, shm: Path
) -> None:
    paths = [host_pool_path(shm, "engine-tp", r) for r in range(2)]
    ranks = [_rank_worker(p, seed=r + 3) for r, p in enumerate(paths)]
    cpu = CPUOffloadingManager(NUM_SLOTS, "lru")
    ns = Namespace(
        model="gpu-test",
        kv_dtype="int8",
        layout="t4,rank_slices=2",
        block_bytes=2 * SLOT,
        world_size=2,
    )
    store = DiskTier(tmp_path / "disk", "4MiB", "files", admission=None).open(ns, "disk0")
    tiers = SchedulerTiers(cpu, [store], paths, NUM_SLOTS, SLOT)
    keys = [ao.make_offload_key(bytes([i]) * 32) for i in range(4)]
    expected = [[_block(kv, b) for b in range(4)] for _, kv in ranks]
    assert expected[0] != expected[1]
    out = cpu.prepare_store(keys)
    assert out is not None
    for worker, _ in ranks:
        _copy(worker, 1, True, [0, 1, 2, 3], list(out.store_spec.block_ids))
    cpu.complete_store(keys)
    tiers.write_through(keys)
    _settle(tiers)
    (stats,) = tiers.stats()
    assert stats.blocks_written == 4 and stats.bytes_written == 4 * 2 * SLOT
    assert all(w.engine.pool.pinned for w, _ in ranks)  # type: ignore[attr-defined]
    assert tiers.drain()
    cpu.reset_cache(force=True)
    for key in keys:
        assert tiers.promote(key)
    _settle(tiers)
    spec = cpu.prepare_load(keys)
    for worker, _ in ranks:
        _copy(worker, 2, False, [10, 11, 12, 13], list(spec.block_ids))
    cpu.complete_load(keys)
    for r, (_, kv) in enumerate(ranks):
        assert [_block(kv, b) for b in (10, 11, 12, 13)] == expected[r], f"rank {r}"
    # Rank 1's slice of one block damaged: a miss for both ranks, no GPU byte changes.
    tiers.drain()
    cpu.reset_cache(force=True)
    victim = store.path_of(keys[0])
    data = bytearray(victim.read_bytes())
    data[4096 + SLOT + 7] ^= 1
    victim.write_bytes(bytes(data))
    assert tiers.promote(keys[0])
    _settle(tiers)
    assert cpu.block_of(keys[0]) is None and not tiers.promote(keys[0])
    (stats,) = tiers.stats()
    assert stats.failures == {"corrupt": 1}
    tiers.close()
    for worker, _ in ranks:
        worker.shutdown()
    assert os.listdir(shm) == []


def test_a_replica_maps_rank_0s_pinned_pool_and_loads_its_copy(shm: Path) -> None:
    """A layout replicated across ranks (MLA) is held once: rank 0's worker makes the pool,
    another rank's maps and pins the same file and loads what rank 0 stored."""
    path = shm / "replicated.pool"
    worker0, kv0 = _rank_worker(path, seed=5)
    gen = torch.Generator().manual_seed(6)
    kv1 = [
        torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen).cuda()
        for _ in range(TENSORS)
    ]
    refs = [[(t, PAGE) for t in range(TENSORS)]]
    worker1 = PagedTransferWorker(
        kv1, [PAGE] * TENSORS, refs, 1, NUM_SLOTS, host_file=path, host_file_owner=False
    )
    assert worker1.engine.pool.pinned  # type: ignore[attr-defined]
    _copy(worker0, 1, True, [1, 2, 3], [5, 6, 7])  # rank 0 alone stores
    _copy(worker1, 2, False, [8, 9, 10], [5, 6, 7])
    assert [_block(kv1, b) for b in (8, 9, 10)] == [_block(kv0, b) for b in (1, 2, 3)]
    worker1.shutdown()
    assert path.exists()  # the replica leaves rank 0's pool be
    worker0.shutdown()
    assert not path.exists()
