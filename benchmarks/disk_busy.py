"""Disk read completions on a busy event loop: the native lanes vs ``run_in_executor``.

A task keeps the loop busy: ``--busy-ms`` of pure-Python work, then ``await
asyncio.sleep(0)``, over and over. Meanwhile another coroutine reads blocks of
``--block-bytes`` from a file on ``--dir`` (``O_DIRECT``), one at a time, each submitted
at a random point of a busy chunk (so reads end at random phases of the busy cycle), and
awaits each. Per read, the delivery latency: "the I/O ended" -> "its completion ran on
the loop" (the callback that resolves the read's future), in time and in busy-loop
iterations (busy chunks started in between); and "the awaiting coroutine resumed",
which asyncio schedules one iteration after the callback, whatever the path.

Paths:

- ``native``: what the disk tier does. An :class:`~asyncoffload.tiers._io.IoPool` (the
  native pread/pwrite lanes, no GIL) bound to a :class:`CompletionBridge`'s eventfd,
  watched with ``add_reader``; each read is an ``IoJob`` of one block of a slab written
  by the same pool, watched on a lane as the engine does. The I/O end is
  ``IoJob.finished_ns``, stamped by the native thread (``CLOCK_MONOTONIC``, the clock of
  ``time.perf_counter_ns``).
- ``executor``: ``loop.run_in_executor(None, read)``, where ``read`` does ``os.preadv``
  of the same bytes, stamps ``time.perf_counter_ns()`` right after it and hands the
  result to the loop with ``call_soon_threadsafe`` (run_in_executor's own path). That
  stamp is taken once the worker holds the GIL again, so it is late by however long the
  worker waited for the GIL; "submit -> resume" (minus the I/O's idle duration) shows
  the whole cost for both paths.

Each on asyncio and uvloop (``--loops``). Output: a table and ``--json PATH``.

Run: ``.venv/bin/python benchmarks/disk_busy.py [--reads 200] [--busy-ms 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import functools
import itertools
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncoffload as ao
from asyncoffload.config import parse_bytes
from asyncoffload.tiers._io import IoJob, IoOp, IoPool, slot_bytes
from asyncoffload.transfer.base import CopyJob
from asyncoffload.transfer.completion import CompletionBridge

now_ns = time.perf_counter_ns
IDENTITY = b"disk-busy-bench!"


def _burn_until(deadline_ns: int) -> int:
    x = 0
    while now_ns() < deadline_ns:
        for i in range(64):
            x += i
    return x


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


@dataclass
class Row:
    loop: str
    path: str
    n: int = 0
    idle_io_us_p50: float = 0.0  # one read on an idle loop, submit -> I/O end
    deliver_us: list[float] = field(default_factory=list)  # p50, p99, max
    deliver_iters: list[float] = field(default_factory=list)  # p50, p99, max
    total_us: list[float] = field(default_factory=list)  # submit -> resume: p50, p99, max
    busy_chunk_ms_p50: float = 0.0
    within_one: float = 0.0  # share of reads delivered within one loop iteration
    # I/O end -> the awaiting coroutine resumed, in busy iterations: asyncio runs a
    # future's waiter one iteration after the callback that set it, whatever the path.
    resume_iters: list[float] = field(default_factory=list)


class Reader:
    """One way to read block ``i`` and learn when it ended: ``read(i)`` returns an
    awaitable of the I/O end (perf_counter_ns)."""

    name = ""

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    def read(self, i: int) -> Awaitable[tuple[int, int]]:
        """An awaitable of (I/O end, completion delivered on the loop), perf_counter_ns."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class BridgeReader(Reader):
    """A reader whose jobs a :class:`CompletionBridge` watches, woken through its eventfd
    (``bind``): what the engine does with its lanes. Subclasses submit block ``i``'s read
    and check its job; ``timeout_s``: a read not back by then raises ``TimeoutError``."""

    lane_name = "read"
    timeout_s: float | None = None
    bridge: CompletionBridge | None = None

    def bind(self, wake_fd: int | None) -> None:
        raise NotImplementedError

    def submit(self, i: int) -> CopyJob:
        raise NotImplementedError

    def check(self, job: CopyJob) -> None:
        raise NotImplementedError

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.bridge = CompletionBridge(loop, "eventfd")
        self.lane = self.bridge.lane(self.lane_name)
        self.bind(self.bridge.wake_fd)

    def read(self, i: int) -> Awaitable[tuple[int, int]]:
        bridge = self.bridge
        assert bridge is not None
        fut: asyncio.Future[tuple[int, int]] = bridge.loop.create_future()
        job = self.submit(i)

        def done(_job: Any) -> None:
            delivered = now_ns()  # the bridge runs this on the loop
            self.check(job)
            fut.set_result((job.finished_ns, delivered))

        bridge.watch(self.lane, job, done)
        return fut if self.timeout_s is None else asyncio.wait_for(fut, self.timeout_s)

    def close(self) -> None:
        if self.bridge is not None:
            self.bind(None)
            self.bridge.close()
            self.bridge = None


class NativeReader(BridgeReader):
    name = "native"
    lane_name = "disk-read"

    def __init__(self, path: Path, block: int, blocks: int) -> None:
        self.block = block
        self.slot = slot_bytes(block)
        self.blocks = blocks
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT
        self.fd = os.open(path, flags, 0o600)
        os.posix_fallocate(self.fd, 0, blocks * self.slot)
        self.buf = mmap.mmap(-1, block * 2)
        self.host = ao_address(self.buf)
        self.pool = IoPool(threads=1, payload_len=block, identity=IDENTITY, direct_files=True)
        self.buf.write(os.urandom(block))
        # The slab, written by the pool itself (reads check the headers it writes).
        ops = [IoOp(self.host, i * self.slot, None, self.key(i), self.fd) for i in range(blocks)]
        job = self.pool.submit(True, ops)
        while not job.query():
            time.sleep(0.001)
        assert not job.failed, job.results[:4]

    def key(self, i: int) -> bytes:
        return b"block-%08d" % i

    def bind(self, wake_fd: int | None) -> None:
        self.pool.bind(wake_fd)

    def submit(self, i: int) -> CopyJob:
        return self.pool.submit(False, [IoOp(self.host, i * self.slot, None, self.key(i), self.fd)])

    def check(self, job: CopyJob) -> None:
        assert isinstance(job, IoJob) and not job.failed, job


class ExecutorReader(Reader):
    name = "executor"

    def __init__(self, path: Path, block: int, blocks: int) -> None:
        self.block = block
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        os.posix_fallocate(fd, 0, blocks * block)
        self.buf = mmap.mmap(-1, block)
        self.buf.write(os.urandom(block))
        for i in range(blocks):
            os.pwritev(fd, [self.buf], i * block)
        self.fd = fd
        self.loop: asyncio.AbstractEventLoop | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def _read(self, i: int, fut: asyncio.Future[tuple[int, int]]) -> None:
        got = os.preadv(self.fd, [self.buf], i * self.block)
        end = now_ns()
        assert got == self.block
        assert self.loop is not None
        # run_in_executor's own path: the worker hands the result to the loop with
        # call_soon_threadsafe (it needs the GIL for that).
        self.loop.call_soon_threadsafe(_deliver, fut, end)

    def read(self, i: int) -> Awaitable[tuple[int, int]]:
        assert self.loop is not None
        fut: asyncio.Future[tuple[int, int]] = self.loop.create_future()
        self.loop.run_in_executor(None, self._read, i, fut)
        return fut


def _deliver(fut: asyncio.Future[tuple[int, int]], end: int) -> None:
    fut.set_result((end, now_ns()))  # on the loop: the completion is delivered


def ao_address(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class _Busy:
    def __init__(self) -> None:
        self.stop = False
        self.request: asyncio.Future[tuple[int, Awaitable[tuple[int, int]]]] | None = None
        self.steps = array("q")
        self.block_index = 0


async def _busy_task(
    state: _Busy, reader: Reader, chunk_ns: int, blocks: int, rng: random.Random
) -> None:
    while not state.stop:
        start = now_ns()
        state.steps.append(start)
        req = state.request
        if req is not None and not req.done():
            _burn_until(start + rng.randrange(chunk_ns))
            state.request = None
            i = rng.randrange(blocks)
            t_submit = now_ns()
            try:
                req.set_result((t_submit, reader.read(i)))
            except Exception as exc:
                req.set_exception(exc)
        _burn_until(start + chunk_ns)
        await asyncio.sleep(0)


async def idle_io_us(reader: Reader, blocks: int, n: int) -> float:
    out = []
    for i in range(n):
        t0 = now_ns()
        end, _ = await reader.read(i % blocks)
        out.append((end - t0) / 1e3)
    return statistics.median(out)


async def measure(reader: Reader, row: Row, n: int, blocks: int, busy_ms: float) -> None:
    loop = asyncio.get_running_loop()
    reader.open(loop)
    try:
        row.idle_io_us_p50 = await idle_io_us(reader, blocks, 50)
        state = _Busy()
        chunk_ns = int(busy_ms * 1e6)
        task = loop.create_task(_busy_task(state, reader, chunk_ns, blocks, random.Random(1)))
        done: list[tuple[int, int, int, int]] = []  # (submit, I/O end, delivered, resumed)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            for k in range(n + 3):
                req: asyncio.Future[tuple[int, Awaitable[tuple[int, int]]]] = loop.create_future()
                state.request = req
                t_submit, pending = await req
                t_end, t_deliv = await pending
                t_res = now_ns()
                if k >= 3:  # warm-up
                    done.append((t_submit, t_end, t_deliv, t_res))
        finally:
            state.stop = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=5)
    finally:
        reader.close()
    steps = list(state.steps)

    def iters(t_end: int, t_res: int) -> int:
        return max(0, bisect.bisect_left(steps, t_res) - bisect.bisect_right(steps, t_end))

    deliver = [(d - e) / 1e3 for _, e, d, _ in done]
    its = [float(iters(e, d)) for _, e, d, _ in done]
    resume_its = [float(iters(e, r)) for _, e, _, r in done]
    total = [(r - s) / 1e3 for s, _, _, r in done]
    row.n = len(done)
    row.deliver_us = [percentile(deliver, q) for q in (50, 99, 100)]
    row.deliver_iters = [percentile(its, q) for q in (50, 99, 100)]
    row.total_us = [percentile(total, q) for q in (50, 99, 100)]
    row.within_one = sum(1 for x in its if x <= 1) / len(its)
    row.resume_iters = [percentile(resume_its, q) for q in (50, 99, 100)]
    row.busy_chunk_ms_p50 = statistics.median(b - a for a, b in itertools.pairwise(steps)) / 1e6


def run_on(loop_name: str, coro_fn: Callable[[], Any]) -> None:
    if loop_name == "uvloop":
        import uvloop

        uvloop.run(coro_fn())
    else:
        asyncio.run(coro_fn())


def table(rows: list[Row]) -> str:
    lines = [
        "| loop | path | reads | idle read us | deliver us p50 / p99 / max "
        "| loop iterations p50 / p99 / max | within 1 iteration | resumed after (iterations) "
        "p50 / p99 / max | submit->resume ms p50 / p99 / max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d, it, t = r.deliver_us, r.deliver_iters, r.total_us
        lines.append(
            f"| {r.loop} | {r.path} | {r.n} | {r.idle_io_us_p50:.0f} "
            f"| {d[0]:.0f} / {d[1]:.0f} / {d[2]:.0f} | {it[0]:.0f} / {it[1]:.0f} / {it[2]:.0f} "
            f"| {100 * r.within_one:.0f}% "
            f"| {r.resume_iters[0]:.0f} / {r.resume_iters[1]:.0f} / {r.resume_iters[2]:.0f} "
            f"| {t[0] / 1e3:.2f} / {t[1] / 1e3:.2f} / "
            f"{t[2] / 1e3:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dir", type=Path, default=None, help="default: a temp dir here")
    parser.add_argument(
        "--block-bytes",
        type=functools.partial(parse_bytes, what="--block-bytes"),
        default=256 << 10,
    )
    parser.add_argument("--blocks", type=int, default=256, help="blocks in the file")
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--loops", default="asyncio,uvloop")
    parser.add_argument("--paths", default="native,executor")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not hasattr(os, "O_DIRECT"):
        print("benchmarks/disk_busy.py needs O_DIRECT (Linux)", file=sys.stderr)
        return 2
    made = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="disk-busy-", dir=os.getcwd())) if made else args.dir
    directory.mkdir(parents=True, exist_ok=True)
    print(
        f"{platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()} | "
        f"asyncoffload {ao.__version__} | block {args.block_bytes} B | busy {args.busy_ms} ms",
        flush=True,
    )
    rows: list[Row] = []
    try:
        readers: dict[str, Reader] = {}
        for path in args.paths.split(","):
            cls = NativeReader if path == "native" else ExecutorReader
            readers[path] = cls(directory / f"{path}.bin", args.block_bytes, args.blocks)
        for loop_name in args.loops.split(","):
            for path, reader in readers.items():
                row = Row(loop_name, path)
                run_on(
                    loop_name,
                    functools.partial(measure, reader, row, args.reads, args.blocks, args.busy_ms),
                )
                rows.append(row)
                print(
                    f"{loop_name:>8} {path:>8}: deliver p50/p99/max {row.deliver_us[0]:.0f}/"
                    f"{row.deliver_us[1]:.0f}/{row.deliver_us[2]:.0f} us, iterations "
                    f"{row.deliver_iters[0]:.0f}/{row.deliver_iters[1]:.0f}/"
                    f"{row.deliver_iters[2]:.0f}, within one {100 * row.within_one:.0f}%",
                    flush=True,
                )
        for reader in readers.values():
            if isinstance(reader, NativeReader):
                reader.pool.close()
            os.close(reader.fd)  # type: ignore[attr-defined]
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
    print()
    print(table(rows))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "cpus": os.cpu_count(),
                    "block_bytes": args.block_bytes,
                    "busy_ms": args.busy_ms,
                    "rows": [asdict(r) for r in rows],
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
