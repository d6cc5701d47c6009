"""Disk tier throughput and CPU cost, next to raw O_DIRECT I/O measured in the same run.

For each block size (``--block-bytes``) and I/O thread count (``--io-threads``), on one
filesystem (``--dir``), ``--repeat`` times (the median is reported):

- raw: a file of ``--total-bytes`` (``posix_fallocate``d, as the tier's slab is), opened
  with ``O_DIRECT``, written then read sequentially, one block per ``os.pwritev`` /
  ``os.preadv`` from a page-aligned ``mmap`` buffer, by ``--raw-threads`` threads (1: one
  block in flight, plain sequential I/O; k > 1: k threads taking the next block in turn);
- tier: an engine on the CPU backend (KV tensors on CPU, policy ``lru``: the CPU tier
  stores every block) with one ``DiskTier`` (slab, ``admission=None``: every block is
  written). Write: ``prepare_store`` of ``total +
  cpu tier`` bytes in calls of ``--batch-bytes``, timed until ``flush()`` returns (every
  disk write ended); a store refused because every CPU slot is pinned by a disk write
  waits and retries. Read: the first ``total`` bytes, now only on disk (evicted from the
  smaller CPU tier), ``lookup`` + ``prepare_load`` back into KV blocks (disk -> CPU slot
  -> KV), calls of ``--batch-bytes``, up to ``--loads-in-flight`` at once.

Throughput counts payload bytes (the tier also writes a 4 KiB header per block). CPU per
GB: process CPU time (``resource.getrusage``: every thread, user + system) over the phase,
divided by the GB moved. Ratios tier/raw per direction; the goal is >= 0.85.

Run: ``.venv/bin/python benchmarks/disk.py [--block-bytes 64KiB,256KiB,1MiB]
[--total-bytes 1GiB] [--io-threads 1,2,4,8] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

import asyncoffload as ao
from asyncoffload.config import parse_bytes
from asyncoffload.tiers._io import IoJob, IoOp, IoPool
from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.format import block_file_bytes

GOAL = 0.85


def cpu_seconds() -> float:
    """User + system CPU time of the whole process (every thread)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


# --- raw O_DIRECT ---------------------------------------------------------------------


def raw_pass(fd: int, total: int, block: int, write: bool, threads: int) -> None:
    """Move ``total`` bytes sequentially, ``block`` per call, ``threads`` calls in flight."""
    n = total // block
    counter = itertools.count()  # next() is atomic under the GIL
    errors: list[BaseException] = []

    def worker() -> None:
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        try:
            if write:
                chunk = min(block, 1 << 16)
                view[:] = os.urandom(chunk) * (block // chunk)
            io = os.pwritev if write else os.preadv
            while True:
                i = next(counter)
                if i >= n:
                    return
                got = io(fd, [view], i * block)
                if got != block:
                    raise OSError(f"short {'write' if write else 'read'}: {got} of {block}")
        except BaseException as exc:
            errors.append(exc)
        finally:
            view.release()
            buf.close()

    if threads == 1:
        worker()
    else:
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    if errors:
        raise errors[0]


def raw_run(directory: Path, total: int, block: int, threads: int) -> dict[str, float]:
    """Seconds and CPU seconds of one raw write pass, then one read pass of it."""
    path = directory / f"raw-{os.getpid()}.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
        out: dict[str, float] = {}
        for write in (True, False):
            c0, t0 = cpu_seconds(), time.perf_counter()
            raw_pass(fd, total, block, write, threads)
            t1, c1 = time.perf_counter(), cpu_seconds()
            name = "write" if write else "read"
            out[name] = t1 - t0
            out[f"{name}_cpu"] = c1 - c0
        return out
    finally:
        os.close(fd)
        path.unlink()


# --- the native lanes alone (no engine) -------------------------------------------------


def lanes_run(
    directory: Path, total: int, block: int, io_threads: int, batch: int
) -> dict[str, float]:
    """The tier's I/O lanes without the engine: an ``IoPool`` writing then reading
    ``total`` bytes of blocks (headers and CRC32C included) to a fallocated O_DIRECT slab,
    jobs of ``batch`` blocks, up to 4 jobs queued, from page-aligned host memory. Splits
    the tier's cost into the lanes' (this) and the engine's (the rest)."""
    n = total // block
    slot = block_file_bytes(block)
    path = directory / f"lanes-{os.getpid()}.slab"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    host = mmap.mmap(-1, batch * block)
    base = ctypes.addressof(ctypes.c_char.from_buffer(host))
    wake = os.eventfd(0, os.EFD_CLOEXEC)
    pool = IoPool(
        threads=io_threads, payload_len=block, identity=b"benchmarks/disk!", direct_files=True
    )
    pool.bind(wake)
    out: dict[str, float] = {}
    try:
        os.posix_fallocate(fd, 0, n * slot)
        for write in (True, False):
            queued: deque[IoJob] = deque()
            c0, t0 = cpu_seconds(), time.perf_counter()
            for start in range(0, n, batch):
                ops = [
                    IoOp(base + j * block, (start + j) * slot, None, b"k%d" % (start + j), fd)
                    for j in range(min(batch, n - start))
                ]
                queued.append(pool.submit(write, ops))
                while len(queued) >= 4 or (start + batch >= n and queued):
                    if queued[0].query():
                        job = queued.popleft()
                        assert not job.failed, job.results[:4]
                    else:
                        os.eventfd_read(wake)  # blocks until some job ends
            t1, c1 = time.perf_counter(), cpu_seconds()
            name = "write" if write else "read"
            out[name] = t1 - t0
            out[f"{name}_cpu"] = c1 - c0
    finally:
        pool.close()
        os.close(wake)
        os.close(fd)
        path.unlink()
    return out


# --- the tier ---------------------------------------------------------------------------


def make_keys(run: int, n: int) -> list[ao.OffloadKey]:
    prefix = run.to_bytes(4, "big")
    return [ao.make_offload_key(prefix + i.to_bytes(8, "big")) for i in range(n)]


async def tier_run(
    directory: Path,
    total: int,
    block: int,
    io_threads: int,
    batch: int,
    cpu_bytes: int,
    loads_in_flight: int,
    run: int,
) -> dict[str, Any]:
    n = total // block
    cpu_blocks = max(cpu_bytes // block, 2 * batch * loads_in_flight)
    stored = n + cpu_blocks  # the first n end up only on disk
    kv_blocks = max(batch * loads_in_flight, 4)
    kv = [torch.randint(0, 256, (kv_blocks, block), dtype=torch.uint8)]
    layout = ao.KVLayout.infer(kv, kv_split=False)
    tier = DiskTier(
        directory / "tier",
        (stored + 1) * block_file_bytes(block),
        "slab",
        admission=None,
        io_threads=io_threads,
        direct_io=True,
    )
    # LRU: every block offered is stored, then written through (the default policy may
    # decline blocks once the CPU tier is full, and a declined block reaches no tier).
    cfg = ao.EngineConfig(cpu_blocks=cpu_blocks, tiers=[tier], model="bench-disk", policy="lru")
    keys = make_keys(run, stored)
    out: dict[str, Any] = {"cpu_blocks": cpu_blocks, "batch_blocks": batch}
    async with ao.AsyncOffloadEngine(kv, cfg, layout=layout) as engine:
        info = engine.stats().tiers[0].info
        out["direct_io"] = info["direct_io"]
        out["host_aligned"] = engine.backend.host_address(0) % 4096 == 0
        ids = list(range(batch))
        refused = 0
        # Write: every block through the CPU tier, then to disk; timed until flush().
        c0, t0 = cpu_seconds(), time.perf_counter()
        handles: deque[ao.Transfer] = deque()
        for start in range(0, stored, batch):
            chunk = keys[start : start + batch]
            while True:
                handle = await engine.prepare_store(chunk, ids[: len(chunk)])
                if handle is not None:
                    break
                # Every CPU slot is pinned by a disk write still running: wait a little.
                refused += 1
                await asyncio.sleep(0.001)  # not less: uvloop truncates to whole ms (spins)
            handles.append(handle)
            while len(handles) > 4:
                await handles.popleft()
        for handle in handles:
            await handle
        await engine.flush()
        t1, c1 = time.perf_counter(), cpu_seconds()
        st = engine.stats().tiers[0]
        declined = engine.manager.stats().store_skipped
        assert st.blocks_written == stored, (st.blocks_written, stored, st.failures, declined)
        out["write"] = t1 - t0
        out["write_cpu"] = c1 - c0
        out["write_bytes"] = stored * block
        out["store_refusals"] = refused
        # Read: the first n keys, on disk only now.
        first = keys[:n]
        on_cpu = sum(1 for key in first if engine.manager.block_of(key) is not None)
        assert on_cpu == 0, f"{on_cpu} of the first {n} keys are still in the CPU tier"
        loads: deque[ao.Transfer] = deque()
        c0, t0 = cpu_seconds(), time.perf_counter()
        for k, start in enumerate(range(0, n, batch)):
            chunk = first[start : start + batch]
            assert engine.lookup(chunk) == len(chunk)
            base = (k % loads_in_flight) * batch
            loads.append(await engine.prepare_load(chunk, list(range(base, base + len(chunk)))))
            if len(loads) >= loads_in_flight:
                await loads.popleft()
        for handle in loads:
            await handle
        t1, c1 = time.perf_counter(), cpu_seconds()
        st = engine.stats().tiers[0]
        assert st.blocks_read == n and st.read_failures == 0, st
        out["read"] = t1 - t0
        out["read_cpu"] = c1 - c0
        out["read_bytes"] = n * block
    return out


# --- driver -----------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def measure(args: argparse.Namespace, directory: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    run = 0
    total = args.total_bytes
    for block in args.block_bytes:
        batch = max(1, args.batch_bytes // block)
        for io_threads in args.io_threads:
            raws: list[dict[str, float]] = []
            tiers: list[dict[str, Any]] = []
            lanes: list[dict[str, float]] = []
            raw_threads = args.raw_threads or io_threads
            for _ in range(args.repeat):
                # Raw and tier alternate, so both see the same drift of the disk.
                raws.append(raw_run(directory, total, block, raw_threads))
                if args.lanes:
                    lanes.append(lanes_run(directory, total, block, io_threads, batch))
                run += 1
                tiers.append(
                    ao.run(
                        tier_run(
                            directory,
                            total,
                            block,
                            io_threads,
                            batch,
                            args.cpu_bytes,
                            args.loads_in_flight,
                            run,
                        ),
                        use_uvloop=False,
                    )
                )
                shutil.rmtree(directory / "tier", ignore_errors=True)
            raw_w = total / median_of(raws, "write") / 1e9
            raw_r = total / median_of(raws, "read") / 1e9
            tier_w = statistics.median(t["write_bytes"] / t["write"] for t in tiers) / 1e9
            tier_r = statistics.median(t["read_bytes"] / t["read"] for t in tiers) / 1e9
            row: dict[str, Any] = {
                "block_bytes": block,
                "io_threads": io_threads,
                "raw_threads": raw_threads,
                "batch_blocks": batch,
                "raw_write_gbps": raw_w,
                "raw_read_gbps": raw_r,
                "tier_write_gbps": tier_w,
                "tier_read_gbps": tier_r,
                "write_ratio": tier_w / raw_w,
                "read_ratio": tier_r / raw_r,
                "raw_write_cpu_s_per_gb": statistics.median(
                    r["write_cpu"] / (total / 1e9) for r in raws
                ),
                "raw_read_cpu_s_per_gb": statistics.median(
                    r["read_cpu"] / (total / 1e9) for r in raws
                ),
                "tier_write_cpu_s_per_gb": statistics.median(
                    t["write_cpu"] / (t["write_bytes"] / 1e9) for t in tiers
                ),
                "tier_read_cpu_s_per_gb": statistics.median(
                    t["read_cpu"] / (t["read_bytes"] / 1e9) for t in tiers
                ),
                "store_refusals": statistics.median(t["store_refusals"] for t in tiers),
                "direct_io": all(t["direct_io"] for t in tiers),
                "host_aligned": all(t["host_aligned"] for t in tiers),
                "raw_runs": raws,
                "tier_runs": tiers,
            }
            if lanes:
                for name in ("write", "read"):
                    row[f"lanes_{name}_gbps"] = total / median_of(lanes, name) / 1e9
                    row[f"lanes_{name}_cpu_s_per_gb"] = statistics.median(
                        r[f"{name}_cpu"] / (total / 1e9) for r in lanes
                    )
                row["lanes_runs"] = lanes
                print(
                    f"  lanes alone (IoPool, no engine): write {row['lanes_write_gbps']:.2f} GB/s "
                    f"({row['lanes_write_cpu_s_per_gb']:.3f} CPU s/GB), read "
                    f"{row['lanes_read_gbps']:.2f} GB/s ({row['lanes_read_cpu_s_per_gb']:.3f})",
                    flush=True,
                )
            rows.append(row)
            print(
                f"block {fmt_bytes(block):>8} io_threads {io_threads}: write raw {raw_w:.2f} "
                f"tier {tier_w:.2f} GB/s ({row['write_ratio']:.2f}); read raw {raw_r:.2f} "
                f"tier {tier_r:.2f} GB/s ({row['read_ratio']:.2f})",
                flush=True,
            )
    return rows


def mark(ratio: float) -> str:
    return "" if ratio >= GOAL else " (below goal)"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"raw: O_DIRECT, raw_threads blocks in flight; ratios tier/raw (goal >= {GOAL}); "
        "CPU: process CPU seconds per GB moved",
        "",
        "| block | io_threads | raw_threads | blocks/call | write raw GB/s | write tier GB/s "
        "| write ratio "
        "| read raw GB/s | read tier GB/s | read ratio | CPU s/GB write raw / tier "
        "| CPU s/GB read raw / tier |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {fmt_bytes(r['block_bytes'])} | {r['io_threads']} | {r['raw_threads']} "
            f"| {r['batch_blocks']} "
            f"| {r['raw_write_gbps']:.2f} | {r['tier_write_gbps']:.2f} "
            f"| {r['write_ratio']:.2f}{mark(r['write_ratio'])} "
            f"| {r['raw_read_gbps']:.2f} | {r['tier_read_gbps']:.2f} "
            f"| {r['read_ratio']:.2f}{mark(r['read_ratio'])} "
            f"| {r['raw_write_cpu_s_per_gb']:.3f} / {r['tier_write_cpu_s_per_gb']:.3f} "
            f"| {r['raw_read_cpu_s_per_gb']:.3f} / {r['tier_read_cpu_s_per_gb']:.3f} |"
        )
    lanes = [r for r in rows if "lanes_write_gbps" in r]
    if lanes:
        lines += [
            "",
            "The native lanes alone (IoPool, no engine), same bytes, same run:",
            "",
            "| block | io_threads | lanes write GB/s (/ raw) | lanes read GB/s (/ raw) "
            "| CPU s/GB write / read |",
            "|---|---|---|---|---|",
        ]
        for r in lanes:
            lw, lr = r["lanes_write_gbps"], r["lanes_read_gbps"]
            lines.append(
                f"| {fmt_bytes(r['block_bytes'])} | {r['io_threads']} "
                f"| {lw:.2f} ({lw / r['raw_write_gbps']:.2f}) "
                f"| {lr:.2f} ({lr / r['raw_read_gbps']:.2f}) "
                f"| {r['lanes_write_cpu_s_per_gb']:.3f} / {r['lanes_read_cpu_s_per_gb']:.3f} |"
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
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the files go (default: a temp dir here)"
    )
    parser.add_argument("--block-bytes", type=byte_list, default=byte_list("64KiB,256KiB,1MiB"))
    parser.add_argument("--total-bytes", type=byte_size, default=1 << 30)
    parser.add_argument("--io-threads", type=int_list, default=[4])
    parser.add_argument(
        "--raw-threads",
        type=int,
        default=1,
        help="raw blocks in flight (1: plain sequential; 0: as many as --io-threads)",
    )
    parser.add_argument(
        "--lanes", action="store_true", help="also time the native lanes alone (no engine)"
    )
    parser.add_argument(
        "--batch-bytes",
        type=byte_size,
        default=8 << 20,
        help="bytes per prepare_store / prepare_load call",
    )
    parser.add_argument(
        "--cpu-bytes",
        type=byte_size,
        default=128 << 20,
        help="CPU tier size (stores beyond it keep at most this much waiting for the disk)",
    )
    parser.add_argument("--loads-in-flight", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    for block in args.block_bytes:
        if block % 4096 or args.total_bytes % block:
            parser.error(f"block {block}: must be a multiple of 4096 dividing --total-bytes")
    if not hasattr(os, "O_DIRECT"):
        print("benchmarks/disk.py needs O_DIRECT (Linux)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    made = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="disk-bench-", dir=os.getcwd())) if made else args.dir
    directory.mkdir(parents=True, exist_ok=True)
    print(
        f"{platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()} | "
        f"asyncoffload {ao.__version__} | dir {directory} | total {fmt_bytes(args.total_bytes)}",
        flush=True,
    )
    try:
        rows = measure(args, directory)
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
    print()
    print(table(rows))
    if args.json is not None:
        with contextlib.suppress(FileExistsError):
            args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "cpus": os.cpu_count(),
                    "dir": str(directory),
                    "total_bytes": args.total_bytes,
                    "raw_threads": args.raw_threads,
                    "batch_bytes": args.batch_bytes,
                    "cpu_bytes": args.cpu_bytes,
                    "loads_in_flight": args.loads_in_flight,
                    "repeat": args.repeat,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
