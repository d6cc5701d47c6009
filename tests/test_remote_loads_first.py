"""Loads go ahead of stores in the shared tier (issue 41): a read is never queued behind
write-through on a connection, on a real Valkey server.

The server is made to hold writes (``CLIENT PAUSE ... WRITE``: a client that sends a
write command is not served until the pause ends, and neither is anything it sent
after): every write pipeline of the tier waits there. A read issued behind them must
still be answered, at once, while none of the writes is; then the pause ends and every
write lands (writes are not starved). Before reads had connections of their own, the
read waited for a connection of the pool the writes held (redis-py, ``max_connections``
as many as the pipelines) or sat behind the writes on glide's one multiplexed
connection, until the pause ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import asyncoffload as ao
from asyncoffload.keys import make_offload_key
from asyncoffload.tiers.remote import RemoteJob, RemoteStore, RemoteTier

pytest.importorskip("redis", reason="the remote tier's tests need redis-py")

FRAG = 4096
#: How long the server holds writes: far longer than a read may take here.
PAUSE_MS = 20_000


@pytest.fixture(params=["redis-py", "glide"])
def client(request: pytest.FixtureRequest) -> str:
    if request.param == "glide":
        pytest.importorskip("glide", reason="valkey-glide is not installed")
    return str(request.param)


def keys(n: int, start: int = 0) -> list[ao.OffloadKey]:
    return [make_offload_key(i.to_bytes(4, "big") * 8) for i in range(start, start + n)]


async def ended(job: RemoteJob, within_s: float, what: str) -> list[int]:
    assert job.task is not None
    try:
        await asyncio.wait_for(asyncio.shield(job.task), within_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"{what} did not end within {within_s}s") from None
    return job.results


async def test_a_read_behind_queued_writes_is_answered_first(
    valkey_server: Any, client: str
) -> None:
    kv = [torch.randint(0, 256, (16, FRAG), dtype=torch.uint8) for _ in range(2)]
    tier = RemoteTier(
        valkey_server.url,
        client=client,
        pipelines=4,
        max_connections=4,  # as many connections as write pipelines
        batch_blocks=1,  # one pipelined request per block: 8 writes, 4 of them sent
        timeout_s=60,
    )
    cfg = ao.EngineConfig(cpu_blocks=16, tiers=[tier], model="m", policy="lru")
    async with ao.AsyncOffloadEngine(kv, cfg) as eng:
        store = eng.tiers[0]
        assert isinstance(store, RemoteStore)
        host = [eng._backend.host_address(i) for i in range(16)]
        # One block on the server, to read back later.
        first = store.submit_write(keys(1), [0], host[:1])
        assert isinstance(first, RemoteJob)
        assert await ended(first, 10, "the first write") == [2 * FRAG]
        valkey_server.command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        try:
            writes = store.submit_write(keys(8, 100), list(range(8)), host[8:16])
            assert isinstance(writes, RemoteJob)
            await asyncio.sleep(0.2)  # the write pipelines are sent, and held
            assert writes.task is not None and not writes.task.done()
            read = store.submit_read(keys(1), [0], host[1:2])
            assert isinstance(read, RemoteJob)
            # (A block's bytes, header and CRC32C checked by the tier.)
            assert await ended(read, 10, "a read behind held writes") == [2 * FRAG]
            assert not writes.task.done()  # the read did not wait for them
        finally:
            valkey_server.command("CLIENT", "UNPAUSE")
        # Held, not starved: every write lands once the server serves writes again.
        assert await ended(writes, 20, "the held writes") == [2 * FRAG] * 8
