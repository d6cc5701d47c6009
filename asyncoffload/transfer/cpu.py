"""The CPU backend: copies between plain (CPU) KV tensors and a host block pool.

Host memory is one ``[num_host_blocks, block_bytes]`` uint8 tensor, block-major. Each
direction has one copy lane whose jobs run in submission order. Two copy engines:

- ``native`` (default where a C compiler is available): a native thread per lane runs
  ``memcpy`` over (src, dst, bytes) descriptors and writes the completion wake fd itself.
  It never takes the GIL, so a busy event loop cannot starve it.
- ``threads``: a Python thread per lane running torch gather/scatter ops. Portable, but
  it needs the GIL between ops: on a loop that is busy with Python work, CPython hands
  it the GIL late, and copies stretch (see docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import queue
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal, NoReturn

import torch

from asyncoffload._native import holding_gil, load_copy_engine, load_mgrcore
from asyncoffload.hostmem import check_host_bytes, format_bytes
from asyncoffload.layout import KVLayout
from asyncoffload.transfer.base import (
    CopyJob,
    HostRegion,
    TransferBackend,
    _Process,
    forked_since,
    host_bytes,
)
from asyncoffload.transfer.faults import FaultDecision, wrap_job

__all__ = ["CpuCopyBackend"]

log = logging.getLogger("asyncoffload.transfer")

CopyEngine = Literal["auto", "native", "threads"]


class _NativeJob(CopyJob):
    """A job run by a native lane; done when the lane's release store says so."""

    __slots__ = ("_lib", "_status")

    def __init__(self, num_blocks: int, nbytes: int, lib: ctypes.CDLL) -> None:
        super().__init__(num_blocks, nbytes)
        self._lib = lib
        self._status = (ctypes.c_int64 * 2)()

    @property
    def status_address(self) -> int:
        return ctypes.addressof(self._status)

    def query(self) -> bool:
        if not self._done:
            state = self._lib.ao_status_load(self.status_address)
            if state:
                # perf_counter_ns is CLOCK_MONOTONIC, the clock the lane stamped.
                self.error = None if state > 0 else _discarded(-state)
                self.finished_ns = self._status[1]
                self._done = True
        return self._done


_PAGE = 4096


def _page_aligned(rows: int, row_bytes: int) -> torch.Tensor:
    """A zeroed ``[rows, row_bytes]`` uint8 tensor starting on a 4096-byte boundary, so
    that lower tiers can read and write host slots with ``O_DIRECT`` (no bounce copy
    when ``row_bytes`` is a multiple of 4096 too)."""
    raw = torch.zeros(rows * row_bytes + _PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % _PAGE
    return raw[skip : skip + rows * row_bytes].view(rows, row_bytes)


#: With ``shared_host``, the bytes kept free before each host slot: a lower tier's block
#: header (asyncoffload.tiers.format.HEADER_BYTES) goes there, beside the payload.
SLOT_ROOM = 4096


def _shared_pages(rows: int, row_bytes: int) -> tuple[torch.Tensor, int, mmap.mmap]:
    """As :func:`_page_aligned`, in a ``memfd`` that another process can map, with
    ``SLOT_ROOM`` bytes before each row: the ``[rows, row_bytes]`` tensor (rows
    ``SLOT_ROOM + row_bytes`` apart), the fd (to close when done) and the mapping it
    views."""
    stride = SLOT_ROOM + row_bytes
    size = max(rows * stride, 1)
    fd = os.memfd_create("asyncoffload-host", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    return flat[: rows * stride].view(rows, stride)[:, SLOT_ROOM:], fd, mm


def _discarded(errno: int) -> OSError:
    return OSError(errno, "the copy was discarded unrun: its backend was dropped")


_ThreadItem = tuple[
    CopyJob,
    Callable[[torch.Tensor, torch.Tensor], None],
    tuple[torch.Tensor, torch.Tensor],
    Callable[[], None],
]


def _run_thread_lane(jobs: queue.SimpleQueue[_ThreadItem | None]) -> None:
    while True:
        item = jobs.get()
        if item is None:  # stop
            return
        job, fn, args, wake = item
        del item
        try:
            fn(*args)
        except BaseException as exc:  # reported through the job, never lost
            job.finish(exc)
        else:
            job.finish()
        try:
            wake()
        except Exception:  # a closed loop: nobody is waiting any more
            log.debug("copy lane: the wake-up failed", exc_info=True)
        # An idle lane must not keep the last copy's backend alive (through ``fn``):
        # dropping it lets the backend's finalizer stop this lane.
        del job, fn, args, wake


#: How long a submission waits for a lane thread whose start an interrupt cut short to
#: show that it runs, before taking it for never started.
_START_GRACE_S = 1.0


class _ThreadLane:
    """A Python thread that runs copies of one direction, in order; started by the
    first submission."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_ThreadItem | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running = False  # the thread's start() returned
        self._stopped = False

    def submit(
        self,
        job: CopyJob,
        fn: Callable[[torch.Tensor, torch.Tensor], None],
        args: tuple[torch.Tensor, torch.Tensor],
        wake: Callable[[], None],
    ) -> None:
        if not self._running:
            self._start()
        self._queue.put((job, fn, args, wake))

    def _start(self) -> None:
        if self._stopped:
            raise RuntimeError("copy lane is closed")
        thread = self._thread
        # An interrupt inside start() may come before the thread was spawned or after:
        # the lane keeps the thread from before start(), so one that runs is never lost
        # (nor a second one started beside it), and one that never started is replaced.
        if thread is not None and not _started(thread, _START_GRACE_S):
            thread = None
        if thread is None:
            thread = threading.Thread(
                target=_run_thread_lane, args=(self._queue,), name=self._name, daemon=True
            )
            self._thread = thread
            thread.start()
        self._running = True

    def stop(self, discard: bool = False) -> None:
        """Stop after the queued copies (queued copies hold their backend alive, so a
        finalizer never finds any: ``discard`` changes nothing here)."""
        self._stopped = True
        self._running = False
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if _started(thread, _START_GRACE_S) and threading.current_thread() is not thread:
                thread.join()


def _started(thread: threading.Thread, timeout: float) -> bool:
    """Whether ``thread`` runs (or ran), waiting up to ``timeout`` seconds for it to
    show (it sets its ident first thing)."""
    deadline = time.monotonic() + timeout
    while thread.ident is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


class _NativeLane:
    """A native thread that copies blocks of one direction, in order, without the GIL;
    started by the first submission. It keeps the status words of the jobs it may still
    write, since a job object may be dropped before its copy ends."""

    def __init__(self, lib: ctypes.CDLL, direction: int, tables: _FragmentTables) -> None:
        self._lib = lib
        self._direction = direction
        self._tables = tables
        self._submit = holding_gil(lib.ao_lane_submit)
        self._copy = holding_gil(lib.ao_copy_blocks)
        # The manager core's CPython entry to ao_copy_blocks, where it is built: a small
        # copy's ids go to C without ctypes or arrays.
        self._core = load_mgrcore()
        self._copy_address = ctypes.cast(lib.ao_copy_blocks, ctypes.c_void_p).value
        #: ``(copy function, fragment tables, direction)``: the addresses and code that
        #: ``mgrcore.call_blocks`` (and ``one_step``) take; ``None`` without the core.
        self.target: tuple[int, int, int] | None = None
        if self._core is not None and self._copy_address:
            self.target = (self._copy_address, tables.address, direction)
        self._handle: int | None = None
        #: The native lane, once created (one handle at most): what ``stop`` destroys.
        self._owned: list[int | None] = []
        self._wake_fd = -1
        self._stopped = False
        self._pending: deque[ctypes.Array[ctypes.c_int64]] = deque()

    def set_wake_fd(self, fd: int) -> None:
        """Signal ``fd`` from now on; once this returns, the previous fd is never
        written again (the lane writes under the lock this takes)."""
        self._wake_fd = fd
        for handle in self._owned:
            if handle:
                self._lib.ao_lane_set_wake_fd(handle, fd)

    def _start(self) -> int:
        if self._stopped:
            raise RuntimeError("copy lane is closed")
        owned = self._owned
        if not owned:
            # extend(map(...)) files the new lane's handle before any bytecode runs after
            # the C call, so an interrupt cannot come between starting the native thread
            # and owning it (a thread nobody stops).
            owned.extend(map(self._lib.ao_lane_create, (self._wake_fd,)))
        handle = owned[0]
        if not handle:
            owned.clear()
            raise OSError("ao_lane_create failed")
        self._handle = handle
        return int(handle)

    def idle(self) -> bool:
        """Whether the lane has no job left to copy."""
        pending = self._pending
        while pending and pending[0][0]:  # the lane is done with these (in order)
            pending.popleft()
        return not pending

    def copy_now(self, kv_ids: Sequence[int], host_ids: Sequence[int]) -> int:
        """Copy on this thread what :meth:`submit` would have the lane copy. Returns 0,
        or (nothing copied) -3 / -4 when a KV / host block id is out of bounds."""
        if self._stopped:
            raise RuntimeError("copy lane is closed")
        tables = self._tables.address
        if self._core is not None and type(kv_ids) in _SEQ and type(host_ids) in _SEQ:
            rc = self._core.call_blocks(
                self._copy_address, tables, self._direction, kv_ids, host_ids
            )
            if rc is not None:
                return int(rc)
        ids = array("q", kv_ids)
        ids.extend(host_ids)
        return int(self._copy(tables, self._direction, len(kv_ids), ids.buffer_info()[0]))

    def submit(self, job: _NativeJob, kv_ids: Sequence[int], host_ids: Sequence[int]) -> None:
        handle = self._handle
        if handle is None:
            handle = self._start()
        pending = self._pending
        while pending and pending[0][0]:  # the lane is done with these (in order)
            pending.popleft()
        ids = array("q", kv_ids)
        ids.extend(host_ids)
        rc = self._submit(
            handle,
            self._tables.address,
            self._direction,
            len(kv_ids),
            ids.buffer_info()[0],
            job.status_address,
        )
        if rc != 0:
            _refused(rc, self._tables, "native copy lane refused the job")
        pending.append(job._status)

    def stop(self, discard: bool = False) -> None:
        """Finish (or, with ``discard``, drop) the queued jobs and join the thread."""
        self._stopped = True
        self._handle = None
        owned = self._owned
        while owned:
            handle = owned[-1]
            if handle:
                if discard:
                    self._lib.ao_lane_cancel(handle)
                self._lib.ao_lane_destroy(handle)  # ends the running job, joins the thread
            owned.pop()
        self._pending.clear()


#: What the manager core's call_blocks converts itself.
_SEQ = (list, tuple)


def _refused(rc: int, tables: _FragmentTables, what: str) -> NoReturn:
    """Raise what a native call's code ``rc`` means (see copy_engine.c)."""
    if rc == -3:
        raise IndexError(f"KV block ids must lie in [0, {tables.words[6]})")
    if rc == -4:
        raise IndexError(f"host block ids must lie in [0, {tables.words[7]})")
    raise RuntimeError(f"{what} (code {rc})")


class _FragmentTables:
    """Where fragment f of a block lives, for the native lanes (which read these arrays
    until they stop, so the backend keeps them)."""

    def __init__(
        self, fragments: list[torch.Tensor], host: torch.Tensor, frag_bytes: int, kv_blocks: int
    ) -> None:
        self.kv_base = array("q", [v.data_ptr() for v in fragments])
        self.kv_stride = array("q", [v.stride(0) for v in fragments])
        #: What the native calls take: nfrag, host_base, the host slots' stride (their
        #: bytes, more with room before each: shared_host), frag_bytes, the addresses of
        #: kv_base and kv_stride, and the KV and host blocks there are (see copy_engine.c).
        self.words = array(
            "q",
            [
                len(fragments),
                host.data_ptr(),
                host.stride(0),
                frag_bytes,
                self.kv_base.buffer_info()[0],
                self.kv_stride.buffer_info()[0],
                kv_blocks,
                host.shape[0],
            ],
        )
        self.address = self.words.buffer_info()[0]


def _release_lanes(
    pid: int,
    lanes: list[_NativeLane] | list[_ThreadLane],
    fds: list[int],
    memory: tuple[object, ...],
    *,
    discard: bool,
) -> None:
    """Stop ``lanes`` (finishing their queued copies, or discarding them), then close
    ``fds``; ``memory``, what the lanes copy to and from, is let go only after this
    returns. A backend's finalizer (``discard``: nobody can see the copies any more) and
    its ``close()``. In a fork's child the lanes are the parent's: left alone."""
    if not forked_since(pid):
        for lane in lanes:
            lane.stop(discard)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    del memory


class CpuCopyBackend(TransferBackend):
    """Copies between CPU KV tensors and a host block pool, off the event-loop thread.

    ``copy_engine`` picks the engine (see the module docstring); ``"auto"`` takes the
    native one where it can be built. ``name`` says which is active.

    With the native engine, a job of at most ``inline_bytes`` whose lane is idle is
    copied by ``submit_*`` itself, on the calling thread: a hop to a lane thread and
    back (a wake-up each way) costs tens of microseconds on a virtual machine, more than
    copying that much (see docs/benchmarks.md). 0 sends every job to its lane.

    ``shared_host``: keep the host slots in a ``memfd`` (:meth:`host_regions`), 4096 bytes
    apart (``SLOT_ROOM``, room for a block's header), so that a lower tier's helper
    process maps them and moves blocks in and out without a copy (the Mooncake tier).
    The memory is then shared with a fork's child, not copied on write; the engine
    refuses to be used from a fork anyway.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        num_host_blocks: int,
        copy_engine: CopyEngine = "auto",
        inline_bytes: int = 0,
        shared_host: bool = False,
    ) -> None:
        if layout.device.type != "cpu":
            raise ValueError(f"CpuCopyBackend needs CPU tensors, got {layout.device}")
        if num_host_blocks <= 0:
            raise ValueError(f"num_host_blocks must be positive, got {num_host_blocks}")
        if isinstance(inline_bytes, bool) or not isinstance(inline_bytes, int) or inline_bytes < 0:
            raise ValueError(f"inline_bytes must be a non-negative int, got {inline_bytes!r}")
        super().__init__(layout, num_host_blocks)
        self.inline_bytes = inline_bytes
        self._block_bytes = layout.block_bytes
        self._kv = list(kv_caches)  # the native lanes hold raw addresses into these
        self._fragments = layout.fragment_views(self._kv)
        check_host_bytes(
            num_host_blocks * layout.block_bytes,
            f"the CPU tier ({num_host_blocks} blocks of {format_bytes(layout.block_bytes)}: "
            "cpu_blocks)",
        )
        #: The host slots' memfd and its mapping (``shared_host``), else -1 / None.
        self._host_fd = -1
        self._host_map: mmap.mmap | None = None
        if shared_host:
            self.host, self._host_fd, self._host_map = _shared_pages(
                num_host_blocks, layout.block_bytes
            )
        else:
            self.host = _page_aligned(num_host_blocks, layout.block_bytes)
        frag = layout.fragment_bytes
        self._host_columns = [
            self.host[:, i * frag : (i + 1) * frag] for i in range(len(self._fragments))
        ]
        self._closed = False
        lib = None if copy_engine == "threads" else load_copy_engine()
        if copy_engine == "native" and lib is None:
            raise RuntimeError(
                "copy_engine='native' but the native copy engine is unavailable (see the log; "
                "asyncoffload._native.build_all() builds it ahead of time)"
            )
        self._lib = lib
        # The wake-up fd the native lanes write: our own duplicate of the one bound, so
        # that its owner closing it can never make a lane write into a reused fd number.
        self._fds: list[int] = []
        lanes: list[_NativeLane] | list[_ThreadLane]
        if lib is not None:
            self.name = "cpu-native"
            self._tables = _FragmentTables(self._fragments, self.host, frag, layout.num_blocks)
            self._native_store = _NativeLane(lib, 0, self._tables)
            self._native_load = _NativeLane(lib, 1, self._tables)
            lanes = [self._native_store, self._native_load]
            memory: tuple[object, ...] = (self.host, self._kv, self._tables)
        else:
            self.name = "cpu-threads"
            self._store_lane = _ThreadLane("asyncoffload-store")
            self._load_lane = _ThreadLane("asyncoffload-load")
            lanes = [self._store_lane, self._load_lane]
            memory = ()
        # Dropped unclosed, the backend is released by this; it must not refer to the
        # backend (that would keep it alive), only to what the lanes touch.
        self._finalizer = weakref.finalize(
            self, _release_lanes, self.pid, lanes, self._fds, memory, discard=True
        )

    def bind(self, wake: Callable[[], None], wake_fd: int | None = None) -> None:
        super().bind(wake, wake_fd)
        # In a fork's child the lanes (and their locks) are the parent's: leave them be.
        if self._lib is not None and not self._closed and not forked_since(self.pid):
            fds = self._fds  # what close() (or the finalizer) closes
            stale = fds[:]
            fd = -1
            if wake_fd is not None:
                # Filed by the same C call that makes it (see _NativeLane._start): an
                # interrupt cannot leak it.
                fds.extend(map(os.dup, (wake_fd,)))
                fd = fds[-1]
            self._native_store.set_wake_fd(fd)
            self._native_load.set_wake_fd(fd)
            for old in stale:  # the lanes no longer write these
                fds.remove(old)
                os.close(old)

    # --- submission ---

    def _check(self, ids: Sequence[int], limit: int, what: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= limit):
            raise IndexError(f"{what} ids must lie in [0, {limit})")

    def submit_store(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyJob:
        return self._submit("store", gpu_ids, host_ids)

    def submit_load(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> CopyJob:
        return self._submit("load", gpu_ids, host_ids)

    def _submit(self, direction: str, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyJob:
        if self.pid != _Process.pid:
            self.check_process()
        if self._closed:
            raise RuntimeError("CpuCopyBackend is closed")
        n = len(gpu_ids)
        if n != len(host_ids):
            raise ValueError(f"{n} KV block ids but {len(host_ids)} host ids")
        nbytes = n * self.layout.block_bytes
        if self._lib is None:
            self._check(gpu_ids, self.layout.num_blocks, "KV block")
            self._check(host_ids, self.num_host_blocks, "host block")
            job = CopyJob(n, nbytes)
            gidx = torch.as_tensor(gpu_ids, dtype=torch.int64)
            hidx = torch.as_tensor(host_ids, dtype=torch.int64)
            fault = self._lane_fault
            if direction == "store":
                copy = self._copy_store if fault is None else fault.lane_copy(self._copy_store)
                self._store_lane.submit(job, copy, (gidx, hidx), self._wake)
            else:
                copy = self._copy_load if fault is None else fault.lane_copy(self._copy_load)
                self._load_lane.submit(job, copy, (hidx, gidx), self._wake)
            return job
        lane = self._native_store if direction == "store" else self._native_load
        # The native calls check the ids' bounds (IndexError, nothing copied).
        if nbytes <= self.inline_bytes and lane.idle():
            return self._copied_here(lane, n, nbytes, gpu_ids, host_ids)
        native_job = _NativeJob(n, nbytes, self._lib)
        lane.submit(native_job, gpu_ids, host_ids)
        return native_job

    def copy_now(
        self, store: bool, gpu_ids: Sequence[int], host_ids: Sequence[int]
    ) -> CopyJob | None:
        """A job of at most ``inline_bytes`` on the native engine, its lane idle, and
        ``submit_*`` of that direction the class's own (not a fault plan's wrapper, nor
        a test's): copied here (see :meth:`TransferBackend.copy_now`)."""
        n = len(gpu_ids)
        lane = self._lane_here(store, n) if n == len(host_ids) else None
        if lane is None:
            return None
        return self._copied_here(lane, n, n * self._block_bytes, gpu_ids, host_ids)

    def copy_target(self, store: bool, n: int) -> tuple[int, int, int] | None:
        """Where :meth:`copy_now` would copy a job of ``n`` blocks here, for a caller
        that copies it in C (``mgrcore.one_step``): the native copy function's address,
        the fragment tables' address and the direction; ``None`` where ``copy_now``
        would not copy it here (the same checks: :meth:`_lane_here`)."""
        lane = self._lane_here(store, n)
        return lane.target if lane is not None else None

    def _lane_here(self, store: bool, n: int) -> _NativeLane | None:
        """The native lane of a job of ``n`` blocks that may be copied on this thread
        now: at most ``inline_bytes``, the native engine open, ``submit_*`` of that
        direction the class's own, the lane idle; else ``None``."""
        if (
            n * self._block_bytes > self.inline_bytes
            or self._lib is None
            or self._closed
            or ("submit_store" if store else "submit_load") in self.__dict__
        ):
            return None
        if self.pid != _Process.pid:
            self.check_process()
        lane = self._native_store if store else self._native_load
        return lane if lane.idle() else None

    def _copied_here(
        self,
        lane: _NativeLane,
        n: int,
        nbytes: int,
        gpu_ids: Sequence[int],
        host_ids: Sequence[int],
    ) -> CopyJob:
        """The ended job of ``lane``'s copy run on this thread (an IndexError, nothing
        copied, for ids out of bounds)."""
        job = CopyJob(n, nbytes)
        rc = lane.copy_now(gpu_ids, host_ids)
        if rc:
            _refused(rc, self._tables, "the copy was refused")
        job.finish_inline()
        return job

    #: Set while a faulted submission runs (see ``_submit_faulted``): the Python lane
    #: applies its delay and copy error itself.
    _lane_fault: FaultDecision | None = None

    def _submit_faulted(
        self,
        submit: Callable[[Sequence[int], Sequence[int]], CopyJob],
        first: Sequence[int],
        second: Sequence[int],
        decision: FaultDecision,
    ) -> CopyJob:
        if self._lib is not None:  # native lanes: the job ends late or failed
            return super()._submit_faulted(submit, first, second, decision)
        # Python lanes sleep before the copy (the jobs behind wait too) and raise
        # instead of copying.
        self._lane_fault = decision
        try:
            job = submit(first, second)
        finally:
            self._lane_fault = None
        return wrap_job(job, decision, self._notify, in_lane=True)

    # The Python-thread copies; tests override these to inject failures or delays.

    def _copy_store(self, gpu_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        for src, dst in zip(self._fragments, self._host_columns):
            dst.index_copy_(0, host_idx, src.index_select(0, gpu_idx))

    def _copy_load(self, host_idx: torch.Tensor, gpu_idx: torch.Tensor) -> None:
        for src, dst in zip(self._host_columns, self._fragments):
            dst.index_copy_(0, gpu_idx, src.index_select(0, host_idx))

    def describe(self) -> dict[str, object]:
        return {
            "copy_engine": "native" if self._lib is not None else "threads",
            "host_bytes": self.num_host_blocks * self.layout.block_bytes,
        }

    def read_host_block(self, host_id: int) -> bytes:
        return host_bytes(self.host[host_id])

    def host_address(self, host_id: int) -> int:
        return int(self.host[host_id].data_ptr())

    def host_regions(self) -> tuple[HostRegion, ...]:
        if self._host_fd < 0 or self._closed or self._host_map is None:
            return ()
        start = int(self.host.data_ptr()) - SLOT_ROOM
        return (HostRegion(self._host_fd, start, len(self._host_map), SLOT_ROOM),)

    def close(self) -> None:
        """Finish queued copies, then stop the copy threads. Idempotent. In a fork's
        child: only marks the backend closed (the threads are the parent's)."""
        if self._closed:
            return
        self._closed = True
        detached = self._finalizer.detach()
        if detached is not None:
            _, release, args, _ = detached
            release(*args, discard=False)
        if self._host_fd >= 0:  # the mapping goes with the last view of it
            os.close(self._host_fd)
            self._host_fd = -1
