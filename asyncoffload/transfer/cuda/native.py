"""The native copy path (``cuda_helpers.c``): a transfer in one C call, through the
structures of :mod:`asyncoffload._native.cuda_abi`.

:class:`NativeCopy` queues, per device and direction, ``ao_cuda_copy_run`` (the wait for
the caller's stream through a fence event, the timing events, a copy kernel JIT-compiled
from PTX with the ids as its parameters, the completion host function and the spinner),
``ao_cuda_staged_run`` (the kernel between the KV pages and device staging rows, the copy
engines between staging and the host slots, double-buffered across a kernel stream and
the copy stream) and ``ao_cuda_copy_wait`` (a copy on the caller's stream waited for on
this thread). Its events (:class:`NativeEvent`) are made natively and recycled.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable, Sequence

import torch

from asyncoffload._native import holding_gil
from asyncoffload._native.cuda_abi import (
    COPY_SIGNATURES,
    CUDA_ERROR_NOT_READY,
    CopyCall,
    CopySpan,
    StagingCall,
    new_wake_slot,
)
from asyncoffload.transfer.cuda.jobs import CudaJob
from asyncoffload.transfer.settings import TransferSettings

__all__ = ["ALIGN", "NativeCopy", "NativeEvent", "NativeStaging", "native_copy_ready"]

log = logging.getLogger("asyncoffload.transfer")

#: The native kernel's alignment need: every address and size a multiple of this.
ALIGN = 16


class NativeEvent:
    """A CUDA event made and recorded by the native copy path, with the part of
    ``torch.cuda.Event``'s interface that jobs use (``query``, ``synchronize``,
    ``elapsed_time``, ``cuda_event``). Destroyed with the object (not in a fork's child:
    the event belongs to the parent's context)."""

    __slots__ = ("_free", "_lib", "_pid", "cuda_event")

    def __init__(self, lib: ctypes.CDLL, handle: int, free: list[int] | None = None) -> None:
        self._lib = lib
        self._pid = os.getpid()
        self._free = free  # the free list it goes back to when dropped (None: destroyed)
        self.cuda_event = handle

    def query(self) -> bool:
        rc = int(self._lib.ao_cuda_event_query(self.cuda_event))
        if rc == 0:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"CUDA error {rc} surfaced by a copy's event")

    def synchronize(self) -> None:
        rc = int(self._lib.ao_cuda_event_sync(self.cuda_event))
        if rc != 0:
            raise RuntimeError(f"CUDA error {rc} surfaced by a copy's event")

    def elapsed_time(self, end: NativeEvent) -> float:
        """Milliseconds from this event to ``end`` (both completed, both timing)."""
        ms = ctypes.c_float(0.0)
        rc = int(self._lib.ao_cuda_event_elapsed(self.cuda_event, end.cuda_event, ctypes.byref(ms)))
        if rc != 0:
            raise RuntimeError(f"cuEventElapsedTime failed: CUresult {rc}")
        return float(ms.value)

    def __del__(self) -> None:
        handle, self.cuda_event = self.cuda_event, 0
        if not handle or os.getpid() != self._pid:
            return
        # Unreferenced, nothing can wait on it or record it again: back to the free list
        # (destroying and creating events costs microseconds of driver time per job).
        free = self._free
        if free is not None and len(free) < _FREE_EVENTS_MAX and _free_events_pid[0] == self._pid:
            free.append(handle)
            return
        with contextlib.suppress(Exception):  # a context torn down at exit
            self._lib.ao_cuda_event_destroy(handle)


# Timing events (all of one device's context, made by ``NativeCopy.events``) no job holds
# any more, for reuse; only in the process that made them.
_free_events: list[int] = []
# The same for events without timing (the end marks of copies waited for in the call).
_free_plain: list[int] = []
_free_events_pid = [os.getpid()]


def _forget_parents_events() -> None:
    """In a fork's child, empty the free lists: their handles are the parent's."""
    if _free_events_pid[0] != os.getpid():
        _free_events.clear()
        _free_plain.clear()
        _free_events_pid[0] = os.getpid()


_FREE_EVENTS_MAX = 256


def native_copy_ready(
    lib: ctypes.CDLL | None, device: torch.device, settings: TransferSettings
) -> bool:
    """Whether the native copy path runs on ``device``: the helper has it, the settings
    leave it on (``ASYNCOFFLOAD_NATIVE_COPY``), and the kernel loaded."""
    if lib is None or not settings.native_copy:
        return False
    try:
        for name, (argtypes, restype) in COPY_SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = restype
    except AttributeError:  # a helper built from an older source
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    variant = 1 if settings.native_kernel == "l2" else 0
    with torch.cuda.device(index):
        torch.empty(1, device=index)  # the primary context is current from here
        rc = int(lib.ao_cuda_copy_init(index, variant))
    if rc != 0:
        log.info("native copy kernel unavailable on cuda:%d (CUresult %d)", index, rc)
        return False
    return True


def aligned(*values: int) -> bool:
    """Whether every address or size in ``values`` suits the native kernel."""
    return all(v % ALIGN == 0 for v in values)


class NativeCopy:
    """One device's native copy launches: per direction a copy stream and a fence event,
    the caller's current stream read raw (no torch stream objects, no context managers),
    the job's timing events made natively, the ids passed as kernel parameters (nothing to
    keep alive after the call). ``programs``: thread blocks per launch."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        device: torch.device,
        streams: Sequence[torch.cuda.Stream],
        settings: TransferSettings,
    ) -> None:
        self.lib = lib
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.streams = [int(s.cuda_stream) for s in streams]
        self._raw_stream = torch._C._cuda_getCurrentRawStream
        self._pair = (ctypes.c_uint64 * 2)()
        #: Events are recycled only where one device is in use (an event belongs to the
        #: context it was made in).
        self.single_device = torch.cuda.device_count() == 1
        self.fences = [self.plain_event() for _ in streams]
        sms = torch.cuda.get_device_properties(self.index).multi_processor_count
        self.programs = settings.native_programs * sms
        # ``ao_cuda_copy_wait`` with the GIL held: a wait on the loop's thread must not
        # hand the GIL to another thread for a switch interval.
        self._copy_wait: Callable[..., int] = holding_gil(lib.ao_cuda_copy_wait)
        self._times = (ctypes.c_int64 * 3)()

    # --- events ---

    def plain_event(self) -> NativeEvent:
        """An event without timing (fences, staging order), not recycled."""
        out = (ctypes.c_uint64 * 1)()
        rc = self.lib.ao_cuda_event_plain(out)
        if rc != 0:
            raise RuntimeError(f"cuEventCreate failed: CUresult {rc}")
        return NativeEvent(self.lib, int(out[0]))

    def events(self) -> tuple[NativeEvent, NativeEvent]:
        """Two timing events (start, end), from the free list where it has them."""
        free = _free_events
        _forget_parents_events()
        reuse = free if self.single_device else None
        if len(free) >= 2 and reuse is not None:
            return NativeEvent(self.lib, free.pop(), reuse), NativeEvent(
                self.lib, free.pop(), reuse
            )
        pair = self._pair
        rc = self.lib.ao_cuda_event_pair(pair)
        if rc != 0:
            raise RuntimeError(f"cuEventCreate failed: CUresult {rc}")
        return NativeEvent(self.lib, pair[0], reuse), NativeEvent(self.lib, pair[1], reuse)

    def mark(self) -> NativeEvent:
        """An event without timing, from its free list where it has one."""
        free = _free_plain
        _forget_parents_events()
        reuse = free if self.single_device else None
        if free and reuse is not None:
            return NativeEvent(self.lib, free.pop(), reuse)
        event = self.plain_event()
        event._free = reuse
        return event

    # --- launches ---

    def _call(
        self,
        job: CudaJob,
        direction: int,
        rows: int,
        bpc: int,
        wake_fd: int | None,
        spin_ns: tuple[int, int] | None,
    ) -> CopyCall:
        """The call of ``job``: its timing events made, its wake-up slot (where
        ``wake_fd``) kept on the job."""
        start, end = self.events()
        job._start, job._event = start, end
        slot = None
        if wake_fd is not None:
            slot = new_wake_slot(wake_fd)
            job._slot = slot
            job._lib = self.lib
        spin_from, spin_until = spin_ns if spin_ns is not None else (0, 0)
        return CopyCall(
            device=self.index,
            caller=self._raw_stream(self.index),
            stream=self.streams[direction],
            fence=self.fences[direction].cuda_event,
            start=start.cuda_event,
            end=end.cuda_event,
            rows=rows,
            bpc=bpc,
            store=int(direction == 0),
            programs=self.programs,
            slot=None if slot is None else ctypes.addressof(slot),
            spin_start=spin_from,
            spin_stop=spin_until,
        )

    def launch(
        self,
        job: CudaJob,
        direction: int,
        rows: int,
        spans: Sequence[CopySpan],
        bpc: int,
        wake_fd: int | None = None,
        spin_ns: tuple[int, int] | None = None,
    ) -> None:
        """Queue ``job``'s copy of ``spans`` (one a group) on ``direction``'s stream after
        the caller's current stream; ``rows``: the device address of the table of host
        slot addresses. Marks the job's completion as :func:`~asyncoffload.transfer.cuda.
        jobs.mark_completion` does. Raises ``RuntimeError`` if a CUDA call failed (what
        was queued before it stays queued)."""
        call = self._call(job, direction, rows, bpc, wake_fd, spin_ns)
        array = (CopySpan * len(spans))(*spans)
        rc = self.lib.ao_cuda_copy_run(ctypes.byref(call), array, len(spans))
        if rc != 0:  # no host function holds the slot then (see cuda_helpers.c)
            job._slot = job._lib = None
            raise RuntimeError(f"native copy launch failed: CUresult {rc}")

    def staged(
        self,
        job: CudaJob,
        direction: int,
        stage: NativeStaging,
        span: CopySpan,
        bpc: int,
        wake_fd: int | None = None,
        spin_ns: tuple[int, int] | None = None,
    ) -> None:
        """Queue ``job``'s staged copy of one group that fills its slots whole (``span``
        as for :meth:`launch`, its skip 0) through ``stage``, the direction's staging."""
        call = self._call(job, direction, 0, bpc, wake_fd, spin_ns)
        rc = self.lib.ao_cuda_staged_run(ctypes.byref(call), ctypes.byref(span), stage.call)
        if rc != 0:  # no host function holds the slot then (see cuda_helpers.c)
            job._slot = job._lib = None
            raise RuntimeError(f"native staged copy failed: CUresult {rc}")

    def copy_wait(
        self, job: CudaJob, direction: int, rows: int, span: CopySpan, budget_ns: int
    ) -> int:
        """Queue ``job``'s copy of one group on the caller's current stream itself, an
        event without timing after it (``job``'s end), and wait up to ``budget_ns`` on
        this thread for it: for a job whose wake-up would cost more than the wait. No
        fence and no timing events; ``job.started_ns`` is set to the launch (and
        ``finished_ns``, where the copy ended, to when the wait saw it). Returns 0
        (ended), ``CUDA_ERROR_NOT_READY`` (still running) or the CUresult of a failed
        copy; raises ``RuntimeError`` if the launch failed."""
        end = self.mark()
        job._start, job._event = None, end
        caller = self._raw_stream(self.index)
        call = CopyCall(
            device=self.index,
            caller=caller,
            stream=caller,
            end=end.cuda_event,
            rows=rows,
            bpc=1,
            store=int(direction == 0),
            programs=self.programs,
        )
        times = self._times
        rc = self._copy_wait(ctypes.byref(call), ctypes.byref(span), budget_ns, times)
        job.started_ns = times[0]
        if not times[2]:
            raise RuntimeError(f"native copy launch failed: CUresult {rc}")
        if rc == 0:
            job.finished_ns = times[1]
        return int(rc)

    def arm(self, job: CudaJob, direction: int, wake_fd: int) -> None:
        """Queue the wake-up of ``job`` (launched by :meth:`copy_wait`) on ``direction``'s
        copy stream, after its end event: the copy stream's later work waits for it as
        for its own."""
        assert job._event is not None
        slot = new_wake_slot(wake_fd)
        stream = self.streams[direction]
        event = job._event.cuda_event  # type: ignore[attr-defined]
        rc = self.lib.ao_cuda_wake_after(stream, event, ctypes.addressof(slot))
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitEvent / cuLaunchHostFunc failed: CUresult {rc}")
        job._slot = slot
        job._lib = self.lib


class NativeStaging:
    """One direction's staging for :meth:`NativeCopy.staged`: two device buffers of
    ``rows`` rows of ``row_stride`` bytes, each with a device table of its row addresses,
    the events that order their reuse, and the call structure that names them with the
    direction's kernel stream and the pool's host slots (``host_rows``: the CPU int64
    tensor of slot addresses, ``rows_per_chunk`` of them a pinned chunk)."""

    def __init__(
        self,
        native: NativeCopy,
        device: torch.device,
        rows: int,
        row_stride: int,
        *,
        kernel_stream: int,
        host_rows: torch.Tensor,
        rows_per_chunk: int,
        slot_bytes: int,
        use_batch: bool,
    ) -> None:
        self.rows = rows
        self.row_stride = row_stride
        self.buffers = [
            torch.empty((rows, row_stride), dtype=torch.uint8, device=device) for _ in range(2)
        ]
        steps = torch.arange(rows, dtype=torch.int64) * row_stride
        self.row_tables = [(b.data_ptr() + steps).to(device) for b in self.buffers]
        self.bases = (ctypes.c_uint64 * 2)(*(b.data_ptr() for b in self.buffers))
        self.tables = (ctypes.c_uint64 * 2)(*(t.data_ptr() for t in self.row_tables))
        self.state = (ctypes.c_int * 3)(0, 0, 0)  # next buffer, buffer 0 / 1 used
        self._events = [native.plain_event() for _ in range(5)]
        self.ready = (ctypes.c_void_p * 2)(*(e.cuda_event for e in self._events[:2]))
        self.done = (ctypes.c_void_p * 2)(*(e.cuda_event for e in self._events[2:4]))
        self.join = self._events[4]
        self._host_rows = host_rows  # read by every call: kept alive here
        self.call = StagingCall(
            rows=rows,
            base=ctypes.addressof(self.bases),
            row_tables=ctypes.addressof(self.tables),
            row_stride=row_stride,
            state=ctypes.addressof(self.state),
            ready=ctypes.addressof(self.ready),
            done=ctypes.addressof(self.done),
            join=self.join.cuda_event,
            kstream=kernel_stream,
            host_rows=host_rows.data_ptr(),
            rows_per_chunk=rows_per_chunk,
            slot_bytes=slot_bytes,
            use_batch=int(use_batch),
        )
