"""Copy engines of the PagedTransferWorker: they run a :class:`CopyPlan` between paged KV
tensors and host slots, one ordered lane per direction, by a fast primary path and an
independent fallback path that a failed copy is retried on.

- :class:`CpuPagedEngine`: CPU tensors. Primary: the native copy lanes (a native thread
  per direction runs ``memcpy`` over the descriptors, never taking the GIL). Fallback:
  torch index copies on the calling thread.
- :class:`CudaPagedEngine`: CUDA tensors, pinned host slots, one copy stream per
  direction. Primary: chosen per job among a Triton gather into device staging plus one
  DMA per slot (``staged``), a Triton kernel through UVA (``kernel``) and one
  ``cuMemcpyBatchAsync`` (``batch``, small jobs). Fallback: one ``cuMemcpyAsync`` per
  descriptor, or torch copies where the native helper is missing.

Jobs are :class:`~asyncoffload.transfer.base.CopyJob` objects: ``query()`` polls,
``engine.wait(job)`` blocks without spinning in Python.

Both engines keep their host slots in private anonymous memory, or, given ``host_file``,
in a :class:`SharedHostFile`: a shared-memory file another process (the scheduler side
of a serving engine, which moves slots to and from a disk tier) maps too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import secrets
import struct
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol

import torch

from asyncoffload._native import load_copy_engine, load_cuda_helpers
from asyncoffload._ownership import check_private_file, check_root_dir
from asyncoffload.transfer.base import CopyJob, check_process, forked_since, host_bytes
from asyncoffload.transfer.paged import CopyPlan, GroupSpan, PageLayout, _cat

__all__ = [
    "LOAD",
    "STORE",
    "CpuCopyEngine",
    "CpuPagedEngine",
    "CudaPagedEngine",
    "PagedEngine",
    "SharedHostFile",
]

log = logging.getLogger("asyncoffload.transfer")

#: Directions: a store copies KV -> host, a load host -> KV.
STORE, LOAD = 0, 1

CpuCopyEngine = Literal["auto", "native", "threads", "torch"]


#: The header page of a :class:`SharedHostFile`: magic, version, header bytes, slot bytes,
#: slots, the creator's pid. The slots follow it, so slot 0 is page-aligned.
_HOST_FILE_MAGIC = b"AOHPOOL\x00"
_HOST_FILE_VERSION = 1
_HOST_FILE_HEADER = 4096
_HOST_FILE_STRUCT = struct.Struct("<8sIIQQQ")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class SharedHostFile:
    """Host slots in a shared-memory file (``/dev/shm`` or any directory), mapped
    ``MAP_SHARED`` by the process that made it (:meth:`create`, a worker) and by others
    (:meth:`open`, the scheduler side) at once.

    Layout: a 4096-byte header page (magic ``AOHPOOL\\0``, version, header bytes, slot
    bytes, number of slots, the creator's pid), then ``num_slots`` slots of
    ``slot_bytes``, back to back: slot ``i`` starts at ``4096 + i * slot_bytes``, so
    slots are 4096-aligned whenever ``slot_bytes`` is a multiple of 4096. The file is
    mode 0600 and appears whole: it is made under a temporary name, sized, given its
    header, and renamed to ``path``. The creator unlinks it at :meth:`close` (and when
    collected); an opener may unlink it once it has mapped it (``unlink=True``), so that
    a crash of both leaves nothing behind. Mappings outlive the name.

    Its directory must be owned by us or root and, if others may write it, sticky
    (``/dev/shm``); an opener maps only a regular file owned by its own uid and not
    writable by group or others (``PermissionError`` naming the path otherwise: another
    user could read or forge the KV blocks in it).
    """

    def __init__(
        self,
        path: str,
        mm: mmap.mmap,
        num_slots: int,
        slot_bytes: int,
        owner: bool,
        creator_pid: int | None = None,
    ) -> None:
        self.path = path
        #: The pid of the process that made the file (from its header).
        self.creator_pid = os.getpid() if creator_pid is None else creator_pid
        self.map: mmap.mmap | None = mm
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.owner = owner
        # Unlinks the name (the creator's), not the memory: views of the map go with
        # their last reference.
        self._finalizer = weakref.finalize(self, _unlink_quietly, path) if owner else None

    @staticmethod
    def file_bytes(num_slots: int, slot_bytes: int) -> int:
        return _HOST_FILE_HEADER + _round_up(num_slots * slot_bytes, mmap.PAGESIZE)

    @classmethod
    def create(
        cls, path: str | os.PathLike[str], num_slots: int, slot_bytes: int
    ) -> SharedHostFile:
        """Make the file at ``path`` (replacing a stale one) and map it. ``OSError``
        (``ENOSPC`` naming the sizes) where its directory has too little room;
        ``PermissionError`` where others could replace it (see the class docstring) or
        another user's file holds the name."""
        path = os.fspath(path)
        size = cls.file_bytes(num_slots, slot_bytes)
        folder = os.path.dirname(path) or "."
        check_root_dir(folder, "shared host pool")
        try:
            st = os.statvfs(folder)
        except OSError:
            pass
        else:
            if st.f_bavail * st.f_frsize < size:
                raise OSError(
                    errno.ENOSPC,
                    f"{folder} has {st.f_bavail * st.f_frsize} bytes free, too few for a "
                    f"{size}-byte shared host pool ({num_slots} slots of {slot_bytes} B)",
                )
        tmp = os.path.join(
            folder, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}"
        )
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        flags |= getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(tmp, flags, 0o600)
        try:
            os.ftruncate(fd, size)
            header = _HOST_FILE_STRUCT.pack(
                _HOST_FILE_MAGIC,
                _HOST_FILE_VERSION,
                _HOST_FILE_HEADER,
                slot_bytes,
                num_slots,
                os.getpid(),
            )
            os.pwrite(fd, header, 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                os.replace(tmp, path)
            except PermissionError:  # a sticky directory: another user's file has the name
                owner = "?"
                with contextlib.suppress(OSError):
                    owner = str(os.lstat(path).st_uid)
                raise PermissionError(
                    f"shared host pool: cannot replace {path}, owned by uid {owner} (this "
                    f"process's uid is {os.geteuid()}): remove it, or set another directory"
                ) from None
        except BaseException:
            _unlink_quietly(tmp)
            raise
        finally:
            os.close(fd)
        return cls(path, mm, num_slots, slot_bytes, owner=True)

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], num_slots: int, slot_bytes: int, *, unlink: bool = False
    ) -> SharedHostFile:
        """Map the file a creator made at ``path``. ``FileNotFoundError`` while it does
        not exist yet; ``ValueError`` if it is not a host pool of ``num_slots`` slots of
        ``slot_bytes``; ``PermissionError`` naming the path if it is no regular file of
        ours, or group or others may write it. ``unlink``: remove the name once mapped."""
        path = os.fspath(path)
        fd = os.open(
            path,
            os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0),
        )
        try:
            size = check_private_file(fd, path, "shared host pool").st_size
            raw = os.pread(fd, _HOST_FILE_STRUCT.size, 0)
            if len(raw) < _HOST_FILE_STRUCT.size:
                raise ValueError(f"{path} is not a host pool file (too short)")
            magic, version, header, slots_b, slots_n, pid = _HOST_FILE_STRUCT.unpack(raw)
            if magic != _HOST_FILE_MAGIC or version != _HOST_FILE_VERSION:
                raise ValueError(f"{path} is not a host pool file (magic or version)")
            if header != _HOST_FILE_HEADER or (slots_b, slots_n) != (slot_bytes, num_slots):
                raise ValueError(
                    f"{path} holds {slots_n} slots of {slots_b} B; expected {num_slots} "
                    f"slots of {slot_bytes} B"
                )
            want = cls.file_bytes(num_slots, slot_bytes)
            if size < want:
                raise ValueError(f"{path} has {size} bytes, fewer than {want}")
            mm = mmap.mmap(fd, want, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if unlink:
            _unlink_quietly(path)
        return cls(path, mm, num_slots, slot_bytes, owner=False, creator_pid=pid)

    @classmethod
    def wait_open(
        cls, path: str | os.PathLike[str], num_slots: int, slot_bytes: int, timeout_s: float
    ) -> SharedHostFile:
        """:meth:`open` the file another process makes at ``path``, waiting for it (and
        past a stale one, whose creator is gone) for at most ``timeout_s``:
        ``TimeoutError`` naming the path then; ``ValueError`` at once for a file of
        other sizes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                shared = cls.open(path, num_slots, slot_bytes)
            except FileNotFoundError:
                pass
            else:
                if shared.creator_alive():
                    return shared
                shared.close()  # a dead creator's: the live one replaces it
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no shared host pool at {os.fspath(path)} after {timeout_s:.0f}s (the "
                    "process that makes it, the first worker, did not start?)"
                )
            time.sleep(0.01)

    def creator_alive(self) -> bool:
        """Whether the process that made the file still runs (a file whose creator is
        gone is stale: a new one replaces it)."""
        try:
            os.kill(self.creator_pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # another user's process (EPERM): it exists
            return True
        return True

    def tensor(self) -> torch.Tensor:
        """The slots as a ``[num_slots, slot_bytes]`` uint8 tensor viewing the map."""
        assert self.map is not None, "the host file is closed"
        return torch.frombuffer(
            self.map,
            dtype=torch.uint8,
            offset=_HOST_FILE_HEADER,
            count=self.num_slots * self.slot_bytes,
        ).view(self.num_slots, self.slot_bytes)

    def close(self) -> None:
        """Unlink the name (the creator) and unmap; a view still alive keeps the memory
        until it goes. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        mm, self.map = self.map, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # a live view: unmapped with it
                mm.close()

    def __repr__(self) -> str:
        return (
            f"<SharedHostFile {self.path} {self.num_slots} slots of {self.slot_bytes} B"
            f"{' (creator)' if self.owner else ''}{' closed' if self.map is None else ''}>"
        )


#: How long a worker that maps another's host pool (``host_file_owner=False``) waits
#: for it to appear.
HOST_FILE_WAIT_S = 120.0


def _host_file(
    path: str | os.PathLike[str], num_slots: int, slot_bytes: int, owner: bool
) -> SharedHostFile:
    """The host pool file at ``path``: made here (``owner``), or made by another process
    and mapped here (waiting for it up to :data:`HOST_FILE_WAIT_S`)."""
    if owner:
        return SharedHostFile.create(path, num_slots, slot_bytes)
    return SharedHostFile.wait_open(path, num_slots, slot_bytes, HOST_FILE_WAIT_S)


class PagedEngine(Protocol):
    """What the worker needs of a copy engine: two ways to run a plan, ordered lanes."""

    #: Names of the primary and fallback paths (for stats and errors).
    primary_name: str
    fallback_name: str

    def submit_primary(self, direction: int, plan: CopyPlan) -> CopyJob:
        """Queue ``plan`` on ``direction``'s lane, by the fast path. Raises if nothing or
        only part was queued; then the lane holds no unfinished part of it."""

    def submit_fallback(self, direction: int, plan: CopyPlan) -> CopyJob:
        """Run ``plan`` by the slower, independent path (maybe synchronously)."""

    def wait(self, job: CopyJob) -> None:
        """Block until ``job`` has ended (well or not)."""

    def quiesce(self, direction: int) -> None:
        """Block until every copy queued on ``direction`` has ended (before a retry
        rewrites what a failed attempt may still touch)."""

    def read_slot(self, slot_id: int) -> bytes: ...

    def close(self) -> None:
        """Finish queued copies and release host memory. In a fork's child: touches
        nothing of the parent's (threads, streams, pinning)."""


class _HostPages:
    """Torch access to host slots stored in ``chunks`` (``[rows, slot_bytes]`` uint8
    tensors of ``rows_per_chunk`` slots each), for the torch copy paths.

    Indexed writes in torch move one element at a time, and are far slower on bytes
    than on int64 (and slower still when intra-op threads contend): copies run on the
    widest integer view both sides allow, and one sub-page position at a time, so every
    indexed op works on whole rows of one 2-D view.
    """

    def __init__(
        self, layout: PageLayout, chunks: Sequence[torch.Tensor], rows_per_chunk: int
    ) -> None:
        self.layout = layout
        self.chunks = chunks
        self.rows_per_chunk = rows_per_chunk

    def split(
        self, plan: CopyPlan, t: int, lo: int, hi: int
    ) -> list[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        """Descriptors ``[lo, hi)`` (a segment of tensor ``t``), split by (chunk,
        sub-page): ``(chunk, sub, rows in the chunk, positions in [0, hi - lo) or None
        for all)``. Every segment of a group splits alike."""
        layout = self.layout
        slots = plan.host_slot[lo:hi]
        bpc = layout.blocks_per_chunk
        rows = self.rows_per_chunk
        if bpc == 1 and len(self.chunks) == 1:
            return [(0, 0, slots, None)]
        sub = (plan.host_offset[lo:hi] - layout.tensor_offset[t]) // layout.page_bytes[t]
        key = sub if len(self.chunks) == 1 else (slots // rows) * bpc + sub
        keys = torch.unique(key).tolist()
        if len(keys) == 1:
            k = keys[0]
            return [(k // bpc, k % bpc, slots - (k // bpc) * rows, None)]
        out: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        for k in keys:
            pos = torch.nonzero(key == k).view(-1)
            out.append((k // bpc, k % bpc, slots[pos] - (k // bpc) * rows, pos))
        return out

    def page_view(self, chunk: int, t: int, sub: int, nbytes: int) -> torch.Tensor:
        """``[rows, nbytes]`` uint8 view of sub-page ``sub`` of tensor ``t`` in a chunk."""
        start = self.layout.tensor_offset[t] + sub * self.layout.page_bytes[t]
        return self.chunks[chunk][:, start : start + nbytes]

    def scatter(
        self,
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor | None]],
        t: int,
        rows: torch.Tensor,
    ) -> None:
        """Write ``rows`` (``[n, nbytes]`` CPU uint8, the group's descriptors in order)
        into the host sub-pages of tensor ``t``."""
        for chunk, sub, slot_rows, pos in parts:
            src = rows if pos is None else rows.index_select(0, pos)
            dst, src = _widest(self.page_view(chunk, t, sub, rows.shape[1]), src)
            dst.index_copy_(0, slot_rows, src)

    def gather(
        self,
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor | None]],
        t: int,
        out: torch.Tensor,
    ) -> None:
        """Fill ``out`` (``[n, nbytes]`` CPU uint8) from the host sub-pages of ``t``."""
        for chunk, sub, slot_rows, pos in parts:
            src, dst = _widest(self.page_view(chunk, t, sub, out.shape[1]), out)
            if pos is None:
                torch.index_select(src, 0, slot_rows, out=dst)
            else:
                dst.index_copy_(0, pos, src.index_select(0, slot_rows))

    def copy_cpu(self, direction: int, plan: CopyPlan) -> None:
        """Run ``plan`` between CPU KV tensors and the host slots."""
        layout = self.layout
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        block_parts: list[torch.Tensor] = []
        group = -1
        for t, nb, lo, hi, g in plan.segments:
            if g != group:  # a group's refs share their blocks, slots and sub-pages
                group = g
                parts = self.split(plan, t, lo, hi)
                blocks = plan.kv_block[lo:hi]
                block_parts = [blocks if p is None else blocks[p] for _, _, _, p in parts]
            kv = layout.byte_views[t][:, :nb]
            for (chunk, sub, slot_rows, _), b in zip(parts, block_parts):
                host, kv_w = _widest(self.page_view(chunk, t, sub, nb), kv)
                if direction == STORE:
                    host.index_copy_(0, slot_rows, kv_w.index_select(0, b))
                else:
                    kv_w.index_copy_(0, b, host.index_select(0, slot_rows))


def _widest(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (uint8, same row length) viewed as the widest integer type both
    allow (alignment, strides and length permitting), else as they are."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return a.view(dtype), b.view(dtype)
        except RuntimeError:
            continue
    return a, b


class _NativeCopies(CopyJob):
    """A descriptor job on a native copy lane (``ao_lane_submit_copies``)."""

    __slots__ = ("_lane", "_lib", "_status")

    def __init__(self, nbytes: int, num_copies: int, lib: ctypes.CDLL, lane: int) -> None:
        super().__init__(num_copies, nbytes)
        self._lib = lib
        self._lane = lane
        self._status = (ctypes.c_int64 * 3)()  # [state, end ns, start ns]

    def query(self) -> bool:
        if not self._done:
            state = int(self._lib.ao_status_load(ctypes.addressof(self._status)))
            if state:
                self._settle(state)
        return self._done

    def _settle(self, state: int) -> None:
        self.error = None if state > 0 else OSError(-state, "native copy lane refused the job")
        self.started_ns = self._status[2] or self.started_ns
        self.finished_ns = self._status[1]  # CLOCK_MONOTONIC, as perf_counter_ns
        self._done = True

    def wait(self) -> None:
        addr = ctypes.addressof(self._status)
        while not self._done:
            # Bounded waits (the GIL is released during each): Ctrl-C still works.
            state = int(self._lib.ao_lane_wait(self._lane, addr, 100_000_000))
            if state:
                self._settle(state)


class _DescriptorLanes:
    """The two native lanes of a :class:`CpuPagedEngine` (store, load), kept apart from
    it so that its finalizer can stop them. Each starts with its first job. They keep
    the status words of the jobs they may still write: a job may be dropped first."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._handles: list[int | None] = [None, None]
        self._pending: tuple[deque[ctypes.Array[ctypes.c_int64]], ...] = (deque(), deque())
        self._stopped = False

    def handle(self, direction: int) -> int:
        handle = self._handles[direction]
        if handle is None:
            if self._stopped:
                raise RuntimeError("the copy lanes are closed")
            created = self._lib.ao_lane_create(-1)
            if not created:
                raise OSError("ao_lane_create failed")
            handle = self._handles[direction] = int(created)
        return handle

    def track(self, direction: int, status: ctypes.Array[ctypes.c_int64]) -> None:
        pending = self._pending[direction]
        while pending and pending[0][0]:  # ended: the lane is done with it
            pending.popleft()
        pending.append(status)

    def stop(self, discard: bool) -> None:
        """Finish (or, with ``discard``, drop) the queued jobs and join the threads."""
        self._stopped = True
        for direction, handle in enumerate(self._handles):
            if handle is not None:
                self._handles[direction] = None
                if discard:
                    self._lib.ao_lane_cancel(handle)
                self._lib.ao_lane_destroy(handle)  # ends the running job, joins the thread
        for pending in self._pending:
            pending.clear()


def _pid() -> int:
    return os.getpid()


def _release_lanes(
    pid: int, lanes: _DescriptorLanes | None, memory: tuple[object, ...], *, discard: bool
) -> None:
    """Stop ``lanes``, then let ``memory`` (what they copy to and from) go: a
    :class:`CpuPagedEngine`'s ``close()`` and finalizer (``discard``: nobody can see the
    queued copies any more). In a fork's child the lanes are the parent's: left alone."""
    if lanes is not None and not forked_since(pid):
        lanes.stop(discard)
    del memory


class CpuPagedEngine:
    """Copies between CPU KV tensors and a page-aligned host buffer of ``num_slots``
    slots (anonymous memory: zero-filled, committed as it is touched).

    ``copy_engine``: ``"native"`` (the native copy lanes: one thread per direction runs
    ``memcpy`` over the plan's descriptors without the GIL; failed copies are retried
    with torch index copies on the calling thread), ``"threads"`` or ``"torch"`` (torch
    index copies on the calling thread, the retry being the same once more), ``"auto"``
    (native where the C helper builds).

    ``host_file``: keep the slots in a :class:`SharedHostFile` made at that path
    (unlinked at :meth:`close`) instead of private memory; with ``host_file_owner``
    False, map the one another worker makes there (waiting for it) and leave it be.
    """

    def __init__(
        self,
        layout: PageLayout,
        num_slots: int,
        copy_engine: CpuCopyEngine,
        host_file: str | os.PathLike[str] | None = None,
        host_file_owner: bool = True,
    ) -> None:
        if layout.device.type != "cpu":
            raise ValueError(f"CpuPagedEngine needs CPU tensors, got {layout.device}")
        if copy_engine not in ("auto", "native", "threads", "torch"):
            raise ValueError(
                f"copy_engine must be 'auto', 'native', 'threads' or 'torch', got {copy_engine!r}"
            )
        self.layout = layout
        self.num_slots = num_slots
        nbytes = num_slots * layout.slot_bytes
        self.shared: SharedHostFile | None = None
        if host_file is None:
            self._map: mmap.mmap | None = mmap.mmap(-1, nbytes)
            self.host = torch.frombuffer(self._map, dtype=torch.uint8).view(
                num_slots, layout.slot_bytes
            )
        else:
            self.shared = _host_file(host_file, num_slots, layout.slot_bytes, host_file_owner)
            self._map = self.shared.map
            self.host = self.shared.tensor()
        self._host_base = self.host.data_ptr()
        self._pages = _HostPages(layout, [self.host], num_slots)
        lib = None if copy_engine in ("threads", "torch") else load_copy_engine()
        if copy_engine == "native" and lib is None:
            raise RuntimeError(
                "copy_engine='native' but the native copy engine is unavailable (see the log; "
                "asyncoffload._native.build_all() builds it ahead of time)"
            )
        self._lib = lib
        self._lanes = _DescriptorLanes(lib) if lib is not None else None
        self.primary_name = "cpu-native" if lib is not None else "cpu-torch"
        self.fallback_name = "cpu-torch"
        self.pid = _pid()
        # Dropped unclosed, the engine is released by this: its lanes stop before the
        # memory they copy to and from goes. It must not refer to the engine.
        self._finalizer = weakref.finalize(
            self,
            _release_lanes,
            self.pid,
            self._lanes,
            (self._map, self.host, list(layout.tensors), self.shared),
            discard=True,
        )

    def submit_primary(self, direction: int, plan: CopyPlan) -> CopyJob:
        check_process(self.pid, "CpuPagedEngine")
        if self._lib is None or self._lanes is None:
            return self.submit_fallback(direction, plan)
        host = self.host_addresses(plan)
        src, dst = (plan.kv_addr, host) if direction == STORE else (host, plan.kv_addr)
        lane = self._lanes.handle(direction)
        job = _NativeCopies(plan.nbytes, plan.num_copies, self._lib, lane)
        rc = self._lib.ao_lane_submit_copies(
            lane,
            plan.num_copies,
            src.data_ptr(),
            dst.data_ptr(),
            plan.size.data_ptr(),
            ctypes.addressof(job._status),
        )
        if rc != 0:
            raise RuntimeError(f"native copy lane refused the job (code {rc})")
        self._lanes.track(direction, job._status)
        return job

    def host_addresses(self, plan: CopyPlan) -> torch.Tensor:
        return self._host_base + plan.host_slot * self.layout.slot_bytes + plan.host_offset

    def submit_fallback(self, direction: int, plan: CopyPlan) -> CopyJob:
        check_process(self.pid, "CpuPagedEngine")
        job = CopyJob(plan.num_copies, plan.nbytes)
        self._pages.copy_cpu(direction, plan)
        job.finish()
        return job

    def wait(self, job: CopyJob) -> None:
        check_process(self.pid, "CpuPagedEngine")
        if isinstance(job, _NativeCopies):
            job.wait()
        elif not job.query():  # jobs of the torch path end before they are returned
            raise RuntimeError(f"{job!r} cannot be waited for")

    def quiesce(self, direction: int) -> None:
        # A failed native job copied nothing (the lane checks every descriptor first),
        # and later jobs of the lane touch other bytes: nothing to wait for.
        return None

    def read_slot(self, slot_id: int) -> bytes:
        return host_bytes(self.host[slot_id])

    def close(self) -> None:
        detached = self._finalizer.detach()
        if detached is not None:
            _, release, args, _ = detached
            release(*args, discard=False)  # finishes queued jobs, joins the threads
        # The tensors that view the map go first; the map then closes with its last
        # reference (closing it while a stray view lives would raise BufferError).
        self.host = torch.empty((0, self.layout.slot_bytes), dtype=torch.uint8)
        self._pages = _HostPages(self.layout, [], 1)
        self._map = None
        if self.shared is not None:
            self.shared.close()  # unlinks the file; the memory goes with the last view


class _RefSet(NamedTuple):
    """Refs of one group that one kernel launch moves: a device table ``[5, k]``
    (kv_base, kv_stride, host_off, page, nbytes) and what the launch needs to know."""

    table: torch.Tensor
    #: Every address and size of these refs is 8-byte aligned (host rows permitting).
    aligned: bool
    #: The largest ``nbytes`` of the refs.
    max_bytes: int


class _GroupRuns(NamedTuple):
    """A group's host bytes per slot, for the staged DMAs: refs moving whole pages
    (``full_*``, by tensor offset) and refs moving part of a page (``part_*``)."""

    #: The whole-page refs tile every slot: a full slot is one run of slot_bytes.
    dense: bool
    full_off: torch.Tensor  # [1, F] tensor offsets in the slot
    full_page: torch.Tensor  # [1, F]
    part_off: torch.Tensor  # [P, 1]
    part_page: torch.Tensor  # [P, 1]
    part_bytes: torch.Tensor  # [P, 1]


class _SharedPinnedPool:
    """:class:`~asyncoffload.transfer.cuda.PinnedHostPool`'s interface over a
    :class:`SharedHostFile`: the file's slots in chunks of about ``chunk_bytes`` rows,
    each registered with CUDA (``cudaHostRegister``, portable and mapped) so copies from
    it are asynchronous DMAs; a chunk that cannot be registered stays pageable (logged).
    :meth:`close` unregisters every chunk before the file is unlinked and unmapped."""

    def __init__(
        self, shared: SharedHostFile, chunk_bytes: int = 1 << 30, pin: bool = True
    ) -> None:
        from asyncoffload.transfer.cuda import _current_pid, _Registrar, _unpin

        self.shared = shared
        num_blocks, block_bytes = shared.num_slots, shared.slot_bytes
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.rows_per_chunk = max(1, chunk_bytes // block_bytes)
        self.chunks: list[torch.Tensor] = []
        self._registered: list[int] = []
        self.pinned_chunks = 0
        self.pageable_chunks = 0
        self._registrar = _Registrar() if pin else None
        # Unpins before the memory goes (the file and its map are held until then).
        self._finalizer = weakref.finalize(
            self, _unpin, _current_pid(), self._registrar, self._registered, []
        )
        whole = shared.tensor()
        device_bases: list[int] = []
        for first in range(0, num_blocks, self.rows_per_chunk):
            chunk = whole[first : first + self.rows_per_chunk]
            ptr, nbytes = chunk.data_ptr(), chunk.numel()
            err = self._registrar.register(ptr, nbytes) if self._registrar else None
            if err == 0:
                assert self._registrar is not None
                self._registered.append(ptr)
                self.pinned_chunks += 1
                device_bases.append(self._registrar.device_pointer(ptr))
            else:
                self.pageable_chunks += 1
                device_bases.append(ptr)
                if err is not None:
                    log.warning(
                        "could not pin a %d MiB chunk of the shared host pool %s (CUDA error "
                        "%s): pageable, copies from it are slower and synchronous",
                        nbytes >> 20,
                        shared.path,
                        err,
                    )
            self.chunks.append(chunk)
        ids = torch.arange(num_blocks, dtype=torch.int64)
        row_offset = (ids % self.rows_per_chunk) * block_bytes
        chunk_of = ids // self.rows_per_chunk
        self.block_address = (
            torch.tensor([c.data_ptr() for c in self.chunks], dtype=torch.int64)[chunk_of]
            + row_offset
        )
        self.device_block_address = (
            torch.tensor(device_bases, dtype=torch.int64)[chunk_of] + row_offset
        )

    @property
    def pinned(self) -> bool:
        return self.pageable_chunks == 0

    def block(self, host_id: int) -> torch.Tensor:
        return self.chunks[host_id // self.rows_per_chunk][host_id % self.rows_per_chunk]

    def runs(self, host_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        from asyncoffload.transfer.cuda import PinnedHostPool

        return PinnedHostPool.runs(self, host_ids)  # type: ignore[arg-type]

    def view(self, first: int, length: int) -> torch.Tensor:
        rows = self.rows_per_chunk
        row = first % rows
        return self.chunks[first // rows][row : row + length]

    def close(self) -> None:
        """Unpin, then unlink and unmap the file. The caller has synchronized every
        stream that touches it. Idempotent."""
        self._finalizer()
        self.chunks.clear()
        self.block_address = self.device_block_address = torch.empty(0, dtype=torch.int64)
        self.shared.close()


class CudaPagedEngine:
    """Copies between KV tensors on one CUDA device and pinned host slots.

    Host slots live in a :class:`~asyncoffload.transfer.cuda.PinnedHostPool` (chunks of
    about ``chunk_bytes``, page-aligned, pinned; pageable if pinning fails, logged). Each
    direction has one copy stream (and a kernel stream for the staged method); a transfer
    first waits for the caller's current stream. Methods, per transfer:

    - ``staged``: a Triton kernel gathers the job's pages into rows of device staging
      memory laid out like host slots (device memory only: fast), and the copy engines
      move each slot's bytes (one DMA descriptor per run of written bytes: one per slot,
      or per run of consecutive slots, for a group that fills its slots), double-buffered
      across the kernel and copy streams when the job is larger than the staging buffer;
      a load is the mirror (DMA into staging, then a scatter kernel). Only the bytes the
      job moves are copied: a store leaves the rest of its slots alone, a load writes only
      the job's KV pages. Staging (``staging_bytes`` per direction, two buffers) is
      allocated on first use;
    - ``kernel``: the Triton kernel copies every page through UVA straight between the
      KV tensors and the pinned slots (best for small pages);
    - ``batch``: one ``cuMemcpyBatchAsync`` over one descriptor per (block, ref) (CUDA
      12.8+): fine for a few descriptors, CPU-bound for many;
    - ``each``: one ``cuMemcpyAsync`` per descriptor: the fallback path;
    - ``torch``: torch gathers on the device and index copies on the host, synchronous
      (where the native CUDA helper cannot be built).

    ``auto`` (the primary path where Triton is installed and the pool is pinned) chooses
    per job (:meth:`choose_method`): ``batch`` under ``small_copies`` descriptors, else
    ``kernel`` if the mean page moved is at most ``kernel_max_fragment_bytes``, else
    ``staged``. The kernels and the staged path send the job's ids to the device (two
    small arrays), never one descriptor per (block, ref), so submitting costs about the
    same for any job size.

    ``host_file``: keep the slots in a :class:`SharedHostFile` made at that path (each
    chunk of it registered with ``cudaHostRegister``, unregistered and the file unlinked
    at :meth:`close`) instead of private pinned memory; with ``host_file_owner`` False,
    map (and register) the one another worker makes there, waiting for it.
    """

    def __init__(
        self,
        layout: PageLayout,
        num_slots: int,
        *,
        pin: bool = True,
        chunk_bytes: int = 1 << 30,
        staging_bytes: int = 256 << 20,
        kernel_max_fragment_bytes: int = 16 << 10,
        small_copies: int = 64,
        kernel_programs: int | None = None,
        host_file: str | os.PathLike[str] | None = None,
        host_file_owner: bool = True,
    ) -> None:
        from asyncoffload.transfer.cuda import (
            PinnedHostPool,
            _new_stream,
            _PinnedRing,
            _release_streams,
            _triton_available,
        )

        if layout.device.type != "cuda":
            raise ValueError(f"CudaPagedEngine needs CUDA tensors, got {layout.device}")
        self.layout = layout
        self.num_slots = num_slots
        device = layout.device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        with torch.cuda.device(device):
            self.pool: PinnedHostPool | _SharedPinnedPool
            if host_file is None:
                self.pool = PinnedHostPool(num_slots, layout.slot_bytes, chunk_bytes, pin)
            else:
                shared = _host_file(host_file, num_slots, layout.slot_bytes, host_file_owner)
                try:
                    self.pool = _SharedPinnedPool(shared, chunk_bytes, pin)
                except BaseException:
                    shared.close()
                    raise
            self.streams = (_new_stream(device), _new_stream(device))
            self.kernel_streams = (_new_stream(device), _new_stream(device))
        helpers = load_cuda_helpers()
        self._lib = helpers[0] if helpers else None
        features = helpers[1] if helpers else 0
        self.has_batch = bool(features & 2)
        self.has_each = bool(features & 16)
        #: Bytes of device staging memory per direction (two buffers), allocated on the
        #: first staged job of the direction; change it before then.
        self.staging_bytes = staging_bytes
        #: ``auto`` uses the kernel for jobs whose mean page is at most this many bytes.
        self.kernel_max_fragment_bytes = kernel_max_fragment_bytes
        #: ``auto`` uses ``batch`` for jobs of fewer descriptors.
        self.small_copies = small_copies
        if kernel_programs is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            kernel_programs = 2 * sms
        #: Programs per kernel launch (kernel, staged).
        self.kernel_programs = kernel_programs
        triton_ok = _triton_available() and self.pool.pinned
        self.has_kernel = triton_ok
        self.has_staged = triton_ok and (self.has_batch or self.has_each)
        base = [m for m, ok in (("batch", self.has_batch), ("each", self.has_each)) if ok]
        base.append("torch")
        #: The method of small jobs under ``auto`` (and the primary path without Triton).
        self.base_method = base[0]
        fallback = "each" if self.has_each else "torch"
        if fallback == self.base_method and not (self.has_kernel or self.has_staged):
            fallback = base[1] if len(base) > 1 else "torch"
        self.fallback_method = fallback
        self.fallback_name = f"cuda-{fallback}"
        self.primary_name = ""
        self.primary_method = "auto" if (self.has_kernel or self.has_staged) else base[0]
        #: Jobs submitted per method (primary and fallback attempts).
        self.jobs_by_method: dict[str, int] = dict.fromkeys(
            ("staged", "kernel", "batch", "each", "torch"), 0
        )
        #: cuMemcpyBatchAsync (source access order, flags) per direction: stores read KV
        #: in stream order; loads read slots nothing writes meanwhile, in any order.
        self.batch_attributes: tuple[tuple[int, int], tuple[int, int]] = ((1, 0), (3, 0))
        self._rings = (_PinnedRing(1 << 16), _PinnedRing(1 << 16))
        # Staging per direction: two [rows, row_stride] buffers, the next one to fill,
        # and for each the event after which it may be refilled.
        self.row_stride = -(-layout.slot_bytes // 256) * 256
        self._staging: list[list[torch.Tensor] | None] = [None, None]
        self._next_buffer = [0, 0]
        # Per direction and buffer: the events after its fill and after its last reader,
        # and whether they were recorded yet.
        self._staging_events: list[tuple[list[torch.cuda.Event], list[torch.cuda.Event]]] = []
        self._staging_used = [[False, False], [False, False]]
        self._ref_sets: list[list[_RefSet]] = []
        self._group_runs: list[_GroupRuns] = []
        self._slots_aligned = layout.slot_bytes % 8 == 0
        if triton_ok:
            try:
                self._prepare_kernels()
            except Exception as exc:  # a Triton that cannot compile here: DMA paths only
                log.warning("paged CUDA engine: copy kernels unavailable (%s)", exc)
                self.has_kernel = self.has_staged = False
                self.primary_method = self.base_method
        if not self.pool.pinned:
            log.warning(
                "paged CUDA engine: %d of %d host chunks are pageable; copies from them are "
                "slower and synchronous",
                self.pool.pageable_chunks,
                len(self.pool.chunks),
            )
        self.pid = _pid()
        # Dropped unclosed, the engine is released by this: its streams are waited for
        # before the memory they touch goes. It must not refer to the engine.
        self._finalizer = weakref.finalize(
            self,
            _release_streams,
            self.pid,
            (*self.kernel_streams, *self.streams),
            self.pool,  # type: ignore[arg-type]  # a _SharedPinnedPool closes alike
            [],
            (self._staging, self._rings, list(layout.tensors)),
        )

    @property
    def primary_method(self) -> str:
        return self._primary_method

    @primary_method.setter
    def primary_method(self, method: str) -> None:
        ok = {
            "auto": self.has_kernel or self.has_staged,
            "staged": self.has_staged,
            "kernel": self.has_kernel,
            "batch": self.has_batch,
            "each": self.has_each,
            "torch": True,
        }
        if not ok.get(method, False):
            raise ValueError(f"copy method {method!r} is unknown or unavailable here")
        self._primary_method = method
        self.primary_name = f"cuda-{method}"

    # --- tables ---------------------------------------------------------------------------

    def _prepare_kernels(self) -> None:
        """Per group: the kernel's ref tables (refs with 8-byte aligned addresses and
        sizes apart from the others) and the run templates of the staged DMAs; then
        compile the kernel variants the layout needs (a first submission would otherwise
        stall for it)."""
        layout = self.layout
        for refs in layout.group_refs:
            rows: list[tuple[list[int], bool]] = []
            for t, nb in refs:
                tensor = layout.tensors[t]
                row = [
                    tensor.data_ptr(),
                    tensor.stride(0),
                    layout.tensor_offset[t],
                    layout.page_bytes[t],
                    nb,
                ]
                rows.append((row, all(v % 8 == 0 for v in row)))
            sets: list[_RefSet] = []
            for aligned in (True, False):
                cols = [r for r, a in rows if a == aligned]
                if cols:
                    table = torch.tensor(cols, dtype=torch.int64).t().contiguous()
                    sets.append(_RefSet(table.to(self.device), aligned, max(c[4] for c in cols)))
            self._ref_sets.append(sets)
            full = sorted(
                (layout.tensor_offset[t], layout.page_bytes[t])
                for t, nb in refs
                if nb == layout.page_bytes[t]
            )
            part = [
                (layout.tensor_offset[t], layout.page_bytes[t], nb)
                for t, nb in refs
                if nb != layout.page_bytes[t]
            ]
            bpc = layout.blocks_per_chunk
            covered = sum(bpc * p for _, p in full)
            dense = (
                not part
                and covered == layout.slot_bytes
                and all(
                    off == (full[i - 1][0] + bpc * full[i - 1][1] if i else 0)
                    for i, (off, _) in enumerate(full)
                )
            )

            def col(v: list[int], shape: tuple[int, int]) -> torch.Tensor:
                return torch.tensor(v, dtype=torch.int64).view(shape)

            self._group_runs.append(
                _GroupRuns(
                    dense,
                    col([o for o, _ in full], (1, -1)),
                    col([p for _, p in full], (1, -1)),
                    col([o for o, _, _ in part], (-1, 1)),
                    col([p for _, p, _ in part], (-1, 1)),
                    col([n for _, _, n in part], (-1, 1)),
                )
            )
        self._host_table = self.pool.device_block_address.to(self.device)
        self._warm_up()

    def _warm_up(self) -> None:
        from asyncoffload.transfer._triton_paged import launch_copy_pages  # needs Triton

        dummy = torch.zeros(1, dtype=torch.int64, device=self.device)
        with torch.cuda.device(self.device):
            seen: set[tuple[bool, bool, bool, int]] = set()
            for sets in self._ref_sets:
                for refs in sets:
                    for store in (True, False):
                        for use_table in (True, False):
                            wide = refs.aligned and (self._slots_aligned or not use_table)
                            elems = refs.max_bytes // 8 if wide else refs.max_bytes
                            key = (store, use_table, wide, elems)
                            if key in seen:
                                continue
                            seen.add(key)
                            launch_copy_pages(
                                dummy,
                                refs.table,
                                self._host_table,
                                n_blocks=0,
                                j0=0,
                                g_off=0,
                                s_off=0,
                                skip=0,
                                bpc=1,
                                max_elems=elems,
                                row_base=1 << 40,
                                row_stride=self.row_stride,
                                row_lo=0,
                                store=store,
                                use_table=use_table,
                                wide=wide,
                                programs=1,
                            )
            torch.cuda.synchronize(self.device)

    # --- submission -----------------------------------------------------------------------

    def choose_method(self, plan: CopyPlan) -> str:
        """The method ``auto`` uses for ``plan``: ``batch`` (or the base method) for
        fewer than ``small_copies`` descriptors, ``kernel`` for small pages, else
        ``staged``."""
        copies = plan.num_copies
        if copies < self.small_copies or not (self.has_kernel or self.has_staged):
            return self.base_method
        if self.has_kernel and plan.nbytes <= copies * self.kernel_max_fragment_bytes:
            return "kernel"
        if self.has_staged and self.row_stride <= self.staging_bytes // 2:
            return "staged"
        return "kernel" if self.has_kernel else self.base_method

    def submit_primary(self, direction: int, plan: CopyPlan) -> CopyJob:
        method = self._primary_method
        if method == "auto":
            method = self.choose_method(plan)
        return self._submit(direction, plan, method)

    def submit_fallback(self, direction: int, plan: CopyPlan) -> CopyJob:
        return self._submit(direction, plan, self.fallback_method)

    def _submit(self, direction: int, plan: CopyPlan, method: str) -> CopyJob:
        from asyncoffload.transfer.cuda import CudaJob, mark_completion, start_timing

        check_process(self.pid, "CudaPagedEngine")
        stream = self.streams[direction]
        job = CudaJob(plan.num_copies, plan.nbytes, method)
        # A store reads finished KV; a load overwrites blocks only after the work queued
        # before it (the zeroing of fresh blocks, earlier reads) has run.
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            start_timing(job, stream)
            try:
                if plan.num_copies:
                    job._keep = self._enqueue(method, direction, plan, stream, current)
            except BaseException:
                # Part of it may be queued: let it end before anyone retries over it.
                self.kernel_streams[direction].synchronize()
                stream.synchronize()
                raise
            mark_completion(job, stream, None, None)
        assert job._event is not None
        for item in job._keep:
            if isinstance(item, torch.Tensor) and item.is_pinned():
                self._rings[direction].release(item, job._event)
        self.jobs_by_method[method] += 1
        return job

    def _enqueue(
        self,
        method: str,
        direction: int,
        plan: CopyPlan,
        stream: torch.cuda.Stream,
        caller: torch.cuda.Stream,
    ) -> list[torch.Tensor]:
        if method == "staged":
            return self._enqueue_staged(direction, plan, stream, caller)
        if method == "kernel":
            ids, ids_dev = self._upload_ids(direction, plan)
            for span in plan.spans:
                self._launch(span, ids_dev, plan, direction, None, 0, span.n, 0)
            return [ids, ids_dev]
        if method == "torch":
            self._torch_copy(direction, plan)
            return []
        assert self._lib is not None
        host = self.pool.block_address[plan.host_slot] + plan.host_offset
        src, dst = (plan.kv_addr, host) if direction == STORE else (host, plan.kv_addr)
        self._memcpy(method, stream, direction, src, dst, plan.size)
        # The driver reads the descriptor arrays during the call; they are kept until the
        # job ends all the same (cheap insurance).
        return [src, dst, plan.size]

    def _memcpy(
        self,
        method: str,
        stream: torch.cuda.Stream,
        direction: int,
        src: torch.Tensor,
        dst: torch.Tensor,
        size: torch.Tensor,
    ) -> None:
        """Copies ``size[i]`` bytes from ``src[i]`` to ``dst[i]`` (int64 CPU tensors) on
        ``stream``: one ``cuMemcpyBatchAsync`` (``batch``) or ``cuMemcpyAsync`` each."""
        assert self._lib is not None
        if method == "batch":
            rc = self._lib.ao_cuda_memcpy_batch(
                stream.cuda_stream,
                dst.data_ptr(),
                src.data_ptr(),
                size.data_ptr(),
                src.numel(),
                direction,
                self.device.index,
                *self.batch_attributes[direction],
            )
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc}")
        elif method == "each":
            rc = self._lib.ao_cuda_memcpy_each(
                stream.cuda_stream, dst.data_ptr(), src.data_ptr(), size.data_ptr(), src.numel()
            )
            if rc != 0:
                raise RuntimeError(f"cuMemcpyAsync failed: CUresult {rc}")
        else:
            raise ValueError(f"unknown copy method {method!r}")

    def _upload_ids(self, direction: int, plan: CopyPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's gpu ids then slot ids, on the device (copied on the current stream
        from a pinned ring region that is reused once the job has ended)."""
        n, m = plan.gpu_ids.numel(), plan.slot_ids.numel()
        ids = self._rings[direction].take(n + m)
        ids[:n] = plan.gpu_ids
        ids[n:] = plan.slot_ids
        return ids, ids.to(self.device, non_blocking=True)

    def _launch(
        self,
        span: GroupSpan,
        ids_dev: torch.Tensor,
        plan: CopyPlan,
        direction: int,
        staging: torch.Tensor | None,
        j0: int,
        j1: int,
        row_lo: int,
    ) -> None:
        """The kernel over blocks ``j0 .. j1 - 1`` of ``span``, one launch per ref set:
        to or from the host slots (``staging`` None), else staging rows (row 0 holds the
        span's slot position ``row_lo``, relative to ``span.slot_lo``)."""
        from asyncoffload.transfer._triton_paged import launch_copy_pages  # needs Triton

        use_table = staging is None
        row_base = 1 << 40 if staging is None else staging.data_ptr()
        for refs in self._ref_sets[span.group]:
            wide = refs.aligned and (self._slots_aligned or not use_table)
            launch_copy_pages(
                ids_dev,
                refs.table,
                self._host_table,
                n_blocks=j1 - j0,
                j0=j0,
                g_off=span.gpu_lo,
                s_off=plan.gpu_ids.numel() + span.slot_lo,
                skip=span.skip,
                bpc=self.layout.blocks_per_chunk,
                max_elems=refs.max_bytes // 8 if wide else refs.max_bytes,
                row_base=row_base,
                row_stride=self.row_stride,
                row_lo=row_lo,
                store=direction == STORE,
                use_table=use_table,
                wide=wide,
                programs=self.kernel_programs,
            )

    def _staged_kernels(
        self,
        plan: CopyPlan,
        ids_dev: torch.Tensor,
        direction: int,
        staging: torch.Tensor,
        lo: int,
        hi: int,
    ) -> None:
        """Gather (store) or scatter (load) the blocks whose slots are the job's slot
        positions ``lo .. hi - 1``, to or from staging rows ``0 .. hi - lo - 1``."""
        bpc = self.layout.blocks_per_chunk
        for span in plan.spans:
            a = max(lo, span.slot_lo) - span.slot_lo
            b = min(hi, span.slot_lo + span.num_slots) - span.slot_lo
            if a >= b:
                continue
            j0 = max(0, a * bpc - span.skip)
            j1 = min(span.n, b * bpc - span.skip)
            if j0 < j1:
                self._launch(span, ids_dev, plan, direction, staging, j0, j1, lo - span.slot_lo)

    def _staging_buffers(self, direction: int) -> list[torch.Tensor]:
        buffers = self._staging[direction]
        if buffers is None:
            rows = max(1, min(self.staging_bytes // 2 // self.row_stride, self.num_slots))
            buffers = [
                torch.empty((rows, self.row_stride), dtype=torch.uint8, device=self.device)
                for _ in range(2)
            ]
            self._staging[direction] = buffers
            while len(self._staging_events) < 2:
                self._staging_events.append(
                    (
                        [torch.cuda.Event() for _ in range(2)],  # type: ignore[no-untyped-call]
                        [torch.cuda.Event() for _ in range(2)],  # type: ignore[no-untyped-call]
                    )
                )
        return buffers

    def staged_runs(self, plan: CopyPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The host bytes a staged job moves, as runs ``(slot position, offset in the
        slot, bytes)`` (int64 CPU tensors), by slot position within each group."""
        bpc = self.layout.blocks_per_chunk
        slot_bytes = self.layout.slot_bytes
        pos_parts: list[torch.Tensor] = []
        off_parts: list[torch.Tensor] = []
        size_parts: list[torch.Tensor] = []

        def slot_runs(k: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, r: _GroupRuns) -> None:
            # Per slot k (relative), sub-pages s0 .. s1 - 1 of every whole-page ref.
            nf = r.full_off.shape[1]
            if not nf or not k.numel():
                return
            pos_parts.append((k + lo).view(-1, 1).expand(-1, nf).reshape(-1))
            off_parts.append((r.full_off + s0.view(-1, 1) * r.full_page).view(-1))
            size_parts.append(((s1 - s0).view(-1, 1) * r.full_page).view(-1))

        for g, _, n, lo, nslots, skip in plan.spans:
            r = self._group_runs[g]
            end = skip + n  # sub-pages in use: skip .. end - 1 over the group's slots
            if r.dense:
                first_partial = skip != 0 or end < bpc
                last_partial = end % bpc != 0
                a = 1 if first_partial else 0
                b = nslots - 1 if last_partial and nslots - 1 >= a else nslots
                if first_partial:
                    one = torch.tensor([0], dtype=torch.int64)
                    slot_runs(one, one * 0 + skip, one * 0 + min(end, bpc), r)
                if b > a:
                    pos_parts.append(torch.arange(lo + a, lo + b, dtype=torch.int64))
                    off_parts.append(torch.zeros(b - a, dtype=torch.int64))
                    size_parts.append(torch.full((b - a,), slot_bytes, dtype=torch.int64))
                if last_partial and b < nslots and (nslots - 1 != 0 or not first_partial):
                    last = torch.tensor([nslots - 1], dtype=torch.int64)
                    slot_runs(last, last * 0, last * 0 + end - (nslots - 1) * bpc, r)
                continue
            k = torch.arange(nslots, dtype=torch.int64)
            s0 = torch.zeros(nslots, dtype=torch.int64)
            s0[0] = skip
            s1 = torch.clamp(end - k * bpc, max=bpc)
            slot_runs(k, s0, s1, r)
            if r.part_off.numel():
                p = torch.arange(skip, end, dtype=torch.int64).view(1, -1)
                np_ = r.part_off.shape[0]
                pos_parts.append((lo + p // bpc).expand(np_, -1).reshape(-1))
                off_parts.append((r.part_off + (p % bpc) * r.part_page).reshape(-1))
                size_parts.append(r.part_bytes.expand(-1, n).reshape(-1))
        return _cat(pos_parts), _cat(off_parts), _cat(size_parts)

    def _enqueue_staged(
        self,
        direction: int,
        plan: CopyPlan,
        stream: torch.cuda.Stream,
        caller: torch.cuda.Stream,
    ) -> list[torch.Tensor]:
        """See the class docstring. The kernel stream starts after the caller's queued
        work; staging buffer ``b`` is refilled only after the work that last read it (the
        DMA of a store, the scatter of a load), across jobs too. Everything ends on the
        copy stream, where the job's completion marker is recorded."""
        kstream = self.kernel_streams[direction]
        kstream.wait_stream(caller)
        buffers = self._staging_buffers(direction)
        ready_events, done_events = self._staging_events[direction]
        used = self._staging_used[direction]
        rows = buffers[0].shape[0]
        store = direction == STORE
        total = plan.slot_ids.numel()
        first = self._next_buffer[direction]
        src, dst, size, counts = self._staged_dmas(plan, rows, buffers, first, store)
        dma = "batch" if self.has_batch else "each"
        # Kernels go to the kernel stream (current here), DMAs and events name their
        # stream. Buffer b's events are re-recorded at each use: a wait takes the most
        # recent record, which is the work that last read the buffer.
        with torch.cuda.stream(kstream):
            ids, ids_dev = self._upload_ids(direction, plan)
            at = 0
            for k, lo in enumerate(range(0, total, rows)):
                hi = min(total, lo + rows)
                buf = (first + k) % 2
                self._next_buffer[direction] = buf ^ 1
                staging, ready, done = buffers[buf], ready_events[buf], done_events[buf]
                # The chunk's DMA descriptors (contiguous slices: their data_ptr is read).
                end = at + counts[k]
                c_src, c_dst, c_size = src[at:end], dst[at:end], size[at:end]
                at = end
                if store:
                    if used[buf]:
                        kstream.wait_event(done)  # the DMA that last read this buffer
                    self._staged_kernels(plan, ids_dev, direction, staging, lo, hi)
                    ready.record(kstream)
                    stream.wait_event(ready)
                    if c_size.numel():
                        self._memcpy(dma, stream, direction, c_src, c_dst, c_size)
                    done.record(stream)
                else:
                    if used[buf]:
                        stream.wait_event(done)  # the scatter that last read this buffer
                    if c_size.numel():
                        self._memcpy(dma, stream, direction, c_src, c_dst, c_size)
                    ready.record(stream)
                    kstream.wait_event(ready)
                    self._staged_kernels(plan, ids_dev, direction, staging, lo, hi)
                    done.record(kstream)
                used[buf] = True
        # The job ends on the copy stream, after the kernel stream's last work.
        stream.wait_stream(kstream)
        return [ids, ids_dev, src, dst, size]

    def _staged_dmas(
        self, plan: CopyPlan, rows: int, buffers: list[torch.Tensor], first: int, store: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """The DMA descriptors (src, dst, size) of a staged job, chunk after chunk (chunk
        ``k``: slot positions ``k * rows ..``, in buffer ``(first + k) % 2``), and how
        many each chunk has. Runs contiguous in staging and in one host chunk merge."""
        pos, off, size = self.staged_runs(plan)
        nchunks = -(-plan.slot_ids.numel() // rows)
        chunk = pos // rows
        if nchunks > 1 and bool((chunk[1:] < chunk[:-1]).any()):
            order = torch.argsort(chunk, stable=True)
            pos, off, size, chunk = pos[order], off[order], size[order], chunk[order]
        slot = plan.slot_ids[pos]
        bases = torch.tensor([buffers[0].data_ptr(), buffers[1].data_ptr()], dtype=torch.int64)
        base = bases[(chunk + first) % 2] if nchunks > 1 else bases[first]
        dev = base + (pos - chunk * rows) * self.row_stride + off
        host = self.pool.block_address[slot] + off
        # A merged run stays in one chunk: host chunks and staging chunks both break it.
        key = (slot // self.pool.rows_per_chunk) * (nchunks + 1) + chunk
        src, dst, size, key = _merge_runs(dev, host, size, key, store=store)
        if nchunks == 1:
            return src, dst, size, [size.numel()]
        counts = torch.bincount(key % (nchunks + 1), minlength=nchunks).tolist()
        return src, dst, size, counts

    def _torch_copy(self, direction: int, plan: CopyPlan) -> None:
        """Synchronous torch copies on the current (copy) stream: per ref, a device
        gather or scatter of the blocks and one staging copy to or from the host."""
        layout = self.layout
        pages = _HostPages(layout, self.pool.chunks, self.pool.rows_per_chunk)
        blocks_dev = plan.kv_block.to(self.device)
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        group = -1
        for t, nb, lo, hi, g in plan.segments:
            if g != group:
                group = g
                parts = pages.split(plan, t, lo, hi)
            kv = layout.byte_views[t][:, :nb]
            blocks = blocks_dev[lo:hi]
            if direction == STORE:
                pages.scatter(parts, t, kv.index_select(0, blocks).cpu())  # waits for it
            else:
                staged = torch.empty((hi - lo, nb), dtype=torch.uint8)
                pages.gather(parts, t, staged)
                kv.index_copy_(0, blocks, staged.to(self.device))

    def wait(self, job: CopyJob) -> None:
        from asyncoffload.transfer.cuda import CudaJob

        check_process(self.pid, "CudaPagedEngine")
        if job.query():
            return
        event = job._event if isinstance(job, CudaJob) else None
        if event is None:
            raise RuntimeError(f"{job!r} cannot be waited for")
        try:
            event.synchronize()
        except RuntimeError as exc:  # a CUDA error surfaced by the event
            job.finish(exc)
        job.query()

    def quiesce(self, direction: int) -> None:
        check_process(self.pid, "CudaPagedEngine")
        self.kernel_streams[direction].synchronize()
        self.streams[direction].synchronize()

    def read_slot(self, slot_id: int) -> bytes:
        return host_bytes(self.pool.block(slot_id))

    def close(self) -> None:
        detached = self._finalizer.detach()
        if detached is not None:
            _, release, args, _ = detached
            release(*args)  # waits for the streams, then unpins the pool
        self._staging = [None, None]


def _merge_runs(
    dev: torch.Tensor, host: torch.Tensor, size: torch.Tensor, key: torch.Tensor, *, store: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, size, key) DMA descriptors for runs between device addresses ``dev``
    and host addresses ``host``: neighbours contiguous on both sides and of one ``key``
    (host chunk, one registration; staging chunk) become one descriptor."""
    n = size.numel()
    if n > 1:
        dev_end = dev + size
        cont = (
            (dev[1:] == dev_end[:-1]) & (host[1:] == host[:-1] + size[:-1]) & (key[1:] == key[:-1])
        )
        if bool(cont.any()):
            first = torch.ones(n, dtype=torch.bool)
            first[1:] = ~cont
            starts = torch.nonzero(first).view(-1)
            ends = torch.empty_like(starts)
            ends[:-1] = starts[1:] - 1
            ends[-1] = n - 1
            size = dev_end[ends] - dev[starts]
            dev, host, key = dev[starts], host[starts], key[starts]
    return (dev, host, size, key) if store else (host, dev, size, key)
