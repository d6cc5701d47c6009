"""What the disk tier and the shared host pool file trust on the file system: FIFOs and
symlinks named like blocks, directories and files other users own or may write, the
temporary files of writers cut by a crash, and settings a file system cannot hold.

The suite runs as root here and in CI: another user is simulated with ``os.chown`` to
uid 65534 (nobody)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

import asyncoffload as ao
from asyncoffload.tiers import _io
from asyncoffload.tiers.base import new_index
from asyncoffload.tiers.disk import DiskStore, DiskTier
from asyncoffload.tiers.format import Namespace, pack_header
from asyncoffload.transfer.paged_engines import SharedHostFile
from tests.test_disk_io import fifo_writer_after
from tests.test_tiers import block, config, keys, kv_caches, store_to_disk_only
from tests.test_tiers import store as store_blocks

pytestmark = pytest.mark.skipif(not _io.available(), reason="native I/O lanes not built")

OTHER_UID = 65534
BLOCK = 8192
NAMESPACE = Namespace("trust-model", "uint8", "test", BLOCK)


def tier(path: Path | str, mode: str = "files", capacity: int = 16 * (4096 + BLOCK)) -> DiskTier:
    return DiskTier(path, capacity, mode, admission=None)


@pytest.fixture
def opened() -> Iterator[list[DiskStore]]:
    """Stores a test opened, closed at its end."""
    stores: list[DiskStore] = []
    yield stores
    for store in stores:
        store.close()


def open_store(stores: list[DiskStore], path: Path, mode: str = "files") -> DiskStore:
    store = tier(path, mode).open(NAMESPACE)
    stores.append(store)
    return store


def forged_block(key: bytes) -> bytes:
    """A block of ``key`` that passes every check of this namespace."""
    payload = os.urandom(BLOCK)
    return pack_header(NAMESPACE.identity(), key, payload) + payload


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def started_at(pid: int) -> float:
    """When process ``pid`` started, in seconds since the epoch (from /proc)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
    with open("/proc/stat", "rb") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


# --- 1. FIFOs and symlinks named like blocks ------------------------------------------


def test_a_fifo_named_like_a_block_does_not_hang_construction(
    tmp_path: Path, opened: list[DiskStore]
) -> None:
    store = open_store(opened, tmp_path)
    fifo = store.path_of(keys(1)[0])
    store.close()
    os.mkfifo(fifo)
    started = time.monotonic()
    with fifo_writer_after(fifo, 3.0):  # bounds the test if open() blocks
        again = open_store(opened, tmp_path)
    took = time.monotonic() - started
    assert took < 2.0, f"the constructor took {took:.1f}s: blocked opening a FIFO"
    assert again.recovered == 0
    assert not os.path.lexists(fifo), "the FIFO named like a block was not removed"


def test_a_symlink_named_like_a_block_is_removed_never_followed(
    tmp_path: Path, opened: list[DiskStore]
) -> None:
    store = open_store(opened, tmp_path / "tier")
    key = keys(1)[0]
    link = store.path_of(key)
    store.close()
    outside = tmp_path / "outside.kv"
    outside.write_bytes(forged_block(key))
    link.symlink_to(outside)
    again = open_store(opened, tmp_path / "tier")
    assert again.recovered == 0 and not new_index(again.index_spec).ready(key)
    assert not os.path.lexists(link) and outside.exists()


async def test_a_fifo_swapped_in_under_an_indexed_block_is_a_miss_and_aclose_returns(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "files")
    ks = keys(2)
    eng = ao.AsyncOffloadEngine(kv_caches(), cfg)
    try:
        await store_to_disk_only(eng, ks, [0, 1])
        store = eng.tiers[0]
        assert isinstance(store, DiskStore)
        fifo = store.path_of(ks[0])
        fifo.unlink()
        os.mkfifo(fifo)
        # The writer bounds the test if a lane blocks in open(); the limits below leave a
        # busy machine room, and a lane blocked until the writer comes exceeds them.
        with fifo_writer_after(fifo, 8.0):
            started = time.monotonic()
            with pytest.raises(ao.TransferError, match="EINVAL"):
                await asyncio.wait_for(await eng.prepare_load(ks, [10, 11]), 10)
            took = time.monotonic() - started
            assert took < 4.0, f"the load of a FIFO took {took:.1f}s: a lane blocked in open()"
            assert eng.lookup(ks) == 0
            started = time.monotonic()
            await asyncio.wait_for(eng.aclose(), 10)
            closed_in = time.monotonic() - started
        assert closed_in < 4.0, f"aclose() took {closed_in:.1f}s: a lane stuck in open()"
    finally:
        await asyncio.wait_for(eng.aclose(), 10)


# --- 2. directories and files others can write ----------------------------------------


@pytest.mark.parametrize("mode", ["files", "slab"])
@pytest.mark.parametrize("bits", [0o777, 0o770, 0o757], ids=oct)
def test_a_tier_root_others_may_write_is_refused(
    tmp_path: Path, opened: list[DiskStore], mode: str, bits: int
) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(bits)
    with pytest.raises(PermissionError, match=rf"{root}: writable by group or others.*{bits:04o}"):
        open_store(opened, root, mode)
    assert os.listdir(root) == []


def test_a_sticky_world_writable_root_is_accepted(tmp_path: Path, opened: list[DiskStore]) -> None:
    """Like /tmp: others may add entries but not rename or remove ours."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    store = open_store(opened, root)
    assert stat.S_IMODE(store.dir.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", ["files", "slab"])
def test_a_tier_root_of_another_user_is_refused(
    tmp_path: Path, opened: list[DiskStore], mode: str
) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)
    os.chown(root, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=rf"{root}: owned by uid {OTHER_UID}, not by"):
        open_store(opened, root, mode)


def test_a_tier_root_symlink_of_another_user_is_refused(
    tmp_path: Path, opened: list[DiskStore]
) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "kv"
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=rf"{link}: a symlink owned by uid {OTHER_UID}"):
        open_store(opened, link)
    assert os.listdir(target) == []


@pytest.mark.parametrize("bits", [0o777, 0o775, 0o757], ids=oct)
def test_an_ancestor_group_or_others_may_write_is_refused_unless_sticky(
    tmp_path: Path, opened: list[DiskStore], bits: int
) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(bits)
    with pytest.raises(
        PermissionError,
        match=rf"{open_dir}: writable by group or others and not sticky \(mode {bits:04o}\)",
    ):
        open_store(opened, open_dir / "kv")
    assert os.listdir(open_dir) == []  # nothing made under it
    open_dir.chmod(bits | stat.S_ISVTX)
    open_store(opened, open_dir / "kv")


@pytest.mark.parametrize("mode", ["files", "slab"])
def test_an_ancestor_another_user_owns_is_refused_and_nothing_is_made_in_it(
    tmp_path: Path, opened: list[DiskStore], mode: str
) -> None:
    """/tmp/X made by another user before DiskTier("/tmp/X/kv"): they could rename kv
    away and plant their own tree under the running engine."""
    theirs = tmp_path / "X"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, -1)
    with pytest.raises(
        PermissionError,
        match=rf"{theirs}: owned by uid {OTHER_UID}, not by .*: its owner could rename a "
        rf"directory above {theirs / 'kv' / 'deep'}.*every directory belongs to this user",
    ):
        open_store(opened, theirs / "kv" / "deep", mode)
    assert os.listdir(theirs) == []


def test_a_symlinked_ancestor_another_user_owns_is_refused(
    tmp_path: Path, opened: list[DiskStore]
) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = sticky / "link"
    link.symlink_to(real)
    os.lchown(link, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=rf"{link}: a symlink owned by uid {OTHER_UID}"):
        open_store(opened, link / "kv")
    assert os.listdir(real) == []
    os.lchown(link, 0, -1)  # root's (or ours): followed, and the target checked
    store = open_store(opened, link / "kv")
    assert (real / "kv" / NAMESPACE.dirname()).is_dir() and store.dir == link / "kv" / (
        NAMESPACE.dirname()
    )


def test_a_symlink_loop_in_the_path_is_an_error_not_a_hang(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(OSError, match="too many levels of symlinks"):
        tier(tmp_path / "a" / "kv").open(NAMESPACE)


@contextlib.contextmanager
def shared_base() -> Iterator[Path]:
    """A directory under /tmp that uid 65534 can reach (pytest's tmp_path is root's
    0700), removed at the end."""
    base = Path(tempfile.mkdtemp(prefix="ao-trust-", dir="/tmp"))
    try:
        base.chmod(0o755)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_other_user(script: str) -> None:
    """Run ``script`` (sh) as uid/gid 65534 with no supplementary groups: a second local
    user."""
    subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "sh",
         "-ec", script],
        check=True,
        timeout=30,
        capture_output=True,
    )  # fmt: skip


async def test_an_ancestor_renamed_mid_run_changes_nothing_the_tier_reads_or_writes() -> None:
    """The tier passed its checks at open; later an ancestor's parent comes under
    another user's control (an administrator's chown), and that user renames the tree
    away and plants a namespace directory of their own, with a forged block that passes
    every check, at the old path. The engine still reads its own blocks and writes into
    its own tree: it works relative to the directory it opened, not by path."""
    kv = kv_caches()
    with shared_base() as base:
        top = base / "top"
        top.mkdir(mode=0o755)
        path = top / "X" / "kv"
        cfg = config(path, "files")
        eng = ao.AsyncOffloadEngine(kv, cfg)
        try:
            ks = keys(3)
            want = [block(kv, i) for i in range(2)]
            await store_to_disk_only(eng, ks[:2], [0, 1])
            disk = eng.tiers[0]
            assert isinstance(disk, DiskStore)
            ns = disk.dir.name
            os.chown(top, OTHER_UID, OTHER_UID)  # the administrator's mistake
            plant = [f"mv {top}/X {top}/X.moved"]
            for key in ks[:2]:  # forged blocks that pass every check (no MAC key here)
                forged = os.urandom(BLOCK)
                forged_file = base / f"{key.hex()}.kv"
                forged_file.write_bytes(pack_header(disk.identity, bytes(key), forged) + forged)
                forged_file.chmod(0o644)
                sub = f"{top}/X/kv/{ns}/{key.hex()[:2]}"
                plant += [f"mkdir -p {sub}", f"cp {forged_file} {sub}/"]
            plant.append(f"chmod -R 777 {top}/X")
            as_other_user(" && ".join(plant))
            for t in kv:
                t[10:12].zero_()
            await asyncio.wait_for(await eng.prepare_load(ks[:2], [10, 11]), 10)
            assert [block(kv, 10), block(kv, 11)] == want, "the planted block was read"
            # A later write lands in the engine's own (moved) tree, not the planted one.
            await store_blocks(eng, [ks[2]], [2])
            mine = top / "X.moved" / "kv" / ns / ks[2].hex()[:2] / f"{ks[2].hex()}.kv"
            planted = top / "X" / "kv" / ns / ks[2].hex()[:2] / f"{ks[2].hex()}.kv"
            assert mine.is_file() and not planted.exists()
        finally:
            await asyncio.wait_for(eng.aclose(), 10)


def test_a_namespace_dir_another_user_made_with_a_forged_block_is_refused(
    tmp_path: Path, opened: list[DiskStore]
) -> None:
    """Another user who could write the tier's path made the namespace directory first
    and planted a block that passes every check: nothing of it is read."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    key = keys(1)[0]
    ns_dir = root / NAMESPACE.dirname()
    sub = ns_dir / key.hex()[:2]
    sub.mkdir(parents=True)
    (sub / f"{key.hex()}.kv").write_bytes(forged_block(key))
    for path in (ns_dir, sub):
        os.chown(path, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=rf"{ns_dir}: owned by uid {OTHER_UID}, not by"):
        open_store(opened, root)


@pytest.mark.parametrize("bits", [0o770, 0o707], ids=oct)
def test_a_namespace_dir_others_may_write_is_refused(
    tmp_path: Path, opened: list[DiskStore], bits: int
) -> None:
    store = open_store(opened, tmp_path)
    store.close()
    store.dir.chmod(bits)
    with pytest.raises(PermissionError, match=rf"{store.dir}: writable by group or others"):
        open_store(opened, tmp_path)


def test_a_subdirectory_symlinked_outside_the_tier_is_refused(
    tmp_path: Path, opened: list[DiskStore]
) -> None:
    store = open_store(opened, tmp_path / "kv")
    store.close()
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    key = keys(1)[0]
    (outside / f"{key.hex()}.kv").write_bytes(forged_block(key))
    sub = store.dir / key.hex()[:2]
    sub.rmdir()
    sub.symlink_to(outside)
    with pytest.raises(PermissionError, match=rf"{sub}: a symlink"):
        open_store(opened, tmp_path / "kv")
    assert os.listdir(outside) == [f"{key.hex()}.kv"]


def test_a_subdirectory_of_another_user_is_refused(tmp_path: Path, opened: list[DiskStore]) -> None:
    store = open_store(opened, tmp_path)
    store.close()
    sub = store.dir / "7f"
    os.chown(sub, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=rf"{sub}: owned by uid {OTHER_UID}"):
        open_store(opened, tmp_path)


# --- 2. the shared host pool file ------------------------------------------------------


def test_a_host_pool_file_of_another_user_is_refused(tmp_path: Path) -> None:
    made = SharedHostFile.create(tmp_path / "rank0.pool", 2, 4096)
    try:
        os.chown(made.path, OTHER_UID, -1)
        with pytest.raises(PermissionError, match=rf"{made.path}: owned by uid {OTHER_UID}"):
            SharedHostFile.open(made.path, 2, 4096)
        started = time.monotonic()
        with pytest.raises(PermissionError, match=rf"{made.path}: owned by uid {OTHER_UID}"):
            SharedHostFile.wait_open(made.path, 2, 4096, timeout_s=10)
        assert time.monotonic() - started < 2.0, "wait_open waited past a foreign file"
    finally:
        made.close()


@pytest.mark.parametrize("bits", [0o620, 0o602, 0o666], ids=oct)
def test_a_host_pool_file_others_may_write_is_refused(tmp_path: Path, bits: int) -> None:
    made = SharedHostFile.create(tmp_path / "rank0.pool", 2, 4096)
    try:
        os.chmod(made.path, bits)
        with pytest.raises(PermissionError, match=rf"{made.path}: writable by group or others"):
            SharedHostFile.open(made.path, 2, 4096)
    finally:
        made.close()


def test_a_host_pool_in_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "shm"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match=rf"{folder}: writable by group or others"):
        SharedHostFile.create(folder / "rank0.pool", 2, 4096)
    assert os.listdir(folder) == []
    folder.chmod(0o1777)  # sticky, as /dev/shm
    SharedHostFile.create(folder / "rank0.pool", 2, 4096).close()


def test_the_scheduler_logs_a_foreign_host_pool_and_turns_tier_io_off(
    tmp_path: Path, opened: list[DiskStore], caplog: pytest.LogCaptureFixture
) -> None:
    """Under vLLM the scheduler maps the worker's pool file: one another user owns is an
    error in the log naming the file, and tier I/O stays off (never a crash of the
    scheduler's step)."""
    from asyncoffload.integrations.vllm.tiers import SchedulerTiers
    from asyncoffload.manager import CPUOffloadingManager

    made = SharedHostFile.create(tmp_path / "rank0.pool", 4, BLOCK)
    try:
        os.chown(made.path, OTHER_UID, -1)
        store = open_store(opened, tmp_path / "disk")
        tiers = SchedulerTiers(CPUOffloadingManager(4), [store], made.path, 4, BLOCK)
        try:
            with caplog.at_level(logging.ERROR, logger="asyncoffload.vllm"):
                assert tiers._pool_base() is None
            assert not tiers.pool_mapped
            assert f"{made.path}: owned by uid {OTHER_UID}" in caplog.text
            assert os.path.exists(made.path), "the foreign file was unlinked"
        finally:
            tiers.close()
    finally:
        made.close()


# --- 10. temporary files of writes cut by a crash ---------------------------------------


def test_temp_files_of_dead_writers_are_removed_and_live_ones_kept(
    tmp_path: Path, opened: list[DiskStore]
) -> None:
    store = open_store(opened, tmp_path)
    store.close()
    key = keys(1)[0].hex()
    sub = store.dir / key[:2]
    dead = dead_pid()
    stale = [
        sub / f"{key}.kv.tmp.{dead}.{dead}.0",
        store.dir / f".namespace.{dead}.0a1b2c3d",
    ]
    kept = [
        sub / f"{key}.kv.tmp.{os.getpid()}.7.1",  # this process: another engine may write
        sub / f"{key}.kv.tmp.{os.getppid()}.8.2",  # a live process older than the file
    ]
    for path in stale + kept:
        path.write_bytes(b"x" * 4096)
    again = open_store(opened, tmp_path)
    assert [p for p in stale if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    assert again.stale_temps == len(stale)


def test_a_temp_file_older_than_its_writers_pid_is_removed(
    tmp_path: Path, opened: list[DiskStore]
) -> None:
    """A pid can be reused: a live process that started after the file was last written
    is not its writer."""
    store = open_store(opened, tmp_path)
    store.close()
    key = keys(1)[0].hex()
    reused = store.dir / key[:2] / f"{key}.kv.tmp.{os.getpid()}.1.3"
    reused.write_bytes(b"x")
    before_us = started_at(os.getpid()) - 30  # and less than an hour ago: only the start time tells
    os.utime(reused, (before_us, before_us))
    again = open_store(opened, tmp_path)
    assert not reused.exists()
    assert again.stale_temps == 1


@pytest.mark.parametrize("pid", [2**31, 2**63, 10**30, 0])
def test_a_temp_file_naming_a_pid_no_process_can_have_is_stale(
    tmp_path: Path, opened: list[DiskStore], pid: int
) -> None:
    """A pid of 2**31 or more made os.kill raise OverflowError, and the engine could not
    start; no process has such a pid (nor 0), so the file is a dead writer's."""
    store = open_store(opened, tmp_path)
    store.close()
    key = keys(1)[0].hex()
    odd = [store.dir / key[:2] / f"{key}.kv.tmp.{pid}.1.3", store.dir / f".namespace.{pid}.0a"]
    for path in odd:
        path.write_bytes(b"x")
    again = open_store(opened, tmp_path)
    assert [p for p in odd if p.exists()] == []
    assert again.stale_temps == 2


# --- 11. settings a file system cannot hold ----------------------------------------------


def test_a_slab_larger_than_any_file_is_refused_at_settings_time(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"capacity 10{30} is larger than any file.*slab"):
        DiskTier(tmp_path, 10**30)
    DiskTier(tmp_path, 10**30, "files")  # files mode: a count of files, no one file


def test_a_slab_the_file_system_cannot_hold_names_the_tier_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """1 PiB: ext4 refuses a file that large (EFBIG), others have no room (ENOSPC)."""
    with pytest.raises(OSError, match=rf"disk tier disk: capacity={2**50} .* {tmp_path}") as err:
        tier(tmp_path, "slab", capacity=2**50).open(NAMESPACE)
    assert err.value.errno is not None
    assert os.listdir(tmp_path) == []


def test_an_empty_path_is_refused(tmp_path: Path) -> None:
    for empty in ("", "  "):
        with pytest.raises(ValidationError, match="path is empty"):
            DiskTier(empty, "1GiB")


def test_a_tilde_in_the_path_is_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert DiskTier("~/kv", "1GiB").path == tmp_path / "kv"
    assert not (tmp_path / "~").exists()
    with pytest.raises(ValidationError, match="cannot be expanded"):
        DiskTier("~no-such-user-here/kv", "1GiB")
