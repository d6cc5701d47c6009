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
unchanged. A damaged object is removed (when its lease allows), so a later put replaces it.

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

import contextlib
import ctypes
import errno
import json
import mmap
import os
import queue
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
#: Damaged objects waiting for their lease to end before removal: at most this many,
#: tried this often, for this long.
MAX_DOOMED = 4096
REMOVE_EVERY_S = 0.5
REMOVE_FOR_S = 120.0
#: ... and when the engine closes, for at most this long (it waits 5 s for the exit).
REMOVE_AT_EXIT_S = 2.0
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


class Helper:
    """One client, its regions and its header buffers; :meth:`serve` reads requests and
    ``workers`` threads run them, each with a header buffer of its own (their store calls
    and checksums release the GIL, so one request's checksums overlap another's
    transfer). Replies may come in another order than the requests."""

    def __init__(
        self,
        store: Any,
        sock: socket.socket,
        lib: Any,
        retry_s: float = 1.0,
        threads: int = 1,
        workers: int = 1,
    ) -> None:
        self.store = store
        self.threads = threads
        self.workers = max(1, workers)
        #: After the master failed to answer (RPC_FAIL), requests fail at once until then:
        #: those queued behind it would each wait for the master again.
        self.down_until = 0.0
        self.retry_s = retry_s
        self.sock = sock
        self.lib = lib
        self.regions: list[tuple[mmap.mmap, int, int]] = []  # (map, address, size)
        self.blocks: _Blocks | None = None
        self.wake_fd = -1
        #: Sends and the wake-up fd (swapped by OP_WAKE) are shared by the threads.
        self.send_lock = threading.Lock()
        #: Damaged objects to remove, with when to give up: the get that found them took
        #: a lease, under which remove fails (-706) until the master's lease TTL passes.
        self.doomed: dict[str, float] = {}
        self.doomed_lock = threading.Lock()
        self.queue: queue.SimpleQueue[tuple[int, int, int, bytes] | None] = queue.SimpleQueue()
        self.headers = mmap.mmap(-1, self.workers * MAX_ITEMS * HEADER)
        self.headers_at = ctypes.addressof(ctypes.c_char.from_buffer(self.headers))

    def register(self) -> int:
        return int(self.store.register_buffer(self.headers_at, len(self.headers)))

    def remove_later(self, names: list[str]) -> None:
        """Remove ``names`` once their leases let go (tried now, then every
        ``REMOVE_EVERY_S`` between requests, for at most ``REMOVE_FOR_S``)."""
        give_up = time.monotonic() + REMOVE_FOR_S
        with self.doomed_lock:
            for name in names:
                if len(self.doomed) < MAX_DOOMED:
                    self.doomed[name] = give_up
        self.remove_due()

    def remove_due(self) -> None:
        now = time.monotonic()
        with self.doomed_lock:
            for name, give_up in list(self.doomed.items()):
                code = int(self.store.remove(name))
                if code != -706 or now > give_up:  # removed, gone, or given up on
                    del self.doomed[name]

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
            while (item := self.queue.get()) is not None:
                job, op, n, data = item
                results = self.request(data, op, n, scratch)
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
            for _ in workers:
                self.queue.put(None)
            for worker in workers:
                worker.join()
            # Closing: the damaged objects still held by a lease get a last chance.
            deadline = time.monotonic() + REMOVE_AT_EXIT_S
            while self.doomed and time.monotonic() < deadline:
                time.sleep(0.05)
                self.remove_due()

    def _read(self) -> None:
        while True:
            self.sock.settimeout(REMOVE_EVERY_S if self.doomed else None)
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 64)
            except TimeoutError:
                self.remove_due()
                continue
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
        if time.monotonic() < self.down_until:
            return [RPC_FAIL] * n
        results = self.call(op, n, names, keys, pieces, inline, ok, scratch)
        if RPC_FAIL in results:
            self.down_until = time.monotonic() + self.retry_s
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
            self.remove_later(damaged)
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
    helper = Helper(store, sock, lib, float(settings.get("retry_s", 1.0)), threads, workers)
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
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
