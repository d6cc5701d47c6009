"""The disk tier: KV blocks in files, read and written by native I/O lanes.

Two layouts:

- ``slab`` (default): one preallocated file per engine, fixed slots of
  :func:`~asyncoffload.tiers.format.block_file_bytes` each, opened with ``O_DIRECT`` and
  mode 0600 (blocks encode user prompts), unlinked as soon as it is open (a crashed
  engine leaves nothing behind). The index lives in memory: the tier starts empty.
- ``files``: one file per block, ``<path>/<namespace dir>/<xx>/<key hex>.kv``, published
  by writing a temporary file and renaming it over the name. A restarted engine finds
  the blocks of the previous run (each header is checked first); engines of one
  namespace may share the directory. A block the index lets go (evicted, dropped) has
  its file removed by the lanes too (:meth:`DiskStore.forget`), after any write of it
  submitted before and before any submitted after.

Every block carries the header of :mod:`asyncoffload.tiers.format`. The lanes check it
and the payload's CRC32C on every read; a block that fails, or a short read, is a miss:
its index entry goes in the same step and a removed event says so.

An operation stuck in a system call (a hung mount, a dying disk) is given up on
:data:`GIVE_UP_S` after its deadline: its job ends as timed out (``late``: the tier
hierarchy holds its host slots until it really ends), and a tier closed while one runs
keeps its lanes and files open (``_io.keep_until_ended``) instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import stat
import time
import uuid
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, SecretBytes, field_validator, model_validator

from asyncoffload._ownership import open_private_dir, open_root_dir
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import Medium
from asyncoffload.tiers.base import IndexSpec, LowerTier
from asyncoffload.tiers.format import (
    HEADER_BYTES,
    Namespace,
    block_file_bytes,
    parse_header,
)
from asyncoffload.tiers.settings import WRITE_PRIORITY_HELP, TierSettings
from asyncoffload.transfer.base import CopyJob
from asyncoffload.validators import ByteSize

if TYPE_CHECKING:
    from asyncoffload.tiers._io import IoJob

__all__ = ["DiskStore", "DiskTier"]

log = logging.getLogger("asyncoffload.tiers")

_SUFFIX = ".kv"
#: A files-mode write's temporary file (disk_io.c): ``<key hex>.kv.tmp.<pid>.<tid>.<n>``,
#: and the namespace description's: ``.namespace.<pid>.<hex>``.
_TEMP = re.compile(r"[0-9a-f]+\.kv\.tmp\.(\d+)\.\d+\.\d+|\.namespace\.(\d+)\.[0-9a-f]+")
#: A temporary file this old is stale even if a process of its writer's pid runs (the
#: pid was reused): no block write takes an hour.
_TEMP_STALE_S = 3600.0
#: The largest file offset (off_t): a slab cannot be larger.
_MAX_FILE_BYTES = 2**63 - 1
#: Linux's largest pid_max (2**22): no process has a larger pid.
_PID_MAX = 1 << 22
#: Seconds after its deadline when a job whose op is still running (stuck in a system
#: call) ends as timed out, its ops left to run on.
GIVE_UP_S = 1.0


class DiskTier(TierSettings):
    """Settings of a disk tier below the CPU tier: ``DiskTier(path, capacity, mode)``.

    ``capacity`` is in bytes (an int or a string like ``"64GiB"``); the tier holds
    ``capacity // block_file_bytes(block_bytes)`` blocks. ``admission="frequency"``
    (default) writes a block the ``min_offers``-th time it is offered (2: spares the SSD
    blocks used once, as Dynamo KVBM does); ``None`` writes every block; a registered
    filter name (``"ghost"``, ``"adaptive"``) uses that filter.
    """

    _positional = ("path", "capacity", "mode")
    _positional_words = "path, capacity and mode"

    kind: Literal["disk"] = "disk"
    path: Path = Field(
        description="Directory of the tier's files (created if missing); a leading '~' is "
        "expanded; must not be empty."
    )
    capacity: ByteSize = Field(description="Bytes of disk the tier may use.")
    mode: Literal["slab", "files"] = "slab"
    policy: str = Field("lru", description="Eviction policy of the tier's index.")
    quotas: dict[str, int | str] = Field(
        default_factory=dict,
        description="Tenant quotas of this tier, {tenant: quota}: blocks (an int), a share "
        "('25%') or bytes ('512MiB'); each tenant must be one of the engine's tenants.",
    )
    admission: str | None = Field(
        "frequency", description="'frequency' (min_offers), None, or a filter name."
    )
    min_offers: int = Field(2, ge=1, description="Offers before a block is written.")
    direct_io: bool | None = Field(
        None,
        description="O_DIRECT: None tries it and falls back to buffered I/O with one "
        "warning where the filesystem refuses it; True requires it; False never.",
    )
    io_threads: int = Field(
        4,
        ge=1,
        le=64,
        description="Native I/O lanes: read lanes, and as many write lanes with "
        'write_priority="idle" (lanes that take both with "normal").',
    )
    write_priority: Literal["normal", "idle"] = Field(
        "idle",
        description=WRITE_PRIORITY_HELP,
    )
    deadline_s: float = Field(
        30.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="An operation not started this long after submission fails; one still "
        "running a second later (stuck in a system call) is given up on (at most a day).",
    )
    mac_key: SecretBytes | None = Field(
        None,
        description="Authenticate blocks with a keyed BLAKE2b MAC: 16 to 64 bytes (a str: "
        "its UTF-8 bytes). Blocks without it, or with another key's, are misses.",
    )

    def __init__(self, *args: Any, **data: Any) -> None:
        """``DiskTier(path, capacity, mode, **settings)``, the first three also by name.
        An explicit ``None`` for any of them is an error, not its default."""
        super().__init__(*args, **data)  # (here for mypy's pydantic plugin)

    @field_validator("path", mode="before")
    @classmethod
    def _path(cls, value: object) -> object:
        if isinstance(value, (str, os.PathLike)):
            text = os.fspath(value)
            if isinstance(text, str) and not text.strip():
                raise ValueError(
                    "path is empty: give the directory of the tier's files (an empty path "
                    "would put them in the current directory)"
                )
            if isinstance(text, str) and text.startswith("~"):
                expanded = os.path.expanduser(text)
                if expanded.startswith("~"):
                    raise ValueError(f"path {text!r}: '~' cannot be expanded (no such user)")
                return expanded
        return value

    @model_validator(mode="after")
    def _positive(self) -> DiskTier:
        if self.capacity <= 0:
            raise ValueError(f"capacity must be positive, got {self.capacity}")
        if self.mode == "slab" and self.capacity > _MAX_FILE_BYTES:
            raise ValueError(
                f"capacity {self.capacity} is larger than any file can be (2**63 - 1 "
                f"bytes): a slab tier at {self.path} is one file of that size"
            )
        return self

    def blocks_for(self, block_bytes: int) -> int:
        """How many blocks of ``block_bytes`` the capacity holds."""
        return self.capacity // block_file_bytes(block_bytes)

    def open(self, namespace: Namespace, name: str = "disk") -> DiskStore:
        """The running tier for ``namespace`` (the engine calls this)."""
        return DiskStore(self, namespace, name)


def _probe_direct(dir_fd: int) -> bool:
    """Whether files in the directory ``dir_fd`` can be opened with O_DIRECT (tmpfs and
    some overlay filesystems refuse it with EINVAL)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = f".direct-probe.{os.getpid()}.{secrets.token_hex(4)}"
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(probe, flags, 0o600, dir_fd=dir_fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(probe, dir_fd=dir_fd)
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe, dir_fd=dir_fd)
    return True


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from ``/proc``; ``None``
    where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def _writer_alive(pid: int, mtime: float) -> bool:
    """Whether process ``pid`` may still be writing a temporary file last modified at
    ``mtime``: it runs, it started before then (a later process that got the same pid
    is not the writer), and the file is less than :data:`_TEMP_STALE_S` old."""
    if not 0 < pid <= _PID_MAX:  # no process has it (a pid os.kill cannot even take)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it runs
    start = _process_start(pid)
    if start is not None and start > mtime + 1.0:  # btime has a one-second grain
        return False
    return time.time() - mtime < _TEMP_STALE_S


class DiskStore(LowerTier):
    """A running disk tier (see the module docstring); made by :meth:`DiskTier.open`."""

    medium = Medium.DISK

    def __init__(self, config: DiskTier, namespace: Namespace, name: str = "disk") -> None:
        from asyncoffload.tiers._io import require

        require("the disk tier")
        self.config = config
        self.name = name
        self.deadline_s = config.deadline_s
        # Authenticated blocks: the key's fingerprint is part of the identity (so of every
        # header and of files mode's directory name).
        mac_key = config.mac_key.get_secret_value() if config.mac_key else None
        namespace = namespace.with_mac_key(mac_key)
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.slot_bytes = block_file_bytes(self.block_bytes)
        num_blocks = config.blocks_for(self.block_bytes)
        if num_blocks <= 0:
            raise ValueError(
                f"disk tier {name}: capacity {config.capacity} holds no block of "
                f"{self.slot_bytes} bytes on disk"
            )
        self.num_blocks = num_blocks
        threshold = config.min_offers if config.admission == "frequency" else 0
        admission = config.admission if config.admission not in (None, "frequency") else None
        self.index_spec = IndexSpec(
            num_blocks,
            Medium.DISK,
            config.policy,
            threshold,
            admission=admission,
            pin_budget=config.pin_budget,
        )
        self._closed = False
        #: Files mode: removals submitted (:meth:`forget`), oldest first, until they ended.
        self._removals: deque[IoJob] = deque()
        self._fd = -1
        #: Files mode: the namespace directory, opened once; every block file is opened,
        #: written and removed relative to it (see asyncoffload._ownership).
        self._dir_fd = -1
        self.identity = namespace.identity()
        root = Path(config.path)
        root_fd = open_root_dir(root, f"disk tier {name}", create=True)
        try:
            self._open(config, root, root_fd, name, mac_key)
        except BaseException:
            self._release_fds()
            raise
        finally:
            os.close(root_fd)

    def _open(
        self, config: DiskTier, root: Path, root_fd: int, name: str, mac_key: bytes | None
    ) -> None:
        from asyncoffload.tiers._io import IoPool

        want = config.direct_io
        direct = _probe_direct(root_fd) if want is not False else False
        if want and not direct:
            raise OSError(
                errno.EINVAL, f"disk tier {name}: direct_io=True but {root} refuses O_DIRECT"
            )
        if want is None and not direct:
            log.warning(
                "disk tier %s: %s refuses O_DIRECT (tmpfs or an overlay filesystem?): "
                "buffered I/O, which uses the page cache",
                name,
                root,
            )
        self.direct_io = direct
        self.dir = root
        if config.mode == "slab":
            self._open_slab(root, root_fd)
        else:
            self.dir = root / self.namespace.dirname()
            self._open_files(root_fd)
        self._pool = IoPool(
            threads=config.io_threads,
            payload_len=self.block_bytes,
            identity=self.identity,
            direct_files=direct,
            mac_key=mac_key,
            write_priority=config.write_priority,
        )

    # --- layouts --------------------------------------------------------------------

    def _open_slab(self, root: Path, root_fd: int) -> None:
        name = f"asyncoffload-{os.getpid()}-{uuid.uuid4().hex}.slab"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        flags |= getattr(os, "O_NOFOLLOW", 0)
        if self.direct_io:
            flags |= os.O_DIRECT
        fd = os.open(name, flags, 0o600, dir_fd=root_fd)
        # Unlinked before it is sized: nothing else may open it, and a crash (or a size
        # the file system refuses) leaves nothing behind.
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=root_fd)
        size = self.num_blocks * self.slot_bytes
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise self._slab_error(exc, root, size) from None
                # fallocate refused (some network filesystems): a sparse file instead.
                log.warning("disk tier %s: fallocate refused (%s): sparse slab", self.name, exc)
                try:
                    os.ftruncate(fd, size)
                except OSError as exc2:
                    raise self._slab_error(exc2, root, size) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _slab_error(self, exc: OSError, root: Path, size: int) -> OSError:
        code = exc.errno or errno.EIO
        if code == errno.ENOSPC:
            why = "has no room for it"
        elif code in (errno.EFBIG, errno.EINVAL):
            why = "cannot hold a file that large (a smaller capacity, or files mode)"
        else:
            why = f"refused it: {exc.strerror or exc}"
        return OSError(
            code,
            f"disk tier {self.name}: capacity={self.config.capacity} needs a {size}-byte "
            f"slab in {root}, and its file system {why}",
        )

    def _open_files(self, root_fd: int) -> None:
        ns_dir = self.dir
        what = f"disk tier {self.name}"
        self._dir_fd = fd = open_private_dir(ns_dir.name, what, root_fd, ns_dir)
        try:
            os.stat("namespace.json", dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            tmp = f".namespace.{os.getpid()}.{secrets.token_hex(4)}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            out = os.open(tmp, flags, 0o600, dir_fd=fd)
            with os.fdopen(out, "w") as f:
                f.write(json.dumps(self.namespace.describe(), indent=1) + "\n")
            os.replace(tmp, "namespace.json", src_dir_fd=fd, dst_dir_fd=fd)
        for i in range(256):
            os.close(open_private_dir(f"{i:02x}", what, fd, ns_dir / f"{i:02x}"))
        self._recover()

    def path_of(self, key: OffloadKey) -> Path:
        """Where the file of ``key`` is (files mode), as of the tier's opening: the tier
        itself uses the name relative to its namespace directory (:meth:`name_of`)."""
        return self.dir / self.name_of(key)

    @staticmethod
    def name_of(key: OffloadKey) -> str:
        """The file of ``key`` relative to the namespace directory (files mode)."""
        hexkey = key.hex()
        return f"{hexkey[:2]}/{hexkey}{_SUFFIX}"

    def _recover(self) -> None:
        """Index the blocks a previous run left (files mode): each must be a regular
        file (anything else named like a block, a FIFO or a symlink, is removed unread)
        whose header parses and matches this namespace, the file's name and its size;
        the newest ``num_blocks`` are kept, in age order (the newest is the most recently
        used). Temporary files of writers that are gone are removed."""
        found: list[tuple[float, OffloadKey]] = []
        skipped = removed = 0
        started = time.monotonic()
        temps = self._remove_stale_temps(self._dir_fd)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        for i in range(256):  # only the subdirectories checked in _open_files
            sub = os.open(f"{i:02x}", flags, dir_fd=self._dir_fd)
            try:
                for entry in os.scandir(sub):
                    name = entry.name
                    if not name.endswith(_SUFFIX):
                        temps += self._remove_if_stale_temp(entry, sub)
                        continue
                    if not entry.is_file(follow_symlinks=False):
                        skipped += 1
                        if not entry.is_dir(follow_symlinks=False):
                            with contextlib.suppress(OSError):
                                os.unlink(name, dir_fd=sub)  # a symlink: removed, not followed
                                removed += 1
                        continue
                    checked = self._check_file(sub, name)
                    if checked is None:
                        skipped += 1
                        continue
                    found.append(checked)
            finally:
                os.close(sub)
        found.sort()
        keep = found[-self.num_blocks :]
        if keep:  # the index holds them, ready, with no event (see tiers.base.new_index)
            spec = self.index_spec
            self.index_spec = IndexSpec(
                spec.num_blocks,
                spec.medium,
                spec.policy,
                spec.store_threshold,
                spec.admission,
                recovered=tuple(key for _, key in keep),
                pin_budget=spec.pin_budget,
            )
        if removed:
            log.warning(
                "disk tier %s: removed %d entries of %s named like blocks that are no "
                "regular files (FIFOs, symlinks, devices)",
                self.name,
                removed,
                self.dir,
            )
        if found or skipped or temps:
            log.info(
                "disk tier %s: found %d blocks in %s (%d kept, %d unusable, %d stale "
                "temporary files removed) in %.2fs",
                self.name,
                len(found),
                self.dir,
                len(keep),
                skipped,
                temps,
                time.monotonic() - started,
            )
        self.recovered = len(keep)
        self.unusable = skipped
        self.stale_temps = temps

    def _remove_stale_temps(self, folder: int) -> int:
        return sum(self._remove_if_stale_temp(entry, folder) for entry in os.scandir(folder))

    def _remove_if_stale_temp(self, entry: os.DirEntry[str], folder: int) -> int:
        """Remove ``entry`` if it is a temporary file (:data:`_TEMP`) whose writer is
        gone: 1 if removed. A live writer's, this process's included (another engine
        may share the directory), is kept."""
        match = _TEMP.fullmatch(entry.name)
        if match is None:
            return 0
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return 0
        if stat.S_ISDIR(st.st_mode):
            return 0
        pid = int(match.group(1) or match.group(2))
        if _writer_alive(pid, st.st_mtime):
            return 0
        try:
            os.unlink(entry.name, dir_fd=folder)
        except OSError:
            return 0
        return 1

    def _check_file(self, folder: int, name: str) -> tuple[float, OffloadKey] | None:
        """The modification time and key of file ``name`` in the directory ``folder`` if
        it is this namespace's block of the key its name says, else ``None``. Never
        blocks: opened ``O_NONBLOCK`` (a FIFO swapped in after the scan) and
        ``O_NOFOLLOW``, and only a regular file is read."""
        try:
            key = bytes.fromhex(name[: -len(_SUFFIX)])
        except ValueError:
            return None
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(name, flags, dir_fd=folder)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            header = parse_header(os.pread(fd, HEADER_BYTES, 0))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if (
            header.identity != self.identity
            or header.key != key
            or header.payload_len != self.block_bytes
            or st.st_size < self.slot_bytes
        ):
            return None
        return st.st_mtime, OffloadKey(key)

    # --- I/O ------------------------------------------------------------------------

    def bind(self, wake_fd: int | None) -> None:
        self._pool.bind(wake_fd)

    def _ops(self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]) -> list:  # type: ignore[type-arg]
        from asyncoffload.tiers._io import IoOp

        if self.config.mode == "slab":
            fd, size = self._fd, self.slot_bytes
            return [
                IoOp(addr, slot * size, None, key, fd) for key, slot, addr in zip(keys, slots, host)
            ]
        fd, name_of = self._dir_fd, self.name_of
        return [IoOp(addr, 0, name_of(key), key, fd) for key, addr in zip(keys, host)]

    def submit_read(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        ops = self._ops(keys, slots, host)
        return self._pool.submit(False, ops, self.config.deadline_s, GIVE_UP_S)

    def set_segments(self, deltas: Sequence[int]) -> None:
        self._pool.set_segments(deltas)

    def submit_write(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        ops = self._ops(keys, slots, host)
        return self._pool.submit(True, ops, self.config.deadline_s, GIVE_UP_S)

    def forget(self, keys: Sequence[OffloadKey]) -> CopyJob | None:
        """Files mode: remove the keys' files on the lanes (queued with the writes, after
        any write of the same file submitted before; a file already gone counts as
        removed), and return that job. Slab mode: nothing (the slots are reused)."""
        from asyncoffload.tiers._io import IoOp

        if self.config.mode != "files" or not keys:
            return None
        fd, name_of = self._dir_fd, self.name_of
        ops = [IoOp(0, 0, name_of(key), key, fd) for key in keys]
        job = self._pool.submit_unlink(ops, self.config.deadline_s, GIVE_UP_S)
        removals = self._removals
        while removals and removals[0].ended:
            removals.popleft()
        if len(removals) > 256:  # a stuck head: keep only those that run
            running = [r for r in removals if not r.ended]
            removals.clear()
            removals.extend(running)
        removals.append(job)
        return job

    @property
    def pool(self) -> Any:
        """The native I/O lanes (fault injection in tests: ``set_fault``, ``set_delay``)."""
        return self._pool

    def describe(self) -> dict[str, object]:
        return {
            "mode": self.config.mode,
            "path": str(self.dir),
            "direct_io": self.direct_io,
            "capacity_bytes": self.config.capacity,
            "slot_bytes": self.slot_bytes,
            "io_threads": self.config.io_threads,
            "authenticated": self.config.mac_key is not None,
        }

    def close(self) -> None:
        """Finish queued I/O, join the lanes, close the files. Removals still queued or
        running are waited for (each ends, or is given up on, within the deadline plus
        :data:`GIVE_UP_S`). Where an op given up on still runs (stuck in a system call),
        joining could wait forever: the lanes and the files they use are kept open, with
        a warning, until it ends (queued removals still run then)."""
        from asyncoffload.tiers._io import keep_until_ended, release_ended

        if self._closed:
            return
        self._closed = True
        pool = self._pool
        removals = [job for job in self._removals if not job.ended]
        self._removals.clear()
        if removals and len(removals) == pool.running:
            # Only removals run (the drivers wait for theirs; a direct caller may not):
            # each ends, or is given up on, within its deadline plus GIVE_UP_S.
            while not all(job.query() for job in removals):
                time.sleep(0.001)
        if not pool.running:
            pool.close()  # joins the lanes: no op uses the fds after this
            self._release_fds()
            release_ended()
            return
        fds = [fd for fd in (self._fd, self._dir_fd) if fd >= 0]
        self._fd = self._dir_fd = -1
        finish = pool.detach()

        def release() -> None:
            finish()
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

        keep_until_ended(f"disk tier {self.name} ({self.dir})", lambda: not pool.running, release)

    def _release_fds(self) -> None:
        for attr in ("_fd", "_dir_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)

    def __repr__(self) -> str:
        return f"<DiskStore {self.name} {self.config.mode} {self.dir} [{self.num_blocks} slots]>"
