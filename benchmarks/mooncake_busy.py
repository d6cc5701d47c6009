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

Run (root, Linux, ``pip install 'asyncoffload[mooncake]'`` and Debian's libibverbs1,
libnl-3-200 and libnl-route-3-200): ``.venv/bin/python benchmarks/mooncake_busy.py``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import mmap
import os
import platform
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from disk_busy import BridgeReader, Reader, Row, measure, now_ns, run_on, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the master

from asyncoffload.tiers._mooncake import OP_GET, OP_PUT, Block, MooncakeJob, MooncakeLane
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--block-bytes", type=int, default=256 << 10)
    parser.add_argument("--blocks", type=int, default=64, help="keys in the store")
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--loops", default="asyncio,uvloop")
    parser.add_argument("--paths", default="process,executor")
    parser.add_argument("--in-netns", action="store_true", help="already in a private netns")
    args = parser.parse_args(argv)
    unshadow(Path(__file__).resolve().parent)  # benchmarks/mooncake.py: not the package
    if not args.in_netns:
        return rerun_in_netns(__file__, argv or sys.argv[1:])
    loopback_up()
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
