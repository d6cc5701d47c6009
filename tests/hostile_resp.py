"""A hostile Redis-protocol server for the shared tier's tests: RESP2 on 127.0.0.1, on
the test's own event loop, keeping values in a dict, and misbehaving on request.

It speaks enough of the protocol for redis-py (``CLIENT SETINFO``, ``SET NX PX``,
``GETRANGE``, ``GET``, ``MGET``, ``EXISTS``, ``TYPE``, ``DEL``, ``PING``) and records
every command it received. What it does wrong is :attr:`HostileServer.mode`:

- ``"honest"``: nothing;
- ``"stall_reads"``: never answers ``GETRANGE``/``GET``/``MGET`` (a value too large to
  arrive, a server stuck mid-reply); the connection stays open;
- ``"stall_all"``: answers nothing at all once set (a server that stopped, SIGSTOP);
- ``"array_values"``: answers a read with an array where a string belongs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

HOST = "127.0.0.1"


def _bulk(value: bytes | None) -> bytes:
    return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)


def _array(items: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(items) + b"".join(items)


class HostileServer:
    """See the module docstring; :attr:`url` to connect, :attr:`received` the commands
    (upper-cased name, then the arguments as bytes) in the order they came."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.mode = "honest"
        self.received: list[list[bytes]] = []
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def commands(self, name: str) -> list[list[bytes]]:
        """The commands named ``name`` received so far, without their name."""
        return [c[1:] for c in self.received if c[0] == name.upper().encode()]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                command = await _read_command(reader)
                if command is None:
                    return
                self.received.append(command)
                reply = self._answer(command)
                if reply is not None:
                    writer.write(reply)
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()

    def _answer(self, command: list[bytes]) -> bytes | None:
        name, args = command[0], command[1:]
        mode = self.mode
        if mode == "stall_all":
            return None
        reads = (b"GETRANGE", b"GET", b"MGET")
        if name in reads and mode == "stall_reads":
            return None
        if name in reads and mode == "array_values":
            return _array([_bulk(b"x")] * 2)
        values = self.values
        if name == b"GETRANGE":
            value = values.get(args[0], b"")
            start, end = int(args[1]), int(args[2])
            return _bulk(value[start : end + 1])
        if name == b"GET":
            return _bulk(values.get(args[0]))
        if name == b"MGET":
            return _array([_bulk(values.get(k)) for k in args])
        if name == b"SET":
            flags = [a.upper() for a in args[2:]]
            if b"NX" in flags and args[0] in values:
                return _bulk(None)
            values[args[0]] = args[1]
            return b"+OK\r\n"
        if name == b"EXISTS":
            return b":%d\r\n" % sum(k in values for k in args)
        if name == b"TYPE":
            return b"+string\r\n" if args[0] in values else b"+none\r\n"
        if name == b"DEL":
            return b":%d\r\n" % sum(values.pop(k, None) is not None for k in args)
        if name == b"PING":
            return b"+PONG\r\n"
        if name in (b"CLIENT", b"SELECT"):
            return b"+OK\r\n"
        return b"-ERR unknown command '%s'\r\n" % name.lower()


async def _read_command(reader: asyncio.StreamReader) -> list[bytes] | None:
    line = await reader.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        raise ConnectionError(f"not a RESP array: {line[:40]!r}")
    out = []
    for _ in range(int(line[1:-2])):
        size_line = await reader.readline()
        size = int(size_line[1:-2])
        data = await reader.readexactly(size + 2)
        out.append(data[:-2])
    out[0] = out[0].upper()
    return out


@contextlib.asynccontextmanager
async def hostile_server() -> AsyncIterator[HostileServer]:
    server = HostileServer()
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def wait_until(check: Any, what: str, timeout_s: float = 10.0) -> None:
    """Poll ``check()`` on the loop until true; AssertionError naming ``what`` after
    ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        await asyncio.sleep(0.02)
