"""The disk tier: KV blocks in files, read and written by native I/O lanes.

Two layouts:

- ``slab`` (default): one preallocated file per engine, fixed slots of
  :func:`~asyncoffload.tiers.format.block_file_bytes` each, opened with ``O_DIRECT`` and
  mode 0600 (blocks encode user prompts), unlinked as soon as it is open (a crashed
  engine leaves nothing behind). The index lives in memory: the tier starts empty.
- ``files``: one file per block, ``<path>/<namespace dir>/<xx>/<key hex>.kv``, published
  by writing a temporary file and renaming it over the name. A restarted engine finds
  the blocks of the previous run (each header is checked first); engines of one
  namespace may share the directory.

Every block carries the header of :mod:`asyncoffload.tiers.format`. The lanes check it
and the payload's CRC32C on every read; a block that fails, or a short read, is a miss:
its index entry goes in the same step and a removed event says so.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import Medium
from asyncoffload.tiers.base import LowerTier, TierManager
from asyncoffload.tiers.format import (
    HEADER_BYTES,
    Namespace,
    block_file_bytes,
    parse_header,
)
from asyncoffload.transfer.base import CopyJob

__all__ = ["DiskStore", "DiskTier"]

log = logging.getLogger("asyncoffload.tiers")

_SUFFIX = ".kv"


class DiskTier(BaseModel):
    """Settings of a disk tier below the CPU tier: ``DiskTier(path, capacity, mode)``.

    ``capacity`` is in bytes (an int or a string like ``"64GiB"``); the tier holds
    ``capacity // block_file_bytes(block_bytes)`` blocks. ``admission="frequency"``
    (default) writes a block the ``min_offers``-th time it is offered (2: spares the SSD
    blocks used once, as Dynamo KVBM does); ``None`` writes every block; a registered
    filter name (``"ghost"``, ``"adaptive"``) uses that filter.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["disk"] = "disk"
    path: Path = Field(description="Directory of the tier's files (created if missing).")
    capacity: int = Field(description="Bytes of disk the tier may use.")
    mode: Literal["slab", "files"] = "slab"
    policy: str = Field("lru", description="Eviction policy of the tier's index.")
    admission: str | None = Field(
        "frequency", description="'frequency' (min_offers), None, or a filter name."
    )
    min_offers: int = Field(2, ge=1, description="Offers before a block is written.")
    direct_io: bool | None = Field(
        None,
        description="O_DIRECT: None tries it and falls back to buffered I/O with one "
        "warning where the filesystem refuses it; True requires it; False never.",
    )
    io_threads: int = Field(4, ge=1, le=64, description="Native I/O lane threads.")
    deadline_s: float = Field(
        30.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="An operation not started this long after submission fails (at most a day).",
    )

    def __init__(self, *args: Any, **data: Any) -> None:
        """``DiskTier(path, capacity, mode, **settings)``, the first three also by name.
        An explicit ``None`` for any of them is an error, not its default."""
        if len(args) > 3:
            raise TypeError(
                f"DiskTier takes path, capacity and mode positionally, got {len(args)} values"
            )
        for name, value in zip(("path", "capacity", "mode"), args):
            if name in data:
                raise TypeError(f"DiskTier got {name} twice")
            data[name] = value
        super().__init__(**data)

    @field_validator("capacity", mode="before")
    @classmethod
    def _bytes(cls, value: object) -> object:
        from asyncoffload.config import byte_setting

        return byte_setting(value, "capacity")

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        from asyncoffload.config import known_policy

        return known_policy(value)

    @field_validator("admission", mode="before")
    @classmethod
    def _admission(cls, value: object) -> object:
        from asyncoffload.config import known_admission

        if isinstance(value, str) and value == "frequency":
            return value
        return known_admission(value)

    @model_validator(mode="after")
    def _positive(self) -> DiskTier:
        if self.capacity <= 0:
            raise ValueError(f"capacity must be positive, got {self.capacity}")
        return self

    def blocks_for(self, block_bytes: int) -> int:
        """How many blocks of ``block_bytes`` the capacity holds."""
        return self.capacity // block_file_bytes(block_bytes)

    def open(self, namespace: Namespace, name: str = "disk") -> DiskStore:
        """The running tier for ``namespace`` (the engine calls this)."""
        return DiskStore(self, namespace, name)


def _probe_direct(path: Path) -> bool:
    """Whether files in ``path`` can be opened with O_DIRECT (tmpfs and some overlay
    filesystems refuse it with EINVAL)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = path / f".direct-probe.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError:
        with contextlib.suppress(OSError):
            probe.unlink()
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        probe.unlink()
    return True


class DiskStore(LowerTier):
    """A running disk tier (see the module docstring); made by :meth:`DiskTier.open`."""

    medium = Medium.DISK

    def __init__(self, config: DiskTier, namespace: Namespace, name: str = "disk") -> None:
        from asyncoffload.tiers._io import IoPool, require

        require("the disk tier")
        self.config = config
        self.name = name
        self.deadline_s = config.deadline_s
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
        self.manager = TierManager(
            num_blocks, Medium.DISK, config.policy, threshold, admission=admission
        )
        self._closed = False
        self._fd = -1
        self.identity = namespace.identity()
        root = Path(config.path)
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise OSError(
                exc.errno, f"disk tier {name}: cannot create {root}: {exc.strerror}"
            ) from None
        want = config.direct_io
        direct = _probe_direct(root) if want is not False else False
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
            self._open_slab(root)
        else:
            self.dir = root / namespace.dirname()
            self._open_files()
        self._pool = IoPool(
            threads=config.io_threads,
            payload_len=self.block_bytes,
            identity=self.identity,
            direct_files=direct,
        )

    # --- layouts --------------------------------------------------------------------

    def _open_slab(self, root: Path) -> None:
        path = root / f"asyncoffload-{os.getpid()}-{uuid.uuid4().hex}.slab"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        flags |= getattr(os, "O_NOFOLLOW", 0)
        if self.direct_io:
            flags |= os.O_DIRECT
        fd = os.open(path, flags, 0o600)
        try:
            size = self.num_blocks * self.slot_bytes
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise OSError(
                        errno.ENOSPC,
                        f"disk tier {self.name}: {root} has no room for a {size}-byte slab "
                        f"(capacity={self.config.capacity})",
                    ) from None
                # fallocate refused (some network filesystems): a sparse file instead.
                log.warning("disk tier %s: fallocate refused (%s): sparse slab", self.name, exc)
                os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        # Nothing else may open it, and a crash leaves nothing behind.
        with contextlib.suppress(OSError):
            path.unlink()
        self._fd = fd

    def _open_files(self) -> None:
        ns_dir = self.dir
        ns_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        meta = ns_dir / "namespace.json"
        if not meta.exists():
            tmp = ns_dir / f".namespace.{os.getpid()}.{secrets.token_hex(4)}"
            tmp.write_text(json.dumps(self.namespace.describe(), indent=1) + "\n")
            os.replace(tmp, meta)
        for i in range(256):
            (ns_dir / f"{i:02x}").mkdir(exist_ok=True, mode=0o700)
        self._recover()

    def path_of(self, key: OffloadKey) -> Path:
        """The file of ``key`` (files mode)."""
        hexkey = key.hex()
        return self.dir / hexkey[:2] / f"{hexkey}{_SUFFIX}"

    def _recover(self) -> None:
        """Index the blocks a previous run left (files mode): each header must parse and
        match this namespace, the file's name and its size; the newest ``num_blocks``
        are kept, in age order (the newest is the most recently used)."""
        found: list[tuple[float, OffloadKey]] = []
        skipped = 0
        started = time.monotonic()
        for sub in sorted(self.dir.iterdir()):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if not entry.name.endswith(_SUFFIX):
                    continue
                key = self._check_file(Path(entry.path), entry.name[: -len(_SUFFIX)])
                if key is None:
                    skipped += 1
                    continue
                with contextlib.suppress(OSError):
                    found.append((entry.stat().st_mtime, key))
        found.sort()
        keep = found[-self.num_blocks :]
        manager = self.manager
        if keep:
            keys = [key for _, key in keep]
            out = manager.reserve(keys)
            assert out is not None
            manager.complete_store(keys)
            manager.take_events()  # not news: the snapshot of a subscriber shows them
        if found or skipped:
            log.info(
                "disk tier %s: found %d blocks in %s (%d kept, %d unusable) in %.2fs",
                self.name,
                len(found),
                self.dir,
                len(keep),
                skipped,
                time.monotonic() - started,
            )
        self.recovered = len(keep)
        self.unusable = skipped

    def _check_file(self, path: Path, hexkey: str) -> OffloadKey | None:
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            return None
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
            header = parse_header(raw)
        except (OSError, ValueError):
            return None
        if (
            header.identity != self.identity
            or header.key != key
            or header.payload_len != self.block_bytes
            or size < self.slot_bytes
        ):
            return None
        return OffloadKey(key)

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
        return [IoOp(addr, 0, str(self.path_of(key)), key, -1) for key, addr in zip(keys, host)]

    def submit_read(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        return self._pool.submit(False, self._ops(keys, slots, host), self.config.deadline_s)

    def set_segments(self, deltas: Sequence[int]) -> None:
        self._pool.set_segments(deltas)

    def submit_write(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        return self._pool.submit(True, self._ops(keys, slots, host), self.config.deadline_s)

    def forget(self, keys: Sequence[OffloadKey]) -> None:
        if self.config.mode != "files":
            return  # slab slots are simply reused
        for key in keys:
            with contextlib.suppress(OSError):
                os.unlink(self.path_of(key))

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
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.close()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        m = self.manager.stats()
        return (
            f"<DiskStore {self.name} {self.config.mode} {self.dir} "
            f"[{m.ready} ready, {m.write_pending} writing of {self.num_blocks}]>"
        )
