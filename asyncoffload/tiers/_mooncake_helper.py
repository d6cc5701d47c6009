"""The process that drives a Mooncake Store client for :mod:`asyncoffload.tiers._mooncake`.

Mooncake's client is synchronous and needs the GIL to return from every call; a thread of
the engine's process would wait for a busy event loop's GIL twice per call. So the calls
run here, in a process of their own (its GIL is its own), on host memory the engine
shares with it (its host pool's file descriptors, mapped here and registered with the
store once): the bytes go straight between the store and the engine's host slots.

This process also keeps the block format (:mod:`asyncoffload.tiers.format`): a block is
one object, its 4096-byte header (in a buffer of this process) then its payload pieces
where they are in the engine's slots. Before a put it writes each header, taking the
payload's CRC32C (and MAC) in place; after a get it checks the header and the payload
in place, so the engine is told a block was read only when it is this block, whole and
unchanged. A damaged object is removed (when its lease allows), so a later put replaces it:
on a thread of its own, bounded (:class:`_Remover`).

Reads (gets, existence checks) go ahead of writes (puts, removals) queued before them, and
writes still go (:class:`_Requests`). While the master is down every request fails at once
(``RPC_FAIL``): Mooncake's client blocks each call about 4.3 s while it reconnects, so a
probe off the request path looks for the master with backoff (:class:`_Master`).

Messages (``SOCK_SEQPACKET``, one per request), each starting ``(job id, op, n)``:

- ``OP_SETUP``: the client's settings, as JSON. Sent first, once: nothing secret or
  private goes through this process's arguments or environment.
- ``OP_CONFIG``: identity (16 bytes), payload length, prefix length, MAC key length,
  then the prefix and the MAC key. Sent second, once.
- ``OP_MAP``: ``n`` region sizes, the regions' fds attached (``SCM_RIGHTS``): mapped in
  order, region ``k`` being the ``k``-th mapped.
- ``OP_WAKE``: the completion eventfd to write after each reply (none attached: none).
- ``OP_GET`` / ``OP_PUT``: ``n`` items ``(key length, piece count)``, each followed by its
  pieces ``(region, offset, length)``; then the keys (an ``OffloadKey``'s bytes). A count
  with ``INLINE`` set: the first piece starts with the 4096 bytes of the header, room the
  engine keeps before its slot; otherwise the header is in this process's buffer.
- ``OP_EXISTS`` / ``OP_REMOVE``: ``n`` items ``(key length, 0)``, then the keys.

Every request but ``OP_WAKE`` and ``OP_SETUP`` is answered ``(job id, n, end ns)`` and
``n`` int64 results: per block the payload bytes (a get), 0 (a put that wrote the block),
``PRESENT`` (a put that found the block there already and wrote nothing), 1 / 0
(exists), or a negative code (Mooncake's, or ``-errno`` of a failed check). The first
reply, job 0, is the setup's code.

After a get returns a code that may leave its transfer running (anything outside
``SETTLED``), this process exits before replying: the engine must not reuse those slots
while a transfer could still write them, and once this process is gone none can. (A put
only reads its slots, and Mooncake revokes a put that failed: its blocks just fail.) The
engine sees the socket close and fails what was pending. It also exits when the engine's
end of the socket closes, and ignores SIGINT (the engine's Ctrl-C is the engine's).

Run by the engine only, as a script (``python .../_mooncake_helper.py FD SETTINGS``): it
imports nothing of asyncoffload (the package imports torch, seconds of start-up), and
loads the native library at the path the settings give.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import mmap
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any

#: (job id, op, item count)
HEAD = struct.Struct("<QII")
#: Per item: key length, piece count.
ITEM = struct.Struct("<HH")
#: In an item's piece count: the first piece starts with the block's header.
INLINE = 0x8000
#: Per piece: region, offset in it, length.
PIECE = struct.Struct("<HQQ")
#: OP_CONFIG: identity, payload length, prefix length, MAC key length.
CONFIG = struct.Struct("<16sqHH")
#: (job id, result count, when the request ended: CLOCK_MONOTONIC ns, the clock of
#: ``time.perf_counter_ns`` in every process), then that many int64 results.
REPLY = struct.Struct("<QIQ")

OP_GET, OP_PUT, OP_EXISTS, OP_REMOVE, OP_WAKE, OP_CONFIG, OP_MAP, OP_SETUP = range(8)
#: A put's result for a block the store held already: nothing written (Mooncake's own
#: put answers 0 for it, as for a block it wrote).
PRESENT = 1
#: Items in one request.
MAX_ITEMS = 512
#: Header size of the block format (asyncoffload.tiers.format.HEADER_BYTES).
HEADER = 4096
#: Store codes after which the call's transfer has ended (0, no space, bad arguments,
#: not ready, not found, exists, lease, RPC failure). vLLM's Mooncake connector notes that
#: other failures (TRANSFER_FAIL, RPC_TIMEOUT among them) can leave I/O in flight into
#: registered memory after the call returned.
SETTLED = frozenset({0, -200, -600, -703, -704, -705, -706, -707, -900})
#: Mooncake's INVALID_PARAMS (a get: a buffer shorter than the object), TRANSFER_FAIL
#: and RPC_FAIL (the master did not answer).
INVALID_PARAMS = -600
TRANSFER_FAIL = -800
RPC_FAIL = -900
#: Checks whose block is damaged or not this one, and objects of another size than a
#: block: the object is removed.
DAMAGED = frozenset(
    -e
    for e in (
        errno.ENODATA,
        errno.EBADMSG,
        errno.ESTALE,
        errno.EKEYREJECTED,
        errno.ENOKEY,
        errno.EMSGSIZE,
    )
)
#: Damaged objects waiting for their lease to end before removal: at most this many
#: (more are dropped, counted), tried this often, for this long.
MAX_DOOMED = 4096
REMOVE_EVERY_S = 0.1
REMOVE_FOR_S = 120.0
#: ... and when the engine closes, for at most this long (it waits ``timeout_s``, 5 s by
#: default, for the exit); none while the master is down.
REMOVE_AT_EXIT_S = 1.0
#: While the master is down: the probe's first wait and its longest (each doubles the
#: last), and how long its TCP connect to the master may take.
PROBE_FIRST_S = 0.05
PROBE_MAX_S = 1.0
PROBE_CONNECT_S = 0.5
#: The name the probe asks the store about (held or not, an answer says the master is up).
PROBE_NAME = "asyncoffload:probe"
#: Reads a worker takes while a write waits, at most, before it takes the write.
READS_PER_WRITE = 8
#: Exit status after a defect of a worker thread.
EXIT_DEFECT = 70
#: Exit status after an unsettled code.
EXIT_UNSETTLED = 75


class _Blocks:
    """What OP_CONFIG set: the names and the block format's checks."""

    def __init__(self, data: bytes, lib: Any, threads: int = 1) -> None:
        #: Threads the checksums of a request are spread over (CRC32C runs at about 10
        #: GB/s a core: one would hold a fast store's transfers back).
        self.threads = threads
        identity, self.payload_len, plen, mlen = CONFIG.unpack_from(data, HEAD.size)
        at = HEAD.size + CONFIG.size
        self.identity = identity
        prefix = data[at : at + plen].decode("ascii")
        self.mac = data[at + plen : at + plen + mlen] or None
        self.mac_len = mlen
        self.name_prefix = f"{prefix}:{identity.hex()}:"
        self.lib = lib

    def name(self, key: bytes) -> str:
        return self.name_prefix + key.hex()

    def run(
        self,
        check: bool,
        headers: list[int],
        keys: list[bytes],
        pieces: list[list[tuple[int, int]]],
        results: list[int] | None,
    ) -> list[int]:
        """ao_seal_blocks (``check`` False) or ao_check_blocks of blocks whose headers are
        at ``headers`` and payloads in ``pieces`` (addresses and lengths per block); the
        checked results, or [] after sealing."""
        n = len(keys)
        flat = [piece for block in pieces for piece in block]
        ptrs = (ctypes.c_uint64 * max(1, len(flat)))(*(p for p, _ in flat))
        lens = (ctypes.c_int64 * max(1, len(flat)))(*(ln for _, ln in flat))
        first = [0]
        for block in pieces:
            first.append(first[-1] + len(block))
        firsts = (ctypes.c_int64 * (n + 1))(*first)
        joined = b"".join(keys)
        key_at = [0]
        for key in keys[:-1]:
            key_at.append(key_at[-1] + len(key))
        ats = (ctypes.c_int64 * max(1, n))(*key_at)
        key_lens = (ctypes.c_int32 * max(1, n))(*(len(k) for k in keys))
        heads = (ctypes.c_uint64 * max(1, n))(*headers)
        args = (heads, n, ptrs, lens, firsts, joined, ats, key_lens, self.identity,
                self.payload_len, self.mac, self.mac_len)  # fmt: skip
        if not check:
            if self.lib.ao_seal_blocks(*args, self.threads) != 0:
                raise ValueError("pieces that do not make blocks")
            return []
        assert results is not None
        out = (ctypes.c_int64 * max(1, n))(*results)
        if self.lib.ao_check_blocks(*args, out, self.threads) != 0:
            raise ValueError("pieces that do not make blocks")
        return list(out[:n])


class _Master:
    """Whether the master answers, as this process last saw it.

    Mooncake's client blocks each call about 4.3 s while it reconnects to a master that
    went away, and it starts reconnecting on its own (its pings fail) whether a call came
    or not; so the master's death is watched here, off the request path: a thread holds
    a TCP connection of its own to the master, idle (it never sends), which the master's
    exit closes (a dead host: TCP keepalive, a few seconds). When it closes, or when a
    call failed with RPC_FAIL, the master is down: every request fails at once
    (RPC_FAIL, without a call), and the thread looks for it with backoff
    (``PROBE_FIRST_S`` doubling to ``PROBE_MAX_S``): a TCP connect, then, once that
    connects, an existence check through the client, which reconnects it. The first
    answer marks it up again: requests go to the store again, with no restart."""

    def __init__(self, store: Any, address: str) -> None:
        self.store = store
        host, _, port = address.rpartition(":")
        self.address = (host.strip("[]"), int(port))
        self.lock = threading.Lock()
        self.up = True
        self.closing = False
        #: Whether the probe is inside a call of the client now.
        self.calling = False
        #: Times it went down.
        self.downs = 0
        #: Wakes the thread from its select (a call failed, or closing).
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_w.setblocking(False)
        self.thread = threading.Thread(target=self._run, name="mooncake-master", daemon=True)
        self.thread.start()

    def failed(self) -> None:
        """The master is down until the probe finds it (a call failed with RPC_FAIL, or
        the watch closed)."""
        with self.lock:
            if self.up:
                self.up = False
                self.downs += 1
        self._wake()

    def close(self) -> None:
        self.closing = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending already
            self.wake_w.send(b"\0")

    def _wait(self, sockets: list[socket.socket], timeout: float | None) -> list[Any]:
        """Wait for ``sockets`` or a wake-up, at most ``timeout``; those readable."""
        ready, _, _ = select.select([self.wake_r, *sockets], [], [], timeout)
        if self.wake_r in ready:
            with contextlib.suppress(OSError):
                self.wake_r.recv(4096)
        return [s for s in ready if s is not self.wake_r]

    def _run(self) -> None:
        watch: socket.socket | None = None
        try:
            while not self.closing:
                if self.up:
                    if watch is None:
                        watch = self._connect()
                        if watch is None:
                            self.failed()
                            continue
                    if self._wait([watch], None):  # closed (or, never asked for, data)
                        watch.close()
                        watch = None
                        # Down, even if a new master listens already: the client has to
                        # reconnect, which the probe's existence check does, not a request.
                        self.failed()
                    continue
                if watch is not None:
                    watch.close()
                watch = self._find()
        except BaseException:
            traceback.print_exc()
            os._exit(EXIT_DEFECT)
        finally:
            if watch is not None:
                watch.close()

    def _find(self) -> socket.socket | None:
        """Down: look for the master with backoff until it answers (then it is up: the
        watch connection, returned) or this process closes (None)."""
        wait = PROBE_FIRST_S
        while True:
            self._wait([], wait)
            if self.closing:
                return None
            watch = self._connect()
            if watch is not None:
                if self._answers():
                    with self.lock:
                        self.up = True
                    return watch
                watch.close()
            wait = min(2 * wait, PROBE_MAX_S)

    def _connect(self) -> socket.socket | None:
        """A connection to the master, with keepalive probes every second after a
        second of silence (a host that died closes nothing); None if refused."""
        try:
            sock = socket.create_connection(self.address, PROBE_CONNECT_S)
        except OSError:
            return None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        return sock

    def _answers(self) -> bool:
        """Whether the client answers an existence check (it reconnects for it)."""
        self.calling = True
        try:
            return int(self.store.batch_is_exist([PROBE_NAME])[0]) != RPC_FAIL
        finally:
            self.calling = False


class _Remover:
    """Damaged objects to remove, on a thread of their own: a get that found one took a
    lease, under which its removal fails (-706) until the master's lease TTL passes. At
    most ``MAX_DOOMED`` wait (more are dropped, counted in ``dropped``); each is tried
    at once, then every ``REMOVE_EVERY_S`` whatever the traffic, for ``REMOVE_FOR_S``;
    none while the master is down (deferred: never a call that blocks for seconds)."""

    def __init__(self, store: Any, master: _Master) -> None:
        self.store = store
        self.master = master
        self.cond = threading.Condition()
        self.doomed: dict[str, float] = {}  # name: when to give up
        #: When closing: the last moment to try (None: not closing).
        self.finish_by: float | None = None
        self.calling = False
        self.removed = 0
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="mooncake-remove", daemon=True)
        self.thread.start()

    def add(self, names: list[str]) -> None:
        give_up = time.monotonic() + REMOVE_FOR_S
        with self.cond:
            for name in names:
                if name in self.doomed or len(self.doomed) < MAX_DOOMED:
                    self.doomed[name] = give_up
                    continue
                if not self.dropped:
                    print(f"mooncake helper: over {MAX_DOOMED} damaged objects to remove: "
                          "dropping the others (left in the store)", file=sys.stderr)  # fmt: skip
                self.dropped += 1
            self.cond.notify_all()

    def finish(self, within_s: float) -> None:
        """Stop, giving the objects left ``within_s`` more (none while the master is
        down); waits for the thread no longer than that."""
        with self.cond:
            self.finish_by = time.monotonic() + within_s
            self.cond.notify_all()
        self.thread.join(within_s + 0.1)

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.doomed and self.finish_by is None:
                        self.cond.wait()
                if self.finish_by is not None and (
                    not self.doomed or time.monotonic() >= self.finish_by
                ):
                    return
                self._remove_due()
                with self.cond:
                    if self.doomed:
                        self.cond.wait(REMOVE_EVERY_S)
        except BaseException:
            traceback.print_exc()
            os._exit(EXIT_DEFECT)

    def _remove_due(self) -> None:
        with self.cond:
            due = list(self.doomed.items())
        for name, give_up in due:
            finish_by = self.finish_by
            if not self.master.up or (finish_by is not None and time.monotonic() >= finish_by):
                return  # deferred while down; the engine is closing
            with self.cond:
                self.calling = True
            try:
                code = int(self.store.remove(name))
            finally:
                with self.cond:
                    self.calling = False
            if code == RPC_FAIL:
                self.master.failed()
                return
            with self.cond:
                if code != -706 or time.monotonic() > give_up:  # removed, gone, given up
                    self.doomed.pop(name, None)
                    self.removed += code == 0


#: A request the workers run: (job id, op, item count, the message).
Request = tuple[int, int, int, bytes]


class _Requests:
    """Requests waiting for a worker: reads (gets, existence checks) ahead of writes
    (puts, removals), so a read never waits behind queued write-through; and writes still
    go: once ``READS_PER_WRITE`` reads were taken while a write waited, the write is
    next. With more than one worker, writes run on all but one at a time: a read that
    comes finds a worker free, or one running a read."""

    def __init__(self, workers: int) -> None:
        self.cond = threading.Condition()
        self.reads: collections.deque[Request] = collections.deque()
        self.writes: collections.deque[Request] = collections.deque()
        self.max_writing = max(1, workers - 1)
        self.writing = 0
        #: Reads taken since a write last went, while writes waited.
        self.passed = 0
        self.stops = 0

    def put(self, item: Request) -> None:
        with self.cond:
            (self.reads if item[1] in (OP_GET, OP_EXISTS) else self.writes).append(item)
            self.cond.notify()

    def stop(self, workers: int) -> None:
        """Each of ``workers`` ends once nothing is left that it may take."""
        with self.cond:
            self.stops += workers
            self.cond.notify_all()

    def get(self) -> tuple[Request, bool] | None:
        """The next request and whether it is a write (then call :meth:`done` after it);
        None: stop."""
        with self.cond:
            while True:
                write_ok = bool(self.writes) and self.writing < self.max_writing
                if self.reads and not (write_ok and self.passed >= READS_PER_WRITE):
                    if self.writes:
                        self.passed += 1
                    return self.reads.popleft(), False
                if write_ok:
                    self.passed = 0
                    self.writing += 1
                    return self.writes.popleft(), True
                if self.stops and not self.reads:  # writes left: others run (it is at cap)
                    self.stops -= 1
                    return None
                self.cond.wait()

    def done(self) -> None:
        """A write ended."""
        with self.cond:
            self.writing -= 1
            self.cond.notify_all()


class Helper:
    """One client, its regions and its header buffers; :meth:`serve` reads requests and
    ``workers`` threads run them, reads first (:class:`_Requests`), each with a header
    buffer of its own (their store calls and checksums release the GIL, so one request's
    checksums overlap another's transfer). Replies may come in another order than the
    requests. While the master is down (:class:`_Master`) requests fail at once; damaged
    objects are removed on a thread of their own (:class:`_Remover`)."""

    def __init__(
        self,
        store: Any,
        sock: socket.socket,
        lib: Any,
        master: str,
        threads: int = 1,
        workers: int = 1,
    ) -> None:
        self.store = store
        self.threads = threads
        self.workers = max(1, workers)
        self.master = _Master(store, master)
        self.remover = _Remover(store, self.master)
        self.sock = sock
        self.lib = lib
        self.regions: list[tuple[mmap.mmap, int, int]] = []  # (map, address, size)
        self.blocks: _Blocks | None = None
        self.wake_fd = -1
        #: Sends and the wake-up fd (swapped by OP_WAKE) are shared by the threads.
        self.send_lock = threading.Lock()
        self.queue = _Requests(self.workers)
        self.headers = mmap.mmap(-1, self.workers * MAX_ITEMS * HEADER)
        self.headers_at = ctypes.addressof(ctypes.c_char.from_buffer(self.headers))

    def register(self) -> int:
        return int(self.store.register_buffer(self.headers_at, len(self.headers)))

    def reply(self, job: int, results: list[int]) -> None:
        end = time.perf_counter_ns()
        message = REPLY.pack(job, len(results), end) + struct.pack(f"<{len(results)}q", *results)
        with self.send_lock:
            self.sock.send(message)
            if self.wake_fd >= 0:
                os.write(self.wake_fd, (1).to_bytes(8, sys.byteorder))

    def work(self, index: int) -> None:
        """A worker: runs requests from the queue with header buffer ``index``, until
        told to stop. A defect ends the process (the engine fails what was pending), never
        one thread alone (its requests would never be answered)."""
        scratch = self.headers_at + index * MAX_ITEMS * HEADER
        try:
            while (taken := self.queue.get()) is not None:
                (job, op, n, data), write = taken
                try:
                    results = self.request(data, op, n, scratch)
                finally:
                    if write:
                        self.queue.done()
                with contextlib.suppress(OSError):  # the engine went away: nobody to answer
                    self.reply(job, results)
        except BaseException:
            traceback.print_exc()
            os._exit(EXIT_DEFECT)

    def serve(self) -> None:
        workers = [
            threading.Thread(target=self.work, args=(k,), name=f"mooncake-{k}", daemon=True)
            for k in range(self.workers)
        ]
        for worker in workers:
            worker.start()
        try:
            self._read()
        finally:
            self.queue.stop(len(workers))
            for worker in workers:
                worker.join()
            # Closing: the damaged objects still held by a lease get a last chance (none
            # while the master is down).
            self.remover.finish(REMOVE_AT_EXIT_S if self.master.up else 0.0)
            self.master.close()

    def quiet(self) -> bool:
        """Whether the client may be closed now: the master is up and no thread of ours
        is inside one of its calls (one may be, blocked for seconds, where it is down)."""
        return self.master.up and not self.master.calling and not self.remover.calling

    def _read(self) -> None:
        while True:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 64)
            if not data:
                return
            job, op, n = HEAD.unpack_from(data)
            if op == OP_WAKE:
                with self.send_lock:
                    if self.wake_fd >= 0:
                        os.close(self.wake_fd)
                    self.wake_fd = fds[0] if fds else -1
                for fd in fds[1:]:
                    os.close(fd)
                continue
            if op == OP_MAP:  # here, in order: later requests may use the regions
                self.reply(job, self.map(data, n, fds))
                continue
            for fd in fds:  # none is expected
                os.close(fd)
            if op == OP_SETUP:  # only before the client was set up (see main)
                continue
            if op == OP_CONFIG:
                self.blocks = _Blocks(data, self.lib, self.threads)
                self.reply(job, [0])
                continue
            self.queue.put((job, op, n, data))

    def map(self, data: bytes, n: int, fds: list[int]) -> list[int]:
        sizes = struct.unpack_from(f"<{n}Q", data, HEAD.size)
        results = []
        for i in range(n):
            if i >= len(fds):
                results.append(-errno.EBADF)
                continue
            try:
                region = mmap.mmap(fds[i], sizes[i])
            except (OSError, ValueError) as exc:
                results.append(-(getattr(exc, "errno", None) or errno.EINVAL))
                continue
            finally:
                os.close(fds[i])
            address = ctypes.addressof(ctypes.c_char.from_buffer(region))
            code = int(self.store.register_buffer(address, sizes[i]))
            results.append(code)
            if code == 0:
                self.regions.append((region, address, sizes[i]))
        for fd in fds[n:]:
            os.close(fd)
        return results

    def request(self, data: bytes, op: int, n: int, scratch: int) -> list[int]:
        """Runs a get, put, existence check or removal; ``scratch``: this worker's header
        buffer."""
        blocks = self.blocks
        if blocks is None or n > MAX_ITEMS:
            return [-errno.EINVAL] * n
        at = HEAD.size
        lengths = []
        pieces: list[list[tuple[int, int]]] = []
        inline: list[bool] = []
        ok = []
        for _ in range(n):
            key_len, count = ITEM.unpack_from(data, at)
            at += ITEM.size
            lengths.append(key_len)
            inline.append(bool(count & INLINE))
            count &= ~INLINE
            block = []
            good = True
            for _ in range(count):
                region, offset, length = PIECE.unpack_from(data, at)
                at += PIECE.size
                if region >= len(self.regions) or offset + length > self.regions[region][2]:
                    good = False
                else:
                    block.append((self.regions[region][1] + offset, length))
            pieces.append(block)
            ok.append(good)
        keys = []
        for key_len in lengths:
            keys.append(data[at : at + key_len])
            at += key_len
        names = [blocks.name(key) for key in keys]
        if not self.master.up:  # at once: a call would block while the client reconnects
            return [RPC_FAIL] * n
        results = self.call(op, n, names, keys, pieces, inline, ok, scratch)
        if RPC_FAIL in results:
            self.master.failed()
        return results

    def call(
        self,
        op: int,
        n: int,
        names: list[str],
        keys: list[bytes],
        pieces: list[list[tuple[int, int]]],
        inline: list[bool],
        ok: list[bool],
        scratch: int,
    ) -> list[int]:
        """Runs a request on the store: its results."""
        blocks = self.blocks
        assert blocks is not None
        if op == OP_EXISTS:
            return [int(r) for r in self.store.batch_is_exist(names)] if names else []
        if op == OP_REMOVE:
            return [int(self.store.remove(name)) for name in names]
        if op not in (OP_GET, OP_PUT):
            return [-errno.EINVAL] * n
        size = blocks.payload_len
        # A block's object: its header, then its payload's pieces. With ``inline``, the
        # first piece starts with the header (room the engine keeps before its slot):
        # one span, which Mooncake moves faster than two (benchmarks/mooncake.py).
        heads: list[int] = []
        payloads: list[list[tuple[int, int]]] = []
        for i, block in enumerate(pieces):
            if inline[i] and block and block[0][1] >= HEADER:
                first, length = block[0]
                heads.append(first)
                payloads.append([(first + HEADER, length - HEADER), *block[1:]])
            else:
                ok[i] = ok[i] and not inline[i]
                heads.append(0)
                payloads.append(block)
        ok = [good and sum(ln for _, ln in p) == size for good, p in zip(ok, payloads)]
        results = [0 if good else -errno.EINVAL for good in ok]  # never sent
        todo = [i for i in range(n) if ok[i]]
        if not todo:
            return results
        spare = iter(range(len(todo)))
        for i in todo:
            if not inline[i]:
                heads[i] = scratch + next(spare) * HEADER
        ptrs = [
            [p for p, _ in pieces[i]] if inline[i] else [heads[i], *(p for p, _ in pieces[i])]
            for i in todo
        ]
        lens = [
            [ln for _, ln in pieces[i]] if inline[i] else [HEADER, *(ln for _, ln in pieces[i])]
            for i in todo
        ]
        names_todo = [names[i] for i in todo]
        keys_todo = [keys[i] for i in todo]
        heads_todo = [heads[i] for i in todo]
        pieces_todo = [payloads[i] for i in todo]
        store = self.store
        if op == OP_PUT:
            return self.put(
                todo, names_todo, heads_todo, keys_todo, pieces_todo, ptrs, lens, results
            )
        got = [int(r) for r in store.batch_get_into_multi_buffers(names_todo, ptrs, lens)]
        whole = HEADER + size
        for k, r in enumerate(got):
            # An object of another size than a block: shorter, it fails as TRANSFER_FAIL
            # (Mooncake 0.3.13 logs that the transfer was not submitted), longer, as
            # INVALID_PARAMS (the buffer is too short); measured in
            # tests/test_mooncake_store.py. A damaged block, not a transfer that may
            # still run: removed like one.
            if r in (TRANSFER_FAIL, INVALID_PARAMS):
                found = int(store.get_size(names_todo[k]))
                if found > whole:
                    got[k] = -errno.EMSGSIZE
                elif 0 <= found < whole:
                    got[k] = found  # checked as short below
        if any(r < 0 and r not in SETTLED and r != -errno.EMSGSIZE for r in got):
            # A transfer may still write these slots: only this process's exit stops it.
            # (A put only reads its slots, and a failed put is revoked, never committed:
            # it fails its blocks and the helper goes on.)
            os._exit(EXIT_UNSETTLED)
        got = blocks.run(True, heads_todo, keys_todo, pieces_todo, got)
        damaged = [name for name, r in zip(names_todo, got) if r in DAMAGED]
        if damaged:
            self.remover.add(damaged)
        for i, r in zip(todo, got):
            results[i] = r
        return results

    def put(
        self,
        todo: list[int],
        names: list[str],
        heads: list[int],
        keys: list[bytes],
        pieces: list[list[tuple[int, int]]],
        ptrs: list[list[int]],
        lens: list[list[int]],
        results: list[int],
    ) -> list[int]:
        """Puts the blocks the store does not hold yet; those it holds are ``PRESENT``
        (Mooncake's put answers 0 for them, as if it had written them). Where the check
        itself failed (the master down), so does the block, without a put that would
        wait for the master again."""
        store = self.store
        held = [int(r) for r in store.batch_is_exist(names)]
        put = [k for k, r in enumerate(held) if r == 0]
        for k, r in enumerate(held):
            if r != 0:
                results[todo[k]] = PRESENT if r == 1 else r
        if not put:
            return results
        blocks = self.blocks
        assert blocks is not None
        blocks.run(
            False, [heads[k] for k in put], [keys[k] for k in put], [pieces[k] for k in put], None
        )
        got = store.batch_put_from_multi_buffers(
            [names[k] for k in put], [ptrs[k] for k in put], [lens[k] for k in put]
        )
        for k, r in zip(put, got):
            results[todo[k]] = int(r)
        return results


def _library(path: str) -> Any:
    """The native library's block checks (asyncoffload._native's disk_io, at ``path``)."""
    lib = ctypes.CDLL(path)
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    blocks: list[Any] = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i32]
    lib.ao_seal_blocks.argtypes = [*blocks, i32]
    lib.ao_seal_blocks.restype = i64
    lib.ao_check_blocks.argtypes = [*blocks, ptr, i32]
    lib.ao_check_blocks.restype = i64
    return lib


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Run as a script (not importing asyncoffload, whose torch takes seconds to import):
    # this file's folder must not shadow the packages it imports (tiers/mooncake.py).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sock = socket.socket(fileno=int(argv[0]))
    # The settings come first on the socket (never in the arguments or environment, which
    # other users may read in /proc).
    first = sock.recv(1 << 20)
    if not first:
        return 0
    _, op, _ = HEAD.unpack_from(first)
    if op != OP_SETUP:
        return EXIT_DEFECT
    settings = json.loads(first[HEAD.size :])
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
    lib = _library(settings["library"])
    threads = int(settings.get("check_threads", 1))
    workers = int(settings.get("in_flight", 1))
    helper = Helper(store, sock, lib, settings["master"], threads, workers)
    if code == 0:
        code = helper.register()
    try:
        sock.send(REPLY.pack(0, 1, time.perf_counter_ns()) + struct.pack("<q", int(code)))
        if code != 0:
            return 1
        helper.serve()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the engine went away: nothing to answer
    finally:
        if not helper.quiet():
            # The master is down, or a thread is in a call: closing the client would
            # wait for it (seconds), and the engine waits for this exit.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
