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

The bytes never pass through the socket: the region (a ``memfd``) is registered with the
store by the helper, and a batch names offsets in it. Each block goes out, and comes back,
as two spans of one object (``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers``): a header and a payload, from and into wherever the
caller keeps them.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from asyncoffload.tiers._mooncake_helper import (
    HEAD,
    ITEM,
    OP_EXISTS,
    OP_GET,
    OP_PUT,
    OP_REMOVE,
    OP_WAKE,
    REPLY,
)
from asyncoffload.transfer.base import CopyJob

__all__ = [
    "MOONCAKE_ERRNO",
    "OP_EXISTS",
    "OP_GET",
    "OP_PUT",
    "OP_REMOVE",
    "SETTLED_CODES",
    "MooncakeJob",
    "MooncakeLane",
    "Span",
]

#: Items in one batch (one message of at most about 150 KB, under the socket's buffer).
MAX_ITEMS = 1024
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
#: Codes after which the call's transfer may have ended (vLLM's Mooncake connector, after
#: Mooncake 0.3.12: other failures, TRANSFER_FAIL and RPC_TIMEOUT among them, can leave
#: I/O in flight into registered memory after the call returned). The tier must not hand
#: a slot on after any other failure until the helper that issued it has exited.
SETTLED_CODES = frozenset({0, -200, -600, -703, -704, -705, -706, -707, -900})


@dataclass(frozen=True)
class Span:
    """One block of a batch: its key and where its header and payload are (offsets into
    the shared region)."""

    key: str
    header_offset: int
    header_len: int
    payload_offset: int
    payload_len: int


class MooncakeJob(CopyJob):
    """A batch the helper runs; ``results`` per block: bytes moved (for a put, 0 on
    success), 1 / 0 for an existence check, or a negative code (``-errno`` where
    :data:`MOONCAKE_ERRNO` knows it, else Mooncake's own)."""

    __slots__ = ("_lane", "results")

    def __init__(self, lane: MooncakeLane, n: int, nbytes: int) -> None:
        super().__init__(n, nbytes)
        self._lane = lane
        self.results: list[int] = []

    def query(self) -> bool:
        if not self._done:
            self._lane.poll()
        return self._done

    def check_failed(self) -> bool:
        if not self._done:
            self._lane.poll(check_alive=True)
        return self._done


class MooncakeLane:
    """A helper process with one Mooncake client, on the shared region ``memfd``.

    ``settings`` are ``MooncakeDistributedStore.setup``'s: ``local_hostname``,
    ``metadata_server``, ``global_segment_bytes``, ``local_buffer_bytes``, ``protocol``,
    ``device_name``, ``master``. The constructor waits up to ``start_timeout_s`` for the
    client's setup and raises ``OSError`` naming what failed. Loop thread only, after that.
    """

    def __init__(
        self,
        memfd: int,
        settings: dict[str, object],
        start_timeout_s: float = 30.0,
    ) -> None:
        self.size = os.fstat(memfd).st_size
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "asyncoffload.tiers._mooncake_helper",
                    str(memfd),
                    str(theirs.fileno()),
                    json.dumps(settings),
                ],
                pass_fds=(memfd, theirs.fileno()),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()  # no helper: nothing else holds the socket
            raise
        finally:
            theirs.close()
        self._jobs: dict[int, MooncakeJob] = {}
        self._ids = itertools.count(1)
        self._dead: str | None = None
        self.closed = False
        try:
            code = self._first_reply(start_timeout_s)
        except BaseException:
            self.close()
            raise
        if code != 0:
            self.close()
            raise OSError(
                errno.EHOSTDOWN,
                f"Mooncake Store: the client's setup failed with code {code} "
                f"(master {settings.get('master')!r})",
            )
        ours.setblocking(False)

    def _first_reply(self, timeout_s: float) -> int:
        self._sock.settimeout(timeout_s)
        try:
            data = self._sock.recv(REPLY.size + 8)
        except TimeoutError:
            raise OSError(
                errno.ETIMEDOUT, f"Mooncake Store: no client after {timeout_s:g} s"
            ) from None
        if len(data) < REPLY.size + 8:
            raise OSError(errno.EHOSTDOWN, "Mooncake Store: the helper process exited at start")
        return int(struct.unpack_from("<q", data, REPLY.size)[0])

    def bind(self, wake_fd: int | None) -> None:
        """Have the helper write ``wake_fd`` (the completion bridge's eventfd) after each
        reply from now on; ``None``: no wake-up (the bridge polls)."""
        if self.closed or self._dead is not None:
            return
        message = [HEAD.pack(0, OP_WAKE, 0)]
        self._sock.setblocking(True)
        try:
            socket.send_fds(self._sock, message, [] if wake_fd is None else [wake_fd])
        finally:
            self._sock.setblocking(False)

    def submit(self, op: int, spans: Sequence[Span] | Sequence[str]) -> MooncakeJob:
        """Queue a batch (``op``: :data:`OP_GET`, :data:`OP_PUT` of spans;
        :data:`OP_EXISTS`, :data:`OP_REMOVE` of keys)."""
        if self.closed:
            raise RuntimeError("the Mooncake lane is closed")
        n = len(spans)
        if n > MAX_ITEMS:
            raise ValueError(f"a batch holds at most {MAX_ITEMS} blocks, got {n}")
        items = []
        keys = []
        nbytes = 0
        for span in spans:
            if isinstance(span, str):
                key = span.encode("ascii")
                items.append(ITEM.pack(len(key), 0, 0, 0, 0))
            else:
                key = span.key.encode("ascii")
                for off, ln in ((span.header_offset, span.header_len),
                                (span.payload_offset, span.payload_len)):  # fmt: skip
                    if off < 0 or ln < 0 or off + ln > self.size:
                        raise ValueError(f"span {span} is outside the region of {self.size} B")
                items.append(ITEM.pack(len(key), span.header_offset, span.header_len,
                                       span.payload_offset, span.payload_len))  # fmt: skip
                nbytes += span.payload_len
            keys.append(key)
        job_id = next(self._ids)
        job = MooncakeJob(self, n, nbytes)
        if self._dead is not None:
            job.results = [-errno.EHOSTDOWN] * n
            job.finish()
            return job
        message = HEAD.pack(job_id, op, n) + b"".join(items) + b"".join(keys)
        try:
            self._sock.send(message)
        except BlockingIOError:
            job.results = [-errno.EAGAIN] * n  # the helper is that far behind: refuse
            job.finish()
            return job
        except OSError as exc:
            self._fail_all(f"the helper's socket failed: {exc}")
            job.results = [-errno.EHOSTDOWN] * n
            job.finish()
            return job
        self._jobs[job_id] = job
        return job

    def poll(self, check_alive: bool = False) -> None:
        """Read the helper's replies and end their jobs; with ``check_alive``, fail every
        job if the helper has exited."""
        while True:
            try:
                data = self._sock.recv(REPLY.size + 8 * MAX_ITEMS)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._fail_all(f"the helper's socket failed: {exc}")
                return
            if not data:
                self._fail_all("the helper process exited")
                return
            job_id, n, end_ns = REPLY.unpack_from(data)
            job = self._jobs.pop(job_id, None)
            if job is not None:
                raw = struct.unpack_from(f"<{n}q", data, REPLY.size)
                job.results = [-MOONCAKE_ERRNO[r] if r in MOONCAKE_ERRNO else r for r in raw]
                job.finish()
                job.finished_ns = end_ns  # the helper's stamp: when the batch ended
        if check_alive and self._jobs and self._proc.poll() is not None:
            self._fail_all(f"the helper process exited with {self._proc.returncode}")

    def _fail_all(self, why: str) -> None:
        self._dead = why
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            job.results = [-errno.EHOSTDOWN] * job.num_blocks
            job.stamped = False  # noticed now, not when anything ended
            job.finish()

    @property
    def pending(self) -> int:
        return len(self._jobs)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the helper (it exits when its socket closes; killed after ``timeout_s``)
        and fail what it had not answered. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._sock.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._fail_all("the lane was closed")
