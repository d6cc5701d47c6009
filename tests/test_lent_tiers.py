"""Our tiers under a framework that owns the host memory (``asyncoffload.tiers.lent``):
stores from lent slots and loads into them, byte-exact, through a disk tier (files and
slab) and a real Valkey server; damaged blocks are misses and removed events; jobs end
and release their slots; several threads at once; bad input changes nothing."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from asyncoffload.keys import OffloadKey
from asyncoffload.tiers import _io
from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.format import HEADER_BYTES, Namespace
from asyncoffload.tiers.lent import LentJob, LentTiers
from asyncoffload.tiers.ports import open_tiers
from asyncoffload.tiers.remote import RemoteTier
from tests.servers import Server, make_valkey, valkey_server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(not _io.available(), reason="native I/O lanes not built")

BLOCK = 4096
SLOTS = 32
NAMESPACE = Namespace("lent-model", "uint8", "test", BLOCK)
#: Seconds any job of these tests may take (a busy machine included).
WAIT_S = 30.0


class Host:
    """Framework-owned host memory: ``SLOTS`` slots of ``BLOCK`` bytes."""

    def __init__(self) -> None:
        self.buf = np.zeros((SLOTS, BLOCK), dtype=np.uint8)

    def address(self, slot: int) -> int:
        if not 0 <= slot < SLOTS:
            raise IndexError(slot)
        return int(self.buf.ctypes.data) + slot * BLOCK

    def fill(self, slot: int, seed: int) -> bytes:
        data = np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)
        self.buf[slot] = data
        return data.tobytes()


def slab(path: Path) -> DiskTier:
    return DiskTier(path, 1 << 20, "slab", admission=None)


def key(i: int) -> OffloadKey:
    return OffloadKey(b"lent-key-%06d" % i)


@pytest.fixture(params=["files", "slab"])
def disk_tiers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[LentTiers, Host]]:
    host = Host()
    capacity = 64 * (BLOCK + HEADER_BYTES)
    settings = DiskTier(tmp_path / "disk", capacity, request.param, admission=None)
    tiers = LentTiers(open_tiers([settings], NAMESPACE), host.address)
    yield tiers, host
    tiers.close()


def done(tiers: LentTiers, job: LentJob) -> LentJob:
    assert tiers.wait([job], WAIT_S), f"the job of {len(job.keys)} keys did not end in {WAIT_S}s"
    return job


def test_a_store_and_a_load_round_trip_byte_exact(disk_tiers: tuple[LentTiers, Host]) -> None:
    tiers, host = disk_tiers
    data = [host.fill(i, i) for i in range(8)]
    stored = done(tiers, tiers.store([key(i) for i in range(8)], list(range(8))))
    assert stored.ok == [True] * 8 and stored.written == [True] * 8
    assert stored.released.is_set()
    assert all(tiers.source(key(i)) == "disk0" for i in range(8))
    loaded = done(tiers, tiers.load([key(i) for i in range(8)], list(range(16, 24))))
    assert loaded.ok == [True] * 8 and loaded.released.is_set()
    for i in range(8):
        assert host.buf[16 + i].tobytes() == data[i], f"block {i} came back different"
    events = tiers.take_events()
    assert [k for e in events if not e.removed for k in e.keys] == [key(i) for i in range(8)]


def test_a_load_of_a_key_in_no_tier_fails_that_key_at_once(
    disk_tiers: tuple[LentTiers, Host],
) -> None:
    tiers, host = disk_tiers
    host.fill(0, 1)
    done(tiers, tiers.store([key(0)], [0]))
    job = tiers.load([key(0), key(99)], [5, 6])
    done(tiers, job)
    assert job.ok == [True, False]
    assert tiers.lookup(key(99)) == "miss" and tiers.lookup(key(0)) == "hit"


def test_a_damaged_block_is_a_miss_dropped_with_a_removed_event(
    tmp_path: Path,
) -> None:
    host = Host()
    settings = DiskTier(tmp_path / "disk", 64 * (BLOCK + HEADER_BYTES), "files", admission=None)
    tiers = LentTiers(open_tiers([settings], NAMESPACE), host.address)
    try:
        host.fill(0, 7)
        done(tiers, tiers.store([key(0)], [0]))
        tiers.take_events()
        files = [p for p in (tmp_path / "disk").rglob("*") if p.is_file() and p.stat().st_size]
        damaged = max(files, key=lambda p: p.stat().st_mtime)
        raw = bytearray(damaged.read_bytes())
        raw[-1] ^= 0xFF
        damaged.write_bytes(bytes(raw))
        host.buf[3] = 0
        job = done(tiers, tiers.load([key(0)], [3]))
        assert job.ok == [False] and job.released.is_set()
        assert tiers.source(key(0)) is None, "a damaged block stayed in the index"
        removed = [k for e in tiers.take_events() if e.removed for k in e.keys]
        assert removed == [key(0)]
        assert tiers.stats()[0].failures.get("corrupt") == 1
    finally:
        tiers.close()


def test_bad_input_raises_and_changes_nothing(disk_tiers: tuple[LentTiers, Host]) -> None:
    tiers, _ = disk_tiers
    with pytest.raises(ValueError, match="2 keys but 1 slots"):
        tiers.store([key(0), key(1)], [0])
    with pytest.raises(ValueError, match="slot -1"):
        tiers.load([key(0)], [-1])
    with pytest.raises(ValueError, match="listed twice"):
        tiers.load([key(0), key(0)], [0, 1])
    with pytest.raises(TypeError, match="not bytes"):
        tiers.store(["text"], [0])  # type: ignore[list-item]
    assert not tiers.pending() and tiers.take_events() == []


def test_blocks_of_different_sizes_are_refused(tmp_path: Path) -> None:
    small = DiskTier(tmp_path / "a", 16 * (BLOCK + HEADER_BYTES), "slab")
    big = DiskTier(tmp_path / "b", 16 * (2 * BLOCK + HEADER_BYTES), "slab")
    stores = open_tiers([small], NAMESPACE) + open_tiers(
        [big], Namespace("lent-model", "uint8", "test", 2 * BLOCK)
    )
    try:
        with pytest.raises(ValueError, match="different sizes"):
            LentTiers(stores, Host().address)
    finally:
        for store in stores:
            store.close()


def test_three_threads_at_once_never_see_a_wrong_byte(
    disk_tiers: tuple[LentTiers, Host],
) -> None:
    """Like SGLang's prefetch, prefetch-I/O and backup threads: each has its own slots;
    stores, existence checks and loads run at once for a bounded time."""
    tiers, host = disk_tiers
    errors: list[str] = []
    stop = time.monotonic() + 2.0
    expected: dict[OffloadKey, bytes] = {}
    lock = threading.Lock()

    def writer(base: int) -> None:
        n = 0
        while time.monotonic() < stop:
            slot = base + n % 4
            k = key(base * 1000 + n)
            data = host.fill(slot, base * 1000 + n)
            job = tiers.store([k], [slot])
            if not tiers.wait([job], WAIT_S):
                errors.append(f"store {k!r} did not end")
                return
            if job.written[0]:
                with lock:
                    expected[k] = data
            n += 1

    def reader(base: int) -> None:
        while time.monotonic() < stop:
            with lock:
                known = list(expected.items())[-4:]
            if not known:
                time.sleep(0.001)
                continue
            ks = [k for k, _ in known]
            present = tiers.exists(ks, WAIT_S)
            ks = [k for k, p in zip(ks, present) if p]
            slots = list(range(base, base + len(ks)))
            job = tiers.load(ks, slots)
            if not tiers.wait([job], WAIT_S):
                errors.append("a load did not end")
                return
            for k, slot, ok in zip(ks, slots, job.ok):
                if ok and host.buf[slot].tobytes() != expected[k]:
                    errors.append(f"wrong bytes for {k!r}")

    threads = [
        threading.Thread(target=writer, args=(0,)),
        threading.Thread(target=writer, args=(4,)),
        threading.Thread(target=reader, args=(16,)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a thread did not end"
    assert not errors, errors[:5]
    assert expected, "nothing was stored"


def test_jobs_left_at_close_end_failed(tmp_path: Path) -> None:
    host = Host()
    tiers = LentTiers(open_tiers([slab(tmp_path / "d")], NAMESPACE), host.address)
    job = tiers.store([key(1)], [1])
    tiers.close()
    assert job.done and job.released.is_set()
    late = tiers.store([key(2)], [2])
    assert late.done and late.ok == [False] and late.causes == ["closed"]
    tiers.close()  # idempotent


def test_a_second_instance_finds_a_shared_tiers_blocks(valkey_server: Server) -> None:  # noqa: F811
    """A real Valkey server: one instance stores, a fresh one (no index of its own)
    finds the blocks by asking, and loads them byte-exact; an unknown key is a miss,
    remembered (the core's negative-answer rule)."""
    first_host, second_host = Host(), Host()
    tier = RemoteTier(url=valkey_server.url, timeout_s=5.0)
    first = LentTiers(open_tiers([tier], NAMESPACE), first_host.address)
    try:
        data = [first_host.fill(i, 100 + i) for i in range(4)]
        job = done(first, first.store([key(i) for i in range(4)], list(range(4))))
        assert job.written == [True] * 4
    finally:
        first.close()
    second = LentTiers(open_tiers([tier], NAMESPACE), second_host.address)
    try:
        assert second.source(key(0)) is None
        assert second.exists([key(i) for i in range(4)] + [key(77)], WAIT_S) == [True] * 4 + [False]
        assert second.lookup(key(77)) == "miss"
        job = done(second, second.load([key(i) for i in range(4)], [10, 11, 12, 13]))
        assert job.ok == [True] * 4
        for i in range(4):
            assert second_host.buf[10 + i].tobytes() == data[i]
    finally:
        second.close()


def test_the_eventfd_is_closed_with_the_tiers(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    tiers = LentTiers(open_tiers([slab(tmp_path / "d")], NAMESPACE), Host().address)
    tiers.close()
    assert len(os.listdir("/proc/self/fd")) <= before


def gated_disk(tmp_path: Path) -> tuple[LentTiers, Host, bytes, int]:
    """Lent tiers over a disk with a 0.2 s deadline, ``key(0)`` stored from slot 0 (its
    bytes), then every lane op held at the pool's test gate (a read stuck in a system
    call: a hung mount) until the returned fd is closed. The caller closes the tiers."""
    host = Host()
    settings = DiskTier(tmp_path / "d", 1 << 20, "slab", admission=None, deadline_s=0.2)
    tiers = LentTiers(open_tiers([settings], NAMESPACE), host.address)
    try:
        data = host.fill(0, 3)
        done(tiers, tiers.store([key(0)], [0]))
        gate, opener = os.pipe()
        try:
            tiers.stores[0]._pool.set_gate(gate)  # type: ignore[attr-defined]
        finally:
            os.close(gate)
    except BaseException:
        tiers.close()
        raise
    return tiers, host, data, opener


def wait_released(tiers: LentTiers, job: LentJob) -> None:
    deadline = time.monotonic() + WAIT_S
    while not job.released.is_set():
        assert time.monotonic() < deadline, "the slots of the stuck read were never released"
        tiers.poll()
        time.sleep(0.01)


def test_a_read_stuck_past_its_deadline_ends_failed_and_releases_its_slots_later(
    tmp_path: Path,
) -> None:
    """A read stuck in a system call (the pool's test gate: a hung mount): the load ends
    failed once its tier's deadline and the core's grace passed, but its slots are
    released only once the read really ended (vLLM's deferred release: the framework
    must not reuse a slot the read may still fill)."""
    tiers, host, data, opener = gated_disk(tmp_path)
    try:
        try:
            job = done(tiers, tiers.load([key(0)], [9]))
            assert job.ok == [False] and not job.released.is_set()
        finally:
            os.close(opener)  # the stuck read goes on
        wait_released(tiers, job)
        assert host.buf[9].tobytes() == data  # the read really ended, into that slot
    finally:
        tiers.close()


def test_a_key_whose_read_outlived_the_load_deadline_is_a_miss_while_it_runs(
    tmp_path: Path,
) -> None:
    """The load's deadline (load or recompute: 50 ms here) passes before the disk's own
    (0.2 s): the load ends failed while its read still runs, and the key is still in
    the tier's index until then. It was a hit meanwhile: asked again, a framework whose
    slots are lent started a second read of it, into other slots, behind the stuck one
    (vLLM 0.34's tiering in a CI run: 4 chunks held back, not 2). It is a miss now."""
    tiers, _, _, opener = gated_disk(tmp_path)
    try:
        tiers.configure_cost(True, tokens_per_block=16, tokens_per_s=1e6)  # 50 ms, the floor
        try:
            job = done(tiers, tiers.load([key(0)], [9]))
            assert job.ok == [False] and not job.released.is_set()
            assert any("deadline" in cause for cause in job.causes), job.causes
            assert tiers.lookup(key(0)) == "miss" and tiers.source(key(0)) is None
            assert tiers.exists([key(0)], 0.0) == [False]
            again = tiers.load([key(0)], [8])
            assert again.done and again.ok == [False] and again.released.is_set()
        finally:
            os.close(opener)  # the stuck read goes on, and ends
        wait_released(tiers, job)
    finally:
        tiers.close()


def test_a_job_says_what_it_moved_and_how_long_it_took(
    disk_tiers: tuple[LentTiers, Host],
) -> None:
    """What a framework's metrics take (vLLM's transfer bytes and time, its
    backpressure's EMA): a store of keys a tier held already moves nothing."""
    tiers, host = disk_tiers
    for i in range(4):
        host.fill(i, i)
    first = done(tiers, tiers.store([key(i) for i in range(4)], list(range(4))))
    again = done(tiers, tiers.store([key(i) for i in range(6)], list(range(6))))
    load = done(tiers, tiers.load([key(0), key(1), key(50)], [10, 11, 12]))
    assert (first.moved, again.moved, load.moved) == (4, 2, 2)
    assert again.written == [True] * 6
    for job in (first, again, load):
        assert 0 < job.submitted <= job.finished


def test_the_deployments_tenant_is_capped_by_each_tiers_quota(tmp_path: Path) -> None:
    host = Host()
    capacity = 64 * (BLOCK + HEADER_BYTES)
    settings = DiskTier(tmp_path / "disk", capacity, "slab", admission=None, quotas={"t": 3})
    tiers = LentTiers(open_tiers([settings], NAMESPACE), host.address, tenant="t")
    try:
        for i in range(5):
            host.fill(i, i)
        job = done(tiers, tiers.store([key(i) for i in range(5)], list(range(5))))
        assert job.written == [True] * 3 + [False] * 2  # the head fits the quota
        (stats,) = tiers.stats()
        assert stats.manager.quota_refused == 2
        assert stats.manager.tenants[0].refused == 2 and stats.manager.tenants[0].held == 3
        # The next store evicts the tenant's own blocks, oldest first, to fit.
        host.fill(5, 5)
        job = done(tiers, tiers.store([key(5)], [5]))
        assert job.written == [True] and tiers.lookup(key(0)) == "miss"
    finally:
        tiers.close()


def test_lent_slots_are_never_held_back_by_the_read_guard(tmp_path: Path) -> None:
    """The framework lends its slots for a job's length: a store's writes go at once,
    however slow reads beside them are (no read guard: the CPU tier counts no slots)."""
    host = Host()
    settings = DiskTier(
        tmp_path / "d", 1 << 20, "slab", admission=None, write_pin_share=1.0, read_guard=True
    )
    tiers = LentTiers(open_tiers([settings], NAMESPACE), host.address)
    try:
        pressure = tiers.core.tiers[0].pressure
        for i in range(4):
            host.fill(i, i)
        done(tiers, tiers.store([key(i) for i in range(4)], list(range(4))))
        pressure.lag_s = 0.010  # the writes lag 10 ms (saturated: 5 ms) for the 3 below
        done(tiers, tiers.load([key(0)], [10]))  # alone: the idle reference
        pressure.idle.latency_s = pressure.idle.floor_s = 1e-9  # every later read "slow"
        for i in range(1, 4):
            writing = tiers.store([key(100 + i)], [20 + i])
            done(tiers, tiers.load([key(i)], [10 + i]))
            done(tiers, writing)
            assert writing.ok == [True] and tiers.source(key(100 + i)) == "disk0"
        assert pressure.read_window is None
    finally:
        tiers.close()
