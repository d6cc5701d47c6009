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
import struct
from collections.abc import Sequence
from typing import Any, Literal
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import Medium
from asyncoffload.tiers.base import LowerTier, TierManager
from asyncoffload.tiers.format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    Namespace,
    pack_header_into,
)
from asyncoffload.transfer.base import CopyJob

__all__ = ["RemoteStore", "RemoteTier"]

log = logging.getLogger("asyncoffload.tiers")

_FIXED = struct.Struct("<8sII16sQII")


class RemoteTier(BaseModel):
    """Settings of a shared tier on Redis or Valkey: ``RemoteTier(url=...)``.

    ``url`` is ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS); with
    ``cluster=True`` it names one node of a Redis / Valkey cluster. ``index_blocks`` bounds
    the local index of blocks known to be on the server (the server's own ``maxmemory``
    bounds what it keeps). ``admission`` is ``None`` (every block, the default: a shared
    tier is for sharing), ``"frequency"`` (the ``min_offers``-th offer) or a filter name.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["remote"] = "remote"
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    username: str | None = None
    password: SecretStr | None = None
    ssl_ca_certs: str | None = Field(None, description="CA bundle for rediss:// URLs.")
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    prefix: str = Field("ao", description="First part of every key.")
    ttl_s: float | None = Field(None, gt=0, description="Expire blocks after this long.")
    index_blocks: int = Field(1 << 20, gt=0, description="Blocks the local index tracks.")
    policy: str = "lru"
    admission: str | None = None
    min_offers: int = Field(2, ge=1)
    max_connections: int = Field(32, gt=0, le=1024)
    batch_blocks: int = Field(64, gt=0, description="Blocks per pipelined request.")
    timeout_s: float = Field(5.0, gt=0, description="Per request; a late one is a miss.")

    def __init__(self, url: str | None = None, **data: Any) -> None:
        if url is not None:
            data["url"] = url
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _password_out_of_url(cls, data: Any) -> Any:
        """A password in the URL moves to ``password`` (a secret, never printed)."""
        if isinstance(data, dict) and isinstance(data.get("url"), str):
            parts = urlsplit(data["url"])
            if parts.password is not None:
                user = unquote(parts.username or "")
                host = parts.netloc.rsplit("@", 1)[1]
                netloc = f"{quote(user)}@{host}" if user else host
                data = dict(data, url=urlunsplit(parts._replace(netloc=netloc)))
                data.setdefault("password", unquote(parts.password))
                if user:
                    data.setdefault("username", user)
        return data

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {value!r}")
        return value

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

    def open(self, namespace: Namespace, name: str = "remote") -> RemoteStore:
        return RemoteStore(self, namespace, name)


class RemoteJob(CopyJob):
    """A batch of block reads or writes run by a task on the event loop; ``results``
    per block: bytes moved, or ``-errno``."""

    __slots__ = ("results", "task")

    def __init__(self, n: int, nbytes: int) -> None:
        super().__init__(n, nbytes)
        self.results: list[int] = []
        self.task: asyncio.Task[None] | None = None


def _errno_of(exc: BaseException) -> int:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, (asyncio.TimeoutError, RedisTimeoutError)):
        return errno.ETIMEDOUT
    if isinstance(exc, RedisConnectionError):
        return errno.ECONNREFUSED
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


class RemoteStore(LowerTier):
    """A running shared tier (see the module docstring); made by :meth:`RemoteTier.open`."""

    medium = Medium.REMOTE

    def __init__(self, config: RemoteTier, namespace: Namespace, name: str = "remote") -> None:
        try:
            import redis.asyncio  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "the remote tier needs redis-py: pip install 'asyncoffload[remote]'"
            ) from None
        self.config = config
        self.name = name
        self.namespace = namespace
        self.identity = namespace.identity()
        self.block_bytes = namespace.block_bytes
        self.deadline_s = config.timeout_s
        threshold = config.min_offers if config.admission == "frequency" else 0
        admission = config.admission if config.admission not in (None, "frequency") else None
        self.manager = TierManager(
            config.index_blocks, Medium.REMOTE, config.policy, threshold, admission=admission
        )
        self._key_prefix = f"{config.prefix}:{self.identity.hex()}:".encode()
        self._client: Any = None
        self._wake_fd: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.errors = 0

    # --- the client -----------------------------------------------------------------

    def _connect(self) -> Any:
        if self._client is not None:
            return self._client
        cfg = self.config
        kwargs: dict[str, Any] = {
            "socket_timeout": cfg.timeout_s,
            "socket_connect_timeout": cfg.timeout_s,
            "health_check_interval": 30,
        }
        if cfg.username is not None:
            kwargs["username"] = cfg.username
        if cfg.password is not None:
            kwargs["password"] = cfg.password.get_secret_value()
        if cfg.url.startswith("rediss://"):
            for field in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
                value = getattr(cfg, field)
                if value is not None:
                    kwargs[field] = value
        if cfg.cluster:
            from redis.asyncio.cluster import RedisCluster

            self._client = RedisCluster.from_url(
                cfg.url, max_connections=cfg.max_connections, **kwargs
            )
        else:
            from redis.asyncio import BlockingConnectionPool, Redis

            # Blocking: a burst of batches waits for a connection instead of failing
            # with MaxConnectionsError, as the default pool does under gather.
            pool = BlockingConnectionPool.from_url(
                cfg.url, max_connections=cfg.max_connections, timeout=cfg.timeout_s, **kwargs
            )
            self._client = Redis(connection_pool=pool)
        return self._client

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
            raise RuntimeError(f"remote tier {self.name} is closed")
        loop = asyncio.get_running_loop()

        async def run() -> None:
            try:
                job.results = await asyncio.wait_for(work, self.config.timeout_s * 2)
            except asyncio.CancelledError:
                job.results = [-errno.ECANCELED] * job.num_blocks
                raise
            except Exception as exc:
                code = _errno_of(exc)
                self.errors += 1
                log.warning("remote tier %s: %s", self.name, exc)
                job.results = [-code] * job.num_blocks
            finally:
                job.finish()
                self._wake()

        task = loop.create_task(run())
        job.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def submit_write(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        n = len(keys)
        job = RemoteJob(n, n * self.block_bytes)
        size = self.block_bytes
        # The bytes are taken now, on the loop: the CPU slots are pinned until the job
        # ends anyway, but a value must be one bytes object for the client.
        values: list[bytearray] = []
        for key, addr in zip(keys, host):
            value = bytearray(HEADER_BYTES + size)
            target = ctypes.addressof(ctypes.c_char.from_buffer(value, HEADER_BYTES))
            ctypes.memmove(target, addr, size)  # the one copy: slot -> value
            pack_header_into(value, self.identity, key)
            values.append(value)
        return self._start(job, self._write(list(keys), values))

    async def _write(self, keys: list[OffloadKey], values: list[bytearray]) -> list[int]:
        client = self._connect()
        ttl = self.config.ttl_s
        px = int(ttl * 1000) if ttl is not None else None
        out: list[int] = []
        batch = self.config.batch_blocks
        for start in range(0, len(keys), batch):
            async with client.pipeline(transaction=False) as pipe:
                for key, value in zip(keys[start : start + batch], values[start : start + batch]):
                    pipe.set(self.redis_key(key), value, nx=True, px=px)
                replies = await pipe.execute(raise_on_error=False)
            for reply in replies:
                # None: already there (put-if-absent: the same content), fine.
                out.append(-errno.EIO if isinstance(reply, Exception) else self.block_bytes)
        return out

    def submit_read(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        n = len(keys)
        job = RemoteJob(n, n * self.block_bytes)
        return self._start(job, self._read(list(keys), list(host)))

    async def _read(self, keys: list[OffloadKey], host: list[int]) -> list[int]:
        client = self._connect()
        out: list[int] = []
        batch = self.config.batch_blocks
        for start in range(0, len(keys), batch):
            chunk = keys[start : start + batch]
            async with client.pipeline(transaction=False) as pipe:
                for key in chunk:
                    pipe.get(self.redis_key(key))
                replies = await pipe.execute(raise_on_error=False)
            for key, addr, value in zip(chunk, host[start : start + batch], replies):
                out.append(self._check_and_copy(key, addr, value))
        return out

    def _check_and_copy(self, key: OffloadKey, addr: int, value: object) -> int:
        """Check a value read for ``key``; copy its payload to ``addr`` only if it is
        whole, of this namespace and this key, and its CRCs match."""
        from asyncoffload.tiers._io import crc32c

        if value is None:
            return -errno.ENOENT  # evicted by the server, or never there
        if isinstance(value, Exception):
            return -_errno_of(value)
        if not isinstance(value, bytes):
            return -errno.EBADMSG
        size = self.block_bytes
        if len(value) < HEADER_BYTES + size:
            return -errno.ENODATA
        view = memoryview(value)
        magic, version, length, identity, payload_len, crc, key_len = _FIXED.unpack_from(view)
        (header_crc,) = struct.unpack_from("<I", view, HEADER_BYTES - 4)
        if (
            magic != MAGIC
            or version != FORMAT_VERSION
            or length != HEADER_BYTES
            or header_crc != crc32c(view[: HEADER_BYTES - 4])
            or payload_len != size
        ):
            return -errno.EBADMSG
        if identity != self.identity:
            return -errno.ESTALE
        if bytes(view[_FIXED.size : _FIXED.size + key_len]) != key:
            return -errno.EKEYREJECTED
        if crc32c(view[HEADER_BYTES : HEADER_BYTES + size]) != crc:
            return -errno.EBADMSG
        # Straight from the reply's buffer into the slot: no intermediate copy.
        source = ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value
        assert source is not None
        ctypes.memmove(addr, source + HEADER_BYTES, size)
        return size

    async def exists(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the server holds now (one pipelined EXISTS per key)."""
        client = self._connect()
        out: list[bool] = []
        batch = self.config.batch_blocks
        for start in range(0, len(keys), batch):
            async with client.pipeline(transaction=False) as pipe:
                for key in keys[start : start + batch]:
                    pipe.exists(self.redis_key(key))
                replies = await asyncio.wait_for(
                    pipe.execute(raise_on_error=False), self.config.timeout_s
                )
            out.extend(reply == 1 for reply in replies)
        return out

    def forget(self, keys: Sequence[OffloadKey]) -> None:
        """Blocks leaving the local index stay on the server: other engines may use them."""

    def describe(self) -> dict[str, object]:
        cfg = self.config
        host = cfg.url.split("@")[-1]  # never the password
        return {"url": host, "cluster": cfg.cluster, "ttl_s": cfg.ttl_s, "prefix": cfg.prefix}

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    def close(self) -> None:
        self._closed = True
        self._client = None  # its connections close with it
