"""Native disk I/O lanes: a pool of native threads that write blocks of host memory to
disk and read them back (``pread``/``pwrite``), each block checked by CRC32C, with no
Python thread on the I/O path (asyncoffload/_native/disk_io.c).

A block on disk is a 4096-byte header (magic, format version, the pool's 16-byte
identity, the payload length, the payload's CRC32C, the key, and the header's own
CRC32C) followed by the payload, zero-padded to a multiple of 4096: :func:`slot_bytes`.
It lives either in a slab (an open fd, at an offset: ``IoOp.fd``/``IoOp.offset``) or in
a file of its own (``IoOp.path``, relative to the directory fd ``IoOp.fd``: written to a
temporary name, then renamed into place).

A job's ops end one by one, each with a result: ``payload_len`` when it worked, else
``-errno``: a read of a block that fails its checks ends with ``-EBADMSG`` (damaged:
magic, version, header or payload CRC, payload length), ``-ESTALE`` (another identity),
``-EKEYREJECTED`` (another key's block), ``-ENOKEY`` (a pool with a MAC key: a block
without its MAC, or another key's; a pool without: a block with a MAC), ``-ENODATA``
(truncated) or ``-ENOENT`` (no file); an op that had not started by the job's deadline
ends with ``-ETIMEDOUT``.

**Stuck ops.** No deadline can interrupt an op inside a system call (a hung NFS or FUSE
mount, a dying disk). A job submitted with ``give_up_s`` stops waiting for such an op:
``give_up_s`` after its deadline, ``query()`` says it ended, every op ``-ETIMEDOUT``, and
``late`` is True, while its ops may still run: the host memory, fds and status words
they touch must stay valid until ``ended``. Closing a pool with such a job
(:meth:`IoPool.detach`) joins nothing; :func:`keep_until_ended` keeps what the ops
touch, with a warning, and :func:`release_ended` releases it once they ended.

Reads go before writes: a worker always takes the next op of the oldest read job with
ops left before any write. With ``write_priority="idle"`` (the disk tier's default; the
tiers' ``write_priority`` setting) the pool runs ``threads`` *read lanes* (reads, and
checks of values read) and as many *write lanes* (writes, removals, packing values) at
``SCHED_IDLE``: they use the CPU time the rest of the machine leaves, so a write never
takes a CPU a read, a copy or the event loop wants (issue 41: on a 2-vCPU VM, a one-block
read from a disk tier written through at about 1 GB/s took a median 0.6-0.7 ms against
0.33 idle; with idle write lanes 0.4-0.5: benchmarks/tier_contention.py). So that writes
progress on a machine whose CPUs are all busy, a read lane with no read to do takes a
write op whose job has waited 20 ms for a write lane while the write lanes starve (one
was runnable at two samples 20 ms apart and on a CPU for less than half the time
between, read from ``/proc/self/task/TID/stat`` and ``schedstat``; where they cannot be
read, the 20 ms alone), at most
``threads - 1`` read lanes at once (one at least) (:meth:`IoPool.lanes_info` counts
them). A write lane asleep in a slow disk's I/O is not starving: its writes stay with it,
and the read lanes with the reads. ``"normal"`` (the pool's default, the remote tier's):
``threads`` lanes that take both, reads first.

Removals of block files (:meth:`IoPool.submit_unlink`, files mode) queue with the
writes, and the writes and removals of one file run in the order they were submitted: a
block evicted and written again at once is written after its old file went, never
removed after. A finished job writes 1 to the bound wake fd.

**Fork.** The pool's threads exist only in the process that made it: in a fork's child
``submit`` raises ``RuntimeError`` and ``close`` touches nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from asyncoffload._native import load_disk_io, native_disabled
from asyncoffload.transfer.base import CopyJob, check_process, forked_since

__all__ = [
    "HEADER_BYTES",
    "IoJob",
    "IoOp",
    "IoPool",
    "available",
    "crc32c",
    "keep_until_ended",
    "kept",
    "release_ended",
    "slot_bytes",
]

log = logging.getLogger("asyncoffload.tiers")

#: The header that precedes every block's payload on disk.
HEADER_BYTES = 4096
#: The write lanes' CPU priority (see the module docstring).
WRITE_PRIORITIES = ("idle", "normal")

#: The longest key a block may carry.
MAX_KEY_BYTES = 256
_ALIGN = 4096


def slot_bytes(payload_len: int) -> int:
    """The bytes one block takes on disk: the header, then the payload padded to 4096."""
    return HEADER_BYTES + (payload_len + _ALIGN - 1) // _ALIGN * _ALIGN


#: What a job's ops do (the native pool's AO_KIND_*).
KIND_READ, KIND_WRITE, KIND_PACK, KIND_UNPACK, KIND_UNLINK = 0, 1, 2, 3, 4


#: The most slices a block's payload may be in (tensor-parallel ranks).
MAX_SEGMENTS = 64


class IoOp(NamedTuple):
    """One block to write or read: ``payload_len`` bytes at address ``host``. In a slab:
    ``fd`` and ``offset`` (of the header), ``path`` None; in files mode: ``path`` (the
    block file's final path) relative to the directory ``fd`` (held open by the caller
    until the job ended; -1: the current directory), ``offset`` 0."""

    host: int
    offset: int
    path: str | None
    key: bytes
    fd: int


class _Op(ctypes.Structure):
    _fields_ = [
        ("host", ctypes.c_int64),
        ("offset", ctypes.c_int64),
        ("path", ctypes.c_char_p),
        ("key", ctypes.c_char_p),
        ("key_len", ctypes.c_int32),
        ("fd", ctypes.c_int32),
    ]


_Status = ctypes.c_int64 * 3


class IoJob(CopyJob):
    """A submitted disk job; ``query()`` is True once every op has ended. Then
    ``results`` holds each op's outcome (``payload_len`` or ``-errno``) and ``error`` is
    ``None``, unless the whole job was discarded unrun (the pool closed under it:
    ``error`` is an ``OSError(ECANCELED)``). ``give_up_ns`` (``time.monotonic_ns``, 0:
    never): an op still running then ends the job on the caller's side, every op
    ``-ETIMEDOUT`` and ``late`` True, while its ops may go on until ``ended``."""

    __slots__ = ("_give_up_ns", "_lib", "_results", "_status", "late", "results")

    def __init__(self, n: int, payload_len: int, lib: ctypes.CDLL, give_up_ns: int = 0) -> None:
        super().__init__(n, n * payload_len)
        self._lib = lib
        self._status = _Status()
        self._results = (ctypes.c_int64 * n)()
        self._give_up_ns = give_up_ns
        self.results: list[int] = []
        #: Given up on (see above): its ops may still run until ``ended``.
        self.late = False

    @property
    def status_address(self) -> int:
        return ctypes.addressof(self._status)

    def query(self) -> bool:
        if not self._done:
            state = self._lib.ao_io_status_load(self.status_address)
            if state:
                self.results = list(self._results)
                self.error = None if state > 0 else _discarded(-state)
                # time.perf_counter_ns is CLOCK_MONOTONIC, the clock the pool stamped.
                self.finished_ns = self._status[1]
                self._done = True
            elif self._give_up_ns and time.monotonic_ns() >= self._give_up_ns:
                # An op stuck in a system call: stop waiting for it (see the module
                # docstring); what it touches stays valid until ``ended``.
                self.results = [-errno.ETIMEDOUT] * self.num_blocks
                self.error = None
                self.late = True
                self.stamped = False  # not when the ops ended
                self.finished_ns = time.perf_counter_ns()
                self._done = True
        return self._done

    @property
    def ended(self) -> bool:
        """Whether every op really ended (or was discarded): none touches the host memory,
        the fds or this job's status words any more. For a job that is not ``late``,
        the same as ``query()``."""
        return bool(self._lib.ao_io_status_load(self.status_address))

    @property
    def first_op_ns(self) -> int:
        """When the first op started (CLOCK_MONOTONIC ns; 0 before, or if none did)."""
        return int(self._status[2])

    @property
    def failed(self) -> list[int]:
        """The indices of the ops that failed (after ``query()`` returned True)."""
        return [i for i, r in enumerate(self.results) if r < 0]

    def __repr__(self) -> str:
        state = "running"
        if self._done:
            state = "discarded" if self.error is not None else f"done, {len(self.failed)} failed"
            if self.late:
                state = "given up on, still running" if not self.ended else "given up on, ended"
        return f"<IoJob {self.num_blocks} ops {self.nbytes} B {state}>"


def _discarded(code: int) -> OSError:
    return OSError(code, "the disk job was discarded unrun: its pool was closed or dropped")


def _unavailable_reason() -> str:
    if native_disabled():
        return "ASYNCOFFLOAD_NO_NATIVE is set"
    if load_disk_io.building:
        return (
            "it is being built on a background thread (asyncoffload._native.build_all() "
            "builds it ahead of time)"
        )
    return "it could not be built or loaded (no C compiler? see the log)"


def available() -> bool:
    """Whether the native disk I/O library loads here."""
    return load_disk_io() is not None


def require(what: str) -> None:
    """Make sure the native library is loaded for ``what`` (say "the disk tier"): made
    on an event loop before a background build ended, start-up waits for the build (a
    tier cannot run without it: no fallback); ``RuntimeError`` when it cannot be built."""
    from asyncoffload._native import compile_timeout_s

    if not available() and load_disk_io.building:
        load_disk_io.wait_for_build(compile_timeout_s())
    if not available():
        raise RuntimeError(
            f"{what} needs the native I/O lanes, which could not be built (a C compiler "
            f"is needed on first use; see docs/install.md): {_unavailable_reason()}"
        )


def _library() -> ctypes.CDLL:
    lib = load_disk_io()
    if lib is None:
        raise RuntimeError(f"the native disk I/O library is unavailable: {_unavailable_reason()}")
    return lib


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data``, continuing from ``crc``: chainable,
    ``crc32c(b, crc32c(a)) == crc32c(a + b)``."""
    lib = _library()
    if isinstance(data, bytes):
        return int(lib.ao_crc32c(crc, data, len(data)))
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("crc32c needs a contiguous buffer")
    view = view.cast("B")
    n = len(view)
    if n == 0:
        return int(lib.ao_crc32c(crc, None, 0))
    if view.readonly:
        return int(lib.ao_crc32c(crc, bytes(view), n))
    buf = (ctypes.c_char * n).from_buffer(view)
    try:
        return int(lib.ao_crc32c(crc, ctypes.addressof(buf), n))
    finally:
        del buf


def _release_pool(
    lib: ctypes.CDLL,
    pid: int,
    owned: list[int | None],
    pending: deque[tuple[ctypes.Array[ctypes.c_int64], ctypes.Array[ctypes.c_int64]]],
    fds: list[int],
    *,
    discard: bool,
) -> None:
    """Stop the native pool (finishing its queued jobs, or with ``discard`` dropping
    them) and join its threads; only then let go of the status words the threads write
    and close the wake fd. In a fork's child the pool is the parent's: left alone."""
    if not forked_since(pid):
        while owned:
            handle = owned[-1]
            if handle:
                if discard:
                    lib.ao_io_cancel(handle)
                lib.ao_io_destroy(handle)  # ends the running ops, joins the threads
            owned.pop()
        pending.clear()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class IoPool:
    """``threads`` native threads moving blocks of ``payload_len`` bytes between host
    memory and disk, stamping and checking ``identity`` (16 bytes) in every block.
    ``direct_files``: open files-mode files with ``O_DIRECT`` (where the file system
    refuses it, buffered I/O). ``mac_key`` (1 to 64 bytes): every block written or packed
    carries its keyed BLAKE2b-256 MAC, and a block read or unpacked without it, or with
    another key's, ends with ``-ENOKEY``. The native threads start with the first
    submission: a pool never used holds none. Raises ``RuntimeError`` (saying why) where
    the native library is unavailable."""

    def __init__(
        self,
        *,
        threads: int,
        payload_len: int,
        identity: bytes,
        direct_files: bool,
        mac_key: bytes | None = None,
        write_priority: str = "normal",
    ) -> None:
        if threads < 1 or threads > 256:
            raise ValueError(f"threads must be 1 to 256, got {threads}")
        if write_priority not in WRITE_PRIORITIES:
            raise ValueError(
                f"write_priority must be one of {', '.join(WRITE_PRIORITIES)}, "
                f"got {write_priority!r}"
            )
        if payload_len < 0:
            raise ValueError(f"payload_len must not be negative, got {payload_len}")
        if len(identity) != 16:
            raise ValueError(f"identity must be 16 bytes, got {len(identity)}")
        if mac_key is not None and not 1 <= len(mac_key) <= 64:
            raise ValueError(f"a MAC key must be 1 to 64 bytes, got {len(mac_key)}")
        self._lib = _library()
        self.threads = threads
        self.payload_len = payload_len
        self.identity = bytes(identity)
        self.direct_files = direct_files
        self.write_priority = write_priority
        #: Blocks carry a MAC with this key (never shown: not in repr).
        self._mac_key = bytes(mac_key) if mac_key else None
        self.slot_bytes = slot_bytes(payload_len)
        self.pid = os.getpid()
        self._closed = False
        #: The native pool, once created (one handle at most).
        self._owned: list[int | None] = []
        self._handle: int | None = None
        self._fds: list[int] = []  # our duplicate of the bound wake fd
        self._wake_fd = -1
        self._faults: dict[int, tuple[int, int]] = {}
        self._delay_ns = 0
        #: Where a block's payload lives (see :meth:`set_segments`): one run by default.
        self.nseg = 1
        self.deltas: ctypes.Array[ctypes.c_int64] | None = None
        self._pending: deque[tuple[ctypes.Array[ctypes.c_int64], ctypes.Array[ctypes.c_int64]]] = (
            deque()
        )
        # Dropped unclosed, the pool is released by this; it refers only to what the
        # native threads touch, never to the pool object.
        self._finalizer = weakref.finalize(
            self,
            _release_pool,
            self._lib,
            self.pid,
            self._owned,
            self._pending,
            self._fds,
            discard=True,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def started(self) -> bool:
        """Whether the native pool (and its threads) exists."""
        return bool(self._owned)

    def bind(self, wake_fd: int | None) -> None:
        """Write 1 (8 bytes) to ``wake_fd`` when a job ends (``None``: signal nothing).
        The pool writes a duplicate of it, so the caller may close its own; once this
        returns, the fd bound before is never written again."""
        if self._closed or forked_since(self.pid):
            return
        fds = self._fds
        stale = fds[:]
        fd = -1
        if wake_fd is not None:
            # Filed by the C call that makes it: an interrupt cannot leak it.
            fds.extend(map(os.dup, (wake_fd,)))
            fd = fds[-1]
        self._wake_fd = fd
        for handle in self._owned:
            if handle:
                self._lib.ao_io_set_wake_fd(handle, fd)
        for old in stale:  # the pool no longer writes these
            fds.remove(old)
            os.close(old)

    def _start(self) -> int:
        owned = self._owned
        if not owned:
            create = functools.partial(
                self._lib.ao_io_create,
                self.threads,
                self._wake_fd,
                self.payload_len,
                self.identity,
            )
            # extend(map(...)) files the handle before any bytecode runs after the C
            # call: an interrupt cannot come between starting the threads and owning them.
            flags = (1 if self.direct_files else 0) | (2 if self.write_priority == "idle" else 0)
            owned.extend(map(create, (flags,)))
        handle = owned[0]
        if not handle:
            owned.clear()
            raise OSError("ao_io_create failed")
        if self._mac_key is not None:
            self._lib.ao_io_set_mac(handle, self._mac_key, len(self._mac_key))
        for write, (every, err) in self._faults.items():
            self._lib.ao_io_set_fault(handle, write, every, err)
        if self._delay_ns:
            self._lib.ao_io_set_delay(handle, self._delay_ns)
        if self.nseg > 1:
            self._lib.ao_io_set_segments(handle, self.nseg, self.deltas)
        self._handle = handle
        return int(handle)

    def set_segments(self, deltas: Sequence[int]) -> None:
        """Jobs submitted from now on find each block's payload in ``len(deltas)``
        equal slices, slice ``r`` at the op's host address plus ``deltas[r]``
        (``deltas[0]`` is 0): the same slot of each tensor-parallel rank's host pool. A
        block is still one value, holding every slice in order, and a read checks it
        whole before any slice is written. ``[0]`` goes back to one run."""
        deltas = [int(d) for d in deltas]
        n = len(deltas)
        if not 1 <= n <= MAX_SEGMENTS:
            raise ValueError(f"a block has 1 to {MAX_SEGMENTS} slices, got {n}")
        if deltas[0] != 0:
            raise ValueError(f"the first slice is at the op's address (delta 0), got {deltas[0]}")
        if self.payload_len % n:
            raise ValueError(
                f"a payload of {self.payload_len} B does not split into {n} equal slices"
            )
        self.nseg = n
        self.deltas = (ctypes.c_int64 * n)(*deltas) if n > 1 else None
        if self._handle is not None:
            rc = self._lib.ao_io_set_segments(self._handle, n, self.deltas)
            if rc != 0:  # checked above: a defect if it happens
                raise RuntimeError(f"ao_io_set_segments refused the slices (code {rc})")

    def submit(
        self,
        write: bool,
        ops: Sequence[IoOp],
        deadline_s: float | None = None,
        give_up_s: float | None = None,
    ) -> IoJob:
        """Queue ``ops`` (all writes or all reads); ``deadline_s``: seconds from now
        after which ops not yet started end with ``-ETIMEDOUT``; ``give_up_s`` (with a
        deadline): seconds after the deadline when the job ends on the caller's side
        even if an op still runs (``late``, see the module docstring). The host memory,
        the slab fds and the directory fds must stay valid until the job has ``ended``."""
        self._check_open(deadline_s, give_up_s)
        array = (_Op * len(ops))()
        for i, op in enumerate(ops):
            key = _key_of(op)
            if op.path is None and op.fd < 0:
                raise ValueError("an op needs a path (files mode) or an fd (slab mode)")
            if op.host == 0 and self.payload_len:
                raise ValueError("an op needs a host address")
            c = array[i]
            c.host = op.host
            c.offset = op.offset if op.path is None else 0
            c.path = None if op.path is None else os.fsencode(op.path)
            c.key = key
            c.key_len = len(key)
            c.fd = op.fd  # files mode: the directory the path is relative to (-1: cwd)
        deadline_ns, give_up_ns = _deadlines(deadline_s, give_up_s)
        return self._submit(KIND_WRITE if write else KIND_READ, array, deadline_ns, give_up_ns)

    def _check_open(self, deadline_s: float | None, give_up_s: float | None) -> None:
        """Raise unless a job can be queued now with these deadlines."""
        if give_up_s is not None and not (deadline_s is not None and give_up_s >= 0):
            raise ValueError(
                f"give_up_s needs a deadline and must not be negative, got {give_up_s}"
            )
        check_process(self.pid, "IoPool")
        if self._closed:
            raise RuntimeError("IoPool is closed")

    def submit_unlink(
        self,
        ops: Sequence[IoOp],
        deadline_s: float | None = None,
        give_up_s: float | None = None,
    ) -> IoJob:
        """Queue the removal of each op's block file (files mode: ``path`` relative to the
        directory ``fd``, held open by the caller until the job has ended; ``host`` and
        ``offset`` unused), behind the reads, in order with the writes of the same file.
        An op's result is 0 once the file is gone (it was gone already included), else
        ``-errno``. ``deadline_s`` and ``give_up_s`` as for :meth:`submit`."""
        self._check_open(deadline_s, give_up_s)
        array = (_Op * len(ops))()
        for i, op in enumerate(ops):
            key = _key_of(op)
            if op.path is None:
                raise ValueError("removing a block needs its file's path (files mode)")
            c = array[i]
            c.path = os.fsencode(op.path)
            c.key = key
            c.key_len = len(key)
            c.fd = op.fd
        deadline_ns, give_up_ns = _deadlines(deadline_s, give_up_s)
        return self._submit(KIND_UNLINK, array, deadline_ns, give_up_ns, payload_len=0)

    def submit_values(self, pack: bool, ops: Sequence[tuple[int, int, bytes]]) -> IoJob:
        """Queue ``(host, value, key)`` ops on values of a key-value store in memory, at
        address ``value`` (``HEADER_BYTES + payload_len`` bytes). ``pack``: write the
        header of ``key`` and copy the payload at ``host`` behind it (its CRC32C in the
        same pass). Otherwise check the value is this namespace's block ``key``, whole,
        with matching CRCs, and copy its payload to ``host`` (a result ``< 0`` is the
        ``-errno`` of what did not match; ``host`` then holds part of it, to be
        ignored). Unpacks run before packs; both stay valid until the job has ended."""
        check_process(self.pid, "IoPool")
        if self._closed:
            raise RuntimeError("IoPool is closed")
        n = len(ops)
        array = (_Op * n)()
        for i, (host, value, key) in enumerate(ops):
            if not 1 <= len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"a key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
            if not host or not value:
                raise ValueError("an op needs a host and a value address")
            c = array[i]
            c.host = host
            c.offset = value
            c.key = key
            c.key_len = len(key)
            c.fd = -1
        return self._submit(KIND_PACK if pack else KIND_UNPACK, array, 0)

    def _submit(
        self,
        kind: int,
        array: ctypes.Array[_Op],
        deadline_ns: int,
        give_up_ns: int = 0,
        payload_len: int | None = None,
    ) -> IoJob:
        n = len(array)
        handle = self._handle
        if handle is None:
            handle = self._start()
        pending = self._pending
        while pending and pending[0][0][0]:  # ended: the pool no longer writes these
            pending.popleft()
        if len(pending) > 256:
            kept = [p for p in pending if not p[0][0]]
            pending.clear()
            pending.extend(kept)
        moved = self.payload_len if payload_len is None else payload_len
        job = IoJob(n, moved, self._lib, give_up_ns)
        # Filed before the C call: the threads may write these as soon as it returns, and
        # an interrupt right after it must not let them go.
        entry = (job._status, job._results)
        pending.append(entry)
        rc = self._lib.ao_io_submit(
            handle,
            kind,
            n,
            ctypes.addressof(array),
            deadline_ns,
            job.status_address,
            ctypes.addressof(job._results),
        )
        if rc != 0:
            pending.remove(entry)
            reason = {-1: "out of memory", -2: "the pool is stopping", -3: "bad arguments"}
            raise RuntimeError(
                f"the native disk pool refused the job: {reason.get(rc, f'code {rc}')}"
            )
        return job

    def set_fault(self, write: bool, every_nth: int, err: int) -> None:
        """Tests: from now on every ``every_nth``-th op of that direction (1: each, 0:
        none) ends with ``-err`` without touching the file (removals are not counted)."""
        direction = 1 if write else 0
        self._faults[direction] = (every_nth, err)
        if self._handle is not None:
            self._lib.ao_io_set_fault(self._handle, direction, every_nth, err)

    def set_delay(self, seconds: float) -> None:
        """Tests: sleep ``seconds`` before each op (a slow disk)."""
        self._delay_ns = max(0, int(seconds * 1e9))
        if self._handle is not None:
            self._lib.ao_io_set_delay(self._handle, self._delay_ns)

    def set_gate(self, fd: int | None) -> None:
        """Tests: from now on each op, once past its deadline check, waits until ``fd``
        polls readable or hung up, as in a system call that hangs: the read end of a
        pipe holds every op that starts until its write end is closed (then none, for
        good). ``None`` removes the gate. The native pool keeps a duplicate of ``fd``
        (the caller may close its own) and is started now if it was not yet. Not to be
        replaced while an op waits at it."""
        check_process(self.pid, "IoPool")
        if self._closed:
            raise RuntimeError("IoPool is closed")
        handle = self._handle if self._handle is not None else self._start()
        if self._lib.ao_io_set_gate(handle, -1 if fd is None else fd) != 0:
            raise OSError(errno.EBADF, f"cannot duplicate the test gate fd {fd}")

    def pause_writers(self, on: bool) -> None:
        """Tests: the write lanes take nothing while ``on`` (a machine whose CPUs are all
        busy at normal priority): the read lanes take writes that waited 20 ms."""
        check_process(self.pid, "IoPool")
        if self._closed:
            raise RuntimeError("IoPool is closed")
        handle = self._handle if self._handle is not None else self._start()
        self._lib.ao_io_pause_writers(handle, 1 if on else 0)

    def lanes_info(self) -> tuple[int, int]:
        """(write ops that a read lane took for want of a write lane, write lanes that
        asked for ``SCHED_IDLE`` and did not get it); (0, 0) before the pool started."""
        if self._handle is None or forked_since(self.pid):
            return 0, 0
        out = (ctypes.c_int64 * 2)()
        self._lib.ao_io_lanes_info(self._handle, out)
        return out[0], out[1]

    @property
    def running(self) -> int:
        """How many submitted jobs have not ended (their ops may still run)."""
        if forked_since(self.pid):
            return 0
        return sum(1 for status, _ in self._pending if not status[0])

    def detach(self) -> Callable[[], None]:
        """Close without joining the threads, for a pool whose ops may be stuck in a
        system call (``running``): no submission is taken any more, and neither dropping
        the pool nor the interpreter's exit joins its threads (that could wait forever).
        Returns what finishes the close (joins the threads, frees the pool): call it
        once ``running`` is 0. Idempotent (a closed pool's is a no-op)."""
        self._closed = True
        self._handle = None
        detached = self._finalizer.detach()
        if detached is None:
            return _nothing
        _, release, args, _ = detached
        return functools.partial(release, *args, discard=False)

    def close(self) -> None:
        """Finish the queued jobs, join the threads, free the pool. Idempotent. In a
        fork's child: only marks the pool closed (its threads are the parent's). A job
        stuck in a system call keeps this waiting: see :meth:`detach`."""
        if self._closed:
            return
        self._closed = True
        self._handle = None
        detached = self._finalizer.detach()
        if detached is not None:
            _, release, args, _ = detached
            release(*args, discard=False)

    def __enter__(self) -> IoPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._owned else "idle")
        return f"<IoPool {self.threads} threads, {self.payload_len} B blocks, {state}>"


def _nothing() -> None:
    return None


def _key_of(op: IoOp) -> bytes:
    """``op``'s key as bytes; ``ValueError`` unless it is 1 to MAX_KEY_BYTES long."""
    key = bytes(op.key)
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def _deadlines(deadline_s: float | None, give_up_s: float | None) -> tuple[int, int]:
    """A job's deadline and give-up time (``time.monotonic_ns``; 0: none)."""
    deadline_ns = give_up_ns = 0
    if deadline_s is not None:
        deadline_ns = max(1, time.monotonic_ns() + int(deadline_s * 1e9))
        if give_up_s is not None:
            give_up_ns = deadline_ns + int(give_up_s * 1e9)
    return deadline_ns, give_up_ns


class _Kept(NamedTuple):
    what: str
    ended: Callable[[], bool]
    release: Callable[[], None]


#: What ops that outlived their owner still touch (host memory, a pool's threads and
#: status words, fds), kept alive on purpose until they end: freed, it would take wrong
#: bytes into another block, or be a use after free.
_KEPT: list[_Kept] = []


def keep_until_ended(what: str, ended: Callable[[], bool], release: Callable[[], None]) -> None:
    """Keep ``what`` (whatever ``release`` refers to) alive until ``ended()``, then call
    ``release`` (from :func:`release_ended`); logs a warning naming ``what``."""
    release_ended()
    _KEPT.append(_Kept(what, ended, release))
    log.warning(
        "%s: an I/O operation is still stuck in a system call after its deadline (a hung "
        "mount or a failing disk?): leaking its memory, threads and files on purpose until "
        "it ends, rather than letting it write into memory reused or freed",
        what,
    )


def release_ended() -> int:
    """Release what :func:`keep_until_ended` kept whose ops ended; how many."""
    done = [entry for entry in _KEPT if entry.ended()]
    for entry in done:
        _KEPT.remove(entry)
        try:
            entry.release()
        except Exception:
            log.exception("releasing %s failed", entry.what)
        else:
            log.info("%s: its stuck operation ended, released", entry.what)
    return len(done)


def kept() -> list[str]:
    """What is kept alive now for ops that outlived their owner (see above)."""
    return [entry.what for entry in _KEPT]


#: errno values a read's result may carry, by what they mean (documentation and tests).
READ_ERRORS = {
    "damaged": errno.EBADMSG,
    "other identity": errno.ESTALE,
    "other key": errno.EKEYREJECTED,
    "unauthenticated": errno.ENOKEY,
    "truncated": errno.ENODATA,
    "missing": errno.ENOENT,
    "deadline": errno.ETIMEDOUT,
}
