"""The Mooncake tier's parts that need no store (issue 26): its settings, the block checks
its helper runs (native, on payloads left where they are), and the host memory it maps.
The tier against a real master: tests/test_mooncake_tier.py."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncoffload as ao
from asyncoffload.tiers import _mooncake_helper as helper
from asyncoffload.tiers._io import _library, crc32c
from asyncoffload.tiers.format import HEADER_BYTES, Namespace, pack_header
from asyncoffload.tiers.mooncake import MooncakeTier
from asyncoffload.transfer.cpu import CopyEngine
from asyncoffload.transfer.host_file import SharedHostFile

# --- settings -----------------------------------------------------------------------


def test_settings_take_the_master_positionally_and_sizes_as_strings() -> None:
    tier = MooncakeTier("10.0.0.5:50051", segment_bytes="4GiB", batch_blocks=128)
    assert (tier.kind, tier.master, tier.segment_bytes) == ("mooncake", "10.0.0.5:50051", 4 << 30)
    assert MooncakeTier(segment_bytes=0).segment_bytes == 0  # a client of the others' memory


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"master": "nohost"}, "master must be host:port"),
        ({"master": "host:0"}, "master must be host:port"),
        ({"master": "host:65536"}, "master must be host:port"),
        ({"segment_bytes": -1}, "segment_bytes"),
        ({"segment_bytes": True}, "segment_bytes"),
        ({"segment_bytes": "lots"}, "segment_bytes"),
        ({"prefix": "a:b"}, "prefix"),
        ({"batch_blocks": 513}, "batch_blocks"),
        ({"protocol": "udp"}, "protocol"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"mac_key": b"short"}, "mac_key"),
        ({"policy": "nope"}, "unknown cache policy"),
        ({"colour": "blue"}, "colour"),
        # Settings that validated and could never work (issue 37, D11): sizes of 2**64
        # or more killed the helper at every start ("connection reset by peer"); a port
        # in other scripts' digits was taken, then "no Mooncake client after 30 s".
        ({"segment_bytes": 1 << 64}, "segment_bytes"),
        ({"segment_bytes": "16EiB"}, "segment_bytes"),
        ({"local_buffer_bytes": 1 << 64}, "local_buffer_bytes"),
        ({"master": "127.0.0.1:\u0665\u0660\u0660\u0665\u0661"}, "ASCII digits"),
        ({"master": "h\u00f4st:50051"}, "ASCII host"),
        ({"master": "a b:50051"}, "ASCII host"),
        ({"local_hostname": "h\u00f4st"}, "local_hostname"),
        ({"local_hostname": "127.0.0.1:\u0665"}, "local_hostname"),
    ],
)
def test_bad_settings_are_named(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MooncakeTier(**settings)


def test_sizes_no_machine_holds_are_refused_when_the_tier_opens() -> None:
    """Valid settings (a tier list may be written on another machine), and more memory
    than this machine has: refused before any helper starts, naming the field."""
    from asyncoffload.tiers.format import Namespace
    from asyncoffload.tiers.mooncake import _physical_memory

    memory = _physical_memory()
    assert memory > 0
    ns = Namespace("m", "uint8", "x", 8192)
    for field in ("segment_bytes", "local_buffer_bytes"):
        tier = MooncakeTier(**{field: 2 * memory})
        with pytest.raises(ValueError, match=rf"{field}=.* more than this machine's memory"):
            tier.open(ns)


def test_a_tier_list_takes_a_mooncake_tier_by_kind_or_by_its_master() -> None:
    cfg = ao.EngineConfig(tiers=[{"master": "127.0.0.1:7"}, {"kind": "mooncake"}])
    assert [type(t).__name__ for t in cfg.tiers] == ["MooncakeTier", "MooncakeTier"]
    env = ao.EngineConfig.from_env(prefix="X_", tiers='[{"master": "127.0.0.1:9"}]')
    assert isinstance(env.tiers[0], MooncakeTier) and env.tiers[0].master == "127.0.0.1:9"


def test_the_mac_key_is_never_shown() -> None:
    tier = MooncakeTier(mac_key=b"s" * 32)
    assert "sss" not in repr(tier) and "sss" not in str(tier.model_dump())


# --- the helper's block checks ------------------------------------------------------------

PAYLOAD = 3 * 4096
IDENTITY = Namespace("m", "uint8", "x", PAYLOAD).identity()


class Pieces:
    """A payload in three pieces, in three buffers; a header buffer for n blocks."""

    def __init__(self, n: int = 1) -> None:
        self.bufs = [mmap.mmap(-1, 4096) for _ in range(3)]
        for buf in self.bufs:
            buf.write(os.urandom(4096))
        self.headers = mmap.mmap(-1, n * HEADER_BYTES)
        self.at = ctypes.addressof(ctypes.c_char.from_buffer(self.headers))

    def payload(self) -> bytes:
        return b"".join(bytes(buf) for buf in self.bufs)

    def list(self) -> list[tuple[int, int]]:
        return [(ctypes.addressof(ctypes.c_char.from_buffer(b)), 4096) for b in self.bufs]

    def header(self, i: int = 0) -> bytes:
        return bytes(self.headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES])


def blocks(identity: bytes = IDENTITY, mac: bytes = b"", threads: int = 1) -> Any:
    """The helper's block checks as OP_CONFIG sets them."""
    message = (
        helper.HEAD.pack(0, helper.OP_CONFIG, 0)
        + helper.CONFIG.pack(identity, PAYLOAD, 2, len(mac))
        + b"ao"
        + mac
    )
    return helper._Blocks(message, helper._library(_library()._name), threads)


@pytest.mark.parametrize("mac", [b"", b"k" * 32])
def test_a_sealed_header_is_the_block_formats_own(mac: bytes) -> None:
    """Written in place over the pieces, the header equals the one the Python format
    packs for the whole payload: every tier reads the same blocks."""
    p = Pieces()
    blocks(mac=mac).run(False, [p.at], [b"key-1"], [p.list()], None)
    assert p.header() == pack_header(IDENTITY, b"key-1", p.payload(), mac or None)


def test_a_block_read_back_is_checked_in_place() -> None:
    p = Pieces()
    b = blocks()
    b.run(False, [p.at], [b"key-1"], [p.list()], None)
    whole = HEADER_BYTES + PAYLOAD
    assert b.run(True, [p.at], [b"key-1"], [p.list()], [whole]) == [PAYLOAD]
    # What the read gave stands: a miss stays a miss, a short object is short.
    assert b.run(True, [p.at], [b"key-1"], [p.list()], [-704]) == [-704]
    assert b.run(True, [p.at], [b"key-1"], [p.list()], [whole - 1]) == [-errno.ENODATA]
    # Another key's block, another namespace's, another MAC key's.
    assert b.run(True, [p.at], [b"key-2"], [p.list()], [whole]) == [-errno.EKEYREJECTED]
    other = blocks(identity=bytes(16))
    assert other.run(True, [p.at], [b"key-1"], [p.list()], [whole]) == [-errno.ESTALE]
    keyed = blocks(mac=b"k" * 32)
    assert keyed.run(True, [p.at], [b"key-1"], [p.list()], [whole]) == [-errno.ENOKEY]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_flipped_byte_fails_the_check(where: str) -> None:
    p = Pieces()
    b = blocks()
    b.run(False, [p.at], [b"key-1"], [p.list()], None)
    if where == "payload":
        p.bufs[2][100] ^= 1  # the last piece
    else:
        p.headers[40] ^= 1  # the payload's CRC
    whole = HEADER_BYTES + PAYLOAD
    assert b.run(True, [p.at], [b"key-1"], [p.list()], [whole]) == [-errno.EBADMSG]


def test_a_mac_over_pieces_catches_a_payload_forged_with_its_crc() -> None:
    """A writer without the key rewrites the payload and its CRC: the MAC fails."""
    p = Pieces()
    keyed = blocks(mac=b"k" * 32)
    keyed.run(False, [p.at], [b"key-1"], [p.list()], None)
    p.bufs[0][0] ^= 1
    p.headers[40:44] = crc32c(p.payload()).to_bytes(4, "little")
    p.headers[4092:4096] = crc32c(p.headers[:4092]).to_bytes(4, "little")
    whole = HEADER_BYTES + PAYLOAD
    assert keyed.run(True, [p.at], [b"key-1"], [p.list()], [whole]) == [-errno.ENOKEY]
    assert blocks().run(True, [p.at], [b"key-1"], [p.list()], [whole]) == [-errno.ENOKEY]


@pytest.mark.parametrize("threads", [2, 3, 16])
def test_blocks_spread_over_threads_are_sealed_and_checked_as_on_one(threads: int) -> None:
    """Eight blocks, their checksums on several threads: the same headers as on one,
    and each block's verdict its own (two damaged ones among them)."""
    batches = [Pieces(8), Pieces(8)]
    many = [[Pieces() for _ in range(8)] for _ in batches]
    for batch, owners, n in zip(batches, many, (1, threads)):
        heads = [batch.at + i * HEADER_BYTES for i in range(8)]
        keys = [f"key-{i}".encode() for i in range(8)]
        if n == threads:  # the same payloads as the one-thread batch
            for mine, theirs in zip(owners, many[0]):
                for a, b in zip(mine.bufs, theirs.bufs):
                    a[:] = b[:]
        blocks(threads=n).run(False, heads, keys, [p.list() for p in owners], None)
    assert bytes(batches[1].headers) == bytes(batches[0].headers)
    owners = many[1]
    owners[2].bufs[1][7] ^= 1
    owners[5].bufs[0][0] ^= 1
    whole = HEADER_BYTES + PAYLOAD
    heads = [batches[1].at + i * HEADER_BYTES for i in range(8)]
    keys = [f"key-{i}".encode() for i in range(8)]
    got = blocks(threads=threads).run(True, heads, keys, [p.list() for p in owners], [whole] * 8)
    want = [PAYLOAD] * 8
    want[2] = want[5] = -errno.EBADMSG
    assert got == want


def test_pieces_that_do_not_make_a_block_are_refused() -> None:
    p = Pieces()
    with pytest.raises(ValueError, match="do not make blocks"):
        blocks().run(False, [p.at], [b"key-1"], [p.list()[:2]], None)


# --- the helper's order of requests (issue 41) -----------------------------------------------


def _request(job: int, op: int) -> tuple[int, int, int, bytes]:
    return (job, op, 1, b"")


def _ops(taken: list[tuple[tuple[int, int, int, bytes], bool] | None]) -> list[int]:
    return [t[0][0] if t is not None else -1 for t in taken]


def test_a_read_goes_ahead_of_queued_writes() -> None:
    """Gets and existence checks are taken before the puts and removals queued ahead
    of them: a read never waits behind queued write-through."""
    queue = helper._Requests(workers=2)
    for job in range(20):
        queue.put(_request(job, helper.OP_PUT if job % 2 else helper.OP_REMOVE))
    queue.put(_request(100, helper.OP_GET))
    queue.put(_request(101, helper.OP_EXISTS))
    first, second = queue.get(), queue.get()
    assert _ops([first, second]) == [100, 101]
    assert first is not None and not first[1]  # a read: no done() owed


def test_writes_still_go_while_reads_keep_coming() -> None:
    """No starvation: once READS_PER_WRITE reads were taken while a write waited, the
    write is next, and every write is taken in the end, in order."""
    queue = helper._Requests(workers=2)
    for job in range(3):
        queue.put(_request(job, helper.OP_PUT))
    taken = []
    for round_ in range(3):
        for job in range(helper.READS_PER_WRITE + 2):  # more reads than the guard lets by
            queue.put(_request(1000 * (round_ + 1) + job, helper.OP_GET))
        got = [queue.get() for _ in range(helper.READS_PER_WRITE + 1)]
        taken += got
        write = got[-1]
        assert write is not None and write[1], _ops(got)  # the write, after the reads
        queue.done()
    writes = [t[0][0] for t in taken if t is not None and t[1]]
    assert writes == [0, 1, 2]


def test_writes_leave_a_worker_for_reads() -> None:
    """With 3 workers, writes run on 2 at most: the third is there for a read."""
    queue = helper._Requests(workers=3)
    for job in range(5):
        queue.put(_request(job, helper.OP_PUT))
    assert _ops([queue.get(), queue.get()]) == [0, 1]
    queue.put(_request(50, helper.OP_GET))
    assert _ops([queue.get()]) == [50]  # not write 2: two are running
    queue.done()
    assert _ops([queue.get()]) == [2]


def test_workers_stop_once_what_they_may_take_is_done() -> None:
    queue = helper._Requests(workers=2)
    queue.put(_request(1, helper.OP_PUT))
    queue.put(_request(2, helper.OP_GET))
    queue.stop(2)
    assert _ops([queue.get(), queue.get()]) == [2, 1]
    assert queue.get() is None  # the other worker: the write running is not its to take
    queue.done()
    assert queue.get() is None


# --- the helper's watch on the master (issue 41) -----------------------------------------


class _Store:
    """What the helper's probe asks of Mooncake's client: an existence check."""

    def __init__(self) -> None:
        self.asked = 0

    def batch_is_exist(self, names: list[str]) -> list[int]:
        self.asked += 1
        return [0] * len(names)


def _until(check: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.01)


def _listen(port: int = 0) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    return server


def test_the_master_closing_its_connection_marks_it_down_until_it_answers_again() -> None:
    """The helper watches the master over a connection of its own: the master's exit
    closes it, and every request fails at once from then (no call of the client, which
    would block seconds while it reconnects), until the master listens again and the
    client answers the probe's existence check."""
    server = _listen()
    port = server.getsockname()[1]
    store = _Store()
    master = helper._Master(store, f"127.0.0.1:{port}")
    try:
        watch, _ = server.accept()  # the helper's watch connection
        assert master.up and store.asked == 0
        server.close()
        watch.close()  # the master exits
        _until(lambda: not master.up, "the master marked down")
        assert master.downs == 1 and store.asked == 0  # refused: the client not asked
        server = _listen(port)  # back
        _until(lambda: master.up, "the master found again")
        assert store.asked == 1
        server.accept()[0].close()  # its watch again, closed at once: down again
        _until(lambda: master.downs == 2, "the master marked down again")
    finally:
        master.close()
        master.thread.join(10)
        server.close()
    assert not master.thread.is_alive()


def test_a_call_that_failed_marks_the_master_down_until_the_probe_finds_it() -> None:
    server = _listen()
    port = server.getsockname()[1]
    store = _Store()
    master = helper._Master(store, f"127.0.0.1:{port}")
    try:
        master.failed()  # a call got RPC_FAIL
        assert not master.up
        _until(lambda: master.up, "the master found again")
        assert store.asked == 1 and master.downs == 1
    finally:
        master.close()
        master.thread.join(10)
        server.close()
    assert not master.thread.is_alive()


# --- host memory another process maps -------------------------------------------------------


def test_a_shared_host_cpu_backend_gives_its_slots_as_a_memfd() -> None:
    kv = [torch.zeros(4, 4096, dtype=torch.uint8) for _ in range(2)]
    layout = ao.KVLayout.infer(kv)
    plain = ao.CpuCopyBackend(kv, layout, 4)
    assert plain.host_regions() == ()
    plain.close()
    backend = ao.CpuCopyBackend(kv, layout, 4, shared_host=True)
    try:
        (region,) = backend.host_regions()
        # Each slot has room for a block's header before it: header and payload are one
        # span for the store.
        stride = 4096 + layout.block_bytes
        assert region.header_room == 4096
        assert region.address == backend.host_address(0) - 4096
        assert backend.host_address(3) - backend.host_address(2) == stride
        assert region.size == 4 * stride
        seen = mmap.mmap(region.fd, region.size)  # as the helper maps it
        backend.host[2].fill_(7)
        assert seen[2 * stride + 4096] == 7 and seen[2 * stride + 4095] == 0
        seen.close()
    finally:
        backend.close()
    assert backend.host_regions() == ()


def test_a_host_pool_file_kept_open_is_shared_whole(tmp_path: Path) -> None:
    made = SharedHostFile.create(tmp_path / "rank0.pool", 2, 4096)
    opened = SharedHostFile.open(tmp_path / "rank0.pool", 2, 4096, keep_fd=True)
    plain = SharedHostFile.open(tmp_path / "rank0.pool", 2, 4096)
    try:
        region = opened.region()
        assert region.size == SharedHostFile.file_bytes(2, 4096)
        made.tensor()[1].fill_(9)
        seen = mmap.mmap(region.fd, region.size)
        assert seen[4096 + 4096] == 9  # the header page, then slot 0, then slot 1
        seen.close()
        with pytest.raises(ValueError, match="keep_fd"):
            plain.region()
    finally:
        plain.close()
        opened.close()
        made.close()
    assert opened.fd == -1


@pytest.mark.parametrize("engine", ["native", "threads"])
@pytest.mark.parametrize("inline_bytes", [0, 1 << 20])
async def test_slots_with_room_between_them_copy_byte_exact(
    engine: CopyEngine, inline_bytes: int
) -> None:
    """The copy engines (lanes, the one-step path, Python threads) with slots 4096 bytes
    apart: blocks go and come back whole, and the room between slots stays untouched."""
    gen = torch.Generator().manual_seed(3)
    kv = [torch.randint(0, 256, (16, 4096), dtype=torch.uint8, generator=gen) for _ in range(2)]
    want = [b"".join(t[i].numpy().tobytes() for t in kv) for i in range(16)]
    layout = ao.KVLayout.infer(kv)
    backend = ao.CpuCopyBackend(
        kv, layout, 8, copy_engine=engine, inline_bytes=inline_bytes, shared_host=True
    )
    (region,) = backend.host_regions()
    room = mmap.mmap(region.fd, region.size)
    config = ao.EngineConfig(cpu_blocks=8)
    async with ao.AsyncOffloadEngine(kv, config, backend=backend) as eng:
        keys = [ao.make_offload_key(bytes([i]) * 32) for i in range(8)]
        await (await eng.prepare_store(keys, list(range(8))))  # type: ignore[misc]
        for t in kv:
            t[8:].zero_()
        await (await eng.prepare_load(keys, list(range(8, 16))))
        got = [b"".join(t[8 + i].numpy().tobytes() for t in kv) for i in range(8)]
        assert got == want[:8]
        stride = 4096 + layout.block_bytes
        assert all(room[i * stride : i * stride + 4096] == bytes(4096) for i in range(8))
    room.close()
