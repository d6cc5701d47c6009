"""A shared tier on Mooncake Store: KV blocks in the distributed DRAM pool that vLLM,
SGLang and LMCache also use, so that engines on many machines reuse each other's KV.

One object per block, named ``<prefix>:<namespace identity hex>:<key hex>``, holding the
block format of :mod:`asyncoffload.tiers.format` (the 4096-byte header, then the
payload): a value the store evicted, cut short, or that another namespace wrote is a miss
and never reaches the KV blocks.

The client is Mooncake's, in a helper process (:mod:`asyncoffload.tiers._mooncake`):
its calls are synchronous and a busy event loop would starve a thread making them. The
helper maps the host slots' memory (the CPU backend's ``memfd``, vLLM's shared-memory
pool files) and registers it with the store, so a block moves straight between a host
slot and the pool: the payload is never copied in this process. The header lives in the
helper's own registered buffer and goes out beside the payload, as one object of several
pieces; the helper writes it before a put and checks it and the payload's checksum in
place after a get. Replies come back on a socket and wake the completion bridge through
its eventfd.

The tier's index is local knowledge, as for the Redis / Valkey tier: blocks this engine
wrote, or found with :meth:`~asyncoffload.AsyncOffloadEngine.alookup`. The store evicts
on its own; a block it dropped is found missing when read and leaves the index then,
with a removed event.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretBytes, field_validator

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import Medium
from asyncoffload.tiers._mooncake_helper import PRESENT
from asyncoffload.tiers.base import LowerTier, shared_index_spec
from asyncoffload.tiers.format import HEADER_BYTES, Namespace
from asyncoffload.tiers.settings import READ_GUARD_HELP, SHARED_READ_GUARD, TierSettings
from asyncoffload.transfer.base import CopyJob, HostRegion
from asyncoffload.validators import ByteSize, byte_setting

__all__ = ["MooncakeStore", "MooncakeTier"]

log = logging.getLogger("asyncoffload.tiers")

#: Failures after which the store counts as down for ``retry_s``.
_DOWN = frozenset({errno.EHOSTDOWN, errno.ETIMEDOUT})
#: A host name or address as Mooncake takes it: ASCII letters, digits, dots, dashes and
#: underscores, or a bracketed IPv6 address. (str.isdigit takes other scripts' digits.)
_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)


def _physical_memory() -> int:
    """This machine's memory in bytes (0 where it cannot be told)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class MooncakeTier(TierSettings):
    """Settings of a shared tier on Mooncake Store: ``MooncakeTier(master="host:port")``.

    The client joins the cluster of ``master`` (``mooncake_master``), with
    ``metadata_server`` (``"P2PHANDSHAKE"``: none; or an etcd / HTTP metadata URL) over
    ``protocol`` (``"tcp"``, or ``"rdma"`` with ``device_name``), announcing itself as
    ``local_hostname``. It gives ``segment_bytes`` of its own memory to the pool (0: none,
    a client of the others' memory only); objects in that segment go when the engine
    closes. ``index_blocks`` bounds the local index; ``admission`` and ``mac_key`` are
    the Redis / Valkey tier's (see :class:`~asyncoffload.tiers.remote.RemoteTier`).

    Mooncake's transfer engine and the metadata server listen on every interface: see
    docs/tiers.md for confining them.
    """

    _positional = ("master",)
    _positional_words = "the master alone"
    #: The tier's I/O runs in a helper process that maps the host slots.
    shares_host: ClassVar[bool] = True

    kind: Literal["mooncake"] = "mooncake"
    master: str = Field("127.0.0.1:50051", description="mooncake_master's host:port.")
    metadata_server: str = "P2PHANDSHAKE"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field("", description="RDMA devices (protocol 'rdma').")
    local_hostname: str = Field("127.0.0.1", description="This client's address in the cluster.")
    segment_bytes: int = Field(
        512 << 20,
        ge=0,
        lt=1 << 63,
        description="Memory this client gives to the pool (0: none; at most the machine's "
        "memory, checked when the tier opens).",
    )
    local_buffer_bytes: ByteSize = Field(
        16 << 20,
        ge=1 << 20,
        lt=1 << 63,
        description="The client's transfer buffer (at most the machine's memory).",
    )
    mac_key: SecretBytes | None = Field(
        None,
        description="Authenticate blocks with a keyed BLAKE2b MAC: 16 to 64 bytes (a str: "
        "its UTF-8 bytes). Values without it, or with another key's, are misses.",
    )
    prefix: str = Field(
        "ao", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="First part of every name."
    )
    index_blocks: int = Field(1 << 20, gt=0, description="Blocks the local index tracks.")
    policy: str = "lru"
    quotas: dict[str, int | str] = Field(
        default_factory=dict,
        description="Tenant quotas of this tier, {tenant: quota}: blocks (an int), a share "
        "('25%') or bytes ('512MiB'); each tenant must be one of the engine's tenants.",
    )
    admission: str | None = None
    min_offers: int = Field(2, ge=1)
    batch_blocks: int = Field(64, gt=0, le=512, description="Blocks per request to the helper.")
    in_flight: int = Field(
        2,
        ge=1,
        le=8,
        description="Requests the helper runs at once: one's checksums overlap another's transfer.",
    )
    check_threads: int = Field(
        4,
        ge=1,
        le=16,
        description="Threads the helper takes and checks a request's checksums on (at most "
        "the machine's CPUs): CRC32C runs at about 10 GB/s a core, slower than a fast store.",
    )
    read_guard: bool = Field(True, description=READ_GUARD_HELP + SHARED_READ_GUARD)
    timeout_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="Every request to the helper (a get, a put, an existence check) ends "
        "within this long after it was submitted: a late one fails (a miss, a skipped "
        "write) and the helper, stuck in a Mooncake call, is killed and later restarted; "
        "flush() and aclose() wait no longer than this.",
    )
    retry_s: float = Field(
        1.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="After the store or the helper failed, fail at once for this long.",
    )
    start_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="How long a question waits for a helper's client to be set up.",
    )

    def __init__(self, *args: Any, **data: Any) -> None:
        """``MooncakeTier(master, **settings)``."""
        super().__init__(*args, **data)  # (here for mypy's pydantic plugin)

    @field_validator("segment_bytes", mode="before")
    @classmethod
    def _segment(cls, value: object) -> object:
        """A byte size (``"4GiB"``), or 0 (a client of the others' memory only)."""
        if value == 0 and not isinstance(value, bool):
            return 0
        return byte_setting(value, "segment_bytes")

    @field_validator("master")
    @classmethod
    def _master(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if (
            not sep
            or not _HOST.fullmatch(host)
            or not _PORT.fullmatch(port)
            or not 0 < int(port) < 65536
        ):
            raise ValueError(
                f"master must be host:port (an ASCII host name or address, a port of "
                f"ASCII digits 1-65535), got {value!r}"
            )
        return value

    @field_validator("local_hostname")
    @classmethod
    def _local_hostname(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        bare = host if sep and _PORT.fullmatch(port) and 0 < int(port) < 65536 else value
        if not _HOST.fullmatch(bare):
            raise ValueError(
                f"local_hostname must be an ASCII host name or address (with an optional "
                f":port), got {value!r}"
            )
        return value

    def open(self, namespace: Namespace, name: str = "mooncake") -> MooncakeStore:
        return MooncakeStore(self, namespace, name)


class MooncakeBatch(CopyJob):
    """A tier read or write: one request to the helper per ``batch_blocks`` blocks;
    ``results`` per block: ``block_bytes`` or ``-errno`` (see :class:`LowerTier`)."""

    __slots__ = ("_left", "_parts", "_store", "_write", "results")

    def __init__(self, store: MooncakeStore, n: int, write: bool) -> None:
        super().__init__(n, n * store.block_bytes)
        self._store = store
        self._write = write
        self._parts: list[Any] = []
        self._left = 0
        self.results: list[int] = []

    def add(self, job: Any) -> None:
        self._parts.append(job)
        self._left += 1
        job.on_end = self._part_ended
        if job._done:  # ended at submission (refused): no callback will come
            job.on_end = None
            self._part_ended(job)

    def _part_ended(self, _job: Any) -> None:
        self._left -= 1
        if self._left == 0 and not self._done:
            self.end([r for job in self._parts for r in job.results])

    def end(self, raw: list[int], observed: bool = True) -> None:
        """Ends the job with the helper's results ``raw``; ``observed``: they come from
        the helper (not failed at once by the tier), so they say whether it is down."""
        size = self._store.block_bytes
        if self._write:  # a block the store held already: present, 0 bytes written
            self.results = [
                size if r == 0 else 0 if r == PRESENT else (r if r < 0 else -errno.EIO) for r in raw
            ]
        else:
            self.results = [size if r == size else (r if r < 0 else -errno.EIO) for r in raw]
        if observed:
            self._store._seen(self.results)
        self._parts = []
        self.finish()

    def query(self) -> bool:
        if not self._done:
            for job in list(self._parts):
                job.query()
        return self._done

    def check_failed(self) -> bool:
        if not self._done:
            for job in list(self._parts):
                job.check_failed()
        return self._done


class MooncakeStore(LowerTier):
    """A running Mooncake tier (see the module docstring); made by :meth:`MooncakeTier.open`."""

    medium = Medium.REMOTE

    def __init__(self, config: MooncakeTier, namespace: Namespace, name: str = "mooncake") -> None:
        memory = _physical_memory()
        for field in ("segment_bytes", "local_buffer_bytes"):
            size = int(getattr(config, field))
            if memory and size > memory:
                raise ValueError(
                    f"Mooncake tier {name}: {field}={size} is more than this machine's "
                    f"memory ({memory} bytes): its client could never be set up"
                )
        from asyncoffload.tiers._io import require

        require("the Mooncake tier")  # the helper checks blocks with the native library
        try:
            import mooncake.store  # noqa: F401
        except (ImportError, OSError) as exc:
            raise RuntimeError(
                "the Mooncake tier needs asyncoffload[mooncake] (and, on Debian, libibverbs1, "
                f"libnl-3-200 and libnl-route-3-200): {exc}"
            ) from None
        self.config = config
        self.name = name
        self._mac_key = config.mac_key.get_secret_value() if config.mac_key else None
        namespace = namespace.with_mac_key(self._mac_key)
        self.namespace = namespace
        self.identity = namespace.identity()
        self.block_bytes = namespace.block_bytes
        self.deadline_s = config.timeout_s
        self.index_spec = shared_index_spec(config)
        self._name_prefix = f"{config.prefix}:{self.identity.hex()}:"
        #: The host memory the helper maps: (our fd (a duplicate), address, size).
        self._regions: list[tuple[int, int, int]] = []
        self._deltas: tuple[int, ...] = (0,)
        self._inline = False
        self._lane: Any = None
        self._wake_fd: int | None = None
        self._down_until = 0.0
        self._closed = False
        self._asking = 0
        #: Waiting in connect() for the helper's setup.
        self._started: list[asyncio.Future[None]] = []
        self._reader: tuple[asyncio.AbstractEventLoop, int] | None = None
        #: Helpers started (the first, and each restart).
        self.starts = 0
        self.errors = 0
        # The helper starts now, in the background: its client is set up by the time the
        # first request comes, which queues behind the setup otherwise.
        self._start()

    def object_name(self, key: OffloadKey) -> str:
        """The store's name of block ``key``."""
        return self._name_prefix + key.hex()

    # --- the helper -------------------------------------------------------------------

    def attach_host(self, regions: Sequence[HostRegion]) -> None:
        """Map ``regions`` (the host slots' memory) in the helper, now and after each
        restart of it. ``ValueError`` (nothing changed) for none, or a second call."""
        if not regions:
            raise ValueError(
                f"tier {self.name}: the Mooncake tier needs the host slots in shared memory "
                "(the CPU backend keeps them in a memfd for it; vLLM's workers in shared-"
                "memory files); this backend gives none"
            )
        if self._regions:
            raise ValueError(f"tier {self.name}: host memory is attached already")
        if self._closed:
            raise RuntimeError(f"Mooncake tier {self.name} is closed")
        self._regions = [(os.dup(r.fd), r.address, r.size) for r in regions]
        #: Room before every host slot for the header: one span per block.
        self._inline = all(r.header_room >= HEADER_BYTES for r in regions)
        if self._lane is not None and self._lane.dead is None:
            self._lane.map([(fd, size) for fd, _, size in self._regions])

    def _settings(self) -> dict[str, object]:
        cfg = self.config
        return {
            "local_hostname": cfg.local_hostname,
            "metadata_server": cfg.metadata_server,
            "global_segment_bytes": int(cfg.segment_bytes),
            "local_buffer_bytes": int(cfg.local_buffer_bytes),
            "protocol": cfg.protocol,
            "device_name": cfg.device_name,
            "master": cfg.master,
            "check_threads": min(cfg.check_threads, os.cpu_count() or 1),
            "in_flight": cfg.in_flight,
        }

    def _start(self) -> None:
        """A new helper: its client set up in the background, the regions mapped, the
        wake-up fd given."""
        from asyncoffload.tiers._mooncake import MooncakeLane

        self.starts += 1
        lane = MooncakeLane(
            self._settings(),
            identity=self.identity,
            payload_len=self.block_bytes,
            prefix=self.config.prefix,
            mac_key=self._mac_key,
        )
        if self._regions:
            lane.map([(fd, size) for fd, _, size in self._regions])
        lane.bind(self._wake_fd)
        self._lane = lane

    def _live_lane(self) -> Any:
        """The helper's lane, restarted once ``retry_s`` has passed since it died; None
        while the store counts as down."""
        lane = self._lane
        if self._closed or lane is None:
            raise RuntimeError(f"Mooncake tier {self.name} is closed")
        if time.monotonic() < self._down_until:
            return None
        if lane.dead is not None:
            self._drop_reader()
            log.warning("Mooncake tier %s: %s; starting a new helper", self.name, lane.dead)
            lane.close()
            self._start()
        return self._lane

    def _seen(self, results: Sequence[int]) -> None:
        """After a request: a store that failed to answer, or a helper that died, counts
        as down for ``retry_s``."""
        lane = self._lane
        if self._closed:
            return
        if any(-r in _DOWN for r in results) or (lane is not None and lane.dead is not None):
            self.errors += 1
            if time.monotonic() >= self._down_until:
                why = lane.dead if lane is not None and lane.dead else "the store did not answer"
                log.warning(
                    "Mooncake tier %s: %s: failing at once for %g s",
                    self.name,
                    why,
                    self.config.retry_s,
                )
            self._down_until = time.monotonic() + self.config.retry_s

    def unavailable(self) -> bool:
        """Whether requests fail at once now (the store or the helper failed within the
        last ``retry_s``)."""
        return time.monotonic() < self._down_until

    # --- LowerTier --------------------------------------------------------------------

    def bind(self, wake_fd: int | None) -> None:
        self._wake_fd = wake_fd
        if self._lane is not None and self._lane.dead is None:
            self._lane.bind(wake_fd)

    def set_segments(self, deltas: Sequence[int]) -> None:
        n = len(deltas)
        if n < 1 or deltas[0] != 0 or self.block_bytes % n:
            raise ValueError(
                f"{n} slices (first delta {deltas[0] if n else None}) for blocks of "
                f"{self.block_bytes} bytes"
            )
        self._deltas = tuple(int(d) for d in deltas)

    def _block(self, key: OffloadKey, address: int) -> Any:
        """Block ``key`` at host ``address``, as the lane sends it: one span of header and
        payload where the slot has room for the header before it (and is one slice), else
        the payload's slices (the helper puts the header beside them)."""
        from asyncoffload.tiers._mooncake import Block

        if self._inline and len(self._deltas) == 1:
            ((region, offset, length),) = self._pieces(address)
            if offset >= HEADER_BYTES:
                piece = (region, offset - HEADER_BYTES, HEADER_BYTES + length)
                return Block(bytes(key), (piece,), inline=True)
        return Block(bytes(key), self._pieces(address))

    def _pieces(self, address: int) -> tuple[tuple[int, int, int], ...]:
        """Where the payload at host ``address`` is, per slice: (region, offset, length)."""
        seg = self.block_bytes // len(self._deltas)
        out = []
        for delta in self._deltas:
            at = address + delta
            for index, (_, base, size) in enumerate(self._regions):
                if base <= at and at + seg <= base + size:
                    out.append((index, at - base, seg))
                    break
            else:
                raise ValueError(
                    f"tier {self.name}: host address {at:#x} (+{seg} B) is outside the "
                    "shared host memory"
                )
        return tuple(out)

    def submit_read(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        return self._submit(False, keys, host)

    def submit_write(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        return self._submit(True, keys, host)

    def _submit(self, write: bool, keys: Sequence[OffloadKey], host: Sequence[int]) -> CopyJob:
        from asyncoffload.tiers._mooncake import OP_GET, OP_PUT

        if len(keys) != len(host):
            raise ValueError(f"{len(keys)} keys but {len(host)} host addresses")
        blocks = [self._block(key, addr) for key, addr in zip(keys, host)]
        lane = self._live_lane()
        job = MooncakeBatch(self, len(blocks), write)
        if lane is None:  # down: failed at once, which says nothing new about the store
            job.end([-errno.EHOSTDOWN] * len(blocks), observed=False)
            return job
        step, timeout_s = self.config.batch_blocks, self.config.timeout_s
        for start in range(0, len(blocks), step):
            part = blocks[start : start + step]
            job.add(lane.submit(OP_PUT if write else OP_GET, part, timeout_s))
        if not blocks:
            job.end([])
        return job

    async def exists(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the store holds now, within ``timeout_s``. ``OSError`` when
        the store (or the helper) failed to answer."""
        from asyncoffload.tiers._mooncake import MAX_ITEMS, OP_EXISTS

        lane = self._live_lane()
        if lane is None:
            return [False] * len(keys)
        await self.connect()
        loop = asyncio.get_running_loop()
        futures = []
        for start in range(0, len(keys), MAX_ITEMS):
            future: asyncio.Future[list[int]] = loop.create_future()
            names = [bytes(k) for k in keys[start : start + MAX_ITEMS]]
            job = lane.submit(OP_EXISTS, names, self.config.timeout_s)
            if job._done:
                future.set_result(list(job.results))
            else:

                def ended(job: Any, future: asyncio.Future[list[int]] = future) -> None:
                    if not future.done():
                        future.set_result(list(job.results))

                job.on_end = ended
            futures.append(future)
        self._asking += 1
        self._watch(loop, lane)
        try:
            parts = await asyncio.wait_for(asyncio.gather(*futures), self.config.timeout_s)
        except asyncio.TimeoutError:
            lane.expire()  # the helper is stuck: killed, restarted after retry_s
            self._seen([-errno.ETIMEDOUT])
            raise OSError(
                errno.ETIMEDOUT, f"tier {self.name}: no answer within {self.config.timeout_s:g} s"
            ) from None
        finally:
            self._asking -= 1
            if not self._asking:
                self._drop_reader()
        found = [r for part in parts for r in part]
        self._seen(found)
        bad = [r for r in found if r < 0]
        if bad:
            why = os.strerror(-bad[0])
            raise OSError(-bad[0], f"tier {self.name}: the existence check failed ({why})")
        return [r == 1 for r in found]

    async def connect(self) -> None:
        """Wait until the helper's client is set up (it starts in the background when
        the tier opens), at most ``start_timeout_s``; ``OSError`` if it failed."""
        lane = self._live_lane()
        if lane is None:
            raise OSError(errno.EHOSTDOWN, f"tier {self.name}: the store is down")
        if lane.setup_code is None and lane.dead is None:
            loop = asyncio.get_running_loop()
            started: asyncio.Future[None] = loop.create_future()
            self._started.append(started)
            self._asking += 1
            self._watch(loop, lane)
            try:
                await asyncio.wait_for(started, self.config.start_timeout_s)
            except asyncio.TimeoutError:
                raise OSError(
                    errno.ETIMEDOUT,
                    f"tier {self.name}: no Mooncake client after {self.config.start_timeout_s:g} s",
                ) from None
            finally:
                self._asking -= 1
                if not self._asking:
                    self._drop_reader()
        if lane.dead is not None:
            self._seen([])
            raise OSError(errno.EHOSTDOWN, f"tier {self.name}: {lane.dead}")

    def _watch(self, loop: asyncio.AbstractEventLoop, lane: Any) -> None:
        """Read the helper's replies when its socket is readable, while a question is
        out (the completion bridge only polls the jobs it was given)."""
        if self._reader is None:
            fd = lane.fileno()
            loop.add_reader(fd, self._readable, lane)
            self._reader = (loop, fd)

    def _readable(self, lane: Any) -> None:
        lane.poll(check_alive=True)
        if self._started and (lane.setup_code is not None or lane.dead is not None):
            waiters, self._started = self._started, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _drop_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            loop, fd = reader
            if not loop.is_closed():
                with contextlib.suppress(Exception):
                    loop.remove_reader(fd)

    def forget(self, keys: Sequence[OffloadKey]) -> None:
        """Blocks leaving the local index stay in the store: other engines may use them."""

    def describe(self) -> dict[str, object]:
        cfg = self.config
        lane = self._lane
        return {
            "master": cfg.master,
            "protocol": cfg.protocol,
            "prefix": cfg.prefix,
            "segment_bytes": int(cfg.segment_bytes),
            "authenticated": self._mac_key is not None,
            "helper_pid": lane.pid if lane is not None and lane.dead is None else None,
            "helper_starts": self.starts,
        }

    async def aclose(self) -> None:
        """:meth:`close`, waiting for the helper's exit on the loop: at most
        ``timeout_s``, then it is killed."""
        lane = self._shut()
        if lane is not None:
            await lane.aclose(self.config.timeout_s)

    def close(self) -> None:
        lane = self._shut()
        if lane is not None:
            lane.close(self.config.timeout_s)

    def _shut(self) -> Any:
        """Mark the tier closed and let go of its fds; the lane to close, or None."""
        if self._closed:
            return None
        self._closed = True
        self._drop_reader()
        lane, self._lane = self._lane, None
        for fd, _, _ in self._regions:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._regions = []
        return lane
