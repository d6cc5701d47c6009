"""The disk tier below the CPU tier, on real files: round trips through promotion, restart
recovery, corruption attacks, a full disk, tenants, eviction per tier, deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import stat
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncoffload as ao
from asyncoffload.keys import make_offload_key
from asyncoffload.manager.base import Medium
from asyncoffload.tiers import _io
from asyncoffload.tiers.base import TierManager
from asyncoffload.tiers.disk import DiskStore, DiskTier
from asyncoffload.tiers.format import HEADER_BYTES, Namespace, block_file_bytes, parse_header
from tests.helpers import tier_index

pytestmark = pytest.mark.skipif(not _io.available(), reason="native I/O lanes not built")

NUM_KV = 32
FRAG = 4096  # one block: 2 layers x 4096 bytes
BLOCK = 2 * FRAG
SLOT = block_file_bytes(BLOCK)


def kv_caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [
        torch.randint(0, 256, (NUM_KV, FRAG), dtype=torch.uint8, generator=gen) for _ in range(2)
    ]


def keys(n: int, start: int = 0) -> list[ao.OffloadKey]:
    return [make_offload_key(i.to_bytes(4, "big") * 8) for i in range(start, start + n)]


def block(kv: list[torch.Tensor], i: int) -> bytes:
    return b"".join(bytes(t[i].numpy().tobytes()) for t in kv)


def config(
    path: Path, mode: str = "slab", cpu_blocks: int = 4, blocks: int = 16, **kw: Any
) -> ao.EngineConfig:
    tier_kw = {"admission": None, **kw.pop("tier", {})}
    kw.setdefault("policy", "lru")  # the tests count on which block the CPU tier evicts
    return ao.EngineConfig(
        cpu_blocks=cpu_blocks,
        tiers=[DiskTier(path, blocks * SLOT, mode, **tier_kw)],
        model="test-model",
        **kw,
    )


@contextlib.asynccontextmanager
async def engine(
    cfg: ao.EngineConfig, kv: list[torch.Tensor] | None = None
) -> AsyncIterator[ao.AsyncOffloadEngine]:
    eng = ao.AsyncOffloadEngine(kv if kv is not None else kv_caches(), cfg)
    try:
        yield eng
    finally:
        await eng.aclose()


async def store(eng: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey], ids: list[int]) -> None:
    handle = await eng.prepare_store(ks, ids)
    assert handle is not None
    await handle
    await eng.flush()


async def store_to_disk_only(
    eng: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey], ids: list[int]
) -> None:
    """Store ``ks`` (written through to disk), then push them out of the CPU tier with
    other keys, so that they live only on disk."""
    await store(eng, ks, ids)
    cpu = eng.config.cpu_blocks
    filler = keys(cpu, start=1000)
    for i in range(0, cpu, 2):
        await store(eng, filler[i : i + 2], [NUM_KV - 1, NUM_KV - 2][: len(filler[i : i + 2])])
    for key in ks:
        assert eng.manager.block_of(key) is None
        assert tier_index(eng).ready(key)


def removed(events: list[Any], medium: Medium) -> set[bytes]:
    return {k for e in events if e.removed and e.medium is medium for k in e.keys}


def stored(events: list[Any], medium: Medium) -> set[bytes]:
    return {k for e in events if not e.removed and e.medium is medium for k in e.keys}


async def collect(eng: ao.AsyncOffloadEngine, sub: ao.EventSubscription) -> list[Any]:
    await eng.aclose()
    return [e async for e in sub if isinstance(e, ao.OffloadingEvent)]


# --- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["slab", "files"])
async def test_promotion_round_trip_is_byte_exact(tmp_path: Path, mode: str) -> None:
    kv = kv_caches()
    want = [block(kv, i) for i in range(8)]
    async with engine(config(tmp_path, mode), kv) as eng:
        ks = keys(8)
        for i in range(0, 8, 2):
            await store(eng, ks[i : i + 2], [i, i + 1])
        assert eng.stats().tiers[0].blocks_written == 8
        # The CPU tier holds 4: the first 4 keys live only on disk now.
        assert [eng.manager.block_of(k) is None for k in ks[:4]] == [True] * 4
        assert eng.lookup(ks) == 8
        for t in kv:
            t[8:16].zero_()
        result = await (await eng.prepare_load(ks[:4], [8, 9, 10, 11]))
        assert result.num_blocks == 4
        for i in range(4):
            assert block(kv, 8 + i) == want[i]
        stats = eng.stats().tiers[0]
        assert stats.blocks_read == 4 and stats.read_failures == 0
        assert stats.lookup_hits == 4
        # Promoted blocks are in the CPU tier again, and still on disk (inclusive).
        assert all(eng.manager.block_of(k) is not None for k in ks[:4])
        assert all(tier_index(eng).ready(k) for k in ks[:4])


async def test_a_load_mixing_cpu_and_disk_blocks_keeps_their_order(tmp_path: Path) -> None:
    kv = kv_caches()
    want = [block(kv, i) for i in range(6)]
    # LRU: which blocks the third store evicts is this test's premise.
    async with engine(config(tmp_path, cpu_blocks=6, policy="lru"), kv) as eng:
        ks = keys(6)
        await store(eng, ks[:3], [0, 1, 2])
        await store(eng, ks[3:], [3, 4, 5])
        await store(eng, keys(2, start=100), [6, 7])  # evicts ks[0], ks[1] from the CPU tier
        assert eng.manager.block_of(ks[0]) is None and eng.manager.block_of(ks[5]) is not None
        dst = [20, 21, 22, 23, 24, 25]
        await (await eng.prepare_load(ks, dst))
        assert [block(kv, d) for d in dst] == want
        assert eng.stats().manager.pinned == 0
        assert tier_index(eng).stats().pinned == 0


async def test_files_mode_blocks_are_private_and_published_atomically(tmp_path: Path) -> None:
    async with engine(config(tmp_path, "files")) as eng:
        ks = keys(2)
        await store(eng, ks, [0, 1])
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        for key in ks:
            path = tier.path_of(key)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            header = parse_header(path.read_bytes()[:HEADER_BYTES])
            assert header.key == key and header.identity == eng.namespace.identity()
            assert header.payload_len == BLOCK
        leftovers = [p for p in tier.dir.rglob("*") if ".tmp." in p.name]
        assert leftovers == []


async def test_the_slab_is_private_preallocated_and_leaves_nothing(tmp_path: Path) -> None:
    async with engine(config(tmp_path, "slab", blocks=16)) as eng:
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        info = os.fstat(tier._fd)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_size == 16 * SLOT
        assert info.st_nlink == 0  # unlinked at once: a crash leaves no file
        assert os.listdir(tmp_path) == []


# --- restart --------------------------------------------------------------------------


async def test_files_mode_restart_finds_the_previous_runs_blocks(tmp_path: Path) -> None:
    kv = kv_caches()
    want = [block(kv, i) for i in range(4)]
    ks = keys(4)
    async with engine(config(tmp_path, "files"), kv) as eng:
        await store(eng, ks, [0, 1, 2, 3])
    kv2 = kv_caches()
    for t in kv2:
        t.zero_()
    async with engine(config(tmp_path, "files"), kv2) as eng:
        assert eng.tiers[0].recovered == 4  # type: ignore[attr-defined]
        assert eng.lookup(ks) == 4
        sub = eng.events(snapshot=True)
        await (await eng.prepare_load(ks, [4, 5, 6, 7]))
        assert [block(kv2, 4 + i) for i in range(4)] == want
        events = await collect(eng, sub)
    snap = {k for e in events if e.snapshot and e.medium is Medium.DISK for k in e.keys}
    assert snap == set(ks)


async def test_a_restart_with_another_identity_sees_nothing(tmp_path: Path) -> None:
    ks = keys(2)
    async with engine(config(tmp_path, "files")) as eng:
        await store(eng, ks, [0, 1])
    other = config(tmp_path, "files").model_copy(update={"model": "other-model"})
    async with engine(other) as eng:
        assert eng.lookup(ks) == 0
        assert eng.tiers[0].recovered == 0  # type: ignore[attr-defined]
    fp8 = ao.EngineConfig(
        cpu_blocks=4,
        tiers=[DiskTier(tmp_path, 16 * SLOT, "files", admission=None)],
        model="test-model",
    )
    kv_fp = [t.view(torch.int8) for t in kv_caches()]  # same bytes, another dtype
    async with engine(fp8, kv_fp) as eng:
        assert eng.lookup(ks) == 0


async def test_restart_skips_files_whose_header_is_wrong(tmp_path: Path) -> None:
    ks = keys(3)
    async with engine(config(tmp_path, "files")) as eng:
        await store(eng, ks, [0, 1, 2])
        paths = [eng.tiers[0].path_of(k) for k in ks]  # type: ignore[attr-defined]
    raw = bytearray(paths[0].read_bytes())
    raw[20] ^= 0xFF  # inside the identity: the header CRC no longer matches
    paths[0].write_bytes(bytes(raw))
    os.truncate(paths[1], HEADER_BYTES + 10)  # truncated
    async with engine(config(tmp_path, "files")) as eng:
        assert eng.tiers[0].recovered == 1  # type: ignore[attr-defined]
        assert eng.lookup([ks[2]]) == 1 and eng.lookup([ks[0]]) == 0 and eng.lookup([ks[1]]) == 0


# --- corruption: each a miss, a removed event, the KV blocks untouched -------------------


@contextlib.contextmanager
def buffered(fd: int) -> Iterator[int]:
    """The (unlinked, O_DIRECT) slab opened again for plain byte-sized I/O."""
    fd2 = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        yield fd2
    finally:
        os.close(fd2)


def _flip(path: Path | int, offset: int) -> None:
    if isinstance(path, int):
        with buffered(path) as fd:
            raw = bytearray(os.pread(fd, 1, offset))
            raw[0] ^= 0x5A
            os.pwrite(fd, bytes(raw), offset)
    else:
        with open(path, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x5A]))


def _corrupt(tier: DiskStore, index: TierManager, key: bytes, how: str, other: bytes) -> None:
    if tier.config.mode == "slab":
        slot = index.block_of(ao.OffloadKey(key))
        assert slot is not None
        base = slot.block_id * tier.slot_bytes
        if how == "payload":
            _flip(tier._fd, base + HEADER_BYTES + 100)
        elif how == "header":
            _flip(tier._fd, base + 8)  # the version field
        elif how == "truncate":
            os.ftruncate(tier._fd, base + HEADER_BYTES + 10)
        elif how == "rename":  # another key's block copied into this slot
            other_slot = index.block_of(ao.OffloadKey(other))
            assert other_slot is not None
            with buffered(tier._fd) as fd:
                data = os.pread(fd, tier.slot_bytes, other_slot.block_id * tier.slot_bytes)
                os.pwrite(fd, data, base)
        return
    path = tier.path_of(ao.OffloadKey(key))
    if how == "payload":
        _flip(path, HEADER_BYTES + 100)
    elif how == "header":
        _flip(path, 8)
    elif how == "truncate":
        os.truncate(path, HEADER_BYTES + 10)
    elif how == "rename":  # another key's file under this key's name
        path.write_bytes(tier.path_of(ao.OffloadKey(other)).read_bytes())
    elif how == "delete":
        path.unlink()


ATTACKS = {
    "payload": "corrupt",
    "header": "corrupt",
    "truncate": "short",
    "rename": "wrong_key",
}


# A slab has no per-block file to delete: its truncation case covers a vanished block.
CASES = [(m, h) for m in ("slab", "files") for h in (*ATTACKS, "identity")] + [("files", "delete")]


@pytest.mark.parametrize(("mode", "how"), CASES)
async def test_a_corrupt_block_is_a_miss_with_a_removed_event(
    tmp_path: Path, mode: str, how: str
) -> None:
    kv = kv_caches()
    async with engine(config(tmp_path, mode), kv) as eng:
        ks = keys(2)
        await store_to_disk_only(eng, ks, [0, 1])
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        # The victim is the block in the last slot (truncating a slab cuts what follows).
        if mode == "slab":
            ks.sort(key=lambda k: tier_index(eng).block_of(k).block_id, reverse=True)  # type: ignore[union-attr]
        if how == "identity":
            _write_foreign_block(tier, tier_index(eng), ks[0])
        else:
            _corrupt(tier, tier_index(eng), ks[0], how, ks[1])
        sub = eng.events()
        before = [t[10:12].clone() for t in kv]
        with pytest.raises(ao.TransferError, match="could not be read"):
            await (await eng.prepare_load(ks, [10, 11]))
        assert all(torch.equal(t[10:12], b) for t, b in zip(kv, before))  # untouched
        assert not tier_index(eng).ready(ks[0])
        assert eng.lookup(ks) == 0  # the bad block is a miss from now on: no livelock
        stats = eng.stats()
        assert stats.tiers[0].dropped == 1 and stats.tiers[0].read_failures == 1
        expect = {"delete": "missing", "identity": "stale"}.get(how) or ATTACKS[how]
        assert stats.tiers[0].failures == {expect: 1}
        assert stats.manager.pinned == 0 and tier_index(eng).stats().pinned == 0
        # The good block came up to the CPU tier and loads.
        await (await eng.prepare_load([ks[1]], [12]))
        assert block(kv, 12) == block(kv, keys(2).index(ks[1]))
        events = await collect(eng, sub)
    assert ks[0] in removed(events, Medium.DISK)
    assert ks[0] not in stored(events, Medium.CPU)


def _write_foreign_block(tier: DiskStore, index: TierManager, key: bytes) -> None:
    """A block of this key and size written by an engine of another model."""
    other = Namespace("another-model", "uint8", "x", BLOCK)
    payload = os.urandom(BLOCK)
    from asyncoffload.tiers.format import pack_header

    raw = pack_header(other.identity(), key, payload) + payload
    raw = raw.ljust(tier.slot_bytes, b"\0")
    if tier.config.mode == "slab":
        slot = index.block_of(ao.OffloadKey(key))
        assert slot is not None
        with buffered(tier._fd) as fd:
            os.pwrite(fd, raw, slot.block_id * tier.slot_bytes)
    else:
        tier.path_of(ao.OffloadKey(key)).write_bytes(raw)


# --- failures of the disk itself -------------------------------------------------------


@contextlib.contextmanager
def small_filesystem(tmp_path: Path, size: int) -> Iterator[Path | None]:
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        yield None
        return
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount)],
        capture_output=True,
    )
    if done.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


async def test_a_full_disk_skips_stores_and_the_engine_serves_on(tmp_path: Path) -> None:
    """Files mode on a real 64 KiB filesystem (tmpfs); where mounting is not allowed,
    the lane's fault hook returns ENOSPC instead."""
    with small_filesystem(tmp_path, 64 * 1024) as mount:
        root = mount if mount is not None else tmp_path / "faulted"
        kv = kv_caches()
        async with engine(config(root, "files", cpu_blocks=8, blocks=64), kv) as eng:
            tier = eng.tiers[0]
            assert isinstance(tier, DiskStore)
            if mount is None:
                tier.pool.set_fault(True, 3, errno.ENOSPC)
            ks = keys(16)
            for i in range(0, 16, 2):
                await store(eng, ks[i : i + 2], [i, i + 1])
            stats = eng.stats().tiers[0]
            assert stats.failures.get("ENOSPC", 0) > 0
            assert stats.write_failures == stats.failures["ENOSPC"]
            assert stats.blocks_written + stats.write_failures == 16
            assert tier_index(eng).stats().ready == stats.blocks_written
            assert not [p for p in tier.dir.rglob("*") if ".tmp." in p.name]
            # What the disk holds still loads, byte-exact; what it refused is a miss.
            on_disk = [k for k in ks if tier_index(eng).ready(k)]
            assert on_disk
            await (await eng.prepare_load(on_disk[:2], [20, 21]))
            assert block(kv, 20) == block(kv, ks.index(on_disk[0]))


async def test_an_io_error_on_read_is_a_miss(tmp_path: Path) -> None:
    kv = kv_caches()
    async with engine(config(tmp_path), kv) as eng:
        ks = keys(2)
        await store_to_disk_only(eng, ks, [0, 1])
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        tier.pool.set_fault(False, 1, errno.EIO)
        with pytest.raises(ao.TransferError, match="EIO"):
            await (await eng.prepare_load(ks, [3, 4]))
        assert eng.lookup(ks) == 0
        tier.pool.set_fault(False, 0, 0)
        assert eng.stats().tiers[0].failures == {"EIO": 2}


def short_deadline(tier: object, seconds: float = 0.05) -> DiskStore:
    """The tier's deadline from now on: stores before it had the default one (30 s),
    which a busy machine cannot miss."""
    assert isinstance(tier, DiskStore)
    tier.config = tier.config.model_copy(update={"deadline_s": seconds})
    tier.deadline_s = seconds
    return tier


async def test_an_operation_past_its_deadline_fails(tmp_path: Path) -> None:
    cfg = config(tmp_path, tier={"io_threads": 1})
    async with engine(cfg) as eng:
        ks = keys(2)
        await store_to_disk_only(eng, ks, [0, 1])
        tier = short_deadline(eng.tiers[0])
        tier.pool.set_delay(0.2)  # a stalled disk: the second op starts after its deadline
        with pytest.raises(ao.TransferError, match="timeout"):
            await (await eng.prepare_load(ks, [3, 4]))
        tier.pool.set_delay(0)
        assert eng.stats().tiers[0].failures.get("timeout", 0) >= 1


async def test_a_stalled_read_fails_its_load_without_waiting_for_the_disk(tmp_path: Path) -> None:
    """A read stuck in the kernel (a hung mount) cannot be interrupted: the load fails
    and its blocks are misses once the deadline and a grace second have passed, and
    ``flush`` waits no longer; its CPU slots stay reserved until the read really ends
    (it still writes into them), and then they are released."""
    cfg = config(tmp_path, tier={"io_threads": 1})
    kv = kv_caches()
    async with engine(cfg, kv) as eng:
        ks = keys(2)
        await store_to_disk_only(eng, ks, [0, 1])
        # A deadline a busy machine's lane starts the read within (at 0.05 s a make test
        # saw it fail unstarted, with no slots held).
        tier = short_deadline(eng.tiers[0], 0.5)
        tier.pool.set_delay(4.0)  # the first read starts at once, then takes 4 s
        before = [t[5:7].clone() for t in kv]
        started = time.monotonic()
        handle = await eng.prepare_load(ks, [5, 6])
        with pytest.raises(ao.TransferError, match=r"stalled|timeout"):
            await asyncio.wait_for(handle, 10.0)
        await asyncio.wait_for(eng.flush(), 10.0)
        assert time.monotonic() - started < 3.5  # not the 4 s the read takes
        assert eng.lookup(ks) == 0  # misses, dropped from the tier
        assert eng.stats().tiers[0].failures == {"timeout": 2}
        assert tier_index(eng).stats().pinned == 0
        assert eng.stats().manager.write_pending == 2  # the read still runs: slots held
        tier.pool.set_delay(0)
        limit = time.monotonic() + 10.0
        while eng.stats().manager.write_pending:
            assert time.monotonic() < limit, "the read's CPU slots were not released in 10 s"
            await asyncio.sleep(0.05)
        assert all(torch.equal(t[5:7], b) for t, b in zip(kv, before))


@contextlib.contextmanager
def gated(tier: DiskStore) -> Iterator[Callable[[], None]]:
    """Every op of ``tier`` that starts from now on hangs, as in a stuck system call,
    until the returned function (or the context's exit) lets them all go."""
    gate, opener = os.pipe()
    try:
        tier.pool.set_gate(gate)
    finally:
        os.close(gate)
    fds = [opener]

    def release() -> None:
        while fds:
            os.close(fds.pop())

    try:
        yield release
    finally:
        release()


async def released(what: str, timeout: float = 10.0) -> None:
    """Wait (at most ``timeout`` s) until nothing kept for a stuck op names ``what``."""
    limit = time.monotonic() + timeout
    while any(what in entry for entry in _io.kept()):
        _io.release_ended()
        assert time.monotonic() < limit, f"{what} still kept {timeout}s after the op ended"
        await asyncio.sleep(0.05)


async def stuck_io(eng: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey]) -> tuple[Any, Any]:
    """With ``eng``'s disk tier stuck (:func:`gated`) and ``deadline_s`` 1: a load of
    ``ks`` (on disk only) into KV blocks 5 and 6, and a store of one block written
    through (its write hangs). Returns the load's handle and the key stored."""
    short_deadline(eng.tiers[0], 1.0)
    load = await eng.prepare_load(ks, [5, 6])
    new = keys(1, start=500)
    handle = await eng.prepare_store(new, [8])
    assert handle is not None
    await asyncio.wait_for(handle, 10.0)  # the CPU copy; its write-through hangs
    return load, new[0]


def pins(eng: ao.AsyncOffloadEngine, key: ao.OffloadKey) -> int:
    block = eng.manager.block_of(key)
    assert block is not None, "the block left the CPU tier"
    return block.ref_cnt


async def test_flush_is_bounded_while_a_disk_op_hangs(tmp_path: Path) -> None:
    """Ops stuck in the kernel past their deadline: flush returns within the deadline
    plus about a second; the read is a miss and nothing it reads reaches the KV; the
    write is a failure, not indexed; their CPU slots stay held while the ops run, and
    go once they end."""
    kv = kv_caches()
    async with engine(config(tmp_path), kv) as eng:
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        before = [t[5:7].clone() for t in kv]
        await store_to_disk_only(eng, keys(2), [0, 1])
        with gated(tier) as release:
            started = time.monotonic()
            load, new = await stuck_io(eng, keys(2))
            await asyncio.wait_for(eng.flush(), 10.0)
            assert time.monotonic() - started < 1.0 + 2.5  # deadline_s 1
            with pytest.raises(ao.TransferError, match=r"stalled|timeout"):
                await load
            stats = eng.stats().tiers[0]
            assert stats.failures == {"timeout": 3}
            assert stats.read_failures == 2 and stats.write_failures == 1
            assert eng.lookup(keys(2)) == 0 and not tier_index(eng).ready(new)
            assert eng.stats().manager.write_pending == 2  # the read's CPU slots: held
            assert pins(eng, new) == 1  # pinned by the stuck write
            release()
            limit = time.monotonic() + 10.0
            while eng.stats().manager.write_pending or pins(eng, new):
                assert time.monotonic() < limit, "the slots were not released in 10 s"
                await asyncio.sleep(0.05)
        assert all(torch.equal(t[5:7], b) for t, b in zip(kv, before))
        assert not tier_index(eng).ready(new)  # the write ended late: still not indexed
        await (await eng.prepare_load([new], [9]))  # its CPU copy is intact
        assert block(kv, 9) == block(kv, 8)


async def test_aclose_is_bounded_while_a_disk_op_hangs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Closing with ops stuck in the kernel: aclose returns within the deadline plus
    about a second, joins no stuck thread, and keeps (with a warning naming the tier
    and its path) the lanes, files and host memory the ops use; once they end, all of
    it is released, and nothing they did reached the KV."""
    kv = kv_caches()
    eng = ao.AsyncOffloadEngine(kv, config(tmp_path))
    tier = eng.tiers[0]
    assert isinstance(tier, DiskStore)
    before = [t[5:7].clone() for t in kv]
    what = f"disk tier {tier.name} ({tier.dir})"
    try:
        await store_to_disk_only(eng, keys(2), [0, 1])
        with gated(tier) as release:
            load, _ = await stuck_io(eng, keys(2))
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="asyncoffload.tiers"):
                await asyncio.wait_for(eng.aclose(), 10.0)
            assert time.monotonic() - started < 1.0 + 2.5  # deadline_s 1
            assert load.done() and isinstance(load.exception(), ao.TransferError)
            assert what in _io.kept()
            assert f"the host memory of {eng.backend.name}" in _io.kept()
            assert any(what in r.getMessage() and "stuck" in r.getMessage() for r in caplog.records)
            assert tier.pool.running == 2  # not joined: the stuck read and write run on
            release()
            await released(what)
            await released("the host memory of")
        assert all(torch.equal(t[5:7], b) for t, b in zip(kv, before))
    finally:
        if not eng.closed:
            await eng.aclose()


# --- admission, eviction, events -----------------------------------------------------


async def test_default_admission_writes_a_block_on_its_second_offer(tmp_path: Path) -> None:
    cfg = config(tmp_path, tier={"admission": "frequency"}, cpu_blocks=8)
    async with engine(cfg) as eng:
        ks = keys(2)
        await store(eng, ks, [0, 1])
        assert eng.stats().tiers[0].blocks_written == 0  # first offer: not yet
        await store(eng, ks, [0, 1])  # already in the CPU tier: offered again
        assert eng.stats().tiers[0].blocks_written == 2


async def test_blocks_the_cpu_tier_declines_are_counted_by_the_tiers_below(
    tmp_path: Path,
) -> None:
    # Issue 40: a shared tier got 64 of 80 blocks written, with no failure counted; the
    # other 16 were declined by the CPU tier's admission and never offered to it.
    cfg = config(tmp_path, cpu_blocks=8, admission="ghost")  # declines first offers
    async with engine(cfg) as eng:
        ks = keys(3)
        handle = await eng.prepare_store(ks[:2], [0, 1])
        assert handle is not None and handle.declined_keys == ks[:2]
        await handle
        await eng.flush()
        (tier,) = eng.stats().tiers
        assert (tier.blocks_written, tier.write_failures, tier.failures) == (0, 0, {})
        assert tier.declined_above == 2
        assert eng.stats().manager.store_skipped == 2
        await store(eng, ks, [0, 1, 2])  # the first two offered again: stored, written
        (tier,) = eng.stats().tiers
        assert (tier.blocks_written, tier.declined_above) == (2, 3)


async def test_a_declined_offer_counts_for_the_admission_below(tmp_path: Path) -> None:
    # The CPU tier declines a block's first offer ("ghost"), the disk writes a block on
    # its second: before issue 40 the disk never heard the declined offer, so the offer
    # the CPU tier took was the disk's first, and the block was not written.
    cfg = config(tmp_path, cpu_blocks=8, admission="ghost", tier={"admission": "frequency"})
    async with engine(cfg) as eng:
        ks = keys(2)
        await store(eng, ks, [0, 1])  # declined above: not written, offer counted
        (tier,) = eng.stats().tiers
        assert (tier.blocks_written, tier.declined_above) == (0, 2)
        assert tier.manager.store_skipped == 0  # the disk declined nothing itself
        await store(eng, ks, [0, 1])  # the CPU tier takes them: the disk's second offer
        (tier,) = eng.stats().tiers
        assert (tier.blocks_written, tier.declined_above) == (2, 2)
        assert eng.lookup(ks) == 2 and tier_index(eng).ready(ks[0])


async def test_each_tier_evicts_with_its_own_events(tmp_path: Path) -> None:
    async with engine(config(tmp_path, "files", cpu_blocks=2, blocks=4)) as eng:
        sub = eng.events()
        ks = keys(6)
        for i in range(0, 6, 2):
            await store(eng, ks[i : i + 2], [i, i + 1])
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        assert tier_index(eng).stats().ready == 4
        assert not tier.path_of(ks[0]).exists()  # evicted from disk: its file is gone
        events = await collect(eng, sub)
    assert removed(events, Medium.DISK) == set(ks[:2])
    assert removed(events, Medium.CPU) == set(ks[:4])
    assert stored(events, Medium.DISK) == set(ks)
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # one stream


async def test_evicted_files_are_removed_on_the_lanes_not_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evicting blocks from a files-mode tier removes their files on the tier's native
    lanes, not on the event loop's thread (where a hung mount would hang the loop): with
    the lanes held, the evicted blocks have left the index while their files are still
    there, and nothing was unlinked on the loop; once the lanes go on, ``flush`` returns
    after the files are gone."""
    loop_thread = threading.get_ident()
    unlinked: list[tuple[str, int]] = []
    unlink = os.unlink

    def spy(path: Any, *args: Any, **kw: Any) -> None:
        unlinked.append((os.fsdecode(path), threading.get_ident()))
        unlink(path, *args, **kw)

    async with engine(config(tmp_path, "files", cpu_blocks=2, blocks=2)) as eng:
        ks = keys(4)
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        await store(eng, ks[:2], [0, 1])
        paths = [tier.path_of(k) for k in ks[:2]]
        assert all(p.exists() for p in paths)
        monkeypatch.setattr(os, "unlink", spy)
        with gated(tier) as release:
            handle = await eng.prepare_store(ks[2:], [2, 3])
            assert handle is not None
            await handle  # written through: evicts ks[:2] from the disk tier
            limit = time.monotonic() + 10.0
            while tier_index(eng).block_of(ks[0]) is not None:
                assert time.monotonic() < limit, "the disk tier did not evict within 10 s"
                await asyncio.sleep(0.01)
            assert all(p.exists() for p in paths)  # the removal waits at the gate
            release()
            await asyncio.wait_for(eng.flush(), 10.0)
        assert not any(p.exists() for p in paths)
        assert [p for p, thread in unlinked if thread == loop_thread] == []
        assert eng.stats().tiers[0].delete_failures == 0


async def test_a_block_file_that_cannot_be_removed_is_counted_and_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with engine(config(tmp_path, "files", cpu_blocks=2, blocks=2)) as eng:
        ks = keys(4)
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        await store(eng, ks[:2], [0, 1])
        tier.path_of(ks[0]).unlink()
        tier.path_of(ks[0]).mkdir()  # a directory in its place: unlinkat fails, EISDIR
        with caplog.at_level(logging.WARNING, logger="asyncoffload"):
            await store(eng, ks[2:], [2, 3])  # evicts ks[:2]
        assert eng.stats().tiers[0].delete_failures == 1
        assert tier.path_of(ks[0]).is_dir() and not tier.path_of(ks[1]).exists()
        assert any("could not be removed (EISDIR 1)" in r.getMessage() for r in caplog.records)


def test_forget_is_a_lane_job_in_files_mode_and_nothing_in_slab_mode(tmp_path: Path) -> None:
    """``forget`` removes the files of ``keys`` on the lanes and returns that job (a
    file gone already counts as removed); a close with removals queued finishes them.
    A slab's slots are reused: nothing to do."""
    namespace = Namespace("m", "uint8", "l", BLOCK)
    files = DiskTier(tmp_path / "f", 4 * SLOT, "files").open(namespace)
    slab = DiskTier(tmp_path / "s", 4 * SLOT, "slab").open(namespace)
    try:
        ks = keys(3)
        for k in ks[:2]:
            files.path_of(k).write_bytes(b"block")
        files.pool.set_delay(0.01)  # still queued when the tier closes
        job = files.forget(ks)
        assert isinstance(job, _io.IoJob)
        assert slab.forget(ks) is None and files.forget([]) is None
    finally:
        files.close()
        slab.close()
    assert job.query() and job.results == [0, 0, 0]
    assert not any(files.path_of(k).exists() for k in ks)
    assert not [w for w in _io.kept() if str(files.dir) in w]  # closed, nothing kept


async def test_kv_events_carry_the_disk_medium(tmp_path: Path) -> None:
    from asyncoffload.integrations.kv_events import wire_events

    async with engine(config(tmp_path, cpu_blocks=2, blocks=4)) as eng:
        sub = eng.events()
        ks = keys(6)
        for i in range(0, 6, 2):
            await store(eng, ks[i : i + 2], [i, i + 1])
        events = await collect(eng, sub)
    wire = [w for e in events for w in wire_events(e)]
    mediums = {(type(w).__name__, getattr(w, "medium", None)) for w in wire}
    assert ("BlockStored", "DISK") in mediums and ("BlockRemoved", "DISK") in mediums
    assert ("BlockStored", "CPU") in mediums


# --- tenants --------------------------------------------------------------------------


async def test_tenants_never_see_each_others_blocks(tmp_path: Path) -> None:
    kv = kv_caches()
    async with engine(config(tmp_path, cpu_blocks=8), kv) as eng:
        ks = keys(2)
        alice = ao.ReqContext("a", tenant="alice")
        bob = ao.ReqContext("b", tenant="bob")
        handle = await eng.prepare_store(ks, [0, 1], alice)
        assert handle is not None
        await handle
        await eng.flush()
        assert eng.lookup(ks, alice) == 2
        assert eng.lookup(ks, bob) == 0 and eng.lookup(ks) == 0
        with pytest.raises(ao.UnknownKeyError):
            await eng.prepare_load(ks, [5, 6], bob)
    # Per engine: another tenant's engine finds nothing in a shared files directory.
    async with engine(config(tmp_path / "f", "files", tenant="alice")) as eng:
        await store(eng, ks, [0, 1])
    async with engine(config(tmp_path / "f", "files", tenant="bob")) as eng:
        assert eng.lookup(ks) == 0
    async with engine(config(tmp_path / "f", "files", tenant="alice")) as eng:
        assert eng.lookup(ks) == 2


# --- configuration and fallbacks -------------------------------------------------------


def test_files_mode_needs_a_model_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="set model="):
        ao.EngineConfig(tiers=[DiskTier(tmp_path, "1GiB", "files")])


def test_bad_tier_settings_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity"):
        DiskTier(tmp_path, "lots")
    with pytest.raises(ValueError, match="mode"):
        DiskTier(tmp_path, "1GiB", "tape")
    with pytest.raises(ValueError, match="unknown cache policy"):
        DiskTier(tmp_path, "1GiB", policy="nope")
    with pytest.raises(ValueError, match="holds no block"):
        ao.AsyncOffloadEngine(kv_caches(), ao.EngineConfig(tiers=[DiskTier(tmp_path, 4096)]))
    cfg = ao.EngineConfig.from_env(
        prefix="X_", tiers=f'[{{"path": "{tmp_path}", "capacity": "1MiB"}}]'
    )
    assert isinstance(cfg.tiers[0], DiskTier) and cfg.tiers[0].capacity == 1 << 20
    remote = ao.EngineConfig(
        tiers=[{"url": "redis://127.0.0.1:7/0"}, {"path": str(tmp_path), "capacity": 1 << 20}]
    )
    assert [type(t).__name__ for t in remote.tiers] == ["RemoteTier", "DiskTier"]


def test_explicit_nones_and_endless_deadlines_are_refused(tmp_path: Path) -> None:
    """An explicit None is not a default (mode=None became slab); a deadline of inf or
    1e300 overflowed at every submission, so the tier wrote nothing (issue 22, 7 and 9)."""
    for bad, message in (
        ({"mode": None}, "mode"),
        ({"capacity": None}, "capacity"),
        ({"deadline_s": math.inf}, "deadline_s\n  Input should be a finite number"),
        ({"deadline_s": 1e300}, "deadline_s\n  Input should be less than or equal to 86400"),
    ):
        settings = {"path": tmp_path, "capacity": "1MiB", **bad}
        with pytest.raises(ValueError, match=message):
            DiskTier(**settings)
    with pytest.raises(ValueError, match="mode"):
        DiskTier(tmp_path, "1MiB", None)
    with pytest.raises(TypeError, match="got path twice"):
        DiskTier(tmp_path, path=tmp_path, capacity="1MiB")
    assert DiskTier(tmp_path, "1MiB", "files", deadline_s=86_400).mode == "files"


async def test_buffered_io_fallback_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncoffload.tiers.disk as disk

    monkeypatch.setattr(disk, "_probe_direct", lambda path: False)  # a filesystem refusing it
    caplog.set_level(logging.WARNING, "asyncoffload.tiers")
    kv = kv_caches()
    async with engine(config(tmp_path, "files"), kv) as eng:
        assert eng.tiers[0].describe()["direct_io"] is False
        await store_to_disk_only(eng, keys(2), [0, 1])
        await (await eng.prepare_load(keys(2), [5, 6]))
        assert block(kv, 5) == block(kv, 0)
    assert sum("refuses O_DIRECT" in r.message for r in caplog.records) == 1
    with pytest.raises(OSError, match="refuses O_DIRECT"):
        ao.AsyncOffloadEngine(kv, config(tmp_path, tier={"direct_io": True}))


def test_a_tier_no_larger_than_the_one_above_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "asyncoffload")
    eng = ao.AsyncOffloadEngine(kv_caches(), config(tmp_path, cpu_blocks=16, blocks=16))
    try:
        assert any("tiers are inclusive" in r.message for r in caplog.records)
    finally:
        asyncio.run(eng.aclose())
    caplog.clear()
    eng = ao.AsyncOffloadEngine(kv_caches(), config(tmp_path, cpu_blocks=4, blocks=16))
    try:
        assert not any("tiers are inclusive" in r.message for r in caplog.records)
    finally:
        asyncio.run(eng.aclose())


async def test_promotion_without_cpu_room_raises_and_changes_nothing(tmp_path: Path) -> None:
    # The load that pins the CPU tier must stay in flight: copies go to a lane thread.
    async with engine(config(tmp_path, cpu_blocks=2, inline_copy_bytes=0)) as eng:
        ks = keys(2)
        await store_to_disk_only(eng, ks, [0, 1])
        pinned = [k for k in eng.manager.resident_keys()]
        hold = await eng.prepare_load(pinned, [20, 21])  # pins the whole CPU tier
        with pytest.raises(ao.PromotionError):
            await eng.prepare_load(ks, [3, 4])
        await hold
        assert tier_index(eng).stats().pinned == 0
        await (await eng.prepare_load(ks, [3, 4]))


async def test_two_engines_share_a_files_directory(tmp_path: Path) -> None:
    kv = kv_caches()
    a = ao.AsyncOffloadEngine(kv, config(tmp_path, "files"))
    b = ao.AsyncOffloadEngine(kv_caches(), config(tmp_path, "files"))
    try:
        ks = keys(4)
        await store(a, ks, [0, 1, 2, 3])
        await store(b, ks, [4, 5, 6, 7])  # the same keys, replaced atomically
        tier = a.tiers[0]
        assert isinstance(tier, DiskStore)
        files = sorted(p.name for p in tier.dir.rglob("*.kv"))
        assert len(files) == 4
    finally:
        await a.aclose()
        await b.aclose()
    async with engine(config(tmp_path, "files"), kv) as eng:
        assert eng.lookup(ks) == 4


def test_reserve_never_evicts_what_it_protects() -> None:
    manager = ao.CPUOffloadingManager(2)
    a, b, c = keys(3)
    for key in (a, b):
        out = manager.prepare_store([key])
        assert out is not None
        manager.complete_store([key])
    manager.touch([b])  # a is the least recently used: LRU would take it
    out = manager.reserve([c], protect=[a])
    assert out is not None and out.evicted_keys == [b]
    assert manager.reserve([keys(1, start=9)[0]], protect=[a, c]) is None  # c is pending
    with pytest.raises(ValueError, match="already present"):
        manager.reserve([a])


def test_a_header_written_in_place_equals_the_packed_one() -> None:
    from asyncoffload.tiers.format import pack_header, pack_header_into

    identity, key, payload = b"i" * 16, b"some-key", os.urandom(5000)
    block_ = bytearray(HEADER_BYTES) + bytearray(payload)
    pack_header_into(block_, identity, key)
    assert bytes(block_) == pack_header(identity, key, payload) + payload
    header = parse_header(bytes(block_[:HEADER_BYTES]))
    assert (header.identity, header.key, header.payload_len) == (identity, key, 5000)
