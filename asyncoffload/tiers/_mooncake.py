"""A lane to a Mooncake Store: its client's calls run in a helper process
(:mod:`asyncoffload.tiers._mooncake_helper`), on host memory both processes map.

Why a process: Mooncake's Python client is synchronous, and it needs the GIL to start
and to return from every call. A worker thread of the engine's process (Mooncake's own
asyncio wrapper uses ``run_in_executor``) waits for a busy event loop's GIL twice per
call, and the engine keeps Python threads off its completion paths
(``benchmarks/mooncake_busy.py`` measures both). The helper has its own interpreter and
GIL; the engine's loop only sends a message per batch and reads the helper's replies when
the completion bridge's eventfd (:meth:`MooncakeLane.bind`), which the helper writes after
each reply, wakes it.

The bytes never pass through the socket: the engine's host memory (file descriptors of
shared memory: a ``memfd``, a shared-memory file) is mapped by the helper and registered
with the store once (:meth:`MooncakeLane.map`), and a request names offsets in it. Each
block goes out, and comes back, as one object of several spans
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``): the block format's
header, in the helper's own buffer, then the payload's pieces where they are. The helper
writes and checks the headers (see its docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncoffload._children import child_env
from asyncoffload.tiers._mooncake_helper import (
    CONFIG,
    EXIT_UNSETTLED,
    HEAD,
    INLINE,
    ITEM,
    MAX_ITEMS,
    OP_CONFIG,
    OP_EXISTS,
    OP_GET,
    OP_MAP,
    OP_PUT,
    OP_REMOVE,
    OP_SETUP,
    OP_WAKE,
    PIECE,
    PRESENT,
    REPLY,
    SETTLED,
)
from asyncoffload.transfer.base import CopyJob

__all__ = [
    "MAX_ITEMS",
    "MOONCAKE_ERRNO",
    "OP_EXISTS",
    "OP_GET",
    "OP_PUT",
    "OP_REMOVE",
    "PRESENT",
    "SETTLED_CODES",
    "Block",
    "MooncakeJob",
    "MooncakeLane",
]

#: The helper, run as a script.
HELPER = str(Path(__file__).with_name("_mooncake_helper.py"))
#: What a Mooncake code (``ErrorCode`` of mooncake-store's types.h) means for a block, as
#: ``-errno`` (the tiers' failure causes); other codes stay Mooncake's own.
MOONCAKE_ERRNO = {
    -200: errno.ENOSPC,  # NO_AVAILABLE_HANDLE: no space (or the segment is not mounted yet)
    -600: errno.ENODATA,  # INVALID_PARAMS: here, a buffer shorter than the object
    -703: errno.EAGAIN,  # REPLICA_IS_NOT_READY: still being written
    -704: errno.ENOENT,  # OBJECT_NOT_FOUND: a miss
    -705: errno.EEXIST,  # OBJECT_ALREADY_EXISTS
    -706: errno.EBUSY,  # OBJECT_HAS_LEASE (remove)
    -707: errno.EBUSY,  # LEASE_EXPIRED
    -800: errno.EIO,  # TRANSFER_FAIL
    -900: errno.EHOSTDOWN,  # RPC_FAIL: the master is unreachable (fails at once)
    -901: errno.ETIMEDOUT,  # RPC_TIMEOUT
}
#: Codes after which the call's transfer has ended (see the helper's ``SETTLED``): after
#: any other, the helper exits before it answers.
SETTLED_CODES = SETTLED


@dataclass(frozen=True)
class Block:
    """One block of a get or a put: its key (an ``OffloadKey``'s bytes) and its payload's
    pieces, ``(region, offset, length)`` in the regions mapped with
    :meth:`MooncakeLane.map`, in order. ``inline``: the first piece starts with the
    block's 4096-byte header (room kept before the slot), so header and payload go as one
    span; otherwise the helper keeps the header in a buffer of its own."""

    key: bytes
    pieces: tuple[tuple[int, int, int], ...]
    inline: bool = False


class MooncakeJob(CopyJob):
    """A request the helper runs; ``results`` per block: payload bytes (a get), 0 (a
    put), :data:`PRESENT` (a put of a block the store held), 1 / 0 (exists), or a
    negative code (``-errno`` where :data:`MOONCAKE_ERRNO` knows it, else Mooncake's
    own). ``on_end``: called once it ended, on the loop. ``deadline``: the monotonic
    time by which it must be answered (None: no limit)."""

    __slots__ = ("_lane", "deadline", "on_end", "results")

    def __init__(
        self, lane: MooncakeLane, n: int, nbytes: int, deadline: float | None = None
    ) -> None:
        super().__init__(n, nbytes)
        self._lane = lane
        self.deadline = deadline
        self.results: list[int] = []
        self.on_end: Callable[[MooncakeJob], None] | None = None

    def query(self) -> bool:
        if not self._done:
            self._lane.poll()
        return self._done

    def check_failed(self) -> bool:
        if not self._done:
            self._lane.poll(check_alive=True)
        return self._done

    def end(self, results: list[int]) -> None:
        self.results = results
        self.finish()
        callback, self.on_end = self.on_end, None
        if callback is not None:
            callback(self)


class MooncakeLane:
    """A helper process with one Mooncake client.

    ``settings`` are ``MooncakeDistributedStore.setup``'s: ``local_hostname``,
    ``metadata_server``, ``global_segment_bytes``, ``local_buffer_bytes``, ``protocol``,
    ``device_name``, ``master`` (while it is down, the helper answers every request at
    once, and looks for it off the request path). ``library``, the native library's
    path, is added here. Blocks are named ``<prefix>:<identity hex>:<key hex>``
    and hold the block format for ``identity`` and ``payload_len`` (authenticated with
    ``mac_key``, if given). The helper starts in the background: requests queue behind its
    setup, and fail (``EHOSTDOWN``) if it fails; :meth:`wait_started` waits for it. Loop
    thread only.

    The settings and the MAC key go to the helper over its socket; it inherits neither
    this package's ``ASYNCOFFLOAD_*`` variables (they may hold secrets) nor any
    argument but the socket's fd. A request not answered by its deadline
    (``timeout_s`` of :meth:`submit`) kills the helper: only its exit ends a transfer
    that may still write the slots, and a helper stuck in a Mooncake call (or stopped)
    would hold every later request.
    """

    def __init__(
        self,
        settings: dict[str, object],
        *,
        identity: bytes,
        payload_len: int,
        prefix: str = "ao",
        mac_key: bytes | None = None,
    ) -> None:
        if len(identity) != 16:
            raise ValueError(f"identity must be 16 bytes, got {len(identity)}")
        from asyncoffload.tiers._io import _library

        settings = dict(settings, library=_library()._name)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        try:
            self._proc = subprocess.Popen(
                [sys.executable, HELPER, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=child_env(),
            )
        except BaseException:
            ours.close()  # no helper: nothing else holds the socket
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._jobs: dict[int, MooncakeJob] = {}
        self._ids = itertools.count(1)
        self._dead: str | None = None
        self.closed = False
        #: The helper's setup code once it answered (0: running), else None.
        self.setup_code: int | None = None
        #: Region sizes mapped so far, in order.
        self.region_sizes: list[int] = []
        mac = mac_key or b""
        prefix_bytes = prefix.encode("ascii")
        config = CONFIG.pack(identity, payload_len, len(prefix_bytes), len(mac))
        self._send(OP_SETUP, 0, json.dumps(settings).encode())
        self._send(OP_CONFIG, 0, config + prefix_bytes + mac)

    @property
    def dead(self) -> str | None:
        """Why the helper is gone (its requests fail), or None."""
        return self._dead

    def wait_started(self, timeout_s: float = 30.0) -> None:
        """Block until the helper's client is set up; ``OSError`` naming what failed."""
        deadline = time.monotonic() + timeout_s
        while self.setup_code is None and self._dead is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OSError(errno.ETIMEDOUT, f"Mooncake Store: no client after {timeout_s:g} s")
            select.select([self._sock], [], [], min(left, 0.1))
            self.poll(check_alive=True)
        if self._dead is not None:
            raise OSError(errno.EHOSTDOWN, f"Mooncake Store: {self._dead}")

    def bind(self, wake_fd: int | None) -> None:
        """Have the helper write ``wake_fd`` (the completion bridge's eventfd) after each
        reply from now on; ``None``: no wake-up (the bridge polls)."""
        if self.closed or self._dead is not None:
            return
        self._sock.setblocking(True)
        try:
            fds = [] if wake_fd is None else [wake_fd]
            socket.send_fds(self._sock, [HEAD.pack(0, OP_WAKE, 0)], fds)
        except OSError as exc:
            self._fail_all(f"the helper's socket failed: {exc}")
        finally:
            self._sock.setblocking(False)

    def map(self, regions: Sequence[tuple[int, int]]) -> MooncakeJob:
        """Map ``regions`` (``(fd, size)``: memory both processes share) in the helper
        and register them with the store; they become regions ``len(region_sizes)`` on.
        The job's results: a code per region (0: usable)."""
        job = MooncakeJob(self, len(regions), 0)
        payload = HEAD.pack(0, OP_MAP, len(regions)) + b"".join(
            struct.pack("<Q", size) for _, size in regions
        )
        self.region_sizes.extend(size for _, size in regions)
        return self._submit(job, OP_MAP, payload[HEAD.size :], [fd for fd, _ in regions])

    def submit(
        self,
        op: int,
        blocks: Sequence[Block] | Sequence[bytes],
        timeout_s: float | None = None,
    ) -> MooncakeJob:
        """Queue a request: :data:`OP_GET`, :data:`OP_PUT` of blocks; :data:`OP_EXISTS`,
        :data:`OP_REMOVE` of keys. ``timeout_s``: not answered this long after now, it
        fails (``ETIMEDOUT``), and so does everything else pending, for the helper is
        killed (see the class docstring); found by :meth:`poll` with ``check_alive``
        (the completion bridge's watchdog calls it) or :meth:`expire`. ``ValueError``
        (nothing sent) for a piece outside the regions mapped, or more than
        :data:`MAX_ITEMS` blocks."""
        if self.closed:
            raise RuntimeError("the Mooncake lane is closed")
        n = len(blocks)
        if n > MAX_ITEMS:
            raise ValueError(f"a request holds at most {MAX_ITEMS} blocks, got {n}")
        items = []
        keys = []
        nbytes = 0
        sizes = self.region_sizes
        for block in blocks:
            if isinstance(block, (bytes, bytearray)):
                key = bytes(block)
                items.append(ITEM.pack(len(key), 0))
            else:
                key = block.key
                count = len(block.pieces) | (INLINE if block.inline else 0)
                items.append(ITEM.pack(len(key), count))
                for region, offset, length in block.pieces:
                    if (
                        not 0 <= region < len(sizes)
                        or offset < 0
                        or length < 0
                        or (offset + length > sizes[region])
                    ):
                        raise ValueError(
                            f"piece {(region, offset, length)} of block {key.hex()} is "
                            f"outside the regions mapped ({sizes})"
                        )
                    items.append(PIECE.pack(region, offset, length))
                    nbytes += length
            if not 0 < len(key) <= 256:
                raise ValueError(f"a key is 1 to 256 bytes, got {len(key)}")
            keys.append(key)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        job = MooncakeJob(self, n, nbytes, deadline)
        return self._submit(job, op, b"".join(items) + b"".join(keys))

    def _submit(
        self, job: MooncakeJob, op: int, body: bytes, fds: Sequence[int] = ()
    ) -> MooncakeJob:
        if self._dead is not None:
            job.end([-errno.EHOSTDOWN] * job.num_blocks)
            return job
        job_id = next(self._ids)
        if not self._send(op, job_id, body, fds, job):
            return job
        self._jobs[job_id] = job
        return job

    def _send(
        self,
        op: int,
        job_id: int,
        body: bytes,
        fds: Sequence[int] = (),
        job: MooncakeJob | None = None,
    ) -> bool:
        message = HEAD.pack(job_id, op, job.num_blocks if job is not None else 0) + body
        try:
            if fds:
                socket.send_fds(self._sock, [message], list(fds))
            else:
                self._sock.send(message)
        except BlockingIOError:
            if job is not None:  # the helper is that far behind: refuse
                job.end([-errno.EAGAIN] * job.num_blocks)
            return False
        except OSError as exc:
            self._fail_all(f"the helper's socket failed: {exc}")
            if job is not None:
                job.end([-errno.EHOSTDOWN] * job.num_blocks)
            return False
        return True

    def poll(self, check_alive: bool = False) -> None:
        """Read the helper's replies and end their jobs; with ``check_alive``, fail every
        job if the helper has exited."""
        while not self.closed:
            try:
                data = self._sock.recv(REPLY.size + 8 * MAX_ITEMS)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._fail_all(f"the helper's socket failed: {exc}")
                return
            if not data:
                self._fail_all(self._exit_reason())
                return
            job_id, n, end_ns = REPLY.unpack_from(data)
            raw = struct.unpack_from(f"<{n}q", data, REPLY.size)
            if job_id == 0:
                self.setup_code = int(raw[0]) if raw else -1
                if self.setup_code != 0:
                    self._fail_all(f"the client's setup failed with code {self.setup_code}")
                    return
                continue
            job = self._jobs.pop(job_id, None)
            if job is not None:
                job.finished_ns = end_ns  # the helper's stamp: when the request ended
                job.end([-MOONCAKE_ERRNO[r] if r in MOONCAKE_ERRNO else r for r in raw])
        if check_alive and self._dead is None:
            if self._proc.poll() is not None:
                self._fail_all(self._exit_reason())
            else:
                self.expire()

    def expire(self) -> bool:
        """If a pending request is past its deadline: kill the helper and fail every
        pending request (those past it ``ETIMEDOUT``, the others ``EHOSTDOWN``); True
        if it did."""
        if self.closed or self._dead is not None:
            return False
        now = time.monotonic()
        late = [
            job_id
            for job_id, job in self._jobs.items()
            if job.deadline is not None and job.deadline < now
        ]
        if not late:
            return False
        self._proc.kill()  # SIGKILL: a stopped helper goes too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(1.0)
        for job_id in late:
            job = self._jobs.pop(job_id)
            job.stamped = False  # noticed now, not when anything ended
            job.end([-errno.ETIMEDOUT] * job.num_blocks)
        self._fail_all(f"the helper did not answer {len(late)} requests by their deadline: killed")
        return True

    def _exit_reason(self) -> str:
        try:
            code = self._proc.wait(5.0)  # the socket closed: it is exiting
        except subprocess.TimeoutExpired:
            return "the helper process closed its socket"
        if code == EXIT_UNSETTLED:
            return "the helper exited after a transfer that may not have ended"
        return f"the helper process exited with {code}"

    def _fail_all(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            job.stamped = False  # noticed now, not when anything ended
            job.end([-errno.EHOSTDOWN] * job.num_blocks)

    @property
    def pending(self) -> int:
        return len(self._jobs)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def fileno(self) -> int:
        """The socket the helper answers on (readable when a reply is there)."""
        return self._sock.fileno()

    def _begin_close(self) -> bool:
        """Fail what the helper had not answered and close the socket (the helper exits
        when it sees that); False if closed already. A helper still in its client's setup
        (a master that does not answer: it retries for long) is killed at once: it has
        nothing to finish."""
        if self.closed:
            return False
        with contextlib.suppress(OSError):
            self.poll()
        self._fail_all("the lane was closed")
        self.closed = True
        self._sock.close()
        if self.setup_code is None:
            self._proc.kill()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """End the helper (it exits when its socket closes; killed after ``timeout_s``)
        and fail what it had not answered. Idempotent."""
        if not self._begin_close():
            return
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """:meth:`close` without blocking the event loop while the helper exits (it
        closes its client, and removes the damaged objects still leased, first)."""
        if not self._begin_close():
            return
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        try:
            pidfd = os.pidfd_open(self._proc.pid)  # readable once the process exits
        except (AttributeError, OSError):  # no pidfd (old kernel): wait off the loop
            pidfd = -1
        try:
            if pidfd >= 0:
                loop.add_reader(pidfd, readable)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(exited, timeout_s)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(self._proc.wait, timeout_s)
        finally:
            if pidfd >= 0:
                loop.remove_reader(pidfd)
                os.close(pidfd)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
