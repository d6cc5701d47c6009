"""The real servers of tests/servers.py, driven by real clients (redis-py with hiredis):
a round trip, server-side eviction, a kill and a restart on the same port, a password,
a 3-node cluster with keys on every node, and no server process left behind."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, ConnectionError, OutOfMemoryError

from tests.processes import describe, run_python
from tests.servers import (
    HOST,
    Server,
    ServerError,
    ServerFactory,
    ValkeyCluster,
    ValkeyServer,
    leftover_servers,
)

MIB = 1 << 20


def client(url: str) -> Redis:
    """A client that fails at once on a dead server (redis-py's default retries back off
    for seconds)."""
    return Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_timeout=5)


async def test_set_get_round_trip(any_server: Server) -> None:
    value = os.urandom(MIB)
    r = client(any_server.url)
    try:
        assert await r.set("k", value, nx=True)
        assert not await r.set("k", b"other", nx=True)  # put-if-absent
        assert await r.get("k") == value
        assert await r.get("missing") is None
    finally:
        await r.aclose()
    assert any_server.dbsize() == 1


async def test_maxmemory_allkeys_lru_evicts(make_server: ServerFactory) -> None:
    server = make_server(maxmemory="4mb", policy="allkeys-lru")
    assert server.config_get("maxmemory-policy") == "allkeys-lru"
    values = {f"block:{i}": os.urandom(64 << 10) for i in range(200)}  # 12.5 MiB > 4 MiB
    r = client(server.url)
    try:
        for start in range(0, len(values), 20):
            async with r.pipeline(transaction=False) as pipe:
                for key in list(values)[start : start + 20]:
                    pipe.set(key, values[key])
                await pipe.execute()
        got = await r.mget(list(values))
        kept = {k: v for k, v in zip(values, got) if v is not None}
        assert 0 < len(kept) < len(values), len(kept)
        assert all(values[k] == v for k, v in kept.items())  # survivors are intact
        assert int(server.info("stats")["evicted_keys"]) > 0
        # Without an eviction policy the server refuses writes instead (OOM).
        server.config_set("maxmemory-policy", "noeviction")
        with pytest.raises(OutOfMemoryError):
            for i in range(200):
                await r.set(f"more:{i}", values["block:0"])
    finally:
        await r.aclose()


async def test_killed_server_restarts_on_its_port(make_server: ServerFactory) -> None:
    server = make_server()
    port, pid = server.port, server.pid
    r = client(server.url)
    try:
        await r.set("k", b"v")
        server.kill()
        assert not server.running
        with pytest.raises(ConnectionError):
            await r.get("k")
        server.start()
        assert (server.port, server.running) == (port, True) and server.pid != pid
        fresh = client(server.url)
        try:
            assert await fresh.get("k") is None  # no persistence: the data died with it
            await fresh.set("k", b"v2")
        finally:
            await fresh.aclose()
        assert await r.get("k") == b"v2"  # the old client reconnects by itself
    finally:
        await r.aclose()


async def test_a_password_server_refuses_unauthenticated_commands(
    make_server: ServerFactory,
) -> None:
    server = make_server(password="s3cret")
    anonymous = client(server.url)
    wrong = client(f"redis://:nope@{HOST}:{server.port}/0")
    good = client(server.auth_url)
    try:
        with pytest.raises(AuthenticationError):
            await anonymous.set("k", b"v")
        with pytest.raises(AuthenticationError):
            await wrong.get("k")
        assert await good.set("k", b"v")
        assert await good.get("k") == b"v"
    finally:
        for r in (anonymous, wrong, good):
            await r.aclose()


async def test_the_cluster_spreads_keys_over_all_nodes(valkey_cluster: ValkeyCluster) -> None:
    rc = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in valkey_cluster.startup_nodes],
        socket_timeout=5,
    )
    keys = [f"spread:{i}" for i in range(100)]
    try:
        async with rc.pipeline() as pipe:
            for key in keys:
                pipe.set(key, key.encode() * 100)
            assert all(await pipe.execute())
        owners: dict[int, int] = {}
        for key in keys:
            slot = valkey_cluster.nodes[0].command("CLUSTER", "KEYSLOT", key)
            node = valkey_cluster.node_for_slot(slot)
            assert node.command("EXISTS", key) == 1, (key, slot, node)
            owners[node.port] = owners.get(node.port, 0) + 1
        assert len(owners) == 3, owners
        per_node = [len(n.command("KEYS", "spread:*")) for n in valkey_cluster.nodes]
        assert sum(per_node) == 100 and min(per_node) > 0, per_node
        assert [await rc.get(k) for k in keys] == [k.encode() * 100 for k in keys]
        assert await rc.delete(*keys) == 100
    finally:
        await rc.aclose()


def test_a_server_that_fails_to_start_fails_fast_with_its_log(tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(ServerError, match="exited with status") as exc:
        ValkeyServer(tmp_path, extra_args=["--no-such-directive", "1"])
    assert "no-such-directive" in str(exc.value)  # the log's tail says why
    assert time.monotonic() - began < 5

    silent = tmp_path / "silent-server"
    silent.write_text("#!/bin/sh\necho 'never answers'\nexec sleep 60\n")
    silent.chmod(silent.stat().st_mode | stat.S_IXUSR)
    server = ValkeyServer(tmp_path, binary=silent, start=False)
    began = time.monotonic()
    with pytest.raises(ServerError, match="did not answer PING") as exc:
        server.start(timeout=1.0)
    assert "never answers" in str(exc.value)
    assert time.monotonic() - began < 5
    assert not server.running  # the silent one was killed, not left behind


def _gone(pid: int) -> bool:
    """Exited (a zombie that no init reaps counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("ending", ["exit", "os._exit"])
def test_a_parent_that_ends_leaves_no_server(ending: str, tmp_path: Path) -> None:
    """atexit stops what a process left running; where atexit does not run (os._exit,
    as pytest-timeout ends a run), the server dies with its parent (Linux)."""
    proc = run_python(
        f"""
        import os
        from pathlib import Path
        from tests.servers import ValkeyServer
        server = ValkeyServer(Path({str(tmp_path)!r}))
        print(server.pid, flush=True)
        if {ending == "os._exit"}:
            os._exit(0)
        """,
        timeout=30,
    )
    assert proc.returncode == 0, describe(proc)
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _gone(pid), f"valkey-server {pid} outlived its parent ({ending})"


def test_no_server_process_is_left(valkey_cluster: ValkeyCluster) -> None:
    """Runs last: every server the earlier tests started is stopped and reaped, but for
    the module's cluster, which stops cleanly too."""
    assert leftover_servers() == valkey_cluster.pids
    valkey_cluster.stop()
    assert leftover_servers() == set()
