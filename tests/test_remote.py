"""The shared tier on a real Valkey server (and a real 3-node cluster), on 127.0.0.1:
engines share blocks, every bad value is a miss, a dead server is survived."""

from __future__ import annotations

import asyncio
import errno
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncoffload as ao
from asyncoffload.keys import make_offload_key
from asyncoffload.manager.base import Medium
from asyncoffload.tiers import remote
from asyncoffload.tiers.format import HEADER_BYTES, Namespace, pack_block, pack_header
from asyncoffload.tiers.remote import RemoteJob, RemoteStore, RemoteTier
from tests.helpers import tier_index
from tests.hostile_resp import wait_until

redis = pytest.importorskip("redis", reason="the remote tier's tests need redis-py")

NUM_KV = 64
FRAG = 4096
BLOCK = 2 * FRAG


@pytest.fixture
def valkey_server_small(make_valkey: Any) -> Any:
    """A server holding about 256 KiB, dropping the least recently used keys beyond."""
    return make_valkey(maxmemory=256 * 1024 + 1024 * 1024, policy="allkeys-lru")


@pytest.fixture(params=["inline", "native"])
def values_on(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Values packed and checked on the loop (small batches) or on native threads."""
    if request.param == "native":
        monkeypatch.setattr(remote, "INLINE_BYTES", 0)
    return str(request.param)


@pytest.fixture(params=["redis-py", "glide"])
def client(request: pytest.FixtureRequest) -> str:
    """The tier's client: redis-py, or valkey-glide (an optional dependency)."""
    if request.param == "glide":
        pytest.importorskip("glide", reason="valkey-glide is not installed")
    return str(request.param)


def kv_caches(seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (NUM_KV, FRAG), dtype=torch.uint8, generator=gen) for _ in range(2)
    ]


def keys(n: int, start: int = 0) -> list[ao.OffloadKey]:
    return [make_offload_key(i.to_bytes(4, "big") * 8) for i in range(start, start + n)]


def block(kv: list[torch.Tensor], i: int) -> bytes:
    return b"".join(bytes(t[i].numpy().tobytes()) for t in kv)


def config(url: str, cpu_blocks: int = 8, **kw: Any) -> ao.EngineConfig:
    tier = kw.pop("tier", {})
    kw.setdefault("policy", "lru")  # the tests count on which block the CPU tier evicts
    return ao.EngineConfig(
        cpu_blocks=cpu_blocks, tiers=[RemoteTier(url, **tier)], model=kw.pop("model", "m"), **kw
    )


async def store(eng: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey], ids: list[int]) -> None:
    handle = await eng.prepare_store(ks, ids)
    assert handle is not None
    await handle
    await eng.flush()


async def collect(eng: ao.AsyncOffloadEngine, sub: ao.EventSubscription) -> list[Any]:
    await eng.aclose()
    return [e async for e in sub if isinstance(e, ao.OffloadingEvent)]


async def test_two_engines_share_blocks_byte_exact(
    any_server: Any, values_on: str, client: str
) -> None:
    valkey_server = any_server  # Valkey, and Redis where redis-server is installed
    kv = kv_caches()
    want = [block(kv, i) for i in range(8)]
    ks = keys(8)
    tier = {"client": client}
    async with ao.AsyncOffloadEngine(kv, config(valkey_server.url, tier=tier)) as a:
        await store(a, ks, list(range(8)))
        assert a.stats().tiers[0].blocks_written == 8
    fresh = [torch.zeros_like(t) for t in kv]
    async with ao.AsyncOffloadEngine(fresh, config(valkey_server.url, tier=tier)) as b:
        sub = b.events()
        assert b.lookup(ks) == 0  # local knowledge only
        assert await b.alookup(ks) == 8
        st = b.stats()
        assert (st.lookups, st.lookup_keys, st.lookup_hits) == (2, 16, 8)  # one each
        assert st.tiers[0].lookup_hits == 8
        assert b.lookup(ks) == 8  # now known
        await (await b.prepare_load(ks, list(range(16, 24))))
        assert [block(fresh, 16 + i) for i in range(8)] == want
        assert b.stats().tiers[0].blocks_read == 8
        events = await collect(b, sub)
    found = {k for e in events if e.medium is Medium.REMOTE and not e.removed for k in e.keys}
    assert found == set(ks)


@pytest.mark.parametrize("cache", ["built", "empty"])
def test_an_engine_in_another_process_loads_what_this_one_stored(
    valkey_server: Any, tmp_path: Path, cache: str
) -> None:
    """With an empty native cache the other process builds its native library on a
    background thread when the engine starts on its loop: the tier waits for it."""
    kv = kv_caches()
    ks = keys(4)

    async def write() -> None:
        async with ao.AsyncOffloadEngine(kv, config(valkey_server.url)) as eng:
            await store(eng, ks, [0, 1, 2, 3])

    asyncio.run(write())
    script = f"""
import asyncio, sys, torch
import asyncoffload as ao
from asyncoffload.keys import make_offload_key
from asyncoffload.tiers.remote import RemoteTier
ks = [make_offload_key(i.to_bytes(4, "big") * 8) for i in range(4)]
kv = [torch.zeros({NUM_KV}, {FRAG}, dtype=torch.uint8) for _ in range(2)]
async def main():
    cfg = ao.EngineConfig(cpu_blocks=8, tiers=[RemoteTier({valkey_server.url!r})], model="m")
    async with ao.AsyncOffloadEngine(kv, cfg) as eng:
        assert await eng.alookup(ks) == 4
        await (await eng.prepare_load(ks, [10, 11, 12, 13]))
    out = [bytes(t[10 + i].numpy().tobytes()) for i in range(4) for t in kv]
    sys.stdout.buffer.write(b"".join(out))
asyncio.run(main())
"""
    env = dict(os.environ)
    if cache == "empty":
        env["ASYNCOFFLOAD_CACHE_DIR"] = str(tmp_path / "cache")
        env.pop("ASYNCOFFLOAD_NO_NATIVE", None)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=300, cwd=tmp_path, env=env
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout == b"".join(block(kv, i) for i in range(4))


async def test_other_identities_and_tenants_find_nothing(valkey_server: Any) -> None:
    ks = keys(2)
    async with ao.AsyncOffloadEngine(kv_caches(), config(valkey_server.url)) as eng:
        await store(eng, ks, [0, 1])
        alice = ao.ReqContext("a", tenant="alice")
        h = await eng.prepare_store(keys(2, start=60), [4, 5], alice)
        assert h is not None
        await h
        await eng.flush()
    async with ao.AsyncOffloadEngine(kv_caches(), config(valkey_server.url, model="other")) as e:
        assert await e.alookup(ks) == 0
    async with ao.AsyncOffloadEngine(kv_caches(), config(valkey_server.url)) as e:
        assert await e.alookup(keys(2, start=60)) == 0  # alice's, asked without a tenant
        assert await e.alookup(keys(2, start=60), ao.ReqContext("b", tenant="bob")) == 0
        assert await e.alookup(keys(2, start=60), ao.ReqContext("a2", tenant="alice")) == 2


async def _raw(url: str) -> Any:
    return redis.asyncio.Redis.from_url(url)


@pytest.mark.parametrize("how", ["payload", "header", "truncate", "foreign", "evicted"])
async def test_a_bad_value_is_a_miss_with_a_removed_event(
    any_server: Any, how: str, values_on: str, client: str
) -> None:
    valkey_server = any_server
    kv = kv_caches()
    ks = keys(2)
    async with ao.AsyncOffloadEngine(kv_caches(), config(valkey_server.url)) as a:
        await store(a, ks, [0, 1])
        rkey = a.tiers[0].redis_key(ks[0])  # type: ignore[attr-defined]
    raw = await _raw(valkey_server.url)
    try:
        value = await raw.get(rkey)
        assert value is not None and len(value) == HEADER_BYTES + BLOCK
        if how == "payload":
            await raw.setrange(rkey, HEADER_BYTES + 77, bytes([value[HEADER_BYTES + 77] ^ 1]))
        elif how == "header":
            await raw.setrange(rkey, 40, bytes([value[40] ^ 1]))
        elif how == "truncate":
            await raw.set(rkey, value[: HEADER_BYTES + 100])
        elif how == "foreign":
            other = Namespace("other", "uint8", "x", BLOCK).identity()
            payload = os.urandom(BLOCK)
            await raw.set(rkey, pack_header(other, ks[0], payload) + payload)
        else:
            await raw.delete(rkey)
    finally:
        await raw.aclose()
    async with ao.AsyncOffloadEngine(kv, config(valkey_server.url, tier={"client": client})) as b:
        sub = b.events()
        assert await b.alookup(ks) == (2 if how != "evicted" else 0)
        if how == "evicted":
            # Known locally (say from an earlier alookup) and gone on the server.
            tier = b.tiers[0]
            assert isinstance(tier, RemoteStore)
            index = tier_index(b)
            gone = [k for k in ks if index.block_of(k) is None]
            assert gone == [ks[0]]  # alookup found the other one
            out = index.reserve(gone)
            assert out is not None
            index.complete_store(gone)
        before = [t[30:32].clone() for t in kv]
        with pytest.raises(ao.TransferError, match="could not be read"):
            await (await b.prepare_load(ks, [30, 31]))
        assert all(torch.equal(t[30:32], x) for t, x in zip(kv, before))
        assert b.lookup(ks) == 0
        cause = {"truncate": "short", "foreign": "stale", "evicted": "missing"}.get(how, "corrupt")
        assert b.stats().tiers[0].failures == {cause: 1}
        events = await collect(b, sub)
    assert ks[0] in {k for e in events if e.removed and e.medium is Medium.REMOTE for k in e.keys}
    if how == "evicted":
        return
    # The damaged value is deleted from the server (put-if-absent would otherwise keep every
    # later store of the block from replacing it): stored again, the block loads.
    raw = await _raw(valkey_server.url)
    try:
        assert await raw.exists(rkey) == 0
    finally:
        await raw.aclose()
    async with ao.AsyncOffloadEngine(kv_caches(), config(valkey_server.url)) as c:
        await store(c, ks, [0, 1])
    fresh = [torch.zeros_like(t) for t in kv]
    async with ao.AsyncOffloadEngine(fresh, config(valkey_server.url)) as d:
        assert await d.alookup(ks) == 2
        await (await d.prepare_load(ks, [30, 31]))
    assert block(fresh, 30) == block(kv, 0) and block(fresh, 31) == block(kv, 1)


@pytest.mark.parametrize("planted", ["list", "hash"])
async def test_a_key_of_another_type_is_damaged_deleted_and_replaced(
    valkey_server: Any, planted: str, client: str
) -> None:
    """A list or hash at a block's key (issue 22, defect 6): EXISTS counts it, MGET
    answers nil and GET WRONGTYPE, and SET NX answers nil, so the block could never be
    cached in the tier again. A load finds it damaged (a miss, a removed event, the key
    deleted); a store that meets it deletes it and writes the block; a nil SET NX over a
    good value is "present", never counted as written."""
    url = valkey_server.url
    kv = kv_caches()
    ks = keys(2)
    async with ao.AsyncOffloadEngine(kv_caches(), config(url)) as a:
        await store(a, ks, [0, 1])
        rkeys = [a.tiers[0].redis_key(k) for k in ks]  # type: ignore[attr-defined]
    raw = await _raw(url)

    async def plant() -> None:
        await raw.delete(rkeys[0])
        if planted == "list":
            await raw.rpush(rkeys[0], b"not", b"a block")
        else:
            await raw.hset(rkeys[0], mapping={b"not": b"a block"})

    try:
        # Two blocks (one MGET, which answers nil for the planted key) and one (a GET,
        # which answers WRONGTYPE).
        for wanted in (ks, ks[:1]):
            await plant()
            tier = {"client": client}
            async with ao.AsyncOffloadEngine(kv, config(url, tier=tier)) as b:
                sub = b.events()
                assert await b.alookup(wanted) == len(wanted)  # EXISTS counts the key
                before = [t[30:32].clone() for t in kv]
                with pytest.raises(ao.TransferError, match="could not be read"):
                    await (await b.prepare_load(wanted, [30, 31][: len(wanted)]))
                assert all(torch.equal(t[30:32], x) for t, x in zip(kv, before))
                assert b.lookup(wanted) == 0
                assert b.stats().tiers[0].failures == {"corrupt": 1}
                events = await collect(b, sub)
            removed = {k for e in events if e.removed and e.medium is Medium.REMOTE for k in e.keys}
            assert ks[0] in removed
            assert await raw.exists(rkeys[0]) == 0  # deleted: a later store can put it
        # A store that meets the planted key deletes it and writes the block; the other
        # block is on the server already: present, not written.
        await plant()
        async with ao.AsyncOffloadEngine(kv, config(url, tier={"client": client})) as c:
            await store(c, ks, [0, 1])
            st = c.stats().tiers[0]
            assert (st.blocks_written, st.blocks_present, st.write_failures) == (1, 1, 0)
            assert st.bytes_written == BLOCK
        assert await raw.type(rkeys[0]) == b"string"
    finally:
        await raw.aclose()
    fresh = [torch.zeros_like(t) for t in kv]
    async with ao.AsyncOffloadEngine(fresh, config(url, tier={"client": client})) as d:
        assert await d.alookup(ks) == 2
        await (await d.prepare_load(ks, [30, 31]))
    assert block(fresh, 30) == block(kv, 0) and block(fresh, 31) == block(kv, 1)


async def test_a_put_if_absent_that_writes_nothing_is_not_counted_written(
    valkey_server: Any, client: str
) -> None:
    """SET NX answering nil (another engine stored the block first) wrote nothing: the
    block is known to be there (ready in the index), counted in ``blocks_present``, not
    in ``blocks_written`` or ``bytes_written``."""
    ks = keys(3)
    tier = {"client": client}
    async with ao.AsyncOffloadEngine(kv_caches(), config(valkey_server.url, tier=tier)) as a:
        await store(a, ks[:2], [0, 1])
        st = a.stats().tiers[0]
        assert (st.blocks_written, st.blocks_present) == (2, 0)
    async with ao.AsyncOffloadEngine(kv_caches(), config(valkey_server.url, tier=tier)) as b:
        await store(b, ks, [0, 1, 2])
        st = b.stats().tiers[0]
        assert (st.blocks_written, st.blocks_present, st.write_failures) == (1, 2, 0)
        assert st.bytes_written == BLOCK
        assert b.lookup(ks) == 3 and st.manager.ready == 3


MAC_KEY = b"shared-tier-mac-key-0123456789ab"  # 32 bytes


async def test_authenticated_blocks_load_and_blocks_without_the_mac_are_misses(
    valkey_server: Any, values_on: str, client: str
) -> None:
    """``mac_key``: blocks carry a keyed BLAKE2b MAC. Engines with the key share them;
    engines with another key or none see another namespace (nothing found, a copied
    value is ``stale``); values put at the keyed names by a writer without the key are
    misses (``unauthenticated``), deleted, and no byte of theirs reaches the KV."""
    url = valkey_server.url
    kv = kv_caches()
    ks = keys(3)
    keyed = {"client": client, "mac_key": MAC_KEY}
    async with ao.AsyncOffloadEngine(kv, config(url, tier=keyed)) as a:
        await store(a, ks, [0, 1, 2])
        st = a.stats().tiers[0]
        assert st.blocks_written == 3 and st.info["authenticated"] is True
        tier = a.tiers[0]
        assert isinstance(tier, RemoteStore)
        rkeys = [tier.redis_key(k) for k in ks]
        identity = tier.identity
        assert identity == a.namespace.with_mac_key(MAC_KEY).identity()
    for other in ({"client": client}, {"client": client, "mac_key": os.urandom(32)}):
        async with ao.AsyncOffloadEngine(kv_caches(), config(url, tier=other)) as e:
            assert await e.alookup(ks) == 0
    raw = await _raw(url)
    try:
        value = await raw.get(rkeys[2])
        evil = os.urandom(BLOCK)
        await raw.set(rkeys[0], pack_block(identity, ks[0], evil))  # no MAC
        await raw.set(rkeys[1], pack_block(identity, ks[1], evil, os.urandom(32)))
        fresh = [torch.zeros_like(t) for t in kv]
        async with ao.AsyncOffloadEngine(fresh, config(url, tier=keyed)) as b:
            sub = b.events()
            assert await b.alookup(ks) == 3
            with pytest.raises(ao.TransferError, match="could not be read"):
                await (await b.prepare_load(ks, [30, 31, 32]))
            assert all(not t[30:33].any() for t in fresh)
            assert b.stats().tiers[0].failures == {"unauthenticated": 2}
            assert b.lookup(ks) == 0
            events = await collect(b, sub)
        gone = {k for e in events if e.removed and e.medium is Medium.REMOTE for k in e.keys}
        assert {ks[0], ks[1]} <= gone
        assert await raw.exists(rkeys[0], rkeys[1]) == 0  # deleted: stores can put them
        async with ao.AsyncOffloadEngine(fresh, config(url, tier=keyed)) as c:
            assert await c.alookup(ks[2:]) == 1
            await (await c.prepare_load(ks[2:], [33]))
        assert block(fresh, 33) == block(kv, 2)
        # A keyed value copied to an unkeyed tier's name: another namespace's block.
        async with ao.AsyncOffloadEngine(fresh, config(url, tier={"client": client})) as d:
            plain = d.tiers[0]
            assert isinstance(plain, RemoteStore)
            await raw.set(plain.redis_key(ks[2]), value)
            assert await d.alookup(ks[2:]) == 1
            with pytest.raises(ao.TransferError):
                await (await d.prepare_load(ks[2:], [34]))
            assert d.stats().tiers[0].failures == {"stale": 1}
    finally:
        await raw.aclose()


async def test_server_eviction_gives_misses_never_wrong_bytes(valkey_server_small: Any) -> None:
    """maxmemory + allkeys-lru: the server drops blocks on its own."""
    kv = kv_caches()
    n = 48  # ~400 KiB of blocks into a 256 KiB server
    ks = keys(n)
    want = {}
    async with ao.AsyncOffloadEngine(kv, config(valkey_server_small.url, cpu_blocks=n)) as a:
        for i in range(0, n, 16):
            ids = list(range(16))
            for j in ids:
                for t in kv:
                    t[j].fill_((i + j) % 251)
            for j in ids:
                want[ks[i + j]] = block(kv, j)
            await store(a, ks[i : i + 16], ids)
    fresh = kv_caches(seed=9)
    async with ao.AsyncOffloadEngine(fresh, config(valkey_server_small.url, cpu_blocks=n)) as b:
        hits = misses = 0
        for key in ks:
            if await b.alookup([key]) != 1:
                misses += 1
                continue
            try:
                await (await b.prepare_load([key], [40]))
            except ao.TransferError:
                misses += 1  # evicted between the lookup and the read
            else:
                hits += 1
                assert block(fresh, 40) == want[key]
        assert misses > 0 and hits > 0


async def test_closing_an_engine_closes_its_connections(valkey_server: Any, client: str) -> None:
    async with ao.AsyncOffloadEngine(
        kv_caches(), config(valkey_server.url, tier={"client": client})
    ) as eng:
        await store(eng, keys(8), list(range(8)))
        assert await eng.alookup(keys(8)) == 8
    raw = await _raw(valkey_server.url)
    try:
        clients = (await raw.execute_command("CLIENT", "LIST")).decode().splitlines()
    finally:
        await raw.aclose()
    assert len(clients) == 1, clients  # only this one


async def test_a_password_and_an_acl_user_with_only_the_tiers_commands(
    make_valkey: Any, client: str
) -> None:
    from tests.servers import resp_command

    server = make_valkey(password="admin-secret")
    # A user that may run only what the tier sends, on the tier's keys.
    resp_command(
        server.port,
        "ACL", "SETUSER", "kv", "on", ">kv-secret", "~ao:*", "resetchannels",
        "+set", "+getrange", "+exists", "+del", "+type", "+ping", "+hello",
        "+client|setinfo",
        "+info",  # valkey-glide asks INFO when it connects
        password="admin-secret",
    )  # fmt: skip
    kv = kv_caches()
    ks = keys(4)
    url = f"redis://127.0.0.1:{server.port}/0"
    for tier in (
        {"password": "admin-secret"},
        {"username": "kv", "password": "kv-secret"},
    ):
        tier["client"] = client
        async with ao.AsyncOffloadEngine(kv, config(url, tier=tier)) as a:
            await store(a, ks, [0, 1, 2, 3])
            st = a.stats().tiers[0]
            # The second user finds the first one's blocks there: present, not written.
            assert st.blocks_written + st.blocks_present == 4 and st.write_failures == 0
        fresh = [torch.zeros_like(t) for t in kv]
        async with ao.AsyncOffloadEngine(fresh, config(url, tier=tier)) as b:
            assert await b.alookup(ks) == 4
            await (await b.prepare_load(ks, [8, 9, 10, 11]))
        assert [block(fresh, 8 + i) for i in range(4)] == [block(kv, i) for i in range(4)]
    # A wrong password: writes fail and are counted; nothing raises, nothing hangs.
    bad = {"username": "kv", "password": "wrong", "client": client, "timeout_s": 2.0}
    async with ao.AsyncOffloadEngine(kv, config(url, tier=bad)) as c:
        await store(c, keys(2, start=50), [0, 1])
        st = c.stats().tiers[0]
        assert st.blocks_written == 0 and st.write_failures == 2
        assert await c.alookup(ks) == 0


async def rejoined(eng: ao.AsyncOffloadEngine, within_s: float = 15.0) -> None:
    """The tier reconnects by itself: fresh blocks are written again within a while."""
    written = eng.stats().tiers[0].blocks_written
    deadline = asyncio.get_running_loop().time() + within_s
    start = 10_000
    while eng.stats().tiers[0].blocks_written < written + 2:
        assert asyncio.get_running_loop().time() < deadline, "the tier did not reconnect"
        await store(eng, keys(2, start=start), [6, 7])
        start += 2
        await asyncio.sleep(0.05)


async def test_a_dead_server_is_survived_and_rejoined(valkey_server: Any, client: str) -> None:
    kv = kv_caches()
    cfg = config(valkey_server.url, cpu_blocks=16, tier={"timeout_s": 1.0, "client": client})
    async with ao.AsyncOffloadEngine(kv, cfg) as eng:
        ks = keys(4)
        await store(eng, ks[:2], [0, 1])
        valkey_server.kill()
        # Stores still resolve (the CPU tier takes them); their write-through fails.
        await store(eng, ks[2:], [2, 3])
        st = eng.stats().tiers[0]
        assert st.write_failures == 2 and st.blocks_written == 2
        # Blocks only the dead server has: misses, quickly, and the engine serves on.
        for _ in range(16 // 2):
            await store(eng, keys(2, start=100 + _ * 2), [4, 5])
        assert eng.manager.block_of(ks[0]) is None
        # After the first refusal or timeout, requests fail at once for retry_s instead
        # of each waiting for the dead server.
        tier = eng.tiers[0]
        assert isinstance(tier, RemoteStore) and tier.unavailable()
        assert eng.stats().tiers[0].failures.get("unavailable", 0) >= 2
        with pytest.raises(ao.TransferError):
            await asyncio.wait_for(await eng.prepare_load(ks[:1], [8]), 10)
        assert await asyncio.wait_for(eng.alookup(keys(1, start=500)), 10) == 0
        valkey_server.start()  # back, empty
        await rejoined(eng)


async def test_a_server_killed_mid_batch_leaves_no_hang_and_no_lost_state(
    valkey_server: Any, client: str
) -> None:
    kv = [t[:, :1024].contiguous() for t in kv_caches()]
    n = 512
    ks = keys(n)
    cfg = ao.EngineConfig(
        cpu_blocks=n,
        tiers=[RemoteTier(valkey_server.url, batch_blocks=8, timeout_s=1.0, client=client)],
        model="m",
    )
    async with ao.AsyncOffloadEngine(kv, cfg) as eng:
        handles = []
        for i in range(0, n, 64):
            h = await eng.prepare_store(ks[i : i + 64], [j % NUM_KV for j in range(64)])
            assert h is not None
            handles.append(h)
        await asyncio.sleep(0)  # the first write-through pipelines are on the wire
        valkey_server.kill()
        await asyncio.wait_for(asyncio.gather(*handles), 30)  # the CPU stores resolve
        await asyncio.wait_for(eng.flush(), 30)  # every write ended, well or not
        st = eng.stats()
        tier = st.tiers[0]
        assert tier.blocks_written + tier.write_failures == n
        assert tier.manager.write_pending == 0 and tier.manager.pinned == 0
        assert st.manager.pinned == 0 and st.manager.ready == n
        valkey_server.start()
        await rejoined(eng)


async def test_thousands_of_blocks_in_flight(valkey_server: Any, values_on: str) -> None:
    kv = [t[:, :1024].contiguous() for t in kv_caches()]
    n = 2048
    ks = keys(n)
    # Every block written, however long it waits: 2,048 queued at once lag a busy
    # machine's writes past write_lag_s (1.06 s in a make test beside two CPU hogs), and
    # backpressure then sheds first offers (32 there), which is not what this test is about.
    tier = RemoteTier(
        valkey_server.url, max_connections=8, pipelines=2, batch_blocks=16, backpressure=False
    )
    cfg = ao.EngineConfig(cpu_blocks=n, tiers=[tier], model="m")
    async with ao.AsyncOffloadEngine(kv, cfg) as eng:
        handles = []
        for i in range(0, n, 32):
            h = await eng.prepare_store(ks[i : i + 32], [j % NUM_KV for j in range(i, i + 32)])
            assert h is not None
            handles.append(h)
        await asyncio.gather(*handles)
        await eng.flush()
        assert eng.stats().tiers[0].blocks_written == n
        # 64 write-through jobs at once, yet values exist only for the pipelines in flight
        # (2 x 16 blocks), reused from one batch to the next.
        store_ = eng.tiers[0]
        assert isinstance(store_, RemoteStore)
        assert store_._values.allocated <= 2 * 16
    fresh = [torch.zeros_like(t) for t in kv]
    async with ao.AsyncOffloadEngine(fresh, cfg) as other:
        assert await other.alookup(ks) == n
        loads = [other.prepare_load(ks[i : i + 32], list(range(32))) for i in range(0, 256, 32)]
        for coro in loads:
            await (await coro)
        assert block(fresh, 5) == block(kv, (224 + 5) % NUM_KV)


async def test_a_cluster_spreads_blocks_across_its_nodes(valkey_cluster: Any, client: str) -> None:
    kv = kv_caches()
    ks = keys(32)
    cfg = config(valkey_cluster.url, cpu_blocks=32, tier={"cluster": True, "client": client})
    async with ao.AsyncOffloadEngine(kv, cfg) as a:
        await store(a, ks, list(range(32)))
        st = a.stats().tiers[0]
        # The cluster is the module's: a run before this one may have put them already.
        assert st.blocks_written + st.blocks_present == 32 and st.write_failures == 0
        rkeys = [a.tiers[0].redis_key(k) for k in ks]  # type: ignore[attr-defined]
    raw = redis.asyncio.cluster.RedisCluster.from_url(valkey_cluster.url)
    await raw.initialize()
    try:
        slots = {raw.keyslot(k) for k in rkeys}
        nodes = {raw.get_node_from_key(k).name for k in rkeys}
    finally:
        await raw.aclose()
    assert len(slots) > 16 and len(nodes) == 3
    fresh = [torch.zeros_like(t) for t in kv]
    async with ao.AsyncOffloadEngine(fresh, cfg) as b:
        assert await b.alookup(ks) == 32
        await (await b.prepare_load(ks, list(range(32, 64))))
        assert [block(fresh, 32 + i) for i in range(32)] == [block(kv, i) for i in range(32)]


async def test_a_cancelled_job_ends_only_after_its_native_packing(
    valkey_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native threads copy out of the job's CPU slots: the job (and so the slots'
    pin) must not end before they do, even when its task is cancelled."""
    monkeypatch.setattr(remote, "INLINE_BYTES", 0)
    async with ao.AsyncOffloadEngine(kv_caches(), config(valkey_server.url)) as eng:
        tier = eng.tiers[0]
        assert isinstance(tier, RemoteStore)
        tier._io.set_delay(1.0)  # each native op sleeps first
        host = [eng._backend.host_address(i) for i in range(2)]
        job = tier.submit_write(keys(2), [0, 1], host)
        assert isinstance(job, RemoteJob) and job.task is not None
        # (Not a fixed sleep: the write's task opens its connections first.)
        await wait_until(lambda: bool(job.natives), "the write's native packing to start")
        job.task.cancel()
        await asyncio.sleep(0.05)
        assert not job.query()  # cancelled, still waiting for the native threads
        await wait_until(job.query, "the cancelled job to end once its packing ended")
        assert job.results == [-errno.ECANCELED] * 2
        tier._io.set_delay(0)


def test_requests_are_bounded_in_blocks_and_in_bytes() -> None:
    ns = Namespace("m", "uint8", "x", 1 << 20)  # 1 MiB blocks
    assert RemoteTier().open(ns).batch == 16  # 16 MiB / 1 MiB, below batch_blocks=64
    assert RemoteTier(batch_bytes="4MiB").open(ns).batch == 4
    assert RemoteTier(batch_bytes=1).open(ns).batch == 1  # at least one block
    small = Namespace("m", "uint8", "x", 4096)
    assert RemoteTier(batch_blocks=8).open(small).batch == 8


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="url must start with"):
        RemoteTier("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="unknown cache policy"):
        RemoteTier(policy="nope")
    tier = RemoteTier("redis://u:secret@127.0.0.1:1/0")
    assert "secret" not in repr(tier) and "secret" not in str(tier.model_dump())
    assert tier.password is not None and tier.password.get_secret_value() == "secret"
    assert tier.username == "u" and tier.url == "redis://u@127.0.0.1:1/0"


@pytest.mark.parametrize(
    ("url", "user", "password", "left"),
    [
        ("redis://127.0.0.1:1/0?password=pw-9&db=0", None, "pw-9", "redis://127.0.0.1:1/0?db=0"),
        (b"redis://u:pw-9@127.0.0.1:1/0", "u", "pw-9", "redis://u@127.0.0.1:1/0"),
        ("redis://u:pw#9/x?y@127.0.0.1:1/0", "u", "pw#9/x?y", "redis://u@127.0.0.1:1/0"),
        ("rediss://:pw-9@127.0.0.1:1/0", None, "pw-9", "rediss://127.0.0.1:1/0"),
        ("unix:///tmp/v.sock?password=pw-9", None, "pw-9", "unix:///tmp/v.sock"),
    ],
)
def test_every_form_of_a_url_password_leaves_the_url(
    url: str | bytes, user: str | None, password: str, left: str
) -> None:
    """A password as a query argument (redis-py reads it), in a bytes URL, or with an
    unescaped #, / or ? moves out of the URL whole: never in repr, JSON or stats."""
    tier = RemoteTier(url=url)
    assert tier.url == left and tier.username == user
    assert tier.password is not None and tier.password.get_secret_value() == password
    ns = Namespace("m", "uint8", "x", 4096)
    shown = [repr(tier), tier.model_dump_json(), str(tier.open(ns).describe())]
    assert not any(password in text or "pw" in text.replace("password", "") for text in shown)


async def test_a_query_argument_password_authenticates(make_valkey: Any) -> None:
    server = make_valkey(password="q-secret")
    kv = kv_caches()
    url = f"redis://127.0.0.1:{server.port}/0?password=q-secret"
    async with ao.AsyncOffloadEngine(kv, config(url)) as eng:
        await store(eng, keys(2), [0, 1])
        assert eng.stats().tiers[0].blocks_written == 2
        assert "q-secret" not in repr(eng.stats())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"url": None}, r"url\n  Input should be a valid string"),
        ({"ttl_s": math.inf}, r"ttl_s\n  Input should be a finite number"),
        ({"ttl_s": 1e300}, r"ttl_s\n  Input should be less than or equal to 315360000"),
        ({"ttl_s": 0.0004}, r"ttl_s\n  Input should be greater than or equal to 0.001"),
        ({"timeout_s": math.inf}, r"timeout_s\n  Input should be a finite number"),
        ({"retry_s": math.nan}, r"retry_s\n  Input should be a finite number"),
    ],
)
def test_settings_that_would_write_nothing_are_refused(
    settings: dict[str, Any], message: str
) -> None:
    """An explicit url=None is not the default URL; a TTL or timeout that overflows, or a
    PX the server refuses or reads as 0, is an error naming the setting (issue 22, 7 and 9)."""
    with pytest.raises(ValueError, match=message):
        RemoteTier(**settings)
    assert RemoteTier(ttl_s=0.001).ttl_s == 0.001  # 1 ms: PX 1
