"""The process that drives a Mooncake Store client for :mod:`asyncoffload.tiers._mooncake`.

Mooncake's client is synchronous and needs the GIL to return from every call; a thread of
the engine's process would wait for a busy event loop's GIL twice per call. So the calls
run here, in a process of their own (its GIL is its own), on host memory the engine
shares with it (a ``memfd`` both map, registered with the store once): the bytes go
straight between the store and the engine's host slots.

Messages (``SOCK_SEQPACKET``, one per batch): the engine sends ``(job id, op, n)`` then
``n`` items ``(key length, header offset, header length, payload offset, payload
length)`` and the keys; this process runs the batch, sends ``(job id, n, end)`` and
``n`` results (bytes moved, or a negative code), then writes 1 to the engine's completion
eventfd, which the engine hands over (and replaces) with an ``OP_WAKE`` message carrying
the fd (none: no wake-up; the engine polls). Its first message is ``(0, setup code)``.
It exits when the engine's end of the socket closes, ignores SIGINT (the engine's Ctrl-C
is the engine's), and never touches the region outside the offsets it is given (checked
against the region's size).

Run by the engine only: ``python -m asyncoffload.tiers._mooncake_helper FD...``.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import socket
import struct
import sys
import time
from typing import Any

#: (job id, op, item count)
HEAD = struct.Struct("<QII")
#: Per item: key length, header offset, header length, payload offset, payload length.
ITEM = struct.Struct("<IQIQI")
#: (job id, result count, when the batch ended: CLOCK_MONOTONIC ns, the clock of
#: ``time.perf_counter_ns`` in every process), then that many int64 results.
REPLY = struct.Struct("<QIQ")

OP_GET, OP_PUT, OP_EXISTS, OP_REMOVE, OP_WAKE = 0, 1, 2, 3, 4
#: A request that names memory outside the shared region (never sent by the engine).
E_RANGE = -22  # -EINVAL


def _items(data: bytes, n: int) -> tuple[list[str], list[tuple[int, int, int, int]]]:
    at = HEAD.size
    spans = []
    lengths = []
    for _ in range(n):
        key_len, h_off, h_len, p_off, p_len = ITEM.unpack_from(data, at)
        at += ITEM.size
        lengths.append(key_len)
        spans.append((h_off, h_len, p_off, p_len))
    keys = []
    for key_len in lengths:
        keys.append(data[at : at + key_len].decode("ascii"))
        at += key_len
    return keys, spans


def serve(store: Any, sock: socket.socket, base: int, size: int) -> None:
    wake = (1).to_bytes(8, sys.byteorder)
    wake_fd = -1
    while True:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 1)
        if not data:
            return
        job, op, n = HEAD.unpack_from(data)
        if op == OP_WAKE:
            if wake_fd >= 0:
                os.close(wake_fd)
            wake_fd = fds[0] if fds else -1
            continue
        for fd in fds:  # none is expected with a batch
            os.close(fd)
        keys, spans = _items(data, n)
        results: list[int]
        if op == OP_EXISTS:
            results = list(store.batch_is_exist(keys)) if keys else []
        elif op == OP_REMOVE:
            results = [store.remove(key) for key in keys]
        else:
            results = [0] * n
            todo = []
            for i, (h_off, h_len, p_off, p_len) in enumerate(spans):
                if h_off + h_len > size or p_off + p_len > size:
                    results[i] = E_RANGE
                else:
                    todo.append(i)
            if todo:
                ptrs = [[base + spans[i][0], base + spans[i][2]] for i in todo]
                lens = [[spans[i][1], spans[i][3]] for i in todo]
                names = [keys[i] for i in todo]
                if op == OP_GET:
                    got = store.batch_get_into_multi_buffers(names, ptrs, lens)
                else:
                    got = store.batch_put_from_multi_buffers(names, ptrs, lens)
                for i, r in zip(todo, got):
                    results[i] = int(r)
        end = time.perf_counter_ns()
        reply = REPLY.pack(job, len(results), end) + struct.pack(f"<{len(results)}q", *results)
        sock.send(reply)
        if wake_fd >= 0:
            os.write(wake_fd, wake)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    memfd, sock_fd = int(argv[0]), int(argv[1])
    settings = json.loads(argv[2])
    sock = socket.socket(fileno=sock_fd)
    size = os.fstat(memfd).st_size
    region = mmap.mmap(memfd, size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        settings["local_hostname"],
        settings["metadata_server"],
        settings["global_segment_bytes"],
        settings["local_buffer_bytes"],
        settings["protocol"],
        settings["device_name"],
        settings["master"],
    )
    if code == 0:
        code = store.register_buffer(base, size)
    sock.send(REPLY.pack(0, 1, time.perf_counter_ns()) + struct.pack("<q", int(code)))
    if code != 0:
        return 1
    try:
        serve(store, sock, base, size)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
