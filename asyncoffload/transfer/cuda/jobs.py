"""A CUDA transfer's life on the host: :class:`CudaJob` (done when its wake-up slot is
stamped, or its event has completed; timed on the device), its completion marker
(:func:`mark_completion`: an event, a host function that writes the loop's eventfd, the
spinner's window), the wake-up slots native code still holds (:func:`wait_for_slots`),
and the copy streams (made, and waited for at close by :func:`release_streams`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from typing import Any, Protocol

import torch

from asyncoffload._native.cuda_abi import new_wake_slot
from asyncoffload.transfer.base import CopyJob, forked_since

__all__ = [
    "CudaJob",
    "highest_priority",
    "mark_completion",
    "new_stream",
    "release_streams",
    "start_timing",
    "wait_for_slots",
]

log = logging.getLogger("asyncoffload.transfer")


class JobEvent(Protocol):
    """What a job needs of its events: ``torch.cuda.Event`` or a native one."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


class _Pool(Protocol):
    def close(self) -> None: ...


class CudaJob(CopyJob):
    """A transfer on a copy stream: done when its host-function slot says so, or (without
    the native helper) when its CUDA event has completed. Its duration is measured on the
    device, between timing events around the copy."""

    __slots__ = ("_event", "_keep", "_lib", "_seconds", "_slot", "_start", "method")

    def __init__(self, num_blocks: int, nbytes: int, method: str) -> None:
        super().__init__(num_blocks, nbytes)
        self.method = method
        self._start: JobEvent | None = None
        self._event: JobEvent | None = None
        self._slot: ctypes.Array[ctypes.c_int64] | None = None
        self._lib: ctypes.CDLL | None = None
        self._keep: list[Any] = []
        self._seconds: float | None = None

    def query(self) -> bool:
        if self._done:
            return True
        slot = self._slot
        if slot is not None:
            assert self._lib is not None
            if self._lib.ao_cuda_slot_done(ctypes.addressof(slot)):
                self.finished_ns = slot[1]  # CLOCK_MONOTONIC, as perf_counter_ns
                self._done = True
                retire(self._lib, slot, self._event)
        else:
            self._query_event()
        if self._done:
            self._keep.clear()
        return self._done

    def _query_event(self) -> None:
        if self._event is None:
            return
        try:
            done = self._event.query()
        except RuntimeError as exc:  # a CUDA error surfaced by the event
            self.finish(exc)
            self.stamped = False
        else:
            if done:
                self.finish()
                self.stamped = False  # noticed now; the copy ended some time before

    def check_failed(self) -> bool:
        # With a host-function slot, a stream error means the slot is never stamped: the
        # event query is what surfaces the error.
        if not self._done and self._slot is not None and self._event is not None:
            try:
                self._event.query()
            except RuntimeError as exc:
                self.finish(exc)
                self.stamped = False
                self._keep.clear()
                if self._lib is not None:
                    retire(self._lib, self._slot, self._event)
        return self._done

    @property
    def duration_s(self) -> float:
        if not self._done:
            return 0.0
        if self._seconds is not None:
            return self._seconds
        if self._start is not None and self._event is not None and self.error is None:
            try:
                ms: float = self._start.elapsed_time(self._event)
                self._seconds = ms / 1e3  # asked for several times once done
                return self._seconds
            except RuntimeError:
                pass
        return super().duration_s


def start_timing(job: CudaJob, stream: torch.cuda.Stream) -> None:
    """Record the timing event that marks the start of ``job``'s copy on ``stream``."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record(stream)
    job._start = start


# Wake-up slots that native code may still touch after their job resolved: the host
# function runs after the job is done when the spinner saw the end first, and the
# spinner may look at a slot until its window closes. They are freed only once native
# code has let go of them (``ao_cuda_slot_released``).
# The spinner also polls the job's event until it lets go of the slot: the event is kept
# with the slot (a native event would otherwise be destroyed under the spinner's feet).
_retired_slots: list[tuple[ctypes.CDLL, ctypes.Array[ctypes.c_int64], object]] = []


def retire(lib: ctypes.CDLL, slot: ctypes.Array[ctypes.c_int64], event: object = None) -> None:
    _retired_slots.append((lib, slot, event))
    if len(_retired_slots) > 64:
        _reap_slots()


def _reap_slots() -> int:
    """Free the retired slots native code is done with; how many remain."""
    _retired_slots[:] = [
        (lib, slot, event)
        for lib, slot, event in _retired_slots
        if not lib.ao_cuda_slot_released(ctypes.addressof(slot))
    ]
    return len(_retired_slots)


def wait_for_slots(timeout_s: float = 2.0) -> bool:
    """Wait until native code has let go of every retired slot (so no host function or
    spinner will write a wake-up fd again). True if it did within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _reap_slots():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def mark_completion(
    job: CudaJob,
    stream: torch.cuda.Stream,
    lib: ctypes.CDLL | None,
    wake_fd: int | None,
    *,
    spin_ns: tuple[int, int] | None = None,
) -> None:
    """Give ``job`` its completion marker at the current end of ``stream``: a CUDA event,
    and, where the native helper ``lib`` is loaded and the loop watches ``wake_fd``, a
    host function that stamps the job and writes the fd once the stream gets there.

    ``spin_ns`` = (from, until), ``time.perf_counter_ns`` times around the expected end
    of the job: the native spinner polls the event in that window and, if it sees the
    end first, stamps the job and writes the fd itself (the host function then does
    nothing). The window bounds its CPU cost; a wrong estimate only loses the speed-up.
    """
    event = torch.cuda.Event(enable_timing=job._start is not None)  # type: ignore[no-untyped-call]
    event.record(stream)
    job._event = event
    if lib is not None and wake_fd is not None:
        slot = new_wake_slot(wake_fd)
        rc = lib.ao_cuda_launch_wake(stream.cuda_stream, ctypes.addressof(slot))
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed: CUresult {rc}")
        job._slot = slot
        job._lib = lib
        if spin_ns is not None:
            slot[4] = 0
            addr = ctypes.addressof(slot)
            if lib.ao_cuda_spin_watch(event.cuda_event, addr, spin_ns[0], spin_ns[1]) != 0:
                slot[4] = 1


def new_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]


def highest_priority() -> int:
    """The most urgent stream priority the device offers (CUDA counts down: -1 or -5 on
    recent GPUs; 0 where priorities are not supported)."""
    try:
        low, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    except (AttributeError, RuntimeError):
        return 0
    return int(min(low, high))


def release_streams(
    pid: int,
    streams: tuple[torch.cuda.Stream, ...],
    pool: _Pool,
    fds: list[int],
    memory: tuple[object, ...],
) -> None:
    """Wait until nothing runs on ``streams`` (nor a wake-up of theirs), then unpin and
    free ``pool``, close ``fds``, and let ``memory`` (what the streams touch) go. A
    backend's ``close()`` and its finalizer. In a fork's child the streams and the
    pinning are the parent's: only the memory goes."""
    if not forked_since(pid):
        try:
            for stream in streams:
                stream.synchronize()
        except RuntimeError as exc:  # a device error: nothing runs on the streams any more
            log.warning("a copy stream failed while the backend closed: %s", exc)
        if not wait_for_slots():
            log.warning("native wake-up code still holds completion slots after close")
        pool.close()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    del memory
