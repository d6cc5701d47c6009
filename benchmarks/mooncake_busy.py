"""Mooncake Store reads on a busy event loop: which design may drive the store's calls
(issue 26).

Mooncake's Python client (``mooncake.store.MooncakeDistributedStore``) is synchronous; it
releases the GIL inside a call and needs it again to return. Its own asyncio wrapper runs
each call with ``run_in_executor``. The engine's rule is that no Python worker thread sits
on a completion path, because a busy loop starves it (``benchmarks/disk_busy.py``); a
native lane cannot call the client without the GIL either (it is a pybind11 module with
no C interface). This script measures, with the busy-loop method of disk_busy.py (a task
runs ``--busy-ms`` of Python between ``await asyncio.sleep(0)``; each read is submitted at
a random point of a busy chunk and awaited), one-block reads (``batch_get_into`` of one
key into registered memory) by:

- ``executor``: Mooncake's own pattern, ``loop.run_in_executor(None, ...)``; the worker
  stamps the end after the call returns and hands it back with ``call_soon_threadsafe``.
- ``process``: a helper process that owns its own client and maps the same host memory
  (a ``memfd`` both processes map, registered with the store by the helper). The loop
  writes a 12-byte request to a socket and learns of the end from the helper's reply,
  read by an ``add_reader`` callback on the loop: no thread of this process, and the
  helper's GIL is its own. The helper stamps the end (``CLOCK_MONOTONIC``, the clock of
  ``time.perf_counter_ns`` in both processes).

Both read the same keys from one ``mooncake_master`` on 127.0.0.1, started here. Mooncake's
client and master listen on every interface, so the script runs inside a private network
namespace: it re-runs itself under ``unshare --net`` (root) unless ``--in-netns`` says it
already is in one.

Run (root, Linux, ``pip install 'asyncoffload[mooncake]'`` and Debian's libibverbs1,
libnl-3-200 and libnl-route-3-200): ``.venv/bin/python benchmarks/mooncake_busy.py``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import mmap
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from disk_busy import Reader, Row, _deliver, measure, now_ns, run_on, table

MASTER_PORT = 50151
REQUEST = struct.Struct("<QI")  # request id, block index
REPLY = struct.Struct("<QqQ")  # request id, bytes read or a negative code, end (ns)

HELPER = r"""
import mmap, os, socket, struct, sys, time
from mooncake.store import MooncakeDistributedStore
fd, sock_fd, size, block = (int(a) for a in sys.argv[1:5])
master = sys.argv[5]
buf = mmap.mmap(fd, size)
import ctypes
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 64 << 20, "tcp", "", master)
assert rc == 0, rc
assert store.register_buffer(base, size) == 0
sock = socket.socket(fileno=sock_fd)
req, rep = struct.Struct("<QI"), struct.Struct("<QqQ")
sock.sendall(b"R")
pending = b""
while True:
    data = sock.recv(65536)
    if not data:
        break
    pending += data
    while len(pending) >= req.size:
        rid, i = req.unpack_from(pending)
        pending = pending[req.size:]
        got = store.batch_get_into(["block-%08d" % i], [base + (i % 2) * block], [block])[0]
        sock.sendall(rep.pack(rid, got, time.perf_counter_ns()))
store.close()
"""


def _address(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def start_master(port: int) -> subprocess.Popen[bytes]:
    import mooncake

    binary = Path(mooncake.__file__).with_name("mooncake_master")
    proc = subprocess.Popen(
        [
            str(binary),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={port}",
            "--enable_http_metadata_server=false",
            f"--metrics_port={port + 1}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("mooncake_master did not listen within 10 s")


class ExecutorReader(Reader):
    name = "executor"

    def __init__(self, store: Any, block: int) -> None:
        self.store = store
        self.block = block
        self.buf = mmap.mmap(-1, 2 * block)
        self.base = _address(self.buf)
        if store.register_buffer(self.base, 2 * block) != 0:
            raise RuntimeError("register_buffer failed")
        self.loop: asyncio.AbstractEventLoop | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def _read(self, i: int, fut: asyncio.Future[tuple[int, int]]) -> None:
        got = self.store.batch_get_into(
            [f"block-{i:08d}"], [self.base + (i % 2) * self.block], [self.block]
        )[0]
        end = now_ns()
        assert got == self.block, got
        assert self.loop is not None
        self.loop.call_soon_threadsafe(_deliver, fut, end)

    def read(self, i: int) -> Awaitable[tuple[int, int]]:
        assert self.loop is not None
        fut: asyncio.Future[tuple[int, int]] = self.loop.create_future()
        self.loop.run_in_executor(None, self._read, i, fut)
        return fut


class ProcessReader(Reader):
    name = "process"

    def __init__(self, block: int, master: str) -> None:
        self.block = block
        size = 2 * block
        self.memfd = os.memfd_create("mooncake-busy", os.MFD_CLOEXEC)
        os.ftruncate(self.memfd, size)
        self.buf = mmap.mmap(self.memfd, size)
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                HELPER,
                str(self.memfd),
                str(theirs.fileno()),
                str(size),
                str(block),
                master,
            ],
            pass_fds=(self.memfd, theirs.fileno()),
        )
        theirs.close()
        ours.settimeout(30)
        if ours.recv(1) != b"R":
            raise RuntimeError("the helper process did not start")
        ours.setblocking(False)
        self.waiting: dict[int, asyncio.Future[tuple[int, int]]] = {}
        self.next_id = 0
        self.pending = b""
        self.loop: asyncio.AbstractEventLoop | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        loop.add_reader(self.sock.fileno(), self._on_reply)

    def _on_reply(self) -> None:
        delivered = now_ns()
        self.pending += self.sock.recv(65536)
        while len(self.pending) >= REPLY.size:
            rid, got, end = REPLY.unpack_from(self.pending)
            self.pending = self.pending[REPLY.size :]
            assert got == self.block, got
            self.waiting.pop(rid).set_result((end, delivered))

    def read(self, i: int) -> Awaitable[tuple[int, int]]:
        assert self.loop is not None
        fut: asyncio.Future[tuple[int, int]] = self.loop.create_future()
        self.next_id += 1
        self.waiting[self.next_id] = fut
        self.sock.send(REQUEST.pack(self.next_id, i))
        return fut

    def close(self) -> None:
        if self.loop is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.loop = None

    def stop(self) -> None:
        self.sock.close()
        self.proc.wait(10)
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
    if not args.in_netns:
        unshare = shutil.which("unshare")
        if unshare is None or os.geteuid() != 0:
            print("mooncake_busy.py runs inside `unshare --net` (root)", file=sys.stderr)
            return 2
        cmd = [sys.executable, os.path.abspath(__file__), "--in-netns", *(argv or sys.argv[1:])]
        return subprocess.call([unshare, "--net", *cmd])
    subprocess.call(["ip", "link", "set", "lo", "up"], stderr=subprocess.DEVNULL)
    from mooncake.store import MooncakeDistributedStore

    print(
        f"{platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()} | "
        f"block {args.block_bytes} B | busy {args.busy_ms} ms",
        flush=True,
    )
    master_proc = start_master(MASTER_PORT)
    master = f"127.0.0.1:{MASTER_PORT}"
    rows: list[Row] = []
    try:
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 512 << 20, 64 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"setup: {rc}")
        payload = mmap.mmap(-1, args.block_bytes)
        payload.write(os.urandom(args.block_bytes))
        base = _address(payload)
        store.register_buffer(base, args.block_bytes)
        keys = [f"block-{i:08d}" for i in range(args.blocks)]
        put = store.batch_put_from(keys, [base] * args.blocks, [args.block_bytes] * args.blocks)
        if any(r != 0 for r in put):
            raise RuntimeError(f"batch_put_from: {put[:4]}")
        readers: dict[str, Reader] = {}
        for path in args.paths.split(","):
            if path == "executor":
                readers[path] = ExecutorReader(store, args.block_bytes)
            else:
                readers[path] = ProcessReader(args.block_bytes, master)
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
                    f"{row.deliver_us[1]:.0f}/{row.deliver_us[2]:.0f} us, submit->resume "
                    f"p50/p99 {row.total_us[0]:.0f}/{row.total_us[1]:.0f} us",
                    flush=True,
                )
        for reader in readers.values():
            if isinstance(reader, ProcessReader):
                reader.stop()
        store.close()
    finally:
        master_proc.terminate()
        master_proc.wait(10)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
