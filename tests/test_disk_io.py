"""The native disk I/O lanes (asyncoffload/_native/disk_io.c, asyncoffload.tiers._io):
real files, real threads."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncoffload.tiers import _io
from asyncoffload.tiers._io import HEADER_BYTES, IoJob, IoOp, IoPool, crc32c, slot_bytes

pytestmark = pytest.mark.skipif(not _io.available(), reason="native disk I/O unavailable")

IDENTITY = bytes(range(16))
OTHER_IDENTITY = bytes(range(16, 32))


def _crc32c_reference(data: bytes, crc: int = 0) -> int:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


class Host:
    """``size`` bytes of host memory at an address that is 4096-aligned (``aligned``)
    or odd."""

    def __init__(self, size: int, aligned: bool) -> None:
        self.size = size
        self._map = mmap.mmap(-1, max(size, 1) + 4096)
        self._buf = (ctypes.c_char * len(self._map)).from_buffer(self._map)
        base = ctypes.addressof(self._buf)
        assert base % 4096 == 0
        self.address = base if aligned else base + 1

    def write(self, data: bytes) -> None:
        assert len(data) == self.size
        ctypes.memmove(self.address, data, len(data))

    def read(self) -> bytes:
        return ctypes.string_at(self.address, self.size)


def wait(job: IoJob, timeout: float = 10.0) -> IoJob:
    deadline = time.monotonic() + timeout
    while not job.query():
        assert time.monotonic() < deadline, "the disk job did not end"
        time.sleep(0.001)
    return job


def task_ids() -> set[str]:
    """This process's threads. Tests compare sets, not counts: another test's thread (a
    cancelled pytest-timeout timer) may still be ending while this one runs."""
    return set(os.listdir("/proc/self/task"))


def wait_gone(threads: set[str], timeout: float = 5.0) -> set[str]:
    """Waits (at most ``timeout`` s) until none of ``threads`` runs; those still running."""
    deadline = time.monotonic() + timeout
    while (left := threads & task_ids()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return left


@pytest.fixture
def pools() -> Iterator[list[IoPool]]:
    made: list[IoPool] = []
    yield made
    for pool in made:
        pool.close()


def make_pool(
    made: list[IoPool],
    payload_len: int,
    *,
    threads: int = 1,
    identity: bytes = IDENTITY,
    direct: bool = False,
    write_priority: str = "normal",
) -> IoPool:
    pool = IoPool(
        threads=threads,
        payload_len=payload_len,
        identity=identity,
        direct_files=direct,
        write_priority=write_priority,
    )
    made.append(pool)
    return pool


def parse_header(block: bytes) -> dict[str, object]:
    h = block[:HEADER_BYTES]
    magic, version, hlen = struct.unpack_from("<8sII", h, 0)
    payload_len, payload_crc, key_len = struct.unpack_from("<QII", h, 32)
    (header_crc,) = struct.unpack_from("<I", h, 4092)
    return {
        "magic": magic,
        "version": version,
        "header_len": hlen,
        "identity": h[16:32],
        "payload_len": payload_len,
        "payload_crc": payload_crc,
        "key": h[48 : 48 + key_len],
        "key_pad": h[48 + key_len : 304],
        "zeros": h[304:4092],
        "header_crc": header_crc,
        "header_crc_ok": header_crc == _crc32c_reference(h[:4092]),
    }


def check_block(block: bytes, payload: bytes, key: bytes, identity: bytes = IDENTITY) -> None:
    assert len(block) == slot_bytes(len(payload))
    h = parse_header(block)
    assert h["magic"] == b"AOKVBLK\0"
    assert h["version"] == 1
    assert h["header_len"] == 4096
    assert h["identity"] == identity
    assert h["payload_len"] == len(payload)
    assert h["payload_crc"] == crc32c(payload) == _crc32c_reference(payload)
    assert h["key"] == key
    assert h["key_pad"] == bytes(256 - len(key))
    assert h["zeros"] == bytes(4092 - 304)
    assert h["header_crc_ok"]
    assert block[HEADER_BYTES : HEADER_BYTES + len(payload)] == payload
    assert block[HEADER_BYTES + len(payload) :] == bytes(len(block) - HEADER_BYTES - len(payload))


# --- CRC32C -------------------------------------------------------------------------------


def test_crc32c_known_vectors_chaining_and_buffer_kinds() -> None:
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"a") == _crc32c_reference(b"a") == 0xC1D04330
    assert crc32c(bytes(32)) == 0x8A9136AA  # iSCSI test vector: 32 zero bytes
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    big = os.urandom(1 << 20)
    small = big[:70001]
    assert crc32c(small) == _crc32c_reference(small)
    lib = _io._library()
    whole = crc32c(big)
    assert whole == lib.ao_crc32c_soft(0, big, len(big))
    for cut in (1, 7, 8, 255, 4096, 24577, 1 << 19):
        assert crc32c(big[cut:], crc32c(big[:cut])) == whole
    for skew in range(1, 9):  # unaligned starts and odd lengths, hardware vs table
        part = big[skew : skew + 100_003]
        assert crc32c(part) == lib.ao_crc32c_soft(0, part, len(part))
    assert crc32c(bytearray(big)) == whole
    assert crc32c(memoryview(big)) == whole
    assert crc32c(memoryview(bytearray(big))[10:]) == crc32c(big[10:])


# --- slab mode -------------------------------------------------------------------------------


def _open_slab(path: Path, direct: bool) -> int:
    flags = os.O_RDWR | os.O_CREAT
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                pytest.skip(f"O_DIRECT is refused on {path.parent}")
            raise
    return os.open(path, flags, 0o600)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize(
    ("payload_len", "aligned"), [(8192, True), (1000, False), (8192, False), (1000, True)]
)
def test_slab_round_trip_is_byte_exact_with_the_documented_header(
    tmp_path: Path, pools: list[IoPool], payload_len: int, aligned: bool, direct: bool
) -> None:
    pool = make_pool(pools, payload_len, threads=2)
    slot = slot_bytes(payload_len)
    fd = _open_slab(tmp_path / "slab", direct)
    try:
        blocks = 3
        hosts = [Host(payload_len, aligned) for _ in range(blocks)]
        payloads = [os.urandom(payload_len) for _ in range(blocks)]
        keys = [f"key-{i}".encode() * (i + 1) for i in range(blocks)]
        for h, p in zip(hosts, payloads):
            h.write(p)
        ops = [IoOp(h.address, i * slot, None, k, fd) for i, (h, k) in enumerate(zip(hosts, keys))]
        job = wait(pool.submit(True, ops))
        assert job.error is None and job.results == [payload_len] * blocks and job.failed == []
        assert job.nbytes == blocks * payload_len and job.num_blocks == blocks

        data = (tmp_path / "slab").read_bytes()
        assert len(data) == blocks * slot
        for i in range(blocks):
            check_block(data[i * slot : (i + 1) * slot], payloads[i], keys[i])

        back = [Host(payload_len, aligned) for _ in range(blocks)]
        ops = [IoOp(h.address, i * slot, None, k, fd) for i, (h, k) in enumerate(zip(back, keys))]
        job = wait(pool.submit(False, list(reversed(ops))))
        assert job.results == [payload_len] * blocks
        assert [h.read() for h in back] == payloads
    finally:
        os.close(fd)


def test_many_ops_run_in_parallel_and_round_trip(tmp_path: Path, pools: list[IoPool]) -> None:
    payload_len = 8192
    count = 256
    pool = make_pool(pools, payload_len, threads=4)
    slot = slot_bytes(payload_len)
    src = Host(payload_len * count, aligned=True)
    data = os.urandom(payload_len * count)
    src.write(data)
    dst = Host(payload_len * count, aligned=True)
    fd = os.open(tmp_path / "slab", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        keys = [i.to_bytes(4, "little") for i in range(count)]
        ops = [
            IoOp(src.address + i * payload_len, i * slot, None, keys[i], fd) for i in range(count)
        ]
        assert wait(pool.submit(True, ops)).results == [payload_len] * count
        ops = [
            IoOp(dst.address + i * payload_len, i * slot, None, keys[i], fd) for i in range(count)
        ]
        job = wait(pool.submit(False, ops))
        assert job.results == [payload_len] * count
        assert dst.read() == data
    finally:
        os.close(fd)


def test_an_empty_job_ends_at_once_and_bad_ops_are_refused(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    pool = make_pool(pools, 100)
    job = wait(pool.submit(True, []))
    assert job.results == [] and job.error is None
    host = Host(100, aligned=False)
    with pytest.raises(ValueError, match="key"):
        pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "a"), b"", -1)])
    with pytest.raises(ValueError, match="key"):
        pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "a"), b"k" * 257, -1)])
    with pytest.raises(ValueError, match="path"):
        pool.submit(True, [IoOp(host.address, 0, None, b"k", -1)])
    with pytest.raises(ValueError, match="16 bytes"):
        IoPool(threads=1, payload_len=1, identity=b"short", direct_files=False)


def test_a_pool_says_why_when_the_native_library_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncoffload import _native

    monkeypatch.setenv("ASYNCOFFLOAD_NO_NATIVE", "1")
    _native.load_disk_io.cache_clear()
    try:
        assert not _io.available()
        with pytest.raises(RuntimeError, match="ASYNCOFFLOAD_NO_NATIVE"):
            IoPool(threads=1, payload_len=1, identity=IDENTITY, direct_files=False)
    finally:
        monkeypatch.delenv("ASYNCOFFLOAD_NO_NATIVE")
        _native.load_disk_io.cache_clear()
    assert _io.available()


# --- files mode ------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize(("payload_len", "aligned"), [(4096, True), (1000, False)])
def test_files_round_trip_leave_no_temporary_file_and_replace_atomically(
    tmp_path: Path, pools: list[IoPool], payload_len: int, aligned: bool, direct: bool
) -> None:
    pool = make_pool(pools, payload_len, threads=2, direct=direct)
    host = Host(payload_len, aligned)
    first = os.urandom(payload_len)
    host.write(first)
    path = tmp_path / "blk"
    job = wait(pool.submit(True, [IoOp(host.address, 0, str(path), b"the-key", -1)]))
    assert job.results == [payload_len]
    assert os.listdir(tmp_path) == ["blk"]
    assert path.stat().st_mode & 0o777 == 0o600 & ~_umask()
    check_block(path.read_bytes(), first, b"the-key")
    inode = path.stat().st_ino

    second = os.urandom(payload_len)
    host.write(second)
    job = wait(pool.submit(True, [IoOp(host.address, 0, str(path), b"the-key", -1)]))
    assert job.results == [payload_len]
    assert os.listdir(tmp_path) == ["blk"]
    assert path.stat().st_ino != inode  # a new file renamed over the old one
    check_block(path.read_bytes(), second, b"the-key")

    back = Host(payload_len, aligned)
    job = wait(pool.submit(False, [IoOp(back.address, 0, str(path), b"the-key", -1)]))
    assert job.results == [payload_len]
    assert back.read() == second


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_files_write_leaves_no_temporary_file(tmp_path: Path, pools: list[IoPool]) -> None:
    pool = make_pool(pools, 100)
    host = Host(100, aligned=False)
    missing_dir = tmp_path / "nope" / "blk"
    target_dir = tmp_path / "dir"
    target_dir.mkdir()
    job = wait(
        pool.submit(
            True,
            [
                IoOp(host.address, 0, str(missing_dir), b"k", -1),
                IoOp(host.address, 0, str(target_dir), b"k", -1),  # rename onto a folder
            ],
        )
    )
    assert job.results == [-errno.ENOENT, -errno.EISDIR]
    assert job.failed == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["dir"] and os.listdir(target_dir) == []


# --- removals (files mode) --------------------------------------------------------------------


def test_unlinks_remove_files_by_the_directory_fd_and_a_missing_file_counts_as_removed(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    """A removal works by the directory fd it is given, never by path: the directory
    renamed, and another planted at its old path, changes nothing. A file gone already
    is removed (0); a directory named like a block is not (``-EISDIR``)."""
    pool = make_pool(pools, 100)
    folder = tmp_path / "ns"
    folder.mkdir()
    for name in ("a", "b"):
        (folder / name).write_bytes(b"block")
    (folder / "d").mkdir()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        moved = tmp_path / "moved"
        folder.rename(moved)
        folder.mkdir()
        (folder / "a").write_bytes(b"planted")
        names = ["a", "b", "gone", "d"]
        job = wait(pool.submit_unlink([IoOp(0, 0, name, b"k", fd) for name in names]))
    finally:
        os.close(fd)
    assert job.results == [0, 0, 0, -errno.EISDIR] and job.failed == [3]
    assert job.nbytes == 0  # nothing moved
    assert os.listdir(moved) == ["d"]
    assert (folder / "a").read_bytes() == b"planted"
    with pytest.raises(ValueError, match="path"):
        pool.submit_unlink([IoOp(0, 0, None, b"k", -1)])
    with pytest.raises(ValueError, match="key"):
        pool.submit_unlink([IoOp(0, 0, "a", b"", -1)])
    with pytest.raises(ValueError, match="give_up_s needs a deadline"):
        pool.submit_unlink([IoOp(0, 0, "a", b"k", -1)], None, 1.0)


def _shut_gate(pool: IoPool) -> int:
    """Holds every op that starts from now on (the pool's test gate); returns the pipe's
    write end: closing it lets them go for good."""
    gate, opener = os.pipe()
    try:
        pool.set_gate(gate)
    finally:
        os.close(gate)
    return opener


def _taken(job: IoJob, what: str) -> None:
    deadline = time.monotonic() + 10.0
    while not job.first_op_ns:
        assert time.monotonic() < deadline, f"{what} was not taken by a lane within 10 s"
        time.sleep(0.001)


def test_an_unlink_waits_for_a_running_write_of_its_file(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    """The writes and removals of one file run in the order they were submitted, on any
    number of lanes: a removal taken while a write of its file still runs (held at the
    gate, then writing 8 MiB) waits for it, so it removes what the write published
    instead of finding nothing and leaving the write's file behind."""
    size = 8 << 20
    pool = make_pool(pools, size, threads=2)
    host = Host(size, aligned=True)
    host.write(os.urandom(size))
    path = str(tmp_path / "blk")
    opener = _shut_gate(pool)
    try:
        write = pool.submit(True, [IoOp(host.address, 0, path, b"k", -1)])
        _taken(write, "the write")
        unlink = pool.submit_unlink([IoOp(0, 0, path, b"k", -1)])
    finally:
        os.close(opener)
    assert wait(write).results == [size]
    assert wait(unlink).results == [0]
    assert os.listdir(tmp_path) == []


def test_a_write_after_an_unlink_of_its_file_is_never_removed(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    """A block evicted and written again at once: the removal of its old file, then the
    write of the new one, on four lanes, released together; every round, the new block
    is the file that stays."""
    pool = make_pool(pools, 4096, threads=4)
    host = Host(4096, aligned=True)
    path = tmp_path / "blk"
    for _ in range(20):
        payload = os.urandom(4096)
        host.write(payload)
        opener = _shut_gate(pool)
        try:
            unlink = pool.submit_unlink([IoOp(0, 0, str(path), b"k", -1)])
            _taken(unlink, "the removal")
            write = pool.submit(True, [IoOp(host.address, 0, str(path), b"k", -1)])
        finally:
            os.close(opener)
        assert wait(unlink).results == [0] and wait(write).results == [4096]
        check_block(path.read_bytes(), payload, b"k")
    pool.set_gate(None)


def test_close_finishes_queued_unlinks(tmp_path: Path, pools: list[IoPool]) -> None:
    pool = make_pool(pools, 100, threads=2)
    pool.set_delay(0.005)
    names = [f"f{i}" for i in range(16)]
    for name in names:
        (tmp_path / name).write_bytes(b"block")
    jobs = [pool.submit_unlink([IoOp(0, 0, str(tmp_path / name), b"k", -1)]) for name in names]
    pool.close()
    assert all(job.query() and job.results == [0] for job in jobs)
    assert os.listdir(tmp_path) == []


# --- integrity ---------------------------------------------------------------------------------


def _write_one(pool: IoPool, path: Path, key: bytes, aligned: bool) -> bytes:
    host = Host(pool.payload_len, aligned)
    payload = os.urandom(pool.payload_len)
    host.write(payload)
    assert wait(pool.submit(True, [IoOp(host.address, 0, str(path), key, -1)])).results == [
        pool.payload_len
    ]
    return payload


def _read_one(pool: IoPool, path: Path, key: bytes, aligned: bool) -> tuple[int, Host]:
    host = Host(pool.payload_len, aligned)
    host.write(b"\xaa" * pool.payload_len)
    job = wait(pool.submit(False, [IoOp(host.address, 0, str(path), key, -1)]))
    return job.results[0], host


def _patch(path: Path, offset: int, data: bytes | None = None) -> None:
    raw = bytearray(path.read_bytes())
    if data is None:
        raw[offset] ^= 0x01
    else:
        raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(("payload_len", "aligned"), [(1000, False), (8192, True)])
def test_damaged_stale_foreign_truncated_and_missing_blocks_are_refused(
    tmp_path: Path, pools: list[IoPool], payload_len: int, aligned: bool
) -> None:
    pool = make_pool(pools, payload_len, threads=2)
    staged = not aligned
    untouched = b"\xaa" * payload_len

    # a flipped payload byte
    path = tmp_path / "payload"
    _write_one(pool, path, b"k1", aligned)
    _patch(path, HEADER_BYTES + payload_len // 2)
    result, host = _read_one(pool, path, b"k1", aligned)
    assert result == -errno.EBADMSG
    if staged:
        assert host.read() == untouched

    # a flipped header byte (the header CRC catches it), in several places
    for offset in (0, 8, 12, 20, 33, 41, 50, 1000, 4093):
        path = tmp_path / f"header{offset}"
        _write_one(pool, path, b"k1", aligned)
        _patch(path, offset)
        result, host = _read_one(pool, path, b"k1", aligned)
        assert result == -errno.EBADMSG, offset
        if staged:
            assert host.read() == untouched

    # truncated: in the payload, and inside the header
    for size in (HEADER_BYTES + payload_len - 1, 100, 0):
        path = tmp_path / f"short{size}"
        _write_one(pool, path, b"k1", aligned)
        os.truncate(path, size)
        result, host = _read_one(pool, path, b"k1", aligned)
        assert result == -errno.ENODATA, size
        if staged:
            assert host.read() == untouched

    # the block of another identity (another namespace)
    path = tmp_path / "other-identity"
    other = make_pool(pools, payload_len, identity=OTHER_IDENTITY)
    _write_one(other, path, b"k1", aligned)
    result, host = _read_one(pool, path, b"k1", aligned)
    assert result == -errno.ESTALE
    if staged:
        assert host.read() == untouched

    # another key's block moved to this key's path
    wrong = tmp_path / "k2"
    _write_one(pool, tmp_path / "k3", b"k3", aligned)
    os.rename(tmp_path / "k3", wrong)
    result, host = _read_one(pool, wrong, b"k2", aligned)
    assert result == -errno.EKEYREJECTED
    if staged:
        assert host.read() == untouched

    # another payload length, with a valid header CRC
    path = tmp_path / "length"
    other_len = make_pool(pools, payload_len + 1)
    _write_one(other_len, path, b"k1", aligned)
    result, _ = _read_one(pool, path, b"k1", aligned)
    assert result == -errno.EBADMSG

    result, host = _read_one(pool, tmp_path / "missing", b"k1", aligned)
    assert result == -errno.ENOENT
    if staged:
        assert host.read() == untouched

    # and an intact block still reads
    path = tmp_path / "good"
    payload = _write_one(pool, path, b"k1", aligned)
    result, host = _read_one(pool, path, b"k1", aligned)
    assert result == payload_len and host.read() == payload


@pytest.mark.parametrize("size", [0, 100, 5000, HEADER_BYTES, HEADER_BYTES + 8191])
def test_a_truncated_block_read_with_o_direct_is_short_not_invalid(
    tmp_path: Path, pools: list[IoPool], size: int
) -> None:
    pool = make_pool(pools, 8192, direct=True)
    path = tmp_path / "blk"
    payload = _write_one(pool, path, b"k", aligned=True)
    os.truncate(path, size)
    assert _read_one(pool, path, b"k", aligned=True)[0] == -errno.ENODATA
    fd = _open_slab(tmp_path / "slab", direct=True)
    try:
        host = Host(8192, aligned=True)
        host.write(payload)
        op = IoOp(host.address, 0, None, b"k", fd)
        assert wait(pool.submit(True, [op])).results == [8192]
        os.ftruncate(fd, size)
        assert wait(pool.submit(False, [op])).results == [-errno.ENODATA]
    finally:
        os.close(fd)


# --- scheduling, deadlines, faults -----------------------------------------------------------


class Blocker:
    """Read ops on FIFOs, each holding a worker until :meth:`release`: the pool's test
    gate (the read end of a pipe the workers poll) stays shut until then. A FIFO no
    longer blocks ``open()``; let through, each op fails at once (no block file)."""

    def __init__(self, pool: IoPool, folder: Path, count: int) -> None:
        self.fifos = [folder / f"fifo{i}" for i in range(count)]
        for fifo in self.fifos:
            os.mkfifo(fifo)
        self.host = Host(pool.payload_len, aligned=False)
        gate, self._opener = os.pipe()
        try:
            pool.set_gate(gate)  # the pool keeps its own duplicate
        finally:
            os.close(gate)
        # One job per op, so that each can be seen taken: a worker held at the gate has
        # stamped its job's first op. Until then the job is only queued (a dropped pool
        # would discard it), so wait for every one, boundedly.
        self.jobs = [
            pool.submit(False, [IoOp(self.host.address, 0, str(f), b"fifo", -1)])
            for f in self.fifos
        ]
        deadline = time.monotonic() + 10.0
        while not all(job.first_op_ns for job in self.jobs):
            assert time.monotonic() < deadline, (
                f"{sum(1 for j in self.jobs if not j.first_op_ns)} of {count} blocking ops "
                "were not taken by a worker within 10 s"
            )
            time.sleep(0.001)

    @property
    def job(self) -> IoJob:
        """The first op's job (the only one where ``count`` is 1)."""
        return self.jobs[0]

    def release(self) -> None:
        """Open the gate for good: closing the pipe's write end makes it poll hung up."""
        if self._opener >= 0:
            os.close(self._opener)
            self._opener = -1


def test_reads_go_before_queued_writes(tmp_path: Path, pools: list[IoPool]) -> None:
    pool = make_pool(pools, 100, threads=1)
    host = Host(100, aligned=False)
    host.write(os.urandom(100))
    wait(pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "r"), b"r", -1)]))
    blocker = Blocker(pool, tmp_path, 1)  # the one worker is busy until released
    writes = [
        pool.submit(True, [IoOp(host.address, 0, str(tmp_path / f"w{i}"), b"w", -1)])
        for i in range(4)
    ]
    read = pool.submit(False, [IoOp(host.address, 0, str(tmp_path / "r"), b"r", -1)])
    blocker.release()
    for job in [blocker.job, *writes, read]:
        wait(job)
    assert blocker.job.results[0] < 0  # a FIFO is no block file
    assert read.results == [100]
    assert all(w.results == [100] for w in writes)
    assert read.finished_ns < min(w.finished_ns for w in writes)
    assert read.first_op_ns <= read.finished_ns
    assert [w.finished_ns for w in writes] == sorted(w.finished_ns for w in writes)


def test_ops_not_started_by_the_deadline_time_out_without_io(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    pool = make_pool(pools, 100, threads=1)
    host = Host(100, aligned=False)
    blocker = Blocker(pool, tmp_path, 1)
    late = pool.submit(
        True,
        [IoOp(host.address, 0, str(tmp_path / f"b{i}"), b"b", -1) for i in range(3)],
        deadline_s=0.01,
    )
    fine = pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "a"), b"a", -1)], 60.0)
    time.sleep(0.03)
    blocker.release()
    wait(late)
    wait(fine)
    assert late.results == [-errno.ETIMEDOUT] * 3 and late.failed == [0, 1, 2]
    assert late.error is None
    assert fine.results == [100]
    assert sorted(os.listdir(tmp_path)) == ["a", "fifo0"]
    # Against a slow disk: the ops queued behind a slow one miss a short deadline.
    pool.set_delay(0.05)
    slow = pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "s"), b"s", -1)])
    behind = pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "t"), b"t", -1)], 0.01)
    assert wait(slow).results == [100]
    assert wait(behind).results == [-errno.ETIMEDOUT]


def test_a_job_stuck_in_a_system_call_is_given_up_on_and_its_pool_detached(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    """No deadline interrupts an op stuck in a system call (the test gate: a hung mount):
    ``give_up_s`` after its deadline the job ends on the caller's side, every op timed
    out and ``late``, while the op goes on; the pool closes without joining it
    (``detach``), and the op, let go, still reads into memory that stayed valid."""
    pool = make_pool(pools, 100, threads=1)
    host = Host(100, aligned=False)
    host.write(os.urandom(100))
    path = str(tmp_path / "r")
    wait(pool.submit(True, [IoOp(host.address, 0, path, b"r", -1)]))
    with pytest.raises(ValueError, match="give_up_s needs a deadline"):
        pool.submit(False, [IoOp(host.address, 0, path, b"r", -1)], None, 1.0)
    gate, opener = os.pipe()
    try:
        pool.set_gate(gate)
    finally:
        os.close(gate)
    out = Host(100, aligned=False)
    try:
        started = time.monotonic()
        job = pool.submit(False, [IoOp(out.address, 0, path, b"r", -1)], 0.2, 0.3)
        wait(job, timeout=10.0)
        assert time.monotonic() - started >= 0.45  # the deadline and the give-up passed
        assert job.late and job.results == [-errno.ETIMEDOUT] and job.error is None
        assert not job.ended and pool.running == 1
        finish = pool.detach()
        assert pool.closed and pool.running == 1
        with pytest.raises(RuntimeError, match="closed"):
            pool.submit(False, [IoOp(out.address, 0, path, b"r", -1)], 1.0, 1.0)
    finally:
        os.close(opener)  # the stuck op goes on
    deadline = time.monotonic() + 10.0
    while not job.ended:
        assert time.monotonic() < deadline, "the op let through did not end within 10 s"
        time.sleep(0.001)
    assert pool.running == 0 and job.results == [-errno.ETIMEDOUT]  # settled as given up
    assert out.read() == host.read()  # read on into memory that stayed valid
    finish()  # joins the idle threads


@contextlib.contextmanager
def fifo_writer_after(fifo: Path, seconds: float) -> Iterator[None]:
    """Bounds a test in which a FIFO's ``open()`` could hang: after ``seconds``, or when
    the context exits if sooner, a thread opens ``fifo`` for writing for a moment, which
    lets a reader blocked in ``open()`` go; the exit waits for that thread."""
    now = threading.Event()

    def opener() -> None:
        now.wait(seconds)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except FileNotFoundError:
                return  # gone: nobody can block on it
            except OSError:  # ENXIO: no reader (yet)
                time.sleep(0.01)
                continue
            time.sleep(0.2)
            os.close(fd)
            return

    thread = threading.Thread(target=opener, daemon=True)
    thread.start()
    try:
        yield
    finally:
        now.set()
        thread.join(10)


def test_a_read_of_anything_but_a_regular_file_fails_at_once(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    """A FIFO (whose open() would wait for a writer), a symlink (never followed: it
    could lead out of the tier) or a directory in place of a block file is a miss."""
    pool = make_pool(pools, 100, threads=1)
    host = Host(100, aligned=False)
    host.write(os.urandom(100))
    real = tmp_path / "real"
    wait(pool.submit(True, [IoOp(host.address, 0, str(real), b"k", -1)]))
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "dir").mkdir()
    names = ("fifo", "link", "dir")
    ops = [IoOp(host.address, 0, str(tmp_path / n), b"k", -1) for n in names]
    started = time.monotonic()
    with fifo_writer_after(tmp_path / "fifo", 3.0):
        job = wait(pool.submit(False, ops))
    took = time.monotonic() - started
    assert job.results == [-errno.EINVAL, -errno.ELOOP, -errno.EINVAL]
    assert took < 2.0, f"the read of a FIFO took {took:.1f}s: blocked in open()"


def test_the_fault_hook_fails_every_nth_op_without_touching_the_file(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    pool = make_pool(pools, 100, threads=1)
    pool.set_fault(True, 2, errno.ENOSPC)
    host = Host(100, aligned=False)
    ops = [IoOp(host.address, 0, str(tmp_path / f"f{i}"), b"f", -1) for i in range(6)]
    job = wait(pool.submit(True, ops))
    assert job.results == [100, -errno.ENOSPC] * 3
    assert job.failed == [1, 3, 5]
    assert sorted(os.listdir(tmp_path)) == ["f0", "f2", "f4"]
    # reads are not affected; then every read fails
    assert wait(pool.submit(False, ops[:1])).results == [100]
    pool.set_fault(False, 1, errno.EIO)
    assert wait(pool.submit(False, ops[:2])).results == [-errno.EIO] * 2
    pool.set_fault(False, 0, 0)
    pool.set_fault(True, 0, 0)
    assert wait(pool.submit(True, ops)).results == [100] * 6


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, capture_output=True)


def test_a_full_disk_ends_ops_with_enospc(small_tmpfs: Path, pools: list[IoPool]) -> None:
    pool = make_pool(pools, 8192, threads=2)
    host = Host(8192, aligned=True)
    host.write(os.urandom(8192))
    ops = [IoOp(host.address, 0, str(small_tmpfs / f"b{i}"), b"b", -1) for i in range(12)]
    job = wait(pool.submit(True, ops))
    assert -errno.ENOSPC in job.results
    assert set(job.results) <= {8192, -errno.ENOSPC}
    written = sorted(os.listdir(small_tmpfs))
    assert written == sorted(f"b{i}" for i, r in enumerate(job.results) if r > 0)  # no tmp left
    # and a slab on the full disk
    fd = os.open(small_tmpfs / "slab", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        slab_ops = [IoOp(host.address, i * slot_bytes(8192), None, b"s", fd) for i in range(8)]
        assert -errno.ENOSPC in wait(pool.submit(True, slab_ops)).results
    finally:
        os.close(fd)


# --- wake-ups and lifetime ---------------------------------------------------------------------


def test_a_finished_job_writes_the_bound_wake_fd(tmp_path: Path, pools: list[IoPool]) -> None:
    pool = make_pool(pools, 100, threads=2)
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        pool.bind(efd)
        host = Host(100, aligned=False)
        job = pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "w"), b"w", -1)])
        readable, _, _ = select.select([efd], [], [], 10.0)
        assert readable == [efd]
        assert os.eventfd_read(efd) >= 1
        assert job.query() and job.results == [100]
        # Rebinding to None: nothing is written any more.
        pool.bind(None)
        wait(pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "x"), b"x", -1)]))
        assert select.select([efd], [], [], 0.05)[0] == []
    finally:
        os.close(efd)


def test_close_finishes_queued_jobs_and_joins_the_threads(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    before = task_ids()
    pool = make_pool(pools, 100, threads=3)
    assert not pool.started and not task_ids() - before  # a pool never used holds no threads
    pool.set_delay(0.005)
    host = Host(100, aligned=False)
    jobs = [
        pool.submit(
            True, [IoOp(host.address, 0, str(tmp_path / f"{j}-{i}"), b"k", -1) for i in range(4)]
        )
        for j in range(4)
    ]
    lanes = task_ids() - before
    assert pool.started and len(lanes) == 3
    pool.close()
    assert not lanes & task_ids()  # joined: none left running
    for job in jobs:
        assert job.query() and job.results == [100] * 4
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(True, [])
    pool.close()  # idempotent

    idle = make_pool(pools, 100, threads=2)
    idle.close()
    assert not task_ids() - before


def test_a_dropped_pool_discards_its_queued_jobs_and_joins_its_threads(tmp_path: Path) -> None:
    before = task_ids()
    pool = IoPool(threads=2, payload_len=100, identity=IDENTITY, direct_files=False)
    blocker = Blocker(pool, tmp_path, 2)  # both workers busy until released
    host = Host(100, aligned=False)
    jobs = [
        pool.submit(True, [IoOp(host.address, 0, str(tmp_path / f"{j}"), b"k", -1)])
        for j in range(5)
    ]
    lanes = task_ids() - before
    assert len(lanes) == 2
    gone = weakref.ref(pool)

    def release_once_dropped() -> None:
        while gone() is not None:
            time.sleep(0.005)
        time.sleep(0.05)  # the finalizer discards the queued jobs, then joins
        blocker.release()

    releaser = threading.Thread(target=release_once_dropped, daemon=True)
    releaser.start()
    del pool
    gc.collect()
    releaser.join(10)
    assert not wait_gone(lanes), "the dropped pool's lanes are still running after 5 s"
    assert all(wait(job).error is None for job in blocker.jobs)
    for job in jobs:
        assert job.query()
        assert isinstance(job.error, OSError) and job.error.errno == errno.ECANCELED
        assert job.results == [-errno.ECANCELED]
    assert sorted(os.listdir(tmp_path)) == ["fifo0", "fifo1"]


def test_a_forked_child_cannot_submit(tmp_path: Path, pools: list[IoPool]) -> None:
    pool = make_pool(pools, 100, threads=1)
    host = Host(100, aligned=False)
    wait(pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "p"), b"p", -1)]))
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        with contextlib.suppress(BaseException):
            try:
                pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "c"), b"c", -1)])
            except RuntimeError:
                pool.close()  # touches nothing of the parent's
                code = 0 if pool.closed else 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (tmp_path / "c").exists()
    # the parent's pool still works
    assert wait(
        pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "q"), b"q", -1)])
    ).results == [100]


# --- values of a key-value store (the shared tier) -----------------------------------------


def _buffer(data: bytes | int) -> tuple[ctypes.Array[ctypes.c_char], int]:
    buf = (
        ctypes.create_string_buffer(data, len(data))
        if isinstance(data, bytes)
        else (ctypes.create_string_buffer(data))
    )
    return buf, ctypes.addressof(buf)


def test_values_pack_and_unpack_natively_with_the_documented_header(
    pools: list[IoPool],
) -> None:
    plen = 3 * 65536 + 123  # pieces of 64 KiB and a tail: the CRC chains across them
    pool = make_pool(pools, plen, threads=2)
    payloads = [os.urandom(plen) for _ in range(3)]
    keys = [b"k%d" % i * 5 for i in range(3)]
    sources = [_buffer(p) for p in payloads]
    values = [_buffer(HEADER_BYTES + plen) for _ in payloads]
    job = wait(
        pool.submit_values(True, [(s[1], v[1], k) for s, v, k in zip(sources, values, keys)])
    )
    assert job.results == [plen] * 3
    for (value, _), payload, key in zip(values, payloads, keys):
        block = value.raw
        check_block(block + bytes(slot_bytes(plen) - len(block)), payload, key)

    # Read back: each value checked, its payload copied to the destination.
    outs = [_buffer(plen) for _ in payloads]
    job = wait(pool.submit_values(False, [(o[1], v[1], k) for o, v, k in zip(outs, values, keys)]))
    assert job.results == [plen] * 3
    assert [o[0].raw for o in outs] == payloads

    # What does not match is refused, each with its errno.
    def unpack(value: bytes, key: bytes) -> int:
        v, o = _buffer(value), _buffer(plen)
        return wait(pool.submit_values(False, [(o[1], v[1], key)])).results[0]

    good = values[0][0].raw
    flipped_payload = bytearray(good)
    flipped_payload[HEADER_BYTES + plen - 1] ^= 1  # the last byte of the tail piece
    flipped_header = bytearray(good)
    flipped_header[40] ^= 1  # the payload CRC field: the header CRC no longer matches
    foreign = make_pool(pools, plen, identity=OTHER_IDENTITY)
    fv = _buffer(HEADER_BYTES + plen)
    wait(foreign.submit_values(True, [(sources[0][1], fv[1], keys[0])]))
    assert unpack(good, keys[0]) == plen
    assert unpack(bytes(flipped_payload), keys[0]) == -errno.EBADMSG
    assert unpack(bytes(flipped_header), keys[0]) == -errno.EBADMSG
    assert unpack(good, keys[1]) == -errno.EKEYREJECTED
    assert unpack(fv[0].raw, keys[0]) == -errno.ESTALE

    with pytest.raises(ValueError, match="host and a value address"):
        pool.submit_values(True, [(0, values[0][1], keys[0])])
    with pytest.raises(ValueError, match="a key must be"):
        pool.submit_values(True, [(sources[0][1], values[0][1], b"")])


# --- a block in slices (tensor parallelism: one slice per rank's host pool) -----------


class _Ranks:
    """``world`` host pools of ``slots`` slots of ``seg`` bytes each, at unrelated
    addresses (as each rank's shared pool file is mapped): slot ``s`` of rank ``r`` at
    ``bases[r] + s * seg``."""

    def __init__(self, world: int, slots: int, seg: int, aligned: bool = True) -> None:
        self.seg = seg
        self.hosts = [Host(slots * seg, aligned) for _ in range(world)]
        self.bases = [h.address for h in self.hosts]
        self.deltas = [b - self.bases[0] for b in self.bases]

    def address(self, slot: int) -> int:
        return self.bases[0] + slot * self.seg

    def slot(self, rank: int, slot: int) -> bytes:
        return self.hosts[rank].read()[slot * self.seg : (slot + 1) * self.seg]

    def fill(self, slot: int, slices: list[bytes]) -> None:
        for rank, data in enumerate(slices):
            ctypes.memmove(self.bases[rank] + slot * self.seg, data, self.seg)


@pytest.mark.parametrize("mode", ["slab", "files"])
def test_a_block_in_rank_slices_is_one_block_of_every_slice_and_reads_back_to_each(
    tmp_path: Path, pools: list[IoPool], mode: str
) -> None:
    world, seg = 3, 8192 + 512  # not a multiple of 4096: buffered through the stage
    pool = make_pool(pools, world * seg, threads=2)
    pool.set_segments(_Ranks(world, 1, seg).deltas)  # before the pool starts: applied later
    ranks = _Ranks(world, 2, seg)
    pool.set_segments(ranks.deltas)
    slices = [[os.urandom(seg) for _ in range(world)] for _ in range(2)]
    for slot in range(2):
        ranks.fill(slot, slices[slot])
    keys = [b"tp-a", b"tp-b"]
    fd = _open_slab(tmp_path / "slab", False) if mode == "slab" else -1
    slot_len = slot_bytes(world * seg)

    def ops(slots: list[int]) -> list[IoOp]:
        if mode == "slab":
            return [IoOp(ranks.address(s), s * slot_len, None, keys[s], fd) for s in slots]
        return [
            IoOp(ranks.address(s), 0, str(tmp_path / keys[s].decode()), keys[s], -1) for s in slots
        ]

    try:
        job = wait(pool.submit(True, ops([0, 1])))
        assert job.results == [world * seg] * 2
        for s in range(2):
            if mode == "slab":
                data = (tmp_path / "slab").read_bytes()[s * slot_len : (s + 1) * slot_len]
            else:
                data = (tmp_path / keys[s].decode()).read_bytes()
            check_block(data, b"".join(slices[s]), keys[s])  # every slice, rank order
        for h in ranks.hosts:
            ctypes.memset(h.address, 0, h.size)
        job = wait(pool.submit(False, ops([1, 0])))
        assert job.results == [world * seg] * 2
        for s in range(2):
            assert [ranks.slot(r, s) for r in range(world)] == slices[s]
        # One slice damaged: the block is refused and no rank's slot is written.
        if mode == "files":
            path = tmp_path / "tp-a"
            damaged = bytearray(path.read_bytes())
            damaged[HEADER_BYTES + 2 * seg + 5] ^= 1  # rank 2's slice
            path.write_bytes(bytes(damaged))
            for h in ranks.hosts:
                ctypes.memset(h.address, 0, h.size)
            job = wait(pool.submit(False, ops([0])))
            assert job.results == [-errno.EBADMSG]
            assert all(h.read() == bytes(h.size) for h in ranks.hosts)
    finally:
        if fd >= 0:
            os.close(fd)


def test_values_in_rank_slices_pack_and_unpack_whole(pools: list[IoPool]) -> None:
    world, seg = 2, 70_000  # more than a 64 KiB piece per slice
    pool = make_pool(pools, world * seg)
    ranks = _Ranks(world, 1, seg, aligned=False)
    pool.set_segments(ranks.deltas)
    slices = [os.urandom(seg) for _ in range(world)]
    ranks.fill(0, slices)
    value = _buffer(HEADER_BYTES + world * seg)
    assert wait(pool.submit_values(True, [(ranks.address(0), value[1], b"k")])).results == [
        world * seg
    ]
    check_block(
        value[0].raw + bytes(slot_bytes(world * seg) - len(value[0].raw)), b"".join(slices), b"k"
    )
    for h in ranks.hosts:
        ctypes.memset(h.address, 0, h.size)
    assert wait(pool.submit_values(False, [(ranks.address(0), value[1], b"k")])).results == [
        world * seg
    ]
    assert [ranks.slot(r, 0) for r in range(world)] == slices
    # A damaged value: refused, checked whole before any slice is written.
    bad = bytearray(value[0].raw)
    bad[HEADER_BYTES + seg + 1] ^= 1
    damaged = _buffer(bytes(bad))
    for h in ranks.hosts:
        ctypes.memset(h.address, 0, h.size)
    assert wait(pool.submit_values(False, [(ranks.address(0), damaged[1], b"k")])).results == [
        -errno.EBADMSG
    ]
    assert all(h.read() == bytes(h.size) for h in ranks.hosts)
    # The functions the shared tier calls on the loop for small batches do the same.
    lib = _io._library()
    ranks.fill(0, slices)
    again = _buffer(HEADER_BYTES + world * seg)
    assert (
        lib.ao_pack_value_segs(
            again[1], ranks.address(0), world * seg, IDENTITY, b"k", 1, world, pool.deltas
        )
        == 0
    )
    assert again[0].raw == value[0].raw
    assert lib.ao_unpack_value_segs(
        damaged[1],
        HEADER_BYTES + world * seg,
        ranks.address(0),
        world * seg,
        IDENTITY,
        b"k",
        1,
        world,
        pool.deltas,
    ) == (-errno.EBADMSG)
    assert (
        lib.ao_pack_value_segs(
            again[1], ranks.address(0), world * seg, IDENTITY, b"k", 1, 65, pool.deltas
        )
        == -3
    )


def test_bad_slices_are_refused_and_leave_the_pool_as_it_was(pools: list[IoPool]) -> None:
    pool = make_pool(pools, 3 * 4096)
    with pytest.raises(ValueError, match="1 to 64 slices, got 0"):
        pool.set_segments([])
    with pytest.raises(ValueError, match="1 to 64 slices, got 65"):
        pool.set_segments([0] * 65)
    with pytest.raises(ValueError, match="delta 0"):
        pool.set_segments([8, 0, 16])
    with pytest.raises(ValueError, match="12288 B does not split into 5 equal slices"):
        pool.set_segments([0, 1 << 20, 2 << 20, 3 << 20, 4 << 20])
    assert pool.nseg == 1 and pool.deltas is None
    pool.set_segments([0, 1 << 20, 2 << 20])
    assert pool.nseg == 3
    pool.set_segments([0])
    assert pool.nseg == 1 and pool.deltas is None


# --- idle write lanes (write_priority="idle") ---------------------------------------------


def test_idle_write_lanes_run_at_sched_idle_beside_normal_read_lanes(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    before = task_ids()
    pool = make_pool(pools, 100, threads=3, write_priority="idle")
    host = Host(100, aligned=False)
    host.write(os.urandom(100))
    wait(pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "w"), b"w", -1)]))
    # Each write lane takes SCHED_IDLE first thing once it runs (glibc cannot start a
    # thread in it); on a busy machine one may not have run yet: wait for it, bounded.
    want = sorted([os.SCHED_OTHER] * 3 + [os.SCHED_IDLE] * 3)
    deadline = time.monotonic() + 10.0
    while True:
        lanes = task_ids() - before
        policies = sorted(os.sched_getscheduler(int(tid)) for tid in lanes)
        if policies == want:
            break
        assert time.monotonic() < deadline, f"lane policies {policies} within 10 s, not {want}"
        time.sleep(0.001)
    assert pool.lanes_info() == (0, 0)  # no write helped, every write lane idle-class
    out = Host(100, aligned=False)
    read = wait(pool.submit(False, [IoOp(out.address, 0, str(tmp_path / "w"), b"w", -1)]))
    assert read.results == [100] and out.read() == host.read()
    pool.close()
    assert not lanes & task_ids()  # all six joined
    normal = make_pool(pools, 100, threads=3)
    wait(normal.submit(True, [IoOp(host.address, 0, str(tmp_path / "n"), b"n", -1)]))
    assert len(task_ids() - before) == 3  # one set of lanes, reads first


def test_idle_write_lanes_reads_do_not_wait_and_starved_writes_are_taken_by_read_lanes(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    """Write lanes that get no CPU (all taken at normal priority; here paused): a read
    is served at once by a read lane, and a write that waited 20 ms is taken by an idle
    read lane, so writes progress; the writes keep their order per file."""
    pool = make_pool(pools, 100, threads=2, write_priority="idle")
    host = Host(100, aligned=False)
    host.write(os.urandom(100))
    wait(pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "r"), b"r", -1)]))
    before, _ = pool.lanes_info()  # on a busy machine the first write may have been helped
    pool.pause_writers(True)
    t0 = time.monotonic()
    writes = [
        pool.submit(True, [IoOp(host.address, 0, str(tmp_path / f"w{i}"), b"w", -1)])
        for i in range(6)
    ]
    out = Host(100, aligned=False)
    read = wait(pool.submit(False, [IoOp(out.address, 0, str(tmp_path / "r"), b"r", -1)]))
    assert read.results == [100]
    for job in writes:
        wait(job)
        assert job.results == [100]
    assert time.monotonic() - t0 >= 0.02  # none was taken before it waited 20 ms
    helped, not_idle = pool.lanes_info()
    assert helped - before == 6 and not_idle == 0, (before, helped, not_idle)
    assert all((tmp_path / f"w{i}").exists() for i in range(6))
    pool.pause_writers(False)
    after = wait(pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "x"), b"x", -1)]))
    assert after.results == [100]  # write lanes back (helped only if they starve)


def test_idle_write_lanes_starved_for_cpu_are_helped_and_a_read_lane_stays_free(
    tmp_path: Path, pools: list[IoPool]
) -> None:
    """The pool's lanes on one CPU that another process keeps busy at normal priority:
    the idle write lane starves (its run-queue wait grows), so a read lane takes the
    writes and they all end. Behind slow writes a read lane stays free for reads."""
    cpu = min(os.sched_getaffinity(0))
    mask = os.sched_getaffinity(0)
    host = Host(100, aligned=False)
    host.write(os.urandom(100))
    spin = f"import os; os.sched_setaffinity(0, {{{cpu}}}); print(flush=True)\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
    try:
        assert hog.stdout is not None
        ready, _, _ = select.select([hog.stdout], [], [], 30.0)
        assert ready and hog.stdout.readline(), "the CPU hog did not start within 30 s"
        pool = make_pool(pools, 100, threads=1, write_priority="idle")
        os.sched_setaffinity(0, {cpu})  # the pool's threads, started now, inherit it
        try:
            wait(pool.submit(True, [IoOp(host.address, 0, str(tmp_path / "first"), b"f", -1)]))
        finally:
            os.sched_setaffinity(0, mask)
        # 256 writes: enough work that the starved lane cannot end them all in the few
        # slices SCHED_IDLE gets (64 were once all written unhelped in a make test).
        job = pool.submit(
            True, [IoOp(host.address, 0, str(tmp_path / f"w{i}"), b"w", -1) for i in range(256)]
        )
        wait(job, timeout=20.0)
    finally:
        hog.kill()
        hog.wait()
    assert job.results == [100] * 256
    helped, _ = pool.lanes_info()
    assert helped > 0, "no read lane took a write from the starved write lane"
    # Slow writes (50 ms an op): read lanes may help only while the write lanes starve
    # (on a busy machine a lane that wakes from its sleep starves too), and never the last
    # free one: a read submitted behind six of them ends before they do.
    slow = make_pool(pools, 100, threads=2, write_priority="idle")
    wait(slow.submit(True, [IoOp(host.address, 0, str(tmp_path / "s0"), b"s", -1)]))
    slow.set_delay(0.05)
    writes = [
        slow.submit(True, [IoOp(host.address, 0, str(tmp_path / f"s{i}"), b"s", -1)])
        for i in range(1, 7)
    ]
    out = Host(100, aligned=False)
    read = slow.submit(False, [IoOp(out.address, 0, str(tmp_path / "s0"), b"s", -1)])
    for job in [read, *writes]:
        wait(job)
    assert read.results == [100] and out.read() == host.read()
    assert all(w.results == [100] for w in writes)
    assert read.finished_ns < max(w.finished_ns for w in writes)


def test_write_priority_is_checked(pools: list[IoPool]) -> None:
    with pytest.raises(ValueError, match="write_priority must be one of idle, normal"):
        make_pool(pools, 100, write_priority="low")
    with pytest.raises(ValueError, match="threads must be 1 to 256"):
        make_pool(pools, 100, threads=257)
