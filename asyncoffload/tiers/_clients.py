"""The shared tier's clients: the few requests it makes, through redis-py or valkey-glide.

Both complete on the event loop: redis-py's ``redis.asyncio`` reads its sockets there;
valkey-glide's native core hands finished requests to the loop through a pipe it reads
there. Neither runs a Python thread.

Loads go ahead of stores: each client keeps its reads (``get_prefixes``, ``exists``,
``types``) on connections of their own, apart from its writes (``put_absent``,
``delete``): a read never queues behind write-through on a connection, neither in a
connection pool that writes have taken (redis-py) nor on a multiplexed connection whose
writes the server has not answered yet (valkey-glide, one connection per client). The
server interleaves the two sets of connections, so writes still make progress.

A client answers per block where the server does: ``put_absent`` and ``get_prefixes``
give one entry per name, an exception object where that name's request failed. A request
that cannot be made at all (the server down, a timeout) raises. Reads are bounded: a
value is read up to a limit set from the block size (``GETRANGE``), so a value planted
far larger than a block costs no more than a block to read.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from pydantic import SecretStr

__all__ = ["Client", "GlideClient", "RedisPyClient", "make_client"]


class Client(Protocol):
    """What the shared tier asks of a server."""

    async def put_absent(self, names: list[bytes], values: list[Any], px: int | None) -> list[Any]:
        """``SET name value NX [PX px]`` for each pair, pipelined: per name ``OK`` (or
        true) when written, ``None`` when it was there already, or an exception."""
        ...

    async def get_prefixes(self, names: list[bytes], end: int | None) -> list[Any]:
        """The first ``end + 1`` bytes of each name's value (``GETRANGE name 0 end``):
        bytes (empty when the name is absent or its value empty), or an exception (a
        name holding another type than a string answers ``WRONGTYPE``). ``end`` None:
        whole values (``MGET``, ``None`` when absent and for another type)."""
        ...

    async def exists(self, names: list[bytes]) -> list[bool]:
        """Which of ``names`` exist."""
        ...

    async def types(self, names: list[bytes]) -> list[Any]:
        """``TYPE`` of each name, pipelined: ``"string"``, ``"list"``, ``"hash"``, ...,
        ``"none"`` when absent, or an exception."""
        ...

    async def delete(self, names: list[bytes]) -> None: ...

    async def aclose(self) -> None: ...


class ClientSettings(Protocol):
    """What a client reads of the shared tier's settings (a ``RemoteTier``); a
    protocol, so that this module need not import the tier that imports it."""

    @property
    def url(self) -> str: ...
    @property
    def client(self) -> Literal["redis-py", "glide"]: ...
    @property
    def cluster(self) -> bool: ...
    @property
    def username(self) -> str | None: ...
    @property
    def password(self) -> SecretStr | None: ...
    @property
    def ssl_ca_certs(self) -> str | None: ...
    @property
    def ssl_certfile(self) -> str | None: ...
    @property
    def ssl_keyfile(self) -> str | None: ...
    @property
    def max_connections(self) -> int: ...
    @property
    def pipelines(self) -> int: ...
    @property
    def timeout_s(self) -> float: ...


def make_client(config: ClientSettings) -> Client:
    if config.client == "glide":
        return GlideClient(config)
    return RedisPyClient(config)


def _type_name(reply: Any) -> Any:
    """A ``TYPE`` reply as a str (clients give bytes or str); an exception as it is."""
    if isinstance(reply, (bytes, bytearray)):
        return bytes(reply).decode(errors="replace")
    return reply


# --- redis-py -----------------------------------------------------------------------------


def _driver_identity() -> dict[str, Any]:
    """CLIENT SETINFO names redis-py and asyncoffload. Given explicitly, redis-py does not
    look its own version up with importlib.metadata for every new connection (2.4 ms
    each here)."""
    import redis

    from asyncoffload._version import __version__

    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # redis-py < 7
        return {
            "lib_name": f"redis-py(asyncoffload_v{__version__})",
            "lib_version": redis.__version__,
        }
    info = DriverInfo(lib_version=redis.__version__).add_upstream_driver(
        "asyncoffload", __version__
    )
    return {"driver_info": info}


class RedisPyClient:
    """``redis.asyncio`` with hiredis: a ``BlockingConnectionPool`` (the default pool
    raises ``MaxConnectionsError`` under ``gather``), or ``RedisCluster``, whose pipelines
    split per node."""

    def __init__(self, config: ClientSettings) -> None:
        try:
            import redis.asyncio  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "the remote tier needs redis-py: pip install 'asyncoffload[remote]'"
            ) from None
        self.config = config
        #: The write client, and the read client (connections of their own).
        self._client: Any = None
        self._reader: Any = None

    def _connect(self, read: bool = False) -> Any:
        client = self._reader if read else self._client
        if client is None:
            client = self._open()
            if read:
                self._reader = client
            else:
                self._client = client
        return client

    def _open(self) -> Any:
        cfg = self.config
        kwargs: dict[str, Any] = {
            "socket_timeout": cfg.timeout_s,
            "socket_connect_timeout": cfg.timeout_s,
            "health_check_interval": 30,
            **_driver_identity(),
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

            return RedisCluster.from_url(cfg.url, max_connections=cfg.max_connections, **kwargs)
        from redis.asyncio import BlockingConnectionPool, Redis

        pool = BlockingConnectionPool.from_url(
            cfg.url, max_connections=cfg.max_connections, timeout=cfg.timeout_s, **kwargs
        )
        return Redis(connection_pool=pool)

    async def _pipelined(self, names: list[bytes], add: Any, read: bool = False) -> list[Any]:
        async with self._connect(read).pipeline(transaction=False) as pipe:
            for i, name in enumerate(names):
                add(pipe, i, name)
            return list(await pipe.execute(raise_on_error=False))

    async def put_absent(self, names: list[bytes], values: list[Any], px: int | None) -> list[Any]:
        return await self._pipelined(
            names, lambda pipe, i, name: pipe.set(name, values[i], nx=True, px=px)
        )

    async def get_prefixes(self, names: list[bytes], end: int | None) -> list[Any]:
        if len(names) == 1 and not self.config.cluster:
            # One command: no pipeline connection release (a task and a shield: three
            # loop passes).
            from redis.exceptions import ResponseError

            client = self._connect(read=True)
            try:
                if end is None:
                    return [await client.get(names[0])]
                return [await client.getrange(names[0], 0, end)]
            except ResponseError as exc:  # WRONGTYPE: that name's answer
                return [exc]
        if end is None:
            if self.config.cluster:  # one pipeline, split per node
                return await self._pipelined(names, lambda pipe, i, name: pipe.get(name), True)
            # One command, one reply: less to parse than a pipeline of GETs.
            return list(await self._connect(read=True).mget(names))
        # A pipeline (split per node on a cluster). Not MGET: it reads values whole,
        # whatever their size.
        return await self._pipelined(
            names, lambda pipe, i, name: pipe.getrange(name, 0, end), read=True
        )

    async def exists(self, names: list[bytes]) -> list[bool]:
        if self.config.cluster:  # keys of one command must share a slot
            return [r == 1 for r in await self._each_exists(names)]
        # One EXISTS per 1,024 names counts those that exist; only a chunk where some
        # are missing is asked again name by name.
        step = 1024
        chunks = [names[i : i + step] for i in range(0, len(names), step)]
        async with self._connect(read=True).pipeline(transaction=False) as pipe:
            for chunk in chunks:
                pipe.exists(*chunk)
            counts = await pipe.execute()
        out: list[bool] = []
        for chunk, count in zip(chunks, counts):
            if count == len(chunk) or count == 0:
                out.extend([count > 0] * len(chunk))
            else:
                out.extend(r == 1 for r in await self._each_exists(chunk))
        return out

    async def _each_exists(self, names: list[bytes]) -> list[Any]:
        async with self._connect(read=True).pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(name)
            return list(await pipe.execute())

    async def types(self, names: list[bytes]) -> list[Any]:
        replies = await self._pipelined(names, lambda pipe, i, name: pipe.type(name), True)
        return [_type_name(reply) for reply in replies]

    async def delete(self, names: list[bytes]) -> None:
        await self._pipelined(names, lambda pipe, i, name: pipe.delete(name))

    async def aclose(self) -> None:
        clients = (self._client, self._reader)
        self._client = self._reader = None
        for client in clients:
            if client is None:
                continue
            with contextlib.suppress(Exception):
                await client.aclose()
            # A Redis client closes only a pool it made itself; this one is ours.
            pool = getattr(client, "connection_pool", None)
            if pool is not None:
                with contextlib.suppress(Exception):
                    await pool.disconnect()


# --- valkey-glide ---------------------------------------------------------------------------


def glide_settings(config: ClientSettings) -> tuple[Any, bool]:
    """valkey-glide's configuration for ``config``, and whether it is a cluster's.
    ``ValueError`` for what glide cannot do here (a unix socket URL)."""
    import glide

    parts = urlsplit(config.url)
    if parts.scheme == "unix":
        raise ValueError("client='glide' needs a redis:// or rediss:// URL, not unix://")
    addresses = [glide.NodeAddress(parts.hostname or "127.0.0.1", parts.port or 6379)]
    tls = parts.scheme == "rediss"
    credentials = None
    username = config.username if config.username is not None else parts.username
    if config.password is not None:
        credentials = glide.ServerCredentials(
            config.password.get_secret_value(), unquote(username) if username else None
        )
    kwargs: dict[str, Any] = {
        "use_tls": tls,
        "credentials": credentials,
        "request_timeout": int(config.timeout_s * 1000),
        # Reads and writes each have `pipelines` requests out, and an alookup one more:
        # well below glide's own limit of 1,000.
        "inflight_requests_limit": 2 * config.pipelines + 8,
        "lib_name": "asyncoffload",
        # Connect on the first request: glide's create() otherwise connects before it
        # returns, blocking the loop (a second per attempt here with the server down).
        "lazy_connect": True,
        # Attempts 50, 100, 200, 400, then every 800 ms: back within a second of the
        # server (glide's default backoff waits longer).
        "reconnect_strategy": glide.BackoffStrategy(num_of_retries=4, factor=50, exponent_base=2),
    }
    tls_config = None
    if tls and (config.ssl_ca_certs or config.ssl_certfile):
        tls_config = glide.TlsAdvancedConfiguration(
            root_pem_cacerts=_read(config.ssl_ca_certs),
            client_cert_pem=_read(config.ssl_certfile),
            client_key_pem=_read(config.ssl_keyfile),
        )
    advanced = (
        glide.AdvancedGlideClusterClientConfiguration
        if config.cluster
        else glide.AdvancedGlideClientConfiguration
    )
    kwargs["advanced_config"] = advanced(
        connection_timeout=int(config.timeout_s * 1000), tls_config=tls_config
    )
    if config.cluster:
        return glide.GlideClusterClientConfiguration(addresses, **kwargs), True
    db = int(parts.path.strip("/") or 0)
    return glide.GlideClientConfiguration(addresses, database_id=db, **kwargs), False


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class GlideClient:
    """valkey-glide (its Rust core; replies come back to the loop through a pipe). Made
    on first use; a cluster client's batches and multi-key commands split per node."""

    def __init__(self, config: ClientSettings) -> None:
        try:
            import glide  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "client='glide' needs valkey-glide: pip install valkey-glide"
            ) from None
        self.config = config
        self._settings, self._cluster = glide_settings(config)
        #: The write client, and the read client (a multiplexed connection of its own).
        self._client: Any = None
        self._reader: Any = None

    async def _connect(self, read: bool = False) -> Any:
        if (self._reader if read else self._client) is None:
            import glide

            kind = glide.GlideClusterClient if self._cluster else glide.GlideClient
            client = await kind.create(self._settings)
            if (self._reader if read else self._client) is not None:
                await client.close()  # another request connected meanwhile
            elif read:
                self._reader = client
            else:
                self._client = client
        return self._reader if read else self._client

    async def put_absent(self, names: list[bytes], values: list[Any], px: int | None) -> list[Any]:
        import glide

        client = await self._connect()
        batch = glide.ClusterBatch(is_atomic=False) if self._cluster else glide.Batch(False)
        expiry = glide.ExpirySet(glide.ExpiryType.MILLSEC, px) if px is not None else None
        for name, value in zip(names, values):
            batch.set(
                name,
                value,
                conditional_set=glide.ConditionalChange.ONLY_IF_DOES_NOT_EXIST,
                expiry=expiry,
            )
        return list(await client.exec(batch, raise_on_error=False) or [])

    async def get_prefixes(self, names: list[bytes], end: int | None) -> list[Any]:
        import glide

        client = await self._connect(read=True)
        if end is None:
            return list(await client.mget(names))
        batch = glide.ClusterBatch(is_atomic=False) if self._cluster else glide.Batch(False)
        for name in names:
            batch.getrange(name, 0, end)
        return list(await client.exec(batch, raise_on_error=False) or [])

    async def exists(self, names: list[bytes]) -> list[bool]:
        import glide

        client = await self._connect(read=True)
        if await client.exists(names) == len(names):
            return [True] * len(names)
        batch = glide.ClusterBatch(is_atomic=False) if self._cluster else glide.Batch(False)
        for name in names:
            batch.exists([name])
        return [r == 1 for r in await client.exec(batch, raise_on_error=False) or []]

    async def types(self, names: list[bytes]) -> list[Any]:
        import glide

        client = await self._connect(read=True)
        batch = glide.ClusterBatch(is_atomic=False) if self._cluster else glide.Batch(False)
        for name in names:
            batch.type(name)
        replies = await client.exec(batch, raise_on_error=False) or []
        return [_type_name(reply) for reply in replies]

    async def delete(self, names: list[bytes]) -> None:
        client = await self._connect()
        await client.delete(names)

    async def aclose(self) -> None:
        clients = (self._client, self._reader)
        self._client = self._reader = None
        for client in clients:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
