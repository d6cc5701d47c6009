"""The paged engine for CPU KV tensors: :class:`CpuPagedEngine`, whose primary path is
the native copy lanes (a native thread per direction runs ``memcpy`` over the plan's
descriptors, never taking the GIL) and whose fallback is torch index copies on the
calling thread.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
import weakref
from collections import deque
from typing import Literal

import torch

from asyncoffload._native import load_copy_engine
from asyncoffload.transfer.base import CopyJob, check_process, forked_since, host_bytes
from asyncoffload.transfer.host_file import SharedHostFile, _host_file
from asyncoffload.transfer.paged import CopyPlan, PageLayout
from asyncoffload.transfer.paged_base import LANES, STORE, _HostPages, _pid

__all__ = ["CpuCopyEngine", "CpuPagedEngine"]

CpuCopyEngine = Literal["auto", "native", "threads", "torch"]


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

    def wait(self, timeout: float | None = None) -> None:
        """Until the lane has ended the job (``TimeoutError`` after ``timeout`` s): the
        lane's own wait, in slices of at most 100 ms with the GIL released, no thread."""
        addr = ctypes.addressof(self._status)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            slice_ns = 100_000_000
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self!r} did not end within {timeout} s")
                slice_ns = max(1, min(slice_ns, int(left * 1e9)))
            # Bounded waits (the GIL is released during each): Ctrl-C still works.
            state = int(self._lib.ao_lane_wait(self._lane, addr, slice_ns))
            if state:
                self._settle(state)


class _DescriptorLanes:
    """The native lanes of a :class:`CpuPagedEngine` (store, load, expedited load), kept
    apart from it so that its finalizer can stop them. Each starts with its first job. They keep
    the status words of the jobs they may still write: a job may be dropped first."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._handles: list[int | None] = [None] * LANES
        self._pending: tuple[deque[ctypes.Array[ctypes.c_int64]], ...] = tuple(
            deque() for _ in range(LANES)
        )
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

    def wait(self, job: CopyJob, timeout: float | None = None) -> None:
        check_process(self.pid, "CpuPagedEngine")
        if isinstance(job, _NativeCopies):
            job.wait(timeout)
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
