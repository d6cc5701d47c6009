"""The shared tier: KV blocks in Redis or Valkey, so that engines reuse each other's KV.

One key per block, ``<prefix>:<namespace identity hex>:<key hex>``, holding the block
format of :mod:`asyncoffload.tiers.format` (the 4096-byte header, then the payload), so
a value the server evicted, cut short, or that another namespace wrote is a miss and
never reaches the KV blocks. Blocks are immutable content: writes are put-if-absent
(``SET ... NX``), with an optional TTL. The client is ``redis.asyncio`` (redis-py, with
hiredis when installed) on the engine's event loop: requests are pipelined per batch and
complete on the loop itself, with no helper thread.

The tier's index (which blocks this engine knows the server holds) is local knowledge:
blocks this engine wrote or found with :meth:`~asyncoffload.AsyncOffloadEngine.alookup`.
The server evicts on its own (``maxmemory``); a block it dropped is found missing when
read, and leaves the index then, with a removed event.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from pydantic import Field, SecretBytes, SecretStr, field_validator, model_validator

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import Medium
from asyncoffload.tiers._clients import make_client
from asyncoffload.tiers.base import LowerTier, shared_index_spec
from asyncoffload.tiers.format import HEADER_BYTES, Namespace
from asyncoffload.tiers.settings import (
    READ_GUARD_HELP,
    SHARED_READ_GUARD,
    WRITE_PRIORITY_HELP,
    TierSettings,
)
from asyncoffload.transfer.base import CopyJob
from asyncoffload.validators import ByteSize

__all__ = ["RemoteStore", "RemoteTier"]

log = logging.getLogger("asyncoffload.tiers")

#: The longest ``ttl_s`` (Redis adds PX to the current time in ms: far larger values
#: overflow there and are refused).
_TEN_YEARS_S = 10 * 365 * 86_400.0
#: What aclose() waits beyond timeout_s for jobs, removals and the client to end.
_CLOSE_GRACE_S = 1.0
#: What each of aclose()'s last steps may take once its deadline passed.
_CLOSE_FLOOR_S = 0.05
#: Batches of at most this many payload bytes are packed or checked on the loop: a
#: native job's wake-up is one more loop pass, which costs more under a busy loop.
INLINE_BYTES = 1 << 20
#: Read-back errors that mean the value on the server is damaged or not this block's:
#: the tier deletes it, so that the next store of the block can put it again (NX). A
#: value longer than a block (EMSGSIZE) is one; so is one whose read was sent and not
#: answered by the deadline (ETIMEDOUT): left there, every later read would pay again.
_DAMAGED = frozenset(
    {
        errno.ENODATA,
        errno.EBADMSG,
        errno.ESTALE,
        errno.EKEYREJECTED,
        errno.ENOKEY,
        errno.EMSGSIZE,
        errno.ETIMEDOUT,
    }
)


class ProtocolError(OSError):
    """The server answered a request with another number of replies than it holds
    commands (or names): nothing of that answer is used."""

    def __init__(self, what: str, got: int, want: int) -> None:
        super().__init__(
            errno.EPROTO, f"the server answered {what} with {got} replies for {want} names"
        )


def _answers(replies: Sequence[Any], want: int, what: str) -> list[Any]:
    """``replies`` as a list if it holds ``want`` of them, else :class:`ProtocolError`
    (a hostile or broken server: zipping them with the names would pair a value with
    the wrong block, or leave blocks unanswered)."""
    out = list(replies)
    if len(out) != want:
        raise ProtocolError(what, len(out), want)
    return out


class RemoteTier(TierSettings):
    """Settings of a shared tier on Redis or Valkey: ``RemoteTier(url=...)``.

    ``url`` is ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS); with
    ``cluster=True`` it names one node of a Redis / Valkey cluster. ``index_blocks`` bounds
    the local index of blocks known to be on the server (the server's own ``maxmemory``
    bounds what it keeps). ``admission`` is ``None`` (every block, the default: a shared
    tier is for sharing), ``"frequency"`` (the ``min_offers``-th offer) or a filter name.
    ``mac_key`` (16 to 64 bytes, a secret) authenticates blocks: each carries a keyed
    BLAKE2b MAC, and a value without it, or with another key's, is a miss (see
    docs/tiers.md, "Authenticated blocks").
    """

    _positional = ("url",)
    _positional_words = "the url alone"

    kind: Literal["remote"] = "remote"
    url: str = "redis://127.0.0.1:6379/0"
    client: Literal["redis-py", "glide"] = Field(
        "redis-py", description="redis-py (with hiredis), or valkey-glide (optional, faster)."
    )
    cluster: bool = False
    username: str | None = None
    password: SecretStr | None = None
    mac_key: SecretBytes | None = Field(
        None,
        description="Authenticate blocks with a keyed BLAKE2b MAC: 16 to 64 bytes (a str: "
        "its UTF-8 bytes). Values without it, or with another key's, are misses.",
    )
    ssl_ca_certs: str | None = Field(None, description="CA bundle for rediss:// URLs.")
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    prefix: str = Field("ao", description="First part of every key.")
    ttl_s: float | None = Field(
        None,
        ge=0.001,
        le=_TEN_YEARS_S,
        allow_inf_nan=False,
        description="Expire blocks after this long (sent as PX: 1 ms to ten years).",
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
    max_connections: int = Field(32, gt=0, le=1024)
    batch_blocks: int = Field(64, gt=0, description="Blocks per pipelined request.")
    batch_bytes: ByteSize = Field(
        16 << 20,
        gt=0,
        description="...and at most this many payload bytes per request (at least one "
        "block): pipelines of 64 MiB ran at half the speed of 16 MiB ones, raw or not.",
    )
    threads: int = Field(
        2, ge=1, le=64, description="Native threads that pack and check values off the loop."
    )
    read_guard: bool = Field(True, description=READ_GUARD_HELP + SHARED_READ_GUARD)
    write_priority: Literal["normal", "idle"] = Field(
        "normal",
        description="The native threads that pack values: " + WRITE_PRIORITY_HELP,
    )
    bounded_reads: bool = Field(
        True,
        description="Read at most one block (and a byte) of each value (GETRANGE): a value "
        "planted far larger than a block costs a reader one block. False: whole values "
        "(MGET: faster where the server shares the engine's cores, see docs/benchmarks.md), "
        "for a keyspace only your engines can write.",
    )
    pipelines: int = Field(
        4, gt=0, le=256, description="Pipelined requests in flight, for reads and for writes."
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="Every job (a load's blocks, a write-through's) and every question "
        "ends within this long after it was submitted, answered or not: a late block is "
        "a miss, and aclose() waits no longer than this.",
    )
    retry_s: float = Field(
        1.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="After a refused or timed-out request, fail at once for this long.",
    )

    def __init__(self, *args: Any, **data: Any) -> None:
        """``RemoteTier(url, **settings)``. An explicit ``url=None`` is an error, not the
        default URL."""
        super().__init__(*args, **data)  # (here for mypy's pydantic plugin)

    @model_validator(mode="before")
    @classmethod
    def _password_out_of_url(cls, data: Any) -> Any:
        """A password in the URL moves to ``password`` (a secret, never printed): in the
        user part (``redis://user:pw@host``, the part before the last ``@``, so a
        password with an unescaped ``/``, ``?`` or ``#`` comes out whole) or as the
        ``password`` query argument that redis-py also reads. A bytes URL is decoded."""
        if not isinstance(data, dict):
            return data
        url = data.get("url")
        if isinstance(url, (bytes, bytearray)):
            try:
                url = bytes(url).decode()
            except UnicodeDecodeError:
                return data  # the field's own check names it, without its bytes
            data = dict(data, url=url)
        if not isinstance(url, str) or "://" not in url:
            return data
        scheme, rest = url.split("://", 1)
        password: str | None = None
        user = ""
        if "@" in rest:
            userinfo, rest = rest.rsplit("@", 1)
            user, sep, secret = userinfo.partition(":")
            user = unquote(user)
            if sep:
                password = unquote(secret)
        parts = urlsplit(f"{scheme}://{rest}")
        query = parse_qsl(parts.query, keep_blank_values=True)
        kept = [(k, v) for k, v in query if k != "password"]
        if len(kept) != len(query):
            password = (
                password if password is not None else [v for k, v in query if k == "password"][-1]
            )
            parts = parts._replace(query=urlencode(kept))
        if password is None and not user:
            return data
        netloc = f"{quote(user)}@{parts.netloc}" if user else parts.netloc
        url = f"{scheme}://{netloc}{parts.path}"  # (urlunsplit drops unix://'s empty host)
        url += f"?{parts.query}" if parts.query else ""
        url += f"#{parts.fragment}" if parts.fragment else ""
        data = dict(data, url=url)
        if password is not None:
            data.setdefault("password", password)
        if user:
            data.setdefault("username", user)
        return data

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {value!r}")
        return value

    def open(self, namespace: Namespace, name: str = "remote") -> RemoteStore:
        return RemoteStore(self, namespace, name)


class _ValuePool:
    """Reused value buffers (header + payload) for writes.

    A fresh bytearray of 4 KiB + a 256 KiB payload is zero-filled and page-faulted on
    every allocation (glibc gives blocks this large back to the kernel when freed), which
    cost 100-130 us per block against 15 us to fill a reused one. A buffer comes back only
    after its pipeline was answered, so the socket is done with it; one of a failed or
    cancelled request is dropped instead (its transport may still hold it).
    """

    __slots__ = ("_free", "_keep", "_size", "allocated")

    def __init__(self, size: int, keep: int) -> None:
        self._size = size
        self._keep = keep
        self._free: list[tuple[bytearray, Any]] = []
        #: Buffers made so far (a steady load reuses them instead).
        self.allocated = 0

    def take(self) -> tuple[bytearray, Any]:
        if self._free:
            return self._free.pop()
        self.allocated += 1
        value = bytearray(self._size)
        # The ctypes view pins the buffer (no resize) and gives its address.
        return value, (ctypes.c_char * self._size).from_buffer(value)

    def give(self, items: list[tuple[bytearray, Any]]) -> None:
        room = self._keep - len(self._free)
        if room > 0:
            self._free.extend(items[:room])


class RemoteJob(CopyJob):
    """A batch of block reads or writes run by a task on the event loop; ``results``
    per block: bytes moved, or ``-errno``."""

    __slots__ = ("natives", "results", "task")

    def __init__(self, n: int, nbytes: int) -> None:
        super().__init__(n, nbytes)
        self.results: list[int] = []
        self.task: asyncio.Task[None] | None = None
        #: Its native pack / unpack jobs not known to have ended: the job does not end
        #: before them (they read or write its CPU slots).
        self.natives: list[asyncio.Future[None]] = []


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, asyncio.TimeoutError):
        return errno.ETIMEDOUT
    redis_errors = sys.modules.get("redis.exceptions")  # whichever client is in use
    if redis_errors is not None:
        if isinstance(exc, redis_errors.TimeoutError):
            return errno.ETIMEDOUT
        if isinstance(exc, redis_errors.ConnectionError):
            return errno.ECONNREFUSED
    glide = sys.modules.get("glide")
    if glide is not None:
        if isinstance(exc, glide.TimeoutError):
            return errno.ETIMEDOUT
        if isinstance(exc, (glide.ConnectionError, glide.ClosingError)):
            return errno.ECONNREFUSED
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


def _deadline(seconds: float) -> contextlib.AbstractAsyncContextManager[Any]:
    """``asyncio.timeout`` (no task of its own, unlike ``wait_for`` before 3.12)."""
    if sys.version_info >= (3, 11):
        return asyncio.timeout(seconds)
    return _WaitFor(seconds)  # pragma: no cover - Python 3.10


def _deadline_at(when: float) -> contextlib.AbstractAsyncContextManager[Any]:
    """``asyncio.timeout_at``: the body ends by ``when`` (the loop's clock)."""
    if sys.version_info >= (3, 11):
        return asyncio.timeout_at(when)
    return _WaitFor(max(0.0, when - asyncio.get_running_loop().time()))  # pragma: no cover


class _WaitFor:
    """Python 3.10: a deadline for the body, by cancelling the task running it."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None

        def fire() -> None:
            self._fired = True
            task.cancel()

        self._timer = asyncio.get_running_loop().call_later(self._seconds, fire)

    async def __aexit__(self, kind: object, exc: object, tb: object) -> bool:
        assert self._timer is not None
        self._timer.cancel()
        if self._fired and kind is asyncio.CancelledError:
            raise asyncio.TimeoutError
        return False


def _wrong_type(reply: object) -> bool:
    """Whether ``reply`` is the server's WRONGTYPE error: a list, hash, ... at the name."""
    return isinstance(reply, Exception) and "WRONGTYPE" in str(reply)


def _reply_errno(value: object, whole: int) -> int:
    """0 for a reply to ``GETRANGE name 0 whole`` to check natively, else the ``-errno``
    of why it is a miss (``-ENOENT`` also for an empty reply: absent, or an empty
    value, which only ``TYPE`` tells apart)."""
    if value is None or value == b"":
        return -errno.ENOENT  # evicted by the server, or never there
    if _wrong_type(value):
        return -errno.EBADMSG  # not a block: damaged, deleted like one
    if isinstance(value, Exception):
        return -_errno_of(value)
    if not isinstance(value, bytes):
        return -errno.EBADMSG
    if len(value) > whole:
        return -errno.EMSGSIZE  # longer than any block: damaged, read no further
    if len(value) < whole:
        return -errno.ENODATA
    return 0


def _address(value: bytes) -> int:
    """The address of a bytes object's buffer (valid while it lives)."""
    address = ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value
    assert address is not None
    return address


async def _settle(natives: list[asyncio.Future[None]]) -> None:
    """Waits until every native job in ``natives`` has ended, even through
    cancellation (they copy memory, so never for long); a cancellation is re-raised
    after."""
    cancelled = False
    while natives:
        try:
            await asyncio.shield(natives[0])
        except asyncio.CancelledError:
            cancelled = True
            continue
        natives.pop(0)
    if cancelled:
        raise asyncio.CancelledError


class RemoteStore(LowerTier):
    """A running shared tier (see the module docstring); made by :meth:`RemoteTier.open`."""

    medium = Medium.REMOTE

    def __init__(self, config: RemoteTier, namespace: Namespace, name: str = "remote") -> None:
        self.config = config
        self.name = name
        # Authenticated blocks: the key's fingerprint is part of the identity (so of every
        # name and header); other keys' and unkeyed tiers' blocks are never found.
        self._mac_key = config.mac_key.get_secret_value() if config.mac_key else None
        namespace = namespace.with_mac_key(self._mac_key)
        self.namespace = namespace
        self.identity = namespace.identity()
        self.block_bytes = namespace.block_bytes
        self.deadline_s = config.timeout_s
        self.index_spec = shared_index_spec(config)
        self._key_prefix = f"{config.prefix}:{self.identity.hex()}:".encode()
        from asyncoffload.tiers._io import IoPool, _library, require

        require("the remote tier")
        # Packing a value (header, payload copy, CRC32C) and checking one read back run on
        # native threads, their ends signalled to the loop through an eventfd.
        self._lib = _library()
        self._io = IoPool(
            threads=config.threads,
            payload_len=self.block_bytes,
            identity=self.identity,
            direct_files=False,
            mac_key=self._mac_key,
            write_priority=config.write_priority,
        )
        self._wake_r = -1
        self._wake_w = -1
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._native: dict[Any, tuple[asyncio.Future[None], object]] = {}
        value_bytes = HEADER_BYTES + self.block_bytes
        # As many value buffers as the writes in flight use (66 MiB at the defaults with
        # 256 KiB blocks), kept for reuse.
        #: Blocks per request.
        self.batch = max(1, min(config.batch_blocks, config.batch_bytes // self.block_bytes))
        self._values = _ValuePool(value_bytes, config.pipelines * self.batch)
        # Reads and writes each have their own pipelines in flight, on connections of
        # their own (``_clients``): reads never queue behind write-through.
        self._read_limit = asyncio.Semaphore(config.pipelines)
        self._write_limit = asyncio.Semaphore(config.pipelines)
        self._client = make_client(config)
        self._wake_fd: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Removals of damaged values, run beside the jobs that found them.
        self._cleanups: set[asyncio.Task[None]] = set()
        self._closed = False
        self._warmed = False
        self._down_until = 0.0
        self.errors = 0

    @property
    def background(self) -> frozenset[asyncio.Task[None]]:
        """Tasks of its own still running beside the jobs (removals of damaged values): a
        driver that steps the loop itself steps it until they end (each within
        ``timeout_s``)."""
        return frozenset(self._cleanups)

    # --- the client -----------------------------------------------------------------

    def redis_key(self, key: OffloadKey) -> bytes:
        """The server key of block ``key``."""
        return self._key_prefix + key.hex().encode()

    # --- LowerTier ------------------------------------------------------------------

    def bind(self, wake_fd: int | None) -> None:
        self._wake_fd = wake_fd

    def _wake(self) -> None:
        fd = self._wake_fd
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, (1).to_bytes(8, "little"))

    def _start(self, job: RemoteJob, work: Any) -> RemoteJob:
        if self._closed:
            work.close()
            raise RuntimeError(f"remote tier {self.name} is closed")
        loop = asyncio.get_running_loop()
        if not self._warmed:
            self._warm(loop)

        async def run() -> None:
            try:
                job.results = await work
            except asyncio.CancelledError:
                job.results = [-errno.ECANCELED] * job.num_blocks
                raise
            except Exception as exc:  # a defect of ours: the blocks fail, the loop goes on
                log.exception("remote tier %s: a job failed", self.name)
                job.results = [-_errno_of(exc)] * job.num_blocks
            finally:
                if job.natives:
                    await _settle(job.natives)
                job.finish()
                self._wake()

        task = loop.create_task(run())
        job.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _batches(
        self,
        limit: asyncio.Semaphore,
        n: int,
        request: Callable[[int, int], Awaitable[list[int]]],
        late: list[int] | None = None,
    ) -> list[int]:
        """Runs ``request(start, end)`` for each batch of ``n`` blocks, the batches in
        parallel as far as ``limit`` lets them; a batch that fails, or is not answered
        within ``timeout_s`` of the job's submission (waiting its turn included), gives
        ``-errno`` for its blocks, the others keep theirs. ``late``: gets the start of
        each batch that was sent and not answered in time."""
        batch = self.batch
        reported = False
        deadline = asyncio.get_running_loop().time() + self.config.timeout_s

        async def one(start: int, end: int) -> list[int]:
            nonlocal reported
            sent = False
            try:
                async with _deadline_at(deadline), limit:
                    if self.unavailable():
                        return [-errno.EHOSTDOWN] * (end - start)
                    sent = True
                    out = _answers(await request(start, end), end - start, "a batch")
                    self._down_until = 0.0
                    return out
            except Exception as exc:
                self.errors += 1
                code = _errno_of(exc)
                if code in (errno.ECONNREFUSED, errno.ETIMEDOUT):
                    self._down_until = time.monotonic() + self.config.retry_s
                if code == errno.ETIMEDOUT and sent and late is not None:
                    late.append(start)
                if not reported:  # one line per job, not one per batch
                    reported = True
                    why = str(exc) or os.strerror(code)
                    log.warning("remote tier %s: %s: %s", self.name, type(exc).__name__, why)
                return [-code] * (end - start)

        if n <= batch:  # one batch: no gather (each task it makes is a loop pass more)
            return await one(0, n)
        starts = range(0, n, batch)
        parts = await asyncio.gather(*(one(i, min(n, i + batch)) for i in starts))
        return [result for part in parts for result in part]

    # --- native packing ---------------------------------------------------------------

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """The native pool signals an fd read by this loop (set up once)."""
        if self._reader_loop is loop:
            return
        if self._reader_loop is not None:
            raise RuntimeError(f"remote tier {self.name} is used from another event loop")
        if hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._wake_r = self._wake_w = fd
        else:  # pragma: no cover - Linux has eventfd
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
        self._io.bind(self._wake_w)
        loop.add_reader(self._wake_r, self._on_native)
        self._reader_loop = loop

    def _on_native(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self._wake_r, 4096)
        for job in [job for job in self._native if job.query()]:
            future, _ = self._native.pop(job)
            if not future.done():
                future.set_result(None)

    async def _natively(
        self, owner: RemoteJob, pack: bool, ops: Sequence[tuple[int, int, bytes]], keep: object
    ) -> list[int]:
        """Runs ``ops`` on the native pool; ``keep`` (the values) stays referenced until
        the native job has ended, even if this is cancelled. A few blocks are done on
        the loop instead: under a busy loop, the wake-up's extra pass costs more."""
        if len(ops) * self.block_bytes <= INLINE_BYTES:
            io = self._io
            # The slices of every rank (set_segments), or one run; the MAC key, or none.
            tail = (io.nseg, io.deltas, self._mac_key, len(self._mac_key or b""))
            pack_fn, unpack_fn = self._lib.ao_pack_block, self._lib.ao_unpack_block
            out = []
            size = self.block_bytes
            identity = self.identity
            for host, value, key in ops:
                if pack:
                    pack_fn(value, host, size, identity, key, len(key), *tail)
                    out.append(size)
                else:
                    whole = HEADER_BYTES + size
                    r = unpack_fn(value, whole, host, size, identity, key, len(key), *tail)
                    out.append(size if r == 0 else int(r))
            return out
        loop = asyncio.get_running_loop()
        self._listen(loop)
        job = self._io.submit_values(pack, ops)
        future: asyncio.Future[None] = loop.create_future()
        self._native[job] = (future, keep)
        owner.natives.append(future)
        if job.query():  # ended before it was filed: no wake-up will name it
            self._on_native()
        await asyncio.shield(future)
        owner.natives.remove(future)
        if job.error is not None:  # discarded unrun: the tier closed under it
            raise job.error
        return list(job.results)

    # --- reads and writes -------------------------------------------------------------

    def set_segments(self, deltas: Sequence[int]) -> None:
        self._io.set_segments(deltas)

    def submit_write(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        n = len(keys)
        job = RemoteJob(n, n * self.block_bytes)
        return self._start(job, self._write(job, list(keys), list(host)))

    async def _write(self, job: RemoteJob, keys: list[OffloadKey], host: list[int]) -> list[int]:
        client = self._client
        ttl = self.config.ttl_s
        px = int(ttl * 1000) if ttl is not None else None
        size = self.block_bytes

        async def request(start: int, end: int) -> list[int]:
            # The bytes are taken once a pipeline may go (the CPU slots stay pinned until
            # the job ends), so only the batches in flight hold value buffers: native
            # threads copy each payload into a reused buffer behind its header, taking
            # its CRC32C in the same pass.
            values = [self._values.take() for _ in range(start, end)]
            ops = [
                (addr, ctypes.addressof(cbuf), key)
                for key, addr, (_, cbuf) in zip(keys[start:end], host[start:end], values)
            ]
            packed = await self._natively(job, True, ops, values)
            names = [self.redis_key(key) for key in keys[start:end]]
            buffers = [value for value, _ in values]
            replies = _answers(await client.put_absent(names, buffers, px), len(names), "SET NX")
            # None: the name was taken. A block there (put-if-absent: the same content,
            # another engine's) is present, 0 bytes written; anything else at the name
            # (a list, a hash) would keep every later store out: deleted, put again.
            taken = [i for i, reply in enumerate(replies) if reply is None and packed[i] >= 0]
            if taken:
                again = await self._replace_wrong_types(
                    [names[i] for i in taken], [buffers[i] for i in taken], px
                )
                for i, reply in zip(taken, again):
                    replies[i] = reply
            # Answered: the socket is done with every buffer. (Not given back on an
            # exception: a transport cut short may still hold some.)
            self._values.give(values)
            return [
                -errno.EIO
                if isinstance(reply, Exception) or p < 0
                else (0 if reply is None else size)
                for reply, p in zip(replies, packed)
            ]

        return await self._batches(self._write_limit, len(keys), request)

    async def _replace_wrong_types(
        self, names: list[bytes], values: list[bytearray], px: int | None
    ) -> list[Any]:
        """``SET NX`` answered nil for ``names``: those holding another type than a
        string are deleted and put again. Per name the reply that stands: ``None`` (a
        block is there: present), the new put's, or an exception. Where ``TYPE`` fails
        (an ACL without it), the names count as present, as before."""
        client = self._client
        try:
            kinds = _answers(await client.types(names), len(names), "TYPE")
        except Exception:
            return [None] * len(names)
        wrong = [i for i, kind in enumerate(kinds) if isinstance(kind, str) and kind != "string"]
        out: list[Any] = [None] * len(names)
        if not wrong:
            return out
        # "none": gone since the SET (evicted); put again as well.
        bad = [i for i in wrong if kinds[i] != "none"]
        if bad:
            log.warning(
                "remote tier %s: %d block keys held another type (%s): deleted",
                self.name,
                len(bad),
                ", ".join(sorted({str(kinds[i]) for i in bad})),
            )
            await client.delete([names[i] for i in bad])
        replies = await client.put_absent([names[i] for i in wrong], [values[i] for i in wrong], px)
        replies = _answers(replies, len(wrong), "SET NX")
        for i, reply in zip(wrong, replies):
            out[i] = reply
        return out

    async def _types(self, names: list[bytes]) -> list[str | None]:
        """A read answered nothing for ``names``: the ``TYPE`` of each (``"none"``: a
        miss; ``"string"``: an empty value; another: a list, a hash: both damaged, to be
        deleted); ``None`` where it is not known (``TYPE`` failed: an ACL without it)."""
        try:
            kinds = _answers(await self._client.types(names), len(names), "TYPE")
        except Exception:
            return [None] * len(names)
        return [kind if isinstance(kind, str) else None for kind in kinds]

    def submit_read(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        n = len(keys)
        job = RemoteJob(n, n * self.block_bytes)
        return self._start(job, self._read(job, list(keys), list(host)))

    async def _read(self, job: RemoteJob, keys: list[OffloadKey], host: list[int]) -> list[int]:
        client = self._client
        damaged: list[bytes] = []
        whole = HEADER_BYTES + self.block_bytes
        limit = whole if self.config.bounded_reads else None
        command = "GETRANGE" if limit is not None else "MGET"

        async def request(start: int, end: int) -> list[int]:
            names = [self.redis_key(key) for key in keys[start:end]]
            # At most one byte more than a block: a longer value is damaged, and costs
            # no more than a block to find so.
            replies = _answers(await client.get_prefixes(names, limit), len(names), command)
            out = [_reply_errno(value, whole) for value in replies]
            absent = [i for i, value in enumerate(replies) if value == b"" or value is None]
            if absent:
                # GETRANGE's "" is also its answer for an empty value; MGET's nil for a
                # list or a hash at the name.
                typed = await self._types([names[i] for i in absent])
                for i, kind in zip(absent, typed):
                    if kind == "string":
                        out[i] = -errno.ENODATA
                    elif kind is not None and kind != "none":
                        out[i] = -errno.EBADMSG
            ops = [
                (host[start + i], _address(value), keys[start + i])
                for i, value in enumerate(replies)
                if out[i] == 0
            ]
            if ops:
                # Header, identity and key checked, then the payload checksummed and
                # copied from the reply's buffer into the slot, 64 KiB at a time: one
                # pass, off the loop; a slot whose check failed is not used.
                checked = iter(await self._natively(job, False, ops, replies))
                out = [next(checked) if r == 0 else r for r in out]
            for key, result in zip(keys[start:end], out):
                if -result in _DAMAGED:
                    damaged.append(self.redis_key(key))
            return out

        late: list[int] = []
        out = await self._batches(self._read_limit, len(keys), request, late)
        for start in late:  # sent and not answered in time: as damaged
            damaged.extend(self.redis_key(k) for k in keys[start : start + self.batch])
        if damaged:
            # A damaged value would stay until evicted, and NX would keep every later
            # store of the block from replacing it. (A good value put between the GET
            # and this DEL is lost too: a miss later, never wrong bytes.) Beside the
            # job, which ends now, within timeout_s.
            self._remove(damaged)
        return out

    def _warm(self, loop: asyncio.AbstractEventLoop) -> None:
        """With the first job, open a connection for reads and one for writes beside it
        (within ``timeout_s``, a failure ignored): the first load after stores, or the
        first lookup, then finds a connection of its own open."""
        self._warmed = True
        probe = [self.redis_key(OffloadKey(b"asyncoffload-connect"))]

        async def warm() -> None:
            with contextlib.suppress(Exception):
                async with _deadline(self.config.timeout_s):
                    await asyncio.gather(self._client.exists(probe), self._client.delete(probe))

        task = loop.create_task(warm())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def _remove(self, names: list[bytes]) -> None:
        """Delete ``names`` on the server, in a task of its own bounded by
        ``timeout_s`` (awaited by :meth:`aclose`)."""

        async def remove() -> None:
            with contextlib.suppress(Exception):
                async with _deadline(self.config.timeout_s):
                    await self._client.delete(names)

        task = asyncio.get_running_loop().create_task(remove())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def unavailable(self) -> bool:
        """Whether the server failed to connect or answer in the last ``retry_s``: until
        then requests fail at once (cause ``unavailable``) and ``exists`` finds nothing,
        instead of each waiting ``timeout_s`` for a server that is down."""
        return self._down_until > time.monotonic()

    async def exists(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the server holds now, within ``timeout_s``: multi-key
        ``EXISTS`` counts, asked again name by name only where some are missing (key
        by key on a redis-py cluster, where one command's keys must share a slot)."""
        names = [self.redis_key(key) for key in keys]
        try:
            async with _deadline(self.config.timeout_s), self._read_limit:
                if self.unavailable():
                    return [False] * len(names)
                found = _answers(await self._client.exists(names), len(names), "EXISTS")
        except Exception as exc:
            if _errno_of(exc) in (errno.ECONNREFUSED, errno.ETIMEDOUT):
                self._down_until = time.monotonic() + self.config.retry_s
            raise
        self._down_until = 0.0
        return found

    async def connect(self) -> None:
        """Open the client's read connections now, within ``timeout_s``: ``pipelines``
        ``EXISTS`` of a name no block has, at once. A driver that steps the loop only
        now and then (vLLM's scheduler, once a call) then pays each connection's
        handshake round trips at start-up, not in the middle of a request."""
        probe = self.redis_key(OffloadKey(b"asyncoffload-connect"))
        async with _deadline(self.config.timeout_s):
            # The reads' connections (loads go ahead of stores on connections of their
            # own): a request's questions and loads find them open; the writes' open with
            # the first write-through, beside the request path.
            await asyncio.gather(
                *(self._client.exists([probe]) for _ in range(self.config.pipelines))
            )

    def forget(self, keys: Sequence[OffloadKey]) -> None:
        """Blocks leaving the local index stay on the server: other engines may use them."""

    def describe(self) -> dict[str, object]:
        cfg = self.config
        host = cfg.url.split("@")[-1]  # never the password
        return {
            "url": host,
            "cluster": cfg.cluster,
            "ttl_s": cfg.ttl_s,
            "prefix": cfg.prefix,
            "authenticated": self._mac_key is not None,
        }

    async def aclose(self) -> None:
        """Wait for the jobs and removals running (each ends within ``timeout_s`` of its
        submission; any left then are cancelled), then close the client's connections
        and the native threads: all of it within ``timeout_s`` + 1 s (+ 0.1 s at worst
        for the cancelled ones and the connections)."""
        self._closed = True
        loop = asyncio.get_running_loop()
        end = loop.time() + self.config.timeout_s + _CLOSE_GRACE_S

        def left_s() -> float:
            return max(_CLOSE_FLOOR_S, end - loop.time())

        tasks = self._tasks | self._cleanups
        if tasks:
            _, left = await asyncio.wait(tasks, timeout=left_s())
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=left_s())
        with contextlib.suppress(Exception):
            async with _deadline(left_s()):
                await self._client.aclose()
        self._stop_native()

    def close(self) -> None:
        self._closed = True  # the client's connections close with it
        self._stop_native()

    def _stop_native(self) -> None:
        """Join the native threads (their queued jobs run first), then wake whoever
        waits on them and let go of the wake fd."""
        self._io.close()
        for job, (future, _) in list(self._native.items()):
            job.query()
            if not future.done():
                future.set_result(None)
        self._native.clear()
        loop, self._reader_loop = self._reader_loop, None
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(self._wake_r)
        for fd in {self._wake_r, self._wake_w} - {-1}:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
