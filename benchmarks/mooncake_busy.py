"""Mooncake Store reads on a busy event loop: which design may drive the store's calls
(issue 26).

Mooncake's Python client (``mooncake.store.MooncakeDistributedStore``) is synchronous; it
releases the GIL inside a call and needs it again to return. Its own asyncio wrapper runs
each call with ``run_in_executor``. The engine's rule is that no Python worker thread sits
on a completion path, because a busy loop starves it (``benchmarks/disk_busy.py``); a
native lane cannot call the client without the GIL either (it is a pybind11 module with
no C interface). This script measures, with the busy-loop method of disk_busy.py (a task
runs ``--busy-ms`` of Python between ``await asyncio.sleep(0)``; each read is submitted at
a random point of a busy chunk and awaited), one-block reads
(``batch_get_into_multi_buffers`` of one key into registered memory) by:

- ``executor``: Mooncake's own pattern, ``loop.run_in_executor(None, ...)``; the worker
  stamps the end after the call returns and hands it back with ``call_soon_threadsafe``.
  A read not back within 10 s marks the path starved (the row says so).
- ``process``: asyncoffload's :class:`~asyncoffload.tiers._mooncake.MooncakeLane`: a
  helper process owns its own client and maps the host memory (a ``memfd``) registered
  with the store, and checks each block it reads; the loop sends one message per batch
  and the helper's reply is read when the completion bridge's eventfd, which the helper
  writes, wakes it: no thread of this process, and the helper's GIL is its own. The
  helper stamps the end (``CLOCK_MONOTONIC``, the clock of ``time.perf_counter_ns`` in
  both processes).

Every block is one object of the block format's 4096-byte header and its payload (as the
tier writes them), put through the lane before the runs (the lane's reads also check
each block's header and checksum, as the tier's do); both paths read the same keys from
one ``mooncake_master`` on 127.0.0.1, started here. Mooncake's client and master listen
on every interface, so the script runs inside a private network namespace: it re-runs
itself under ``unshare --net`` (root) unless ``--in-netns`` says it already is in one.

``--dead-master`` measures instead what each call costs while the master is dead
(issue 41): the master is killed (``SIGKILL``), then the lane gets ``--calls`` requests,
one every ``--gap-ms``, gets, puts, existence checks and removals in turn, each timed
from submission to its reply; then the master is restarted and the seconds until a put
succeeds again are timed. Then the engine's own run of tests/mooncake_engines.py
``dead`` (per-call seconds of stores, questions and loads, flush() and aclose() with the
master dead) and ``damaged_steady`` (``--removals`` times: how long a damaged object
found under steady traffic stays in the store), each against its own master.

Run (root, Linux, ``pip install 'asyncoffload[mooncake]'`` and Debian's libibverbs1,
libnl-3-200 and libnl-route-3-200): ``.venv/bin/python benchmarks/mooncake_busy.py
[--dead-master]``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import mmap
import os
import platform
import select
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

# This tree first (tests/, for the master; and its asyncoffload, which disk_busy imports).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disk_busy import BridgeReader, Reader, Row, measure, now_ns, percentile, run_on, table

from asyncoffload.tiers._mooncake import (
    OP_EXISTS,
    OP_GET,
    OP_PUT,
    OP_REMOVE,
    Block,
    MooncakeJob,
    MooncakeLane,
)
from asyncoffload.transfer.base import CopyJob
from tests.mooncake_probe import lane_settings as settings
from tests.mooncake_probe import loopback_up, rerun_in_netns, start_master, unshadow

MASTER_PORT = 50151
HEADER = 4096  # the block format's header, written and read beside each payload
#: The identity the lane names (and checks) blocks with.
IDENTITY = bytes(range(16))
#: A read not back within this many seconds counts the path as starved.
STARVED_S = 10.0


def _address(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4


def object_name(i: int) -> str:
    """The store's name of block ``i`` as the lane puts it (prefix "ao")."""
    return f"ao:{IDENTITY.hex()}:{key(i).hex()}"


def _deliver(fut: asyncio.Future[tuple[int, int]], end: int) -> None:
    if not fut.done():  # a read that counted as starved was given up
        fut.set_result((end, now_ns()))


class ExecutorReader(Reader):
    name = "executor"

    def __init__(self, store: Any, block: int) -> None:
        self.store = store
        self.block = block
        self.buf = mmap.mmap(-1, 2 * (block + HEADER))
        self.base = _address(self.buf)
        if store.register_buffer(self.base, len(self.buf)) != 0:
            raise RuntimeError("register_buffer failed")
        self.loop: asyncio.AbstractEventLoop | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def _read(self, i: int, fut: asyncio.Future[tuple[int, int]]) -> None:
        at = self.base + (i % 2) * (self.block + HEADER)
        got = self.store.batch_get_into_multi_buffers(
            [object_name(i)], [[at, at + HEADER]], [[HEADER, self.block]]
        )[0]
        end = now_ns()
        assert got == HEADER + self.block, got
        assert self.loop is not None
        self.loop.call_soon_threadsafe(_deliver, fut, end)

    def read(self, i: int) -> Awaitable[tuple[int, int]]:
        assert self.loop is not None
        fut: asyncio.Future[tuple[int, int]] = self.loop.create_future()
        self.loop.run_in_executor(None, self._read, i, fut)
        return asyncio.wait_for(fut, STARVED_S)


class ProcessReader(BridgeReader):
    """asyncoffload's :class:`~asyncoffload.tiers._mooncake.MooncakeLane`, woken through a
    completion bridge as the tier is."""

    name = "process"
    lane_name = "mooncake"
    timeout_s = STARVED_S

    def __init__(self, block: int, master: str, blocks: int) -> None:
        self.block = block
        self.blocks = blocks
        self.size = (blocks + 2) * block
        self.memfd = os.memfd_create("mooncake-busy", os.MFD_CLOEXEC)
        os.ftruncate(self.memfd, self.size)
        self.buf = mmap.mmap(self.memfd, self.size)
        self.buf[: blocks * block] = os.urandom(blocks * block)
        #: The lane to the store (``self.lane`` is the bridge's, as in disk_busy.py).
        self.store = MooncakeLane(settings(master), identity=IDENTITY, payload_len=block)
        self.store.wait_started()
        self.wait(self.store.map([(self.memfd, self.size)]), [0])

    def piece(self, i: int, at: int) -> Block:
        """Block ``i`` with its payload in slot ``at`` (its header is the helper's)."""
        return Block(key(i), ((0, at * self.block, self.block),))

    def wait(self, job: MooncakeJob, want: list[int]) -> None:
        """Wait for ``job`` (polled: no loop yet) and check its results."""
        deadline = time.monotonic() + 30
        while not job.query():
            if time.monotonic() > deadline:
                raise RuntimeError("the helper took over 30 s")
            time.sleep(0.001)
        if job.results != want:
            raise RuntimeError(f"results: {job.results[:4]}")

    def fill(self, blocks: int) -> None:
        """Put blocks [0, blocks) through the lane."""
        put = self.store.submit(OP_PUT, [self.piece(i, i) for i in range(blocks)])
        self.wait(put, [0] * blocks)

    def bind(self, wake_fd: int | None) -> None:
        self.store.bind(wake_fd)

    def submit(self, i: int) -> CopyJob:
        return self.store.submit(OP_GET, [self.piece(i, self.blocks + i % 2)])

    def check(self, job: CopyJob) -> None:
        assert isinstance(job, MooncakeJob) and job.results == [self.block], job

    def stop(self) -> None:
        self.store.close()
        self.buf.close()
        os.close(self.memfd)


def _ms(values: list[float]) -> str:
    """p50 / p99 / max of ``values`` (seconds), in ms."""
    if not values:
        return "-"
    return "/".join(f"{percentile(values, q) * 1e3:.2f}" for q in (50, 99, 100))


def _reply(lane: MooncakeLane, job: MooncakeJob, budget_s: float) -> float:
    """Seconds until ``job`` is answered (read off the lane's socket), at most
    ``budget_s`` (then the budget)."""
    started = time.perf_counter()
    deadline = started + budget_s
    while not job.query():
        left = deadline - time.perf_counter()
        if left <= 0:
            return budget_s
        select.select([lane.fileno()], [], [], min(left, 0.05))
    return time.perf_counter() - started


def dead_master_lane(args: argparse.Namespace) -> None:
    """Per-call seconds of the lane's requests with the master dead, then how long
    until a put succeeds once it is back."""
    port = MASTER_PORT
    master_proc = start_master(port, lease_ms=200)
    block = 64 << 10
    memfd = os.memfd_create("mooncake-dead", os.MFD_CLOEXEC)
    os.ftruncate(memfd, 8 * block)
    buf = mmap.mmap(memfd, 8 * block)
    buf[:] = os.urandom(8 * block)
    lane = MooncakeLane(settings(f"127.0.0.1:{port}"), identity=IDENTITY, payload_len=block)
    procs = [master_proc]
    try:
        lane.wait_started()
        budget = 30.0
        _reply(lane, lane.map([(memfd, 8 * block)]), budget)
        put = [Block(key(i), ((0, i * block, block),)) for i in range(4)]
        _reply(lane, lane.submit(OP_PUT, put), budget)
        master_proc.kill()
        master_proc.wait(10)
        calls: list[tuple[str, Any]] = [
            ("get", lambda i: lane.submit(OP_GET, [Block(key(i % 4), ((0, 5 * block, block),))])),
            ("put", lambda i: lane.submit(OP_PUT, [Block(key(100 + i), ((0, 0, block),))])),
            ("exists", lambda i: lane.submit(OP_EXISTS, [key(i % 4)])),
            ("remove", lambda i: lane.submit(OP_REMOVE, [key(200 + i)])),
        ]
        seconds: dict[str, list[float]] = {name: [] for name, _ in calls}
        codes: dict[str, set[int]] = {name: set() for name, _ in calls}
        ended = time.perf_counter() + args.dead_s
        for i in range(args.calls):
            if time.perf_counter() > ended:
                break
            name, call = calls[i % len(calls)]
            job = call(i)
            seconds[name].append(_reply(lane, job, budget))
            codes[name].update(job.results)
            time.sleep(args.gap_ms / 1e3)
        every = [s for values in seconds.values() for s in values]
        print(
            f"lane, master dead: {len(every)} calls, one every {args.gap_ms:g} ms, "
            f"p50/p99/max {_ms(every)} ms; over 100 ms: {sum(s > 0.1 for s in every)}",
            flush=True,
        )
        for name, values in seconds.items():
            print(f"  {name:>7}: {len(values)} calls, p50/p99/max {_ms(values)} ms, "
                  f"codes {sorted(codes[name])}", flush=True)  # fmt: skip
        procs.append(start_master(port, lease_ms=200))
        back = time.perf_counter()
        while time.perf_counter() - back < 60:
            job = lane.submit(OP_PUT, [Block(key(300), ((0, 0, block),))])
            _reply(lane, job, budget)
            if job.results == [0]:
                print(f"master restarted: a put succeeds after {time.perf_counter() - back:.2f} s")
                break
            time.sleep(0.05)
        else:
            print("master restarted: no put succeeded within 60 s")
    finally:
        lane.close()
        buf.close()
        os.close(memfd)
        for proc in procs:
            proc.kill()
            proc.wait(10)


def dead_master_engine(args: argparse.Namespace) -> None:
    """tests/mooncake_engines.py's ``dead`` and ``damaged_steady`` on the engine."""
    from tests import mooncake_engines as engines

    seen = asyncio.run(engines.dead(MASTER_PORT + 2))
    for phase in ("up", "down", "down_again"):
        calls = seen[phase]["seconds"]
        print(
            f"engine, master {'up' if phase == 'up' else 'dead'} ({phase}): stores landed "
            f"{seen[phase]['landed']}/{len(calls['store'])}; p50/p99/max ms: "
            + ", ".join(f"{kind} {_ms(values)}" for kind, values in calls.items()),
            flush=True,
        )
    print(
        f"engine, master dead: flush {seen['flush_s']:.3f} s, again {seen['flush_again_s']:.3f}"
        f" s, aclose {seen['aclose_s']:.3f} s; master back: written again after "
        f"{seen['rejoined_s']:.2f} s, helper starts {seen['starts']}",
        flush=True,
    )
    removed: list[float] = []
    for _ in range(args.removals):
        master_proc = start_master(MASTER_PORT + 4, lease_ms=200)
        try:
            steady = asyncio.run(engines.damaged_steady(MASTER_PORT + 4))
        finally:
            master_proc.kill()
            master_proc.wait(10)
        value = steady["removed_s"]
        removed.append(engines.STEADY_S if value is None else value)
        what = (
            f"still there after {engines.STEADY_S:g} s"
            if value is None
            else f"removed after {value:.3f} s"
        )
        print(f"damaged object under steady traffic ({steady['traffic_calls']} questions): {what}")
    if removed:
        print(
            f"removal, lease 200 ms: p50/p99/max {_ms(removed)} ms over {len(removed)} runs "
            f"(the first check, {engines.CHECK_EVERY_S:g} s after the read, found it gone: "
            "no finer, a check renews the lease)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--block-bytes", type=int, default=256 << 10)
    parser.add_argument("--blocks", type=int, default=64, help="keys in the store")
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--loops", default="asyncio,uvloop")
    parser.add_argument("--paths", default="process,executor")
    parser.add_argument("--in-netns", action="store_true", help="already in a private netns")
    parser.add_argument("--dead-master", action="store_true", help="calls with the master dead")
    parser.add_argument("--calls", type=int, default=400, help="--dead-master: lane calls")
    parser.add_argument("--gap-ms", type=float, default=10.0, help="--dead-master: between calls")
    parser.add_argument("--dead-s", type=float, default=60.0, help="--dead-master: at most")
    parser.add_argument("--removals", type=int, default=5, help="--dead-master: damaged runs")
    args = parser.parse_args(argv)
    unshadow(Path(__file__).resolve().parent)  # benchmarks/mooncake.py: not the package
    if not args.in_netns:
        return rerun_in_netns(__file__, argv or sys.argv[1:])
    loopback_up()
    if args.dead_master:
        print(
            f"{platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()}",
            flush=True,
        )
        dead_master_lane(args)
        dead_master_engine(args)
        return 0
    from mooncake.store import MooncakeDistributedStore

    print(
        f"{platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()} | "
        f"block {args.block_bytes} B | busy {args.busy_ms} ms",
        flush=True,
    )
    master_proc = start_master(MASTER_PORT, lease_ms=5000)
    master = f"127.0.0.1:{MASTER_PORT}"
    rows: list[Row] = []
    starved: list[str] = []
    try:
        store = MooncakeDistributedStore()
        rc = store.setup(*settings(master).values())
        if rc != 0:
            raise RuntimeError(f"setup: {rc}")
        process = ProcessReader(args.block_bytes, master, args.blocks)
        process.fill(args.blocks)
        readers: dict[str, Reader] = {}
        for path in args.paths.split(","):
            if path == "executor":
                readers[path] = ExecutorReader(store, args.block_bytes)
            else:
                readers[path] = process
        for loop_name in args.loops.split(","):
            for path, reader in readers.items():
                row = Row(loop_name, path)
                try:
                    run_on(
                        loop_name,
                        functools.partial(
                            measure, reader, row, args.reads, args.blocks, args.busy_ms
                        ),
                    )
                except TimeoutError:
                    print(f"{loop_name:>8} {path:>8}: STARVED (a read not back in {STARVED_S:g} s)")
                    starved.append(f"{loop_name} {path}")
                    continue
                rows.append(row)
                print(
                    f"{loop_name:>8} {path:>8}: deliver p50/p99/max {row.deliver_us[0]:.0f}/"
                    f"{row.deliver_us[1]:.0f}/{row.deliver_us[2]:.0f} us, submit->resume "
                    f"p50/p99 {row.total_us[0]:.0f}/{row.total_us[1]:.0f} us",
                    flush=True,
                )
        process.stop()
        store.close()
    finally:
        master_proc.terminate()
        master_proc.wait(10)
    print()
    print(table(rows))
    for name in starved:
        print(f"| {name} | starved: a read was not back within {STARVED_S:g} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
