"""Engines with a Mooncake tier on a real ``mooncake_master`` (issue 26): run by
tests/test_mooncake_tier.py inside a private network namespace (``unshare --net``), since
the master and the clients listen on every interface.

Each scenario starts its own master on 127.0.0.1, drives engines (and, where a test needs
a value planted or a second process, Mooncake's own client or another process of this
script), and prints one JSON object of what it saw. Nothing here decides anything: the
test asserts.

Run: ``unshare --net python tests/mooncake_engines.py PORT SCENARIO [ARGS]`` (root).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncoffload as ao
from asyncoffload.manager.base import Medium
from asyncoffload.tiers.format import HEADER_BYTES, Namespace, pack_header
from asyncoffload.tiers.mooncake import MooncakeStore
from tests.helpers import tier_index
from tests.mooncake_probe import TEST_LEASE_MS, loopback_up, start_master

NUM_KV = 32
FRAG = 4096
BLOCK = 2 * FRAG
#: Each wait of a scenario, at most.
WAIT_S = 30.0
#: How long a restarted master or helper may take to be used again: Mooncake's client
#: reconnects after its pings have failed for a while, then mounts its segment again.
REJOIN_S = 90.0


def kv_caches(seed: int = 5, frag: int = FRAG) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (NUM_KV, frag), dtype=torch.uint8, generator=gen) for _ in range(2)
    ]


def keys(n: int, start: int = 0) -> list[ao.OffloadKey]:
    return [ao.make_offload_key(i.to_bytes(4, "big") * 8) for i in range(start, start + n)]


def block(kv: list[torch.Tensor], i: int) -> bytes:
    return b"".join(bytes(t[i].numpy().tobytes()) for t in kv)


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def config(port: int, cpu_blocks: int = 8, **kw: Any) -> ao.EngineConfig:
    tier = {"segment_bytes": 64 << 20, "timeout_s": 5.0, **kw.pop("tier", {})}
    kw.setdefault("policy", "lru")  # the scenarios count on which block the CPU tier evicts
    return ao.EngineConfig(
        cpu_blocks=cpu_blocks,
        tiers=[ao.MooncakeTier(f"127.0.0.1:{port}", **tier)],
        model=kw.pop("model", "m"),
        **kw,
    )


def the_tier(eng: ao.AsyncOffloadEngine) -> MooncakeStore:
    tier = eng.tiers[0]
    assert isinstance(tier, MooncakeStore)
    return tier


async def store(eng: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey], ids: list[int]) -> None:
    handle = await eng.prepare_store(ks, ids)
    assert handle is not None
    await asyncio.wait_for(handle, WAIT_S)
    await asyncio.wait_for(eng.flush(), WAIT_S)


async def load(eng: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey], ids: list[int]) -> str:
    """ "ok", or the error a load ended with."""
    try:
        await asyncio.wait_for(await eng.prepare_load(ks, ids), WAIT_S)
    except (ao.TransferError, ao.PromotionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


async def events_of(eng: ao.AsyncOffloadEngine, sub: ao.EventSubscription) -> dict[str, list[str]]:
    """Closes ``eng``; the keys of its tier's stored and removed events (hex)."""
    await eng.aclose()
    out: dict[str, list[str]] = {"stored": [], "removed": []}
    async for event in sub:
        if isinstance(event, ao.OffloadingEvent) and event.medium is Medium.REMOTE:
            out["removed" if event.removed else "stored"].extend(k.hex() for k in event.keys)
    return out


def run_here(port: int, scenario: str, *args: str) -> dict[str, Any]:
    """This script's ``scenario`` in another process (in this netns)."""
    cmd = [sys.executable, __file__, str(port), scenario, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{scenario} failed: {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- scenarios ----------------------------------------------------------------------------


async def share(port: int) -> dict[str, Any]:
    """Engine A stores 8 blocks; while it runs (its segment holds them), engine B in
    another process finds and loads them; other identities find nothing."""
    out: dict[str, Any] = {}
    kv = kv_caches()
    ks = keys(8)
    async with ao.AsyncOffloadEngine(kv, config(port)) as a:
        await store(a, ks, list(range(8)))
        out["written"] = a.stats().tiers[0].blocks_written
        out["want"] = [digest(block(kv, i)) for i in range(8)]
        out["reader"] = await asyncio.to_thread(run_here, port, "reader")
        # Another engine stores 6 of the same blocks and 2 new ones: the store held
        # the 6 (Mooncake's put answers 0 for them too): present, not written.
        client_only = {"segment_bytes": 0}
        async with ao.AsyncOffloadEngine(kv_caches(), config(port, tier=client_only)) as c:
            await store(c, ks[:6] + keys(2, start=100), list(range(8)))
            st = c.stats().tiers[0]
            out["again"] = {
                "written": st.blocks_written,
                "present": st.blocks_present,
                "bytes_written": st.bytes_written,
                "failures": st.write_failures,
                "ready": st.manager.ready,
            }
    return out


async def reader(port: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ks = keys(8)
    fresh = [torch.zeros_like(t) for t in kv_caches()]
    async with ao.AsyncOffloadEngine(fresh, config(port)) as b:
        sub = b.events()
        out["lookup_before"] = b.lookup(ks)
        out["alookup"] = await b.alookup(ks)
        out["lookup_after"] = b.lookup(ks)
        out["load"] = await load(b, ks, list(range(16, 24)))
        out["got"] = [digest(block(fresh, 16 + i)) for i in range(8)]
        st = b.stats().tiers[0]
        out["blocks_read"] = st.blocks_read
        out["lookup_hits"] = st.lookup_hits
        out["events"] = await events_of(b, sub)
    # Host slots that are not in shared memory: refused at construction, named.
    kv = kv_caches()
    plain = ao.CpuCopyBackend(kv, ao.KVLayout.infer(kv), 8)
    try:
        ao.AsyncOffloadEngine(kv, config(port), backend=plain)
    except ValueError as exc:
        out["no_shared_host"] = str(exc)
    finally:
        plain.close()
    for name, cfg in (
        ("other_model", config(port, model="other")),
        ("other_tenant", config(port, tenant="t2")),
        ("other_mac", config(port, tier={"mac_key": b"k" * 32})),
    ):
        async with ao.AsyncOffloadEngine(kv_caches(), cfg) as other:
            out[name] = await other.alookup(ks)
    return out


def _raw_client(port: int) -> tuple[Any, mmap.mmap, int]:
    """Mooncake's own client (no segment of its own) with a registered buffer."""
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    code = raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{port}")
    assert code == 0, code
    buf = mmap.mmap(-1, 1 << 20)
    at = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert raw.register_buffer(at, len(buf)) == 0
    return raw, buf, at


def _replace(raw: Any, buf: mmap.mmap, at: int, name: str, value: bytes) -> list[int]:
    """Remove object ``name`` (after its lease) and put ``value`` under it."""
    deadline = time.monotonic() + WAIT_S
    while (code := raw.remove(name)) == -706 and time.monotonic() < deadline:
        time.sleep(0.05)  # the master's lease (200 ms here)
    buf[: len(value)] = value
    return [code, *raw.batch_put_from([name], [at], [len(value)])]


def _until_gone(raw: Any, names: list[str]) -> list[int]:
    """``batch_is_exist(names)`` once none is left, or after ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while any(found := list(raw.batch_is_exist(names))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


async def damaged(port: int) -> dict[str, Any]:
    """Blocks damaged in the store (a flipped payload byte, a flipped header byte, cut
    short, another identity's) are misses: the load fails, the KV stays as it was, a
    removed event says so, and the failures are counted by cause."""
    out: dict[str, Any] = {}
    kv = kv_caches()
    ks = keys(6)  # 5 damaged, the last one good
    bad = len(ks) - 1
    async with ao.AsyncOffloadEngine(kv_caches(), config(port)) as a:
        await store(a, ks, list(range(6)))
        names = [the_tier(a).object_name(k) for k in ks]
        raw, buf, at = _raw_client(port)
        whole = HEADER_BYTES + BLOCK
        got = raw.batch_get_into(names[:5], [at + i * whole for i in range(5)], [whole] * 5)
        out["raw_get"] = list(got)
        values = [bytearray(buf[i * whole : (i + 1) * whole]) for i in range(5)]
        values[0][HEADER_BYTES + 77] ^= 1
        values[1][40] ^= 1
        values[2] = values[2][: HEADER_BYTES + 100]
        other = Namespace("other", "uint8", "x", BLOCK).identity()
        payload = os.urandom(BLOCK)
        values[3] = bytearray(pack_header(other, ks[3], payload) + payload)
        # Longer than a block: Mooncake answers a get of it INVALID_PARAMS (-600), which
        # the helper did not count as damaged: never removed, and put-if-absent kept the
        # good block out for good (issue 37, D5).
        values[4] = values[4] + bytearray(4096)
        out["planted"] = [_replace(raw, buf, at, n, bytes(v)) for n, v in zip(names, values)]
        # A second engine knows the blocks from the store only.
        async with ao.AsyncOffloadEngine(kv, config(port)) as b:
            sub = b.events()
            out["alookup"] = await b.alookup(ks)
            before = [t.clone() for t in kv]
            out["loads"] = [await load(b, [k], [20 + i]) for i, k in enumerate(ks[:bad])]
            out["kv_untouched"] = all(torch.equal(t, x) for t, x in zip(kv, before))
            out["lookup_after"] = [b.lookup([k]) for k in ks]
            out["good_load"] = await load(b, ks[bad:], [26])
            out["good_equal"] = block(kv, 26) == block(kv_caches(), bad)
            st = b.stats().tiers[0]
            out["failures"] = st.failures
            out["dropped"] = st.dropped
            out["events"] = await events_of(b, sub)
        # The reader's helper removes the damaged objects once their leases let it (the
        # get that found them took one), at the latest as it exits.
        out["left_in_store"] = _until_gone(raw, names[:bad])
        # Stored again by an engine without them, the blocks load. (That engine gives
        # the pool no memory: objects in its segment would go when it closes. A still
        # runs, and its segment holds them.)
        client_only = {"segment_bytes": 0}
        async with ao.AsyncOffloadEngine(kv_caches(), config(port, tier=client_only)) as c:
            await store(c, ks[:bad], list(range(bad)))
            out["restored_written"] = c.stats().tiers[0].blocks_written
        out["restored_in_store"] = list(raw.batch_is_exist(names[:bad]))
        raw.close()
        fresh = [torch.zeros_like(t) for t in kv]
        async with ao.AsyncOffloadEngine(fresh, config(port)) as d:
            out["again_alookup"] = await d.alookup(ks[:bad])
            out["again_load"] = await load(d, ks[:bad], list(range(bad)))
            out["again_equal"] = [block(fresh, i) == block(kv_caches(), i) for i in range(bad)]
    return out


async def evicted(port: int) -> dict[str, Any]:
    """More blocks than the pool holds: the store evicts on its own, and every read is
    either the block's bytes or a miss."""
    frag = 64 << 10
    kv = kv_caches(frag=frag)
    n = 160  # 160 x (4 KiB + 128 KiB) into a 16 MiB segment
    ks = keys(n)
    want = {}
    cfg = config(port, cpu_blocks=NUM_KV, tier={"segment_bytes": 16 << 20})
    out: dict[str, Any] = {}
    async with ao.AsyncOffloadEngine(kv, cfg) as a:
        for start in range(0, n, 16):
            ids = list(range(16))
            for j in ids:
                for t in kv:
                    t[j].fill_((start + j) % 251)
                want[ks[start + j]] = block(kv, j)
            await store(a, ks[start : start + 16], ids)
        st = a.stats().tiers[0]
        out["written"] = st.blocks_written
        out["write_failures"] = st.failures
        hits = misses = wrong = 0
        for key in ks:
            if a.lookup([key]) != 1:
                misses += 1  # dropped from the index: a read found it missing
                continue
            result = await load(a, [key], [20])
            if result != "ok":
                misses += 1
            elif block(kv, 20) == want[key]:
                hits += 1
            else:
                wrong += 1
        out["hits"], out["misses"], out["wrong"] = hits, misses, wrong
        out["failures"] = a.stats().tiers[0].failures
        out["dropped"] = a.stats().tiers[0].dropped
    return out


async def _written_again(eng: ao.AsyncOffloadEngine, start: int) -> bool:
    """Whether fresh blocks (keys from ``start`` on) are written to the tier again within
    ``REJOIN_S``, stored two at a time."""
    deadline = time.monotonic() + REJOIN_S
    written = eng.stats().tiers[0].blocks_written
    while eng.stats().tiers[0].blocks_written < written + 2:
        if time.monotonic() > deadline:
            return False
        await store(eng, keys(2, start=start), [6, 7])
        start += 2
        await asyncio.sleep(0.1)
    return True


async def restart(port: int) -> dict[str, Any]:
    """The master killed while writes are in flight, then restarted; the helper killed."""
    out: dict[str, Any] = {}
    masters = [start_master(port, TEST_LEASE_MS)]
    kv = [t[:, :1024].contiguous() for t in kv_caches()]
    n = 256
    ks = keys(n)
    cfg = ao.EngineConfig(
        cpu_blocks=n,
        tiers=[
            ao.MooncakeTier(
                f"127.0.0.1:{port}", segment_bytes=64 << 20, batch_blocks=8, retry_s=0.5
            )
        ],
        model="m",
    )
    try:
        async with ao.AsyncOffloadEngine(kv, cfg) as eng:
            tier = the_tier(eng)
            await store(eng, keys(8, start=5000), list(range(8)))  # the helper is up
            handles = []
            for i in range(0, n, 64):
                h = await eng.prepare_store(ks[i : i + 64], [j % NUM_KV for j in range(64)])
                assert h is not None
                handles.append(h)
            await asyncio.sleep(0)  # the first requests are out
            masters[-1].kill()
            masters[-1].wait(10)
            await asyncio.wait_for(asyncio.gather(*handles), WAIT_S)
            await asyncio.wait_for(eng.flush(), WAIT_S)  # every write ended, well or not
            st = eng.stats()
            t = st.tiers[0]
            out["written_plus_failed"] = t.blocks_written + t.write_failures - 8
            out["tier_pending"] = [t.manager.write_pending, t.manager.pinned]
            out["cpu"] = [st.manager.pinned, st.manager.ready]
            out["failures_down"] = t.failures
            # While down: a question to the store fails at once (a miss).
            started = time.monotonic()
            out["down_unavailable"] = tier.unavailable()
            out["alookup_down"] = await asyncio.wait_for(eng.alookup(keys(1, start=9000)), 10)
            out["alookup_down_s"] = time.monotonic() - started
            masters.append(start_master(port, TEST_LEASE_MS))
            restarted = time.monotonic()
            # The tier rejoins by itself (once Mooncake's client has reconnected and
            # mounted its segment again): fresh blocks are written again.
            out["rejoined"] = await _written_again(eng, 10_000)
            out["rejoined_s"] = time.monotonic() - restarted
            out["starts_after_master"] = tier.starts
            # The helper killed: its requests fail, a new one starts after retry_s.
            pid = tier.describe()["helper_pid"]
            assert isinstance(pid, int)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            out["rejoined_helper"] = await _written_again(eng, 20_000)
            out["rejoined_helper_s"] = time.monotonic() - killed
            out["starts"] = tier.starts
            out["failures"] = eng.stats().tiers[0].failures
    finally:
        for proc in masters:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(10)
    return out


async def dead_master_calls(
    eng: ao.AsyncOffloadEngine, rounds: int, on_tier: list[ao.OffloadKey], fresh: int
) -> dict[str, Any]:
    """Calls to an engine whose tier's master may be dead (issue 41), as serving makes
    them: three streams at once, ``rounds`` calls each, ``GAP_S`` apart: stores of 2
    fresh blocks (write-through goes on after each), ``alookup`` of a key the tier does
    not know (a question to the store), and loads of the blocks of ``on_tier`` (reads
    from the store). Per kind, each call's seconds; how many stores landed in the CPU
    tier (a handle, not None); the loads' results. Fresh keys start at ``fresh``."""
    seconds: dict[str, list[float]] = {"store": [], "alookup": [], "load": []}
    landed = [0]
    results: set[str] = set()

    async def stores() -> None:
        for i in range(rounds):
            started = time.monotonic()
            ids = [2 * (i % 8), 2 * (i % 8) + 1]
            handle = await eng.prepare_store(keys(2, start=fresh + 2 * i), ids)
            if handle is not None:
                landed[0] += 1
                await asyncio.wait_for(handle, WAIT_S)
            seconds["store"].append(time.monotonic() - started)
            await asyncio.sleep(GAP_S)

    async def alookups() -> None:
        for i in range(rounds):
            started = time.monotonic()
            await asyncio.wait_for(eng.alookup(keys(1, start=fresh + 1_000 + i)), WAIT_S)
            seconds["alookup"].append(time.monotonic() - started)
            await asyncio.sleep(GAP_S)

    async def loads() -> None:
        for i in range(rounds):
            started = time.monotonic()
            results.add((await load(eng, on_tier[i : i + 1], [24 + i % 8]))[:20])
            seconds["load"].append(time.monotonic() - started)
            await asyncio.sleep(GAP_S)

    await asyncio.gather(stores(), alookups(), loads())
    return {"seconds": seconds, "landed": landed[0], "load_results": sorted(results)}


#: Between the calls of a stream of dead_master_calls: 24 calls span past the tier's
#: retry_s (1 s), so calls reach the helper, not only the tier's own fail-at-once window.
GAP_S = 0.15


async def _on_tier_only(eng: ao.AsyncOffloadEngine, start: int, n: int) -> list[ao.OffloadKey]:
    """``n`` blocks (keys from ``start``, GPU blocks 0, 1, ... 7, 0, ...) written to a
    16-block CPU tier's Mooncake tier, then pushed out of the CPU tier by 16 others."""
    ks = keys(n, start=start)
    for at in range(0, n, 8):
        await store(eng, ks[at : at + 8], list(range(len(ks[at : at + 8]))))
    await store(eng, keys(16, start=start + 5_000), list(range(16)))
    return ks


async def _write_and_flush(eng: ao.AsyncOffloadEngine, start: int) -> float:
    """Once the tier's own fail-at-once window is over (write-through goes to the
    helper), 2 fresh blocks stored: the seconds flush() takes then."""
    tier = the_tier(eng)
    for _ in range(int(WAIT_S / 0.02)):  # the window lasts retry_s (1 s)
        if not tier.unavailable():
            break
        await asyncio.sleep(0.02)
    handle = await eng.prepare_store(keys(2, start=start), [0, 1])
    assert handle is not None
    await asyncio.wait_for(handle, WAIT_S)
    return await _timed(eng.flush(), 120)


async def dead(port: int) -> dict[str, Any]:
    """The master killed (SIGKILL) mid-run, then restarted (issue 41): every call fails
    well before Mooncake's own ~4 s reconnect, not only the first after the kill; stores
    into a 16-block CPU tier all land (write-through does not hold their slots);
    flush() and aclose() end within 2 s; with the master back, the same helper writes
    and reads again."""
    out: dict[str, Any] = {}
    masters = [start_master(port, TEST_LEASE_MS)]
    kv = kv_caches()
    # Every block offered is written through (no admission), with the master's death
    # noticed by Mooncake's client, not by a deadline of ours.
    cfg = config(port, cpu_blocks=16, tier={"admission": None})
    eng = ao.AsyncOffloadEngine(kv, cfg)
    try:
        tier = the_tier(eng)
        on_tier = await _on_tier_only(eng, 50_000, 48)
        out["up"] = await dead_master_calls(eng, 24, on_tier[:24], 100_000)
        await asyncio.wait_for(eng.flush(), WAIT_S)
        masters[-1].kill()
        masters[-1].wait(10)
        out["down"] = await dead_master_calls(eng, 24, on_tier[24:], 110_000)
        out["flush_s"] = await _write_and_flush(eng, 130_000)
        out["down_failures"] = eng.stats().tiers[0].failures
        out["cpu_pinned"] = eng.stats().manager.pinned
        # Leases of 5 s (Mooncake's default): the removal of a damaged object below waits.
        masters.append(start_master(port, 5000))
        restarted = time.monotonic()
        out["rejoined"] = await _written_again(eng, 80_000)
        out["rejoined_s"] = time.monotonic() - restarted
        back = await _on_tier_only(eng, 90_000, 12)
        out["load_after"] = await load(eng, back[:2], [20, 21])
        out["load_equal"] = [block(kv, 20 + j) == block(kv, j) for j in range(2)]
        out["starts"] = tier.starts
        # A damaged object found by a read: its removal waits for the read's lease.
        raw, buf, at = _raw_client(port)
        name = tier.object_name(back[3])
        whole = HEADER_BYTES + BLOCK
        out["raw_get"] = list(raw.batch_get_into([name], [at], [whole]))
        value = bytearray(buf[:whole])
        value[HEADER_BYTES + 5] ^= 1
        out["planted"] = _replace(raw, buf, at, name, bytes(value))
        raw.close()
        out["damaged_load"] = await load(eng, back[3:4], [28])
        masters[-1].kill()
        masters[-1].wait(10)
        # Calls that come seconds later, once Mooncake's client has begun reconnecting
        # on its own (its pings failed): even the first of them blocked 4.4 s.
        await asyncio.sleep(3.0)
        out["down_again"] = await dead_master_calls(eng, 8, back[4:], 140_000)
        out["flush_again_s"] = await _write_and_flush(eng, 150_000)
        out["aclose_s"] = await _timed(eng.aclose(), 120)
    finally:
        await asyncio.wait_for(eng.aclose(), 120)
        for proc in masters:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(10)
    return out


#: How long damaged_steady's traffic runs, at most, waiting for the removal; how often it
#: checks (twice the 200 ms lease: a check renews it).
STEADY_S = 10.0
CHECK_EVERY_S = 0.4


async def damaged_steady(port: int) -> dict[str, Any]:
    """A damaged object found under steady traffic (a question to the store every 20
    ms: the helper is never idle): removed once the lease of the read that found it
    ends (200 ms here), while the traffic goes on (issue 41: removals waited for 0.5 s
    of idle, so under traffic never, and put-if-absent kept the damaged object)."""
    out: dict[str, Any] = {}
    ks = keys(2, start=200_000)
    async with ao.AsyncOffloadEngine(kv_caches(), config(port)) as a:
        await store(a, ks, [0, 1])
        names = [the_tier(a).object_name(k) for k in ks]
        raw, buf, at = _raw_client(port)
        whole = HEADER_BYTES + BLOCK
        out["raw_get"] = list(raw.batch_get_into(names[:1], [at], [whole]))
        value = bytearray(buf[:whole])
        value[HEADER_BYTES + 9] ^= 1
        out["planted"] = _replace(raw, buf, at, names[0], bytes(value))
        async with ao.AsyncOffloadEngine(kv_caches(), config(port)) as b:
            out["alookup"] = await b.alookup(ks)
            stop = asyncio.Event()
            calls = [0]

            async def traffic() -> None:
                while not stop.is_set():
                    await b.alookup(keys(1, start=210_000 + calls[0]))
                    calls[0] += 1
                    await asyncio.sleep(0.02)

            task = asyncio.create_task(traffic())
            await asyncio.sleep(0.3)  # the traffic is going
            out["load"] = await load(b, ks[:1], [20])
            failed = time.monotonic()
            out["removed_s"] = None
            while time.monotonic() - failed < STEADY_S:
                # An existence check renews the object's lease (as a get does), under
                # which it cannot be removed: checked less often than the lease lasts.
                await asyncio.sleep(CHECK_EVERY_S)
                if not raw.batch_is_exist(names[:1])[0]:
                    out["removed_s"] = time.monotonic() - failed
                    break
            out["traffic_running"] = not task.done()
            stop.set()
            await asyncio.wait_for(task, WAIT_S)
            out["traffic_calls"] = calls[0]
            out["good_left"] = list(raw.batch_is_exist(names[1:]))
        raw.close()
    return out


async def loads_first(port: int) -> dict[str, Any]:
    """48 puts of 8 blocks queued in the helper, then one get (issue 41): the get is
    answered before most of the puts (reads go ahead of queued writes), and every put
    is answered, written (writes still go)."""
    from asyncoffload.tiers._mooncake import OP_GET, OP_PUT, Block, MooncakeJob, MooncakeLane
    from tests.mooncake_probe import lane_settings

    size, puts, per_put = 64 << 10, 48, 8
    slots = puts * per_put + 1
    memfd = os.memfd_create("loads-first", os.MFD_CLOEXEC)
    os.ftruncate(memfd, slots * size)
    region = mmap.mmap(memfd, slots * size)
    region[:] = os.urandom(slots * size)
    lane = MooncakeLane(lane_settings(f"127.0.0.1:{port}"), identity=bytes(16), payload_len=size)

    def at(key: bytes, slot: int) -> Block:
        return Block(key, ((0, slot * size, size),))

    def wait(jobs: list[MooncakeJob]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not all(job.query() for job in jobs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{lane.pending} requests not answered in {WAIT_S:g} s")
            time.sleep(0.002)

    out: dict[str, Any] = {}
    try:
        lane.wait_started()
        mapped = lane.map([(memfd, slots * size)])
        read = lane.submit(OP_PUT, [at(b"read", slots - 1)], WAIT_S)
        wait([mapped, read])
        out["setup"] = [mapped.results, read.results]
        os.kill(lane.pid, signal.SIGSTOP)  # everything below queues in the helper
        try:
            writes = [
                lane.submit(
                    OP_PUT,
                    [at(b"w%d" % (i * per_put + j), i * per_put + j) for j in range(per_put)],
                    WAIT_S,
                )
                for i in range(puts)
            ]
            get = lane.submit(OP_GET, [at(b"read", slots - 1)], WAIT_S)
        finally:
            os.kill(lane.pid, signal.SIGCONT)
        wait([*writes, get])
        out["get"] = get.results
        out["put_results"] = sorted({r for job in writes for r in job.results})
        out["writes_before_read"] = sum(job.finished_ns < get.finished_ns for job in writes)
        out["writes"] = puts
    finally:
        lane.close()
        region.close()
        os.close(memfd)
    return out


async def demo(port: int) -> dict[str, Any]:
    """Two demo runs with ``--mooncake``, one after the other, beside a storage client
    (objects in a demo's own segment go when it ends; those in the storage client's
    stay); then the command line, and a master that does not answer."""
    from mooncake.store import MooncakeDistributedStore

    from asyncoffload import cli
    from asyncoffload.demo import DemoConfig, DemoConfigError, run_demo

    small: dict[str, Any] = dict(
        requests=60,
        system_prompts=2,
        system_prompt_blocks=4,
        turns=3,
        blocks_per_turn=2.0,
        output_tokens=24.0,
        arrival_rate=400.0,
        think_time_s=0.02,
        cpu_blocks=80,
        layers=2,
        kv_heads=1,
        head_dim=16,
        concurrency=2,
        time_scale=0.0,
        mooncake_master=f"127.0.0.1:{port}",
    )
    storage = MooncakeDistributedStore()
    code = storage.setup(
        "127.0.0.1", "P2PHANDSHAKE", 256 << 20, 16 << 20, "tcp", "", f"127.0.0.1:{port}"
    )
    assert code == 0, code
    out: dict[str, Any] = {}
    try:
        first = await run_demo(DemoConfig(**small), progress=False)
        second = await run_demo(DemoConfig(**small), progress=False)
    finally:
        storage.close()
    for name, report in (("first", first), ("second", second)):
        (tier,) = report.stats.tiers
        out[name] = {
            "ok": report.ok,
            "medium": tier.medium,
            "written": tier.blocks_written,
            "write_failures": tier.write_failures,
            "read": tier.blocks_read,
            "read_failures": tier.failures,
            "prelookup": report.remote_prelookup,
            "remote_hits": report.remote_hit_blocks,
            "hit_blocks": report.hit_blocks,
            "verified": report.verified_blocks,
            "rows": dict(report.rows()),
        }
    try:
        await run_demo(DemoConfig(**dict(small, mooncake_master="127.0.0.1:9")), progress=False)
    except DemoConfigError as exc:
        out["no_master"] = str(exc)
    argv = ["demo", "--requests", "20", "--cpu-blocks", "40", "--layers", "2"]
    argv += ["--time-scale", "0", "--mooncake", f"127.0.0.1:{port}"]
    code = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "asyncoffload", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out["cli"] = [code.returncode, code.stdout[-3000:]]
    try:
        cli.main(["demo", "--mooncake", "nohost"])
    except SystemExit as exc:
        out["cli_bad_master"] = exc.code
    return out


async def slices(port: int) -> dict[str, Any]:
    """The tier as vLLM's scheduler drives it with two tensor-parallel ranks: each rank's
    host pool a region of its own (two memfds), a block one slice in each, written and
    read back whole; a block with one damaged slice fails its read whole."""
    from asyncoffload.transfer.base import HostRegion
    from asyncoffload.transfer.completion import CompletionBridge

    slots, half = 4, BLOCK // 2
    maps = []
    regions = []
    for _ in range(2):  # rank 0's pool, rank 1's pool
        fd = os.memfd_create("rank", os.MFD_CLOEXEC)
        os.ftruncate(fd, slots * half)
        mm = mmap.mmap(fd, slots * half)
        maps.append((fd, mm))
        at = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        regions.append(HostRegion(fd, at, slots * half))
    namespace = Namespace("m", "uint8", "tp2", BLOCK, world_size=2)
    store = ao.MooncakeTier(f"127.0.0.1:{port}", segment_bytes=64 << 20).open(namespace)
    out: dict[str, Any] = {}
    loop = asyncio.get_running_loop()
    bridge = CompletionBridge(loop, "eventfd")
    lane = bridge.lane("mooncake")
    try:
        store.attach_host(regions)
        store.set_segments([0, regions[1].address - regions[0].address])
        store.bind(bridge.wake_fd)
        await store.connect()

        async def done(job: Any) -> list[int]:
            fut: asyncio.Future[list[int]] = loop.create_future()
            bridge.watch(lane, job, lambda _j: fut.set_result(list(job.results)))
            return await asyncio.wait_for(fut, WAIT_S)

        def slot(i: int) -> int:  # rank 0's address of slot i
            return regions[0].address + i * half

        for _, mm in maps:
            mm[: 2 * half] = os.urandom(2 * half)  # slots 0 and 1 of each rank
        ks = keys(2)
        out["write"] = await done(store.submit_write(ks, [0, 1], [slot(0), slot(1)]))
        out["read"] = await done(store.submit_read(ks, [0, 1], [slot(2), slot(3)]))
        out["equal"] = [
            mm[2 * half : 4 * half] == mm[: 2 * half] for _, mm in maps
        ]  # both slices of both blocks, where each rank's pool has them
        # A damaged slice: rank 1's half of block 0, rewritten in the store by hand.
        from mooncake.store import MooncakeDistributedStore

        raw = MooncakeDistributedStore()
        assert (
            raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{port}") == 0
        )
        buf = mmap.mmap(-1, HEADER_BYTES + BLOCK)
        at = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert raw.register_buffer(at, len(buf)) == 0
        name = store.object_name(ks[0])
        assert raw.batch_get_into([name], [at], [len(buf)]) == [len(buf)]
        value = bytearray(buf)
        value[HEADER_BYTES + half + 5] ^= 1
        out["replanted"] = _replace(raw, buf, at, name, bytes(value))
        raw.close()
        for _, mm in maps:
            mm[2 * half : 3 * half] = bytes(half)
        out["damaged_read"] = await done(store.submit_read(ks[:1], [0], [slot(2)]))
        # (What a failed read left in the slots is never used: the slot is not ready.)
        out["set_segments_bad"] = ""
        try:
            store.set_segments([5, 0])
        except ValueError as exc:
            out["set_segments_bad"] = str(exc)
    finally:
        await store.aclose()
        bridge.close()
        for fd, mm in maps:
            mm.close()
            os.close(fd)
    return out


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (and been reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def storage_node(port: int) -> int:
    """A Mooncake client giving the pool 64 MiB (a storage node): prints ``ready``, then
    runs until stdin closes. Run as a process of its own (``storage``), to be stopped."""
    from mooncake.store import MooncakeDistributedStore

    node = MooncakeDistributedStore()
    code = node.setup(
        "127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", f"127.0.0.1:{port}"
    )
    print("ready" if code == 0 else f"setup failed: {code}", flush=True)
    try:
        sys.stdin.read()
    finally:
        node.close()
    return 0


def _start_node(port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, str(port), "storage"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _proc_file(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


async def _timed(awaitable: Any, wait_s: float = WAIT_S) -> float:
    started = time.monotonic()
    await asyncio.wait_for(awaitable, wait_s)
    return time.monotonic() - started


async def stopped(port: int) -> dict[str, Any]:
    """A helper that stops answering (SIGSTOP: as one stuck in a Mooncake call), and a
    storage node that does: flush() and aclose() end within timeout_s (issue 37, D2),
    writes fail by their deadline instead of Mooncake's own 60 s, and the CPU slots they
    pinned come back (D6)."""
    timeout_s = 1.0
    tier = {"timeout_s": timeout_s, "retry_s": 0.5}
    out: dict[str, Any] = {"timeout_s": timeout_s}
    # The helper stopped with write-through pending.
    eng = ao.AsyncOffloadEngine(kv_caches(), config(port, cpu_blocks=16, tier=tier))
    try:
        await store(eng, keys(2, start=100), [0, 1])  # the helper is up
        pid = the_tier(eng).describe()["helper_pid"]
        assert isinstance(pid, int)
        os.kill(pid, signal.SIGSTOP)
        for i in range(4):
            handle = await eng.prepare_store(keys(2, start=2 * i), [2 * i, 2 * i + 1])
            assert handle is not None
            await asyncio.wait_for(handle, WAIT_S)  # the CPU copy; write-through goes on
        out["flush_s"] = await _timed(eng.flush())
        st = eng.stats()
        out["failures"] = st.tiers[0].failures
        out["cpu_pinned"] = st.manager.pinned
        out["helper_gone"] = _gone(pid)
        out["aclose_s"] = await _timed(eng.aclose())
    finally:
        await asyncio.wait_for(eng.aclose(), WAIT_S)
    # The helper stopped with nothing pending: aclose waits timeout_s for its exit.
    eng = ao.AsyncOffloadEngine(kv_caches(), config(port, tier=tier))
    try:
        await store(eng, keys(2, start=200), [0, 1])
        pid = the_tier(eng).describe()["helper_pid"]
        assert isinstance(pid, int)
        os.kill(pid, signal.SIGSTOP)
        out["aclose_idle_s"] = await _timed(eng.aclose())
        out["helper_gone_idle"] = _gone(pid)
    finally:
        await asyncio.wait_for(eng.aclose(), WAIT_S)
    # A storage node stopped: the engine gives the pool nothing, so its blocks go there.
    node = _start_node(port)
    try:
        assert node.stdout is not None
        out["node"] = node.stdout.readline().strip()
        client_only = {**tier, "segment_bytes": 0}
        async with ao.AsyncOffloadEngine(
            kv_caches(), config(port, cpu_blocks=8, tier=client_only)
        ) as eng:
            # Written to the node once it has mounted its segment (ENOSPC before).
            out["node_written"] = await _written_again(eng, 300)
            tier_before = eng.stats().tiers[0]
            before = dict(tier_before.failures)  # while the node was mounting
            os.kill(node.pid, signal.SIGSTOP)
            handle = await eng.prepare_store(keys(4, start=400), [0, 1, 2, 3])
            assert handle is not None
            await asyncio.wait_for(handle, WAIT_S)
            out["node_flush_s"] = await _timed(eng.flush())
            st = eng.stats()
            after = st.tiers[0].failures
            out["node_failures"] = {
                k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)
            }
            # The blocks that did not fail: written (a put whose bytes the stopped node's
            # kernel took), shed by backpressure, or given back (evicted while waiting).
            out["node_ended_otherwise"] = {
                field: getattr(st.tiers[0], field) - getattr(tier_before, field)
                for field in ("write_shed", "write_yielded", "blocks_written")
            }
            out["node_cpu_pinned"] = st.manager.pinned
            out["node_aclose_s"] = await _timed(eng.aclose())
    finally:
        os.kill(node.pid, signal.SIGCONT)
        with contextlib.suppress(Exception):
            assert node.stdin is not None
            node.stdin.close()
        try:
            node.wait(15)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait(10)
    return out


async def secrets_(port: int) -> dict[str, Any]:
    """Tiers from ASYNCOFFLOAD_TIERS (a MAC key in them): the helper's environment and
    arguments hold neither that variable nor the key (issue 37, D10)."""
    mac_key = "mac-key-never-in-proc-0123456789"
    os.environ["ASYNCOFFLOAD_TIERS"] = json.dumps(
        [{"kind": "mooncake", "master": f"127.0.0.1:{port}", "segment_bytes": 64 << 20,
          "mac_key": mac_key, "metadata_server": "P2PHANDSHAKE"}]
    )  # fmt: skip
    os.environ["ASYNCOFFLOAD_CPU_BLOCKS"] = "8"
    out: dict[str, Any] = {}
    cfg = ao.EngineConfig.from_env(model="m", policy="lru")
    async with ao.AsyncOffloadEngine(kv_caches(), cfg) as eng:
        await store(eng, keys(2), [0, 1])
        out["written"] = eng.stats().tiers[0].blocks_written
        pid = the_tier(eng).describe()["helper_pid"]
        assert isinstance(pid, int)
        environ, cmdline = _proc_file(pid, "environ"), _proc_file(pid, "cmdline")
    out["env_has_tiers"] = b"ASYNCOFFLOAD_TIERS" in environ
    out["env_has_any_ours"] = b"ASYNCOFFLOAD_" in environ
    out["env_has_key"] = mac_key.encode() in environ
    out["cmdline_has_key"] = mac_key.encode() in cmdline
    out["cmdline_has_master"] = f"127.0.0.1:{port}".encode() in cmdline
    out["cmdline_args"] = len(cmdline.rstrip(b"\0").split(b"\0"))
    return out


async def quotas(port: int) -> dict[str, Any]:
    """Two tenants, one flooding and one steady (tests/quota_flood.py), with CPU, disk,
    Valkey and Mooncake tiers, without and with the flood."""
    import tempfile

    from tests import quota_flood
    from tests.servers import ValkeyServer

    out: dict[str, Any] = {}
    limits = {"flood": 4, "steady": "50%"}
    with tempfile.TemporaryDirectory() as tmp:
        server = ValkeyServer(Path(tmp))
        try:
            for name, flood in (("calm", False), ("flood", True)):
                server.command("FLUSHALL")
                tiers = [
                    ao.DiskTier(Path(tmp) / name, "1MiB", "slab", admission=None, quotas=limits),
                    ao.RemoteTier(url=server.url, index_blocks=64, timeout_s=5.0, quotas=limits),
                    ao.MooncakeTier(
                        f"127.0.0.1:{port}",
                        segment_bytes=64 << 20,
                        timeout_s=5.0,
                        index_blocks=64,
                        admission=None,
                        quotas=limits,
                        prefix=name,
                    ),
                ]
                out[name] = await quota_flood.run(tiers, flood)
        finally:
            server.stop()
    return out


async def pins(port: int) -> dict[str, Any]:
    """Retention pins in a Mooncake tier's index (issue 40): two hinted blocks and two
    plain ones stored, then a flood of plain blocks past the tier's 16-block index: the
    hinted pair stays ready and pinned there, the plain pair goes; a promotion of the
    hinted pair (a promotion) refreshes its pin below."""
    hint = ao.ReqContext("hinted", retention=ao.Retention(600.0))
    # The CPU tier's budget (a fifth of 4 slots) holds no pin: the blocks leave it, and
    # the load is a promotion, a hit in the Mooncake tier.
    cfg = config(port, cpu_blocks=4, pin_budget=0.2, tier={"index_blocks": 16, "admission": None})
    out: dict[str, Any] = {}
    async with ao.AsyncOffloadEngine(kv_caches(), cfg) as eng:
        kept, plain = keys(2), keys(2, 100)
        handle = await eng.prepare_store(kept, [0, 1], hint)
        assert handle is not None
        await asyncio.wait_for(handle, WAIT_S)
        await store(eng, plain, [2, 3])
        for i in range(0, 40, 2):
            await store(eng, keys(2, 1000 + i), [30, 31])
        index = tier_index(eng)
        out["medium"] = index.medium.name
        out["kept_in_cpu"] = [eng.manager.block_of(k) is not None for k in kept]
        out["kept_ready"] = [index.ready(k) for k in kept]
        out["kept_pinned"] = [k in index.pins for k in kept]
        out["plain_ready"] = [index.ready(k) for k in plain]
        pins = eng.stats().tiers[0].pins
        assert pins is not None
        out["lookup_kept"] = eng.lookup(kept, hint)
        out["load_kept"] = await load(eng, kept, [8, 9])
        after = eng.stats().tiers[0].pins
        assert after is not None
        out["pinned"], out["refreshed"] = after.pinned, after.refreshed - pins.refreshed
        out["still_pinned"] = [k in index.pins for k in kept]
    return out


SCENARIOS = {
    "share": share,
    "reader": reader,
    "damaged": damaged,
    "evicted": evicted,
    "restart": restart,
    "demo": demo,
    "slices": slices,
    "stopped": stopped,
    "dead": dead,
    "damaged_steady": damaged_steady,
    "loads_first": loads_first,
    "secrets": secrets_,
    "quotas": quotas,
    "pins": pins,
}


def main() -> int:
    port, scenario = int(sys.argv[1]), sys.argv[2]
    if scenario == "storage":
        return storage_node(port)
    own_master = scenario not in ("reader", "restart", "dead")
    master = None
    if own_master:
        loopback_up()
        master = start_master(port, TEST_LEASE_MS)
    elif scenario in ("restart", "dead"):
        loopback_up()
    try:
        out = asyncio.run(SCENARIOS[scenario](port))
    finally:
        if master is not None:
            master.kill()
            master.wait(10)
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
