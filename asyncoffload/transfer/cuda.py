"""The CUDA backend: KV tensors on a GPU, the host tier in pinned memory.

- **Host pool.** Block-major slots in chunks of page-aligned anonymous memory (no single
  huge allocation), each registered with CUDA (pinned, mapped for UVA). If pinning fails
  the chunk stays pageable: a warning is logged and ``pageable_chunks`` counts it.
- **Streams.** One copy stream per direction. A transfer first waits for the work queued
  on the caller's current stream (``wait_stream``), so a store reads finished KV and a load
  does not race writes queued before it. A direction's transfers complete in order.
- **Copy methods**, chosen per transfer (or forced with ``copy_method``):
  ``kernel``: a Triton kernel copying every (block, layer, K/V) fragment through UVA,
  best for small fragments; ``staged``: the kernel gathers whole blocks into device
  staging memory and the copy engines move one block per DMA descriptor, best for large
  fragments and for both directions at once; ``batch``: one ``cuMemcpyBatchAsync`` over
  every fragment; ``gather``: torch ``index_select`` into staging and one copy per block
  range, the fallback without Triton.
- **The native path** (``NativeCopy``, where the helper builds and the layout is 16-byte
  aligned): the ``kernel`` method as one C call (``ao_cuda_copy_launch``: the wait for
  the caller's stream, the timing events, a copy kernel JIT-compiled from PTX with the
  ids as its parameters, the completion host function); ``auto`` takes it for jobs of up
  to ``native_max_blocks`` blocks of large fragments. ``ASYNCOFFLOAD_NATIVE_COPY=0``
  turns it off.
- **Completion.** Each transfer records a CUDA event; where the native helper is built, a
  host function after it stamps the job and writes the loop's eventfd, without the GIL,
  and a native spinner polls the event around the transfer's expected end so that it can
  do the same sooner.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import mmap
import os
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from asyncoffload._native import holding_gil, load_cuda_helpers
from asyncoffload.hostmem import check_host_bytes, format_bytes
from asyncoffload.layout import KVLayout
from asyncoffload.transfer.base import CopyJob, TransferBackend, forked_since, host_bytes

__all__ = [
    "CopyMethod",
    "CudaCopyBackend",
    "CudaJob",
    "NativeCopy",
    "NativeEvent",
    "PinnedHostPool",
    "mark_completion",
    "start_timing",
    "wait_for_slots",
]

log = logging.getLogger("asyncoffload.transfer")

CopyMethod = Literal["auto", "batch", "kernel", "staged", "gather"]

_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02


class _Registrar:
    """Pins host memory: through the driver API where the native helper is loaded (its
    failures do not linger as the runtime's last error, which the next unrelated kernel
    launch would raise), else through the CUDA runtime."""

    def __init__(self) -> None:
        helpers = load_cuda_helpers()
        self._lib = helpers[0] if helpers and helpers[1] & 4 else None

    def register(self, ptr: int, nbytes: int) -> int:
        if self._lib is not None:
            return int(self._lib.ao_cuda_host_register(ptr, nbytes))
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
        return int(cudart.cudaHostRegister(ptr, nbytes, flags))

    def unregister(self, ptr: int) -> None:
        if self._lib is not None:
            self._lib.ao_cuda_host_unregister(ptr)
        else:
            torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]

    def device_pointer(self, ptr: int) -> int:
        """The address a kernel uses for registered host memory (UVA: usually ``ptr``)."""
        if self._lib is None:
            return ptr
        out = ctypes.c_uint64(0)
        if self._lib.ao_cuda_host_device_pointer(ptr, ctypes.addressof(out)) != 0:
            raise RuntimeError("cuMemHostGetDevicePointer failed for a pinned chunk")
        return int(out.value)


class PinnedHostPool:
    """``num_blocks`` host slots of ``block_bytes``, in chunks of about ``chunk_bytes``."""

    def __init__(
        self, num_blocks: int, block_bytes: int, chunk_bytes: int = 1 << 30, pin: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.rows_per_chunk = max(1, chunk_bytes // block_bytes)
        self.chunks: list[torch.Tensor] = []
        self._maps: list[mmap.mmap] = []
        self._registered: list[int] = []
        self.pinned_chunks = 0
        self.pageable_chunks = 0
        self._registrar = _Registrar() if pin else None
        # Dropped unclosed, the pool unpins its chunks before their memory goes (the
        # finalizer holds the maps until then).
        self._finalizer = weakref.finalize(
            self, _unpin, _current_pid(), self._registrar, self._registered, self._maps
        )
        device_bases: list[int] = []
        remaining = num_blocks
        while remaining > 0:
            rows = min(remaining, self.rows_per_chunk)
            nbytes = rows * block_bytes
            mm = mmap.mmap(-1, nbytes)  # anonymous: page-aligned, zero-filled
            chunk = torch.frombuffer(mm, dtype=torch.uint8).view(rows, block_bytes)
            ptr = chunk.data_ptr()
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
                        "could not pin a %d MiB host chunk (CUDA error %s): using pageable "
                        "memory, copies from it are slower and synchronous",
                        nbytes >> 20,
                        err,
                    )
            self._maps.append(mm)
            self.chunks.append(chunk)
            remaining -= rows
        ids = torch.arange(num_blocks, dtype=torch.int64)
        row_offset = (ids % self.rows_per_chunk) * block_bytes
        chunk_of = ids // self.rows_per_chunk
        #: Host address of each slot.
        self.block_address = (
            torch.tensor([c.data_ptr() for c in self.chunks], dtype=torch.int64)[chunk_of]
            + row_offset
        )
        #: The address of each slot for a kernel (UVA device pointer of pinned memory).
        self.device_block_address = (
            torch.tensor(device_bases, dtype=torch.int64)[chunk_of] + row_offset
        )

    @property
    def pinned(self) -> bool:
        return self.pageable_chunks == 0

    def block(self, host_id: int) -> torch.Tensor:
        return self.chunks[host_id // self.rows_per_chunk][host_id % self.rows_per_chunk]

    def runs(self, host_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(position in host_ids, first id, length)`` of runs of consecutive ids that lie
        in one chunk: each is one contiguous host range."""
        out: list[tuple[int, int, int]] = []
        rows = self.rows_per_chunk
        i = 0
        n = len(host_ids)
        while i < n:
            start = host_ids[i]
            j = i + 1
            while j < n and host_ids[j] == start + (j - i) and host_ids[j] // rows == start // rows:
                j += 1
            out.append((i, start, j - i))
            i = j
        return out

    def view(self, first: int, length: int) -> torch.Tensor:
        rows = self.rows_per_chunk
        row = first % rows
        return self.chunks[first // rows][row : row + length]

    def close(self) -> None:
        """Unpin and free the chunks. The caller first makes sure that no copy still
        reads or writes them (synchronizes its streams). Idempotent; in a fork's child
        only drops the memory (the pinning belongs to the parent's CUDA context)."""
        self._finalizer()
        self.chunks.clear()  # with the tensors that viewed them, the maps go


def _current_pid() -> int:
    return os.getpid()


def _unpin(
    pid: int, registrar: _Registrar | None, registered: list[int], maps: list[mmap.mmap]
) -> None:
    """Unregister the pinned chunks at ``registered``, then let their ``maps`` go."""
    if registered and registrar is not None and not forked_since(pid):
        for ptr in registered:
            try:
                registrar.unregister(ptr)
            except Exception as exc:  # a CUDA context torn down at exit
                log.debug("could not unpin a host chunk: %s", exc)
    registered.clear()
    maps.clear()


class _PinnedRing:
    """Pinned int64 scratch for the block ids of transfers in flight.

    Host-to-device copies from pinned memory are asynchronous, so a region may be reused
    only once the copy that reads it has run: each region is returned with the event of
    its transfer, and ``take`` waits (rarely) for the oldest overlapping region. Pageable
    memory would make every such copy wait for the stream instead.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buf = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.head = 0
        self.busy: deque[tuple[int, int, torch.cuda.Event | NativeEvent]] = deque()

    def take(self, n: int) -> torch.Tensor:
        if n > self.capacity:
            return torch.empty(n, dtype=torch.int64, pin_memory=True)
        start = self.head if self.head + n <= self.capacity else 0
        end = start + n
        busy = self.busy
        while busy and busy[0][2].query():
            busy.popleft()
        while busy and any(s < end and start < e for s, e, _ in busy):
            busy.popleft()[2].synchronize()
        self.head = end
        return self.buf[start:end]

    def release(self, region: torch.Tensor, event: torch.cuda.Event | NativeEvent) -> None:
        """``region`` (from :meth:`take`) is free once ``event`` has completed."""
        if region.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr():
            start = int(region.storage_offset())
            self.busy.append((start, start + int(region.numel()), event))


_CUDA_ERROR_NOT_READY = 600


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
        if rc == _CUDA_ERROR_NOT_READY:
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


_NATIVE_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "ao_cuda_copy_init": ([ctypes.c_int], ctypes.c_int),
    "ao_ids_check": (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int],
        ctypes.c_int64,
    ),
    "ao_cuda_event_pair": ([ctypes.c_void_p], ctypes.c_int),
    "ao_cuda_event_plain": ([ctypes.c_void_p], ctypes.c_int),
    "ao_cuda_event_query": ([ctypes.c_void_p], ctypes.c_int),
    "ao_cuda_event_sync": ([ctypes.c_void_p], ctypes.c_int),
    "ao_cuda_copy_wait": (
        [
            ctypes.c_int,  # device
            ctypes.c_void_p,  # the caller's stream
            ctypes.c_void_p,  # end event
            ctypes.c_uint64,  # refs table (device)
            ctypes.c_uint64,  # row table (device)
            ctypes.c_int,  # nref
            ctypes.c_int,  # blocks
            ctypes.c_void_p,  # gpu ids (int64)
            ctypes.c_void_p,  # slot ids (int64)
            ctypes.c_int,  # store
            ctypes.c_int,  # programs
            ctypes.c_int64,  # largest page
            ctypes.c_int64,  # wait budget (ns)
            ctypes.c_void_p,  # times [launched, ended, queued]
        ],
        ctypes.c_int,
    ),
    "ao_cuda_wake_after": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int),
    "ao_cuda_event_destroy": ([ctypes.c_void_p], ctypes.c_int),
    "ao_cuda_event_elapsed": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int),
    "ao_cuda_staged_launch": (
        [
            ctypes.c_int,  # device
            ctypes.c_void_p,  # caller stream
            ctypes.c_void_p,  # copy stream
            ctypes.c_void_p,  # kernel stream
            ctypes.c_void_p,  # fence event
            ctypes.c_void_p,  # join event
            ctypes.c_void_p,  # start event
            ctypes.c_void_p,  # end event
            ctypes.c_uint64,  # refs table (device)
            ctypes.c_int,  # nref
            ctypes.c_int,  # blocks
            ctypes.c_void_p,  # gpu ids (int64)
            ctypes.c_void_p,  # slot ids (int64)
            ctypes.c_int,  # store
            ctypes.c_int,  # blocks per slot
            ctypes.c_int,  # programs
            ctypes.c_int64,  # largest page
            ctypes.c_void_p,  # host slot addresses (int64, CPU)
            ctypes.c_int64,  # slots per pinned chunk
            ctypes.c_int64,  # slot bytes
            ctypes.c_int,  # staging rows per buffer
            ctypes.c_void_p,  # staging bases [2]
            ctypes.c_void_p,  # staging row tables (device) [2]
            ctypes.c_int64,  # row stride
            ctypes.c_void_p,  # state [next buffer, used 0, used 1]
            ctypes.c_void_p,  # ready events [2]
            ctypes.c_void_p,  # done events [2]
            ctypes.c_int,  # use cuMemcpyBatchAsync
            ctypes.c_void_p,  # wake-up slot
            ctypes.c_int64,  # spin from
            ctypes.c_int64,  # spin until
        ],
        ctypes.c_int,
    ),
    "ao_cuda_copy_launch": (
        [
            ctypes.c_int,  # device
            ctypes.c_void_p,  # caller stream
            ctypes.c_void_p,  # copy stream
            ctypes.c_void_p,  # fence event
            ctypes.c_void_p,  # start event
            ctypes.c_void_p,  # end event
            ctypes.c_uint64,  # refs table (device)
            ctypes.c_uint64,  # row table (device)
            ctypes.c_int,  # nref
            ctypes.c_int,  # blocks
            ctypes.c_void_p,  # gpu ids (int64)
            ctypes.c_void_p,  # slot ids (int64)
            ctypes.c_int,  # skip
            ctypes.c_int,  # bpc
            ctypes.c_int,  # store
            ctypes.c_int,  # programs
            ctypes.c_int64,  # largest page
            ctypes.c_void_p,  # wake-up slot
            ctypes.c_int64,  # spin from
            ctypes.c_int64,  # spin until
        ],
        ctypes.c_int,
    ),
}


def native_copy_ready(lib: ctypes.CDLL | None, device: torch.device) -> bool:
    """Whether the native copy path (``ao_cuda_copy_launch``, a kernel JIT-compiled from
    PTX by the driver) runs on ``device``: the helper has it, and the kernel loaded.
    ``ASYNCOFFLOAD_NATIVE_COPY=0`` turns it off (the Python paths then run)."""
    if lib is None or os.environ.get("ASYNCOFFLOAD_NATIVE_COPY", "1") == "0":
        return False
    try:
        for name, (argtypes, restype) in _NATIVE_SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = restype
    except AttributeError:  # a helper built from an older source
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        torch.empty(1, device=index)  # the primary context is current from here
        rc = int(lib.ao_cuda_copy_init(index))
    if rc != 0:
        log.info("native copy kernel unavailable on cuda:%d (CUresult %d)", index, rc)
        return False
    return True


def _native_programs(sms: int) -> int:
    """Thread blocks per native launch: ``ASYNCOFFLOAD_NATIVE_PROGRAMS`` per
    multiprocessor (default 4)."""
    return max(1, int(os.environ.get("ASYNCOFFLOAD_NATIVE_PROGRAMS", "4")) * sms)


class NativeCopy:
    """One device's native copy launches (see ``ao_cuda_copy_launch`` in
    ``cuda_helpers.c``): per direction a copy stream and a fence event, the caller's
    current stream read raw (no torch stream objects, no context managers), the job's
    timing events made natively, the ids passed as kernel parameters (nothing to keep
    alive after the call)."""

    #: Kernel launch's alignment need: every address and size a multiple of this.
    ALIGN = 16

    def __init__(
        self, lib: ctypes.CDLL, device: torch.device, streams: Sequence[torch.cuda.Stream]
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
        # ``ao_cuda_copy_wait`` with the GIL held: a wait on the loop's thread must not
        # hand the GIL to another thread for a switch interval.
        self._copy_wait: Callable[..., int] = holding_gil(lib.ao_cuda_copy_wait)
        self._times = (ctypes.c_int64 * 3)()

    def arm(self, job: CudaJob, direction: int, wake_fd: int) -> None:
        """Queue the wake-up (the completion host function, see :func:`mark_completion`)
        of ``job``, launched by :meth:`copy_wait`, on ``direction``'s copy stream, after
        its end event: the copy stream's later work waits for it as for its own."""
        assert job._event is not None
        slot = (ctypes.c_int64 * 5)(0, 0, wake_fd, 0, 1)
        stream = self.streams[direction]
        rc = self.lib.ao_cuda_wake_after(stream, job._event.cuda_event, ctypes.addressof(slot))
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitEvent / cuLaunchHostFunc failed: CUresult {rc}")
        job._slot = slot
        job._lib = self.lib

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

    def staged(
        self,
        job: CudaJob,
        direction: int,
        kernel_stream: int,
        stage: _NativeStaging,
        span: tuple[int, int, int, int, int, int, int],
        host_rows: int,
        rows_per_chunk: int,
        slot_bytes: int,
        bpc: int,
        programs: int,
        use_batch: bool,
        wake_fd: int | None = None,
        spin_ns: tuple[int, int] | None = None,
    ) -> None:
        """Queue ``job``'s staged copy of one group with whole slots (see
        ``ao_cuda_staged_launch``): ``span`` as for :meth:`launch` (its skip 0),
        ``host_rows``: the CPU int64 table of host slot addresses, ``stage``: the
        direction's staging buffers and their events."""
        start, end = self.events()
        job._start, job._event = start, end
        refs, nref, n, gpu_ids, slot_ids, _skip, page = span
        slot = None
        if wake_fd is not None:
            # [state, end ns, fd, host function ran, spinner done] (see cuda_helpers.c)
            slot = (ctypes.c_int64 * 5)(0, 0, wake_fd, 0, 1)
        spin_from, spin_until = spin_ns if spin_ns is not None else (0, 0)
        rc = self.lib.ao_cuda_staged_launch(
            self.index,
            self._raw_stream(self.index),
            self.streams[direction],
            kernel_stream,
            self.fences[direction].cuda_event,
            stage.join.cuda_event,
            start.cuda_event,
            end.cuda_event,
            refs,
            nref,
            n,
            gpu_ids,
            slot_ids,
            direction == 0,
            bpc,
            programs,
            page,
            host_rows,
            rows_per_chunk,
            slot_bytes,
            stage.rows,
            stage.bases,
            stage.tables,
            stage.row_stride,
            stage.state,
            stage.ready,
            stage.done,
            use_batch,
            None if slot is None else ctypes.addressof(slot),
            spin_from,
            spin_until,
        )
        if rc != 0:  # no host function holds the slot then (see cuda_helpers.c)
            raise RuntimeError(f"native staged copy failed: CUresult {rc}")
        if slot is not None:
            job._slot = slot
            job._lib = self.lib

    def launch(
        self,
        job: CudaJob,
        direction: int,
        rows: int,
        spans: Sequence[tuple[int, int, int, int, int, int, int]],
        bpc: int,
        programs: int,
        wake_fd: int | None,
        spin_ns: tuple[int, int] | None,
    ) -> None:
        """Queue ``job``'s copy on ``direction``'s stream after the caller's current
        stream. ``spans``: per group ``(refs, nref, n, gpu_ids, slot_ids, skip, page)``,
        its ref table (device address of an int64 ``[5, nref]`` table: kv_base,
        kv_stride, host offset, page, bytes), ``n`` blocks at ``gpu_ids`` and their slots
        at ``slot_ids`` (addresses of int64 arrays, read during the call), the sub-blocks
        its first slot skips and its largest page; ``rows``: the device address of the
        table of host slot addresses. Marks the job's completion as
        :func:`mark_completion` does. Raises ``RuntimeError`` if a CUDA call failed (what
        was queued before it stays queued)."""
        start, end = self.events()
        job._start, job._event = start, end
        slot = None
        if wake_fd is not None:
            # [state, end ns, fd, host function ran, spinner done] (see cuda_helpers.c)
            slot = (ctypes.c_int64 * 5)(0, 0, wake_fd, 0, 1)
        spin_from, spin_until = spin_ns if spin_ns is not None else (0, 0)
        stream = self.streams[direction]
        caller = self._raw_stream(self.index)
        last = len(spans) - 1
        for i, (refs, nref, n, gpu_ids, slot_ids, skip, page) in enumerate(spans):
            rc = self.lib.ao_cuda_copy_launch(
                self.index,
                caller if i == 0 else stream,  # the stream itself: no fence
                stream,
                self.fences[direction].cuda_event,
                start.cuda_event if i == 0 else None,
                end.cuda_event if i == last else None,
                refs,
                rows,
                nref,
                n,
                gpu_ids,
                slot_ids,
                skip,
                bpc,
                direction == 0,
                programs,
                page,
                None if slot is None or i != last else ctypes.addressof(slot),
                spin_from,
                spin_until,
            )
            if rc != 0:  # no host function holds the slot then (see cuda_helpers.c)
                raise RuntimeError(f"native copy launch failed: CUresult {rc}")
        if slot is not None:
            job._slot = slot
            job._lib = self.lib

    def copy_wait(
        self,
        job: CudaJob,
        direction: int,
        rows: int,
        span: tuple[int, int, int, int, int, int, int],
        programs: int,
        budget_ns: int,
    ) -> int:
        """Queue ``job``'s copy of one group (``span`` as for :meth:`launch`) on the
        caller's current stream itself, an event without timing after it (``job``'s
        end), and wait up to ``budget_ns`` on this thread for it (``ao_cuda_copy_wait``):
        for a job whose wake-up would cost more than the wait. No fence and no timing
        events; ``job.started_ns`` is set to the launch (and ``finished_ns``, where the
        copy ended, to when the wait saw it). Returns 0 (ended), ``CUDA_ERROR_NOT_READY``
        (still running) or the CUresult of a failed copy; raises ``RuntimeError`` if
        the launch failed."""
        end = self.mark()
        job._start, job._event = None, end
        refs, nref, n, gpu_ids, slot_ids, _skip, page = span
        times = self._times
        rc = self._copy_wait(
            self.index,
            self._raw_stream(self.index),
            end.cuda_event,
            refs,
            rows,
            nref,
            n,
            gpu_ids,
            slot_ids,
            direction == 0,
            programs,
            page,
            budget_ns,
            times,
        )
        job.started_ns = times[0]
        if not times[2]:
            raise RuntimeError(f"native copy launch failed: CUresult {rc}")
        if rc == 0:
            job.finished_ns = times[1]
        return int(rc)


class _NativeStaging:
    """One direction's staging for :meth:`NativeCopy.staged`: two device buffers of
    ``rows`` rows of ``row_stride`` bytes, each with a device table of its row addresses,
    and the events that order their reuse."""

    def __init__(
        self, native: NativeCopy, device: torch.device, rows: int, row_stride: int
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


def _new_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]


def _highest_priority() -> int:
    """The most urgent stream priority the device offers (CUDA counts down: -1 or -5 on
    recent GPUs; 0 where priorities are not supported)."""
    try:
        low, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    except (AttributeError, RuntimeError):
        return 0
    return int(min(low, high))


class CudaJob(CopyJob):
    """A transfer on a copy stream: done when its host-function slot says so, or (without
    the native helper) when its CUDA event has completed. Its duration is measured on the
    device, between timing events around the copy."""

    __slots__ = ("_event", "_keep", "_lib", "_seconds", "_slot", "_start", "method")

    def __init__(self, num_blocks: int, nbytes: int, method: str) -> None:
        super().__init__(num_blocks, nbytes)
        self.method = method
        self._start: torch.cuda.Event | NativeEvent | None = None
        self._event: torch.cuda.Event | NativeEvent | None = None
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
                _retire(self._lib, slot, self._event)
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
                    _retire(self._lib, self._slot, self._event)
        return self._done

    @property
    def duration_s(self) -> float:
        if not self._done:
            return 0.0
        if self._seconds is not None:
            return self._seconds
        if self._start is not None and self._event is not None and self.error is None:
            try:
                ms: float = self._start.elapsed_time(self._event)  # type: ignore[arg-type]
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


def _retire(lib: ctypes.CDLL, slot: ctypes.Array[ctypes.c_int64], event: object = None) -> None:
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
        # [state, end ns, fd, host function ran, spinner done] (see cuda_helpers.c)
        slot = (ctypes.c_int64 * 5)(0, 0, wake_fd, 0, 1)
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


class CudaCopyBackend(TransferBackend):
    """Copies between KV tensors on one CUDA device and a pinned host pool."""

    name = "cuda"
    DEFAULT_KERNEL_PROGRAMS = 132

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        num_host_blocks: int,
        *,
        copy_method: CopyMethod = "auto",
        chunk_bytes: int = 1 << 30,
        pin: bool = True,
        kernel_max_fragment_bytes: int = 16 << 10,
        kernel_programs: int = DEFAULT_KERNEL_PROGRAMS,
        staging_bytes: int = 192 << 20,
        inline_wait_us: float = 100.0,
    ) -> None:
        if layout.device.type != "cuda":
            raise ValueError(f"CudaCopyBackend needs CUDA tensors, got {layout.device}")
        super().__init__(layout, num_host_blocks)
        self.device = layout.device
        self._kv = list(kv_caches)
        self._frags = layout.fragment_views(self._kv)
        frag = layout.fragment_bytes
        with torch.cuda.device(self.device):
            check_host_bytes(
                num_host_blocks * layout.block_bytes,
                f"the CPU tier ({num_host_blocks} blocks of "
                f"{format_bytes(layout.block_bytes)}: cpu_blocks)",
            )
            self.pool = PinnedHostPool(num_host_blocks, layout.block_bytes, chunk_bytes, pin)
            self._streams = (_new_stream(self.device), _new_stream(self.device))
        self._kv_base = torch.tensor([v.data_ptr() for v in self._frags], dtype=torch.int64)
        self._kv_stride = torch.tensor([v.stride(0) for v in self._frags], dtype=torch.int64)
        self._frag_offset = torch.arange(len(self._frags), dtype=torch.int64) * frag
        # Device copies of the address tables, for the copy kernel.
        self._kv_base_dev = self._kv_base.to(self.device)
        self._kv_stride_dev = self._kv_stride.to(self.device)
        self._host_addr_dev = self.pool.device_block_address.to(self.device)
        self._rings = (_PinnedRing(1 << 18), _PinnedRing(1 << 18))
        helpers = load_cuda_helpers()
        self._lib = helpers[0] if helpers else None
        features = helpers[1] if helpers else 0
        self.has_host_wake = bool(features & 1)
        self.has_batch = bool(features & 2)
        self.has_kernel = _triton_available() and self.pool.pinned and frag % 8 == 0
        self.can_wake = self.has_host_wake
        #: Poll each transfer's event natively around its expected end (see
        #: ``mark_completion``); the expected end comes from the bandwidth this backend
        #: has measured per direction.
        self.spin = bool(features & 8) and self.has_host_wake
        self.spin_lead_ns = 60_000
        self.spin_window_ns = 150_000
        #: A native copy expected (from the measured bandwidth and the copies queued
        #: before it) to end within this many ns is waited for on the submitting thread,
        #: at most twice as long, and ends inside ``submit_*`` (see ``EngineConfig``'s
        #: ``inline_wait_us``); 0: never.
        self.inline_wait_ns = int(inline_wait_us * 1000)
        #: Waits that gave up (the copy then completed through its wake-up).
        self.inline_waits_missed = 0
        self._rate: list[float | None] = [None, None]  # bytes per ns, EWMA
        self._lane_end_ns = [0, 0]
        # Per direction, the jobs not yet seen ended, in submission order.
        self._recent: tuple[deque[CudaJob], deque[CudaJob]] = (deque(), deque())
        self.copy_method: CopyMethod = copy_method
        #: Per-direction overrides of ``copy_method`` (store, load); ``None`` keeps it.
        self.method_by_direction: list[CopyMethod | None] = [None, None]
        self.kernel_max_fragment_bytes = kernel_max_fragment_bytes
        self.kernel_programs = kernel_programs
        #: cuMemcpyBatchAsync attributes per direction, (source access order, flags).
        #: Stores read in stream order (their source was written by earlier work on the
        #: stream); loads read host slots nothing writes while they are pinned, so any
        #: order. No overlap-with-compute hint: it cost both-direction bandwidth (75 GB/s
        #: against 86 without, H200).
        self.batch_attributes: tuple[tuple[int, int], tuple[int, int]] = ((1, 0), (3, 0))
        #: Per-direction overrides of ``kernel_programs`` (store, load); ``None`` keeps it.
        self.kernel_programs_by_direction: list[int | None] = [None, None]
        # Rows beyond the KV cache's block count would serve only stores that repeat ids.
        self.staging_blocks = max(1, min(staging_bytes // layout.block_bytes, layout.num_blocks))
        self._staging: list[torch.Tensor | None] = [None, None]
        # The staged method: per direction a kernel stream, two buffers, and for each
        # buffer the event after which it may be refilled.
        self._kernel_streams = (_new_stream(self.device), _new_stream(self.device))
        self._staged: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None, None]
        self._staged_buffers: list[torch.Tensor] = []
        self._staging_free: list[list[torch.cuda.Event | None]] = [[None, None], [None, None]]
        self.transfers_by_method: dict[str, int] = {
            "batch": 0,
            "kernel": 0,
            "staged": 0,
            "gather": 0,
        }
        #: The native copy path (``NativeCopy``): the ``kernel`` method in one C call, no
        #: Triton launch, no torch stream objects; ``auto`` takes it for jobs of at most
        #: ``native_max_blocks`` blocks. ``None`` where it is unavailable.
        self._native: NativeCopy | None = None
        self.native_max_blocks = 32
        #: Small native jobs gather through device staging and DMA the blocks (True), or
        #: the kernel writes the host slots through UVA (False, the default);
        #: ``ASYNCOFFLOAD_NATIVE_SMALL=staged`` sets it.
        self.native_small_staged = os.environ.get("ASYNCOFFLOAD_NATIVE_SMALL") == "staged"
        self._native_stage: list[_NativeStaging | None] = [None, None]
        self._native_refs: torch.Tensor | None = None
        self._plain_enqueue = False
        self._setup_native()
        if copy_method != "auto" and not self._available(copy_method):
            raise RuntimeError(f"copy_method={copy_method!r} is not available here")
        if self.has_kernel:
            self._warm_up_kernel()
        self._closed = False
        # Duplicates of the bound wake-up fd that host functions write (see ``bind``).
        self._fds: list[int] = []
        # Dropped unclosed, the backend is released by this; it must not refer to the
        # backend (that would keep it alive), only to what the streams touch.
        self._finalizer = weakref.finalize(
            self,
            _release_streams,
            self.pid,
            (*self._streams, *self._kernel_streams),
            self.pool,
            self._fds,
            (
                self._kv,
                self._staging,
                self._staged,
                self._staged_buffers,
                self._rings,
                self._native_refs,
                self._native_stage,
            ),
        )
        log.info(
            "CUDA backend on %s: %d host blocks of %d B (%s), methods: batch=%s kernel=%s, "
            "host-function wake-ups=%s",
            self.device,
            num_host_blocks,
            layout.block_bytes,
            "pinned" if self.pool.pinned else f"{self.pool.pageable_chunks} pageable chunks",
            self.has_batch,
            self.has_kernel,
            self.has_host_wake,
        )

    def bind(self, wake: Callable[[], None], wake_fd: int | None = None) -> None:
        """As :meth:`TransferBackend.bind`; host functions write a duplicate of
        ``wake_fd`` owned by the backend (closed once its streams are done), so that the
        owner closing ``wake_fd`` can never make one write into a reused fd number."""
        if wake_fd is None or self._closed or forked_since(self.pid):
            super().bind(wake, wake_fd)
            return
        fd = os.dup(wake_fd)
        self._fds.append(fd)  # earlier ones may sit in queued host functions' slots
        super().bind(wake, fd)

    def _expect(self, job: CudaJob, direction: int) -> tuple[int, int, bool] | None:
        """``(now, end, idle)``: ``job``'s expected end (``time.perf_counter_ns``), from
        the bandwidth measured in this direction and the transfers queued before it, and
        whether every earlier transfer of this direction has ended; ``None`` before a
        measurement. Counts ``job`` as queued."""
        recent = self._recent[direction]
        while recent and recent[0].query():  # a stream's jobs end in order
            done = recent.popleft()
            seconds = done.duration_s
            if done.error is None and done.nbytes and seconds > 0:
                sample = done.nbytes / (seconds * 1e9)
                old = self._rate[direction]
                self._rate[direction] = sample if old is None else 0.7 * old + 0.3 * sample
        idle = not recent
        if len(recent) < 64:
            recent.append(job)
        rate = self._rate[direction]
        if not (rate and job.nbytes):
            return None
        now = time.perf_counter_ns()
        end = max(now, self._lane_end_ns[direction]) + int(job.nbytes / rate)
        self._lane_end_ns[direction] = end
        return now, end, idle

    def _spin_window(self, expected: tuple[int, int, bool] | None) -> tuple[int, int] | None:
        """When the spinner should poll a job's event: around its ``expected`` end."""
        if expected is None or not (self.spin and self._wake_fd is not None):
            return None
        now, end, _idle = expected
        return (max(now, end - self.spin_lead_ns), end + self.spin_window_ns)

    def _wait_here(self, expected: tuple[int, int, bool] | None) -> int:
        """Nanoseconds to wait on this thread for a job ``expected`` to end within
        ``inline_wait_us`` with nothing of its direction ahead of it (twice that: past it
        the wait gives up); 0: don't wait."""
        limit = self.inline_wait_ns
        if expected is None or not limit:
            return 0
        now, end, idle = expected
        return 2 * limit if idle and end - now <= limit else 0

    def _settle(
        self, native: NativeCopy, job: CudaJob, direction: int, rc: int, wake_fd: int | None
    ) -> None:
        """The outcome ``rc`` of :meth:`NativeCopy.copy_wait` for ``job``. Ended: it is
        marked as copied inline (the engine completes it in the caller's step, with no
        wake-up round trip), its duration host time from the launch to the end the wait
        saw. Not yet: its wake-up is queued now, on the direction's copy stream after
        its end."""
        if rc == 0:
            job.inline = True
            job._done = True
            return
        if rc != _CUDA_ERROR_NOT_READY:  # the copy failed; its event says so
            job.finish_inline(RuntimeError(f"CUDA error {rc} surfaced by a copy's event"))
            job.stamped = False
            return
        self.inline_waits_missed += 1
        if wake_fd is not None:
            native.arm(job, direction, wake_fd)

    def _warm_up_kernel(self) -> None:
        """Compile and load the copy kernel for both directions now, on scratch memory:
        the first launch would otherwise stall a submission (and the event loop) for a
        compile and a module load that may synchronize the device."""
        frag = self.layout.fragment_bytes
        nfrag = len(self._frags)
        with torch.cuda.device(self.device):
            dev = torch.empty(nfrag * frag, dtype=torch.uint8, device=self.device)
            host = self.pool.block(0)  # slot 0 holds nothing yet
            kv_base = (dev.data_ptr() + torch.arange(nfrag, dtype=torch.int64) * frag).to(
                self.device
            )
            kv_stride = torch.zeros(nfrag, dtype=torch.int64, device=self.device)
            host_addr = self.pool.device_block_address[:1].to(self.device)
            ids = torch.zeros(2, dtype=torch.int64, device=self.device)
            from asyncoffload.transfer._triton_copy import launch_copy_blocks

            for store in (True, False):
                launch_copy_blocks(
                    ids, 1, kv_base, kv_stride, host_addr, frag, store, self.kernel_programs
                )
            torch.cuda.synchronize(self.device)
            host.zero_()

    def _setup_native(self) -> None:
        """Use the native copy path if the helper has it, the pool is pinned and every
        fragment address, stride and size (and every host slot) is 16-byte aligned."""
        frag = self.layout.fragment_bytes
        align = NativeCopy.ALIGN
        aligned = (
            frag % align == 0
            and self.layout.block_bytes % align == 0
            and all(v.data_ptr() % align == 0 and v.stride(0) % align == 0 for v in self._frags)
            and bool((self.pool.device_block_address % align == 0).all())
        )
        if not (aligned and self.pool.pinned and native_copy_ready(self._lib, self.device)):
            return
        assert self._lib is not None
        nfrag = len(self._frags)
        table = torch.stack(
            [
                self._kv_base,
                self._kv_stride,
                self._frag_offset,
                torch.zeros(nfrag, dtype=torch.int64),
                torch.full((nfrag,), frag, dtype=torch.int64),
            ]
        )
        self._native_refs = table.contiguous().to(self.device)
        self._native = NativeCopy(self._lib, self.device, self._streams)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._native_programs = _native_programs(sms)
        self._plain_enqueue = type(self)._enqueue is CudaCopyBackend._enqueue
        torch.cuda.synchronize(self.device)

    @property
    def has_native(self) -> bool:
        """Whether the native copy path serves the ``kernel`` method here."""
        return self._native is not None

    def _available(self, method: str) -> bool:
        return {
            "batch": self.has_batch,
            "kernel": self.has_kernel or self._native is not None,
            "staged": self.has_kernel and self.has_batch,
            "gather": True,
        }[method]

    def choose_method(self, num_blocks: int, direction: int = 0) -> str:
        """The copy method a transfer of ``num_blocks`` blocks uses in ``direction``
        (0: store, 1: load). ``method_by_direction`` entries override ``copy_method``."""
        forced = self.method_by_direction[direction] or self.copy_method
        if forced != "auto":
            return forced
        fragments = num_blocks * self.layout.fragments_per_block
        small = self.layout.fragment_bytes <= self.kernel_max_fragment_bytes
        if not small and self._native is not None and num_blocks <= self.native_max_blocks:
            # Large fragments, few blocks: the native kernel beats staging's launches.
            return "kernel"
        if self.has_kernel and small and fragments >= 64:
            return "kernel"
        if not small and self._available("staged"):
            return "staged"
        if self.has_batch:
            return "batch"
        return "kernel" if self.has_kernel else "gather"

    def read_host_block(self, host_id: int) -> bytes:
        return host_bytes(self.pool.block(host_id))

    def host_address(self, host_id: int) -> int:
        return int(self.pool.block(host_id).data_ptr())

    def describe(self) -> dict[str, object]:
        return {
            "device": str(self.device),
            "host_bytes": self.num_host_blocks * self.layout.block_bytes,
            "pinned_chunks": self.pool.pinned_chunks,
            "pageable_chunks": self.pool.pageable_chunks,
            "copy_method": self.copy_method,
            "batch_memcpy": self.has_batch,
            "copy_kernel": self.has_kernel,
            "native_copy": self._native is not None,
            "host_function_wakeups": self.has_host_wake,
            "completion_spinner": self.spin,
            "inline_wait_us": self.inline_wait_ns / 1000,
            "inline_waits_missed": self.inline_waits_missed,
            "transfers_by_method": dict(self.transfers_by_method),
        }

    # --- submission ---

    def submit_store(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyJob:
        return self._submit(0, gpu_ids, host_ids)

    def submit_load(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> CopyJob:
        return self._submit(1, gpu_ids, host_ids)

    def _submit(self, direction: int, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyJob:
        self.check_process()
        if self._closed:
            raise RuntimeError("CudaCopyBackend is closed")
        if len(gpu_ids) != len(host_ids):
            raise ValueError(f"{len(gpu_ids)} KV block ids but {len(host_ids)} host ids")
        n = len(gpu_ids)
        if n and (min(gpu_ids) < 0 or max(gpu_ids) >= self.layout.num_blocks):
            raise IndexError(f"KV block ids must lie in [0, {self.layout.num_blocks})")
        if n and (min(host_ids) < 0 or max(host_ids) >= self.num_host_blocks):
            raise IndexError(f"host block ids must lie in [0, {self.num_host_blocks})")
        method = self.choose_method(n, direction)
        if method == "kernel" and n and self._native is not None and self._plain_enqueue:
            return self._submit_native(direction, gpu_ids, host_ids)
        job = CudaJob(n, n * self.layout.block_bytes, method)
        stream = self._streams[direction]
        # Order after the caller's queued work: a store reads finished KV, a load does not
        # overwrite blocks that earlier kernels still read or write.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            try:
                start_timing(job, stream)
                if n:
                    job._keep = self._enqueue(method, direction, list(gpu_ids), list(host_ids))
                lib = self._lib if self.has_host_wake else None
                spin = self._spin_window(self._expect(job, direction))
                mark_completion(job, stream, lib, self._wake_fd, spin_ns=spin)
            except BaseException:
                # Part of the transfer may be queued: its slots must not be freed (the
                # caller does, on failure) before the device is done with them.
                self._kernel_streams[direction].synchronize()
                stream.synchronize()
                raise
            assert job._event is not None
            for item in job._keep:
                if isinstance(item, torch.Tensor) and item.is_pinned():
                    self._rings[direction].release(item, job._event)
        self.transfers_by_method[method] += 1
        return job

    def _submit_native(
        self, direction: int, gpu_ids: Sequence[int], host_ids: Sequence[int]
    ) -> CopyJob:
        """The ``kernel`` method through :class:`NativeCopy`: one C call queues the wait
        for the caller's stream, the timing events, the kernel (ids as its parameters)
        and the completion host function."""
        native = self._native
        assert native is not None and self._native_refs is not None
        n = len(gpu_ids)
        job = CudaJob(n, n * self.layout.block_bytes, "kernel")
        gids = array("q", gpu_ids)
        hids = array("q", host_ids)
        wake_fd = self._wake_fd if self.has_host_wake else None
        staged = self.native_small_staged and self.has_batch
        expected = self._expect(job, direction)
        wait_ns = 0 if staged else self._wait_here(expected)
        try:
            span = (
                self._native_refs.data_ptr(),
                len(self._frags),
                n,
                gids.buffer_info()[0],
                hids.buffer_info()[0],
                0,
                self.layout.fragment_bytes,
            )
            rows = self._host_addr_dev.data_ptr()
            if wait_ns:
                rc = native.copy_wait(job, direction, rows, span, self._native_programs, wait_ns)
                self._settle(native, job, direction, rc, wake_fd)
            elif staged:
                # The kernel gathers into device staging, one DMA per block (per run of
                # consecutive slots) moves it: serial on the copy stream.
                stage = self._native_stage[direction]
                if stage is None:
                    rows = max(1, min(self.native_max_blocks, self.staging_blocks))
                    stage = _NativeStaging(native, self.device, rows, self.layout.block_bytes)
                    self._native_stage[direction] = stage
                native.staged(
                    job,
                    direction,
                    native.streams[direction],
                    stage,
                    span,
                    self.pool.block_address.data_ptr(),
                    self.pool.rows_per_chunk,
                    self.layout.block_bytes,
                    1,
                    self._native_programs,
                    True,
                    wake_fd,
                    self._spin_window(expected),
                )
            else:
                spin = self._spin_window(expected)
                native.launch(
                    job, direction, rows, (span,), 1, self._native_programs, wake_fd, spin
                )
        except BaseException:
            # Part of the transfer may be queued: its slots must not be freed (the
            # caller does, on failure) before the device is done with them.
            if wait_ns:
                torch.cuda.current_stream(self.device).synchronize()
            self._streams[direction].synchronize()
            raise
        self.transfers_by_method["kernel"] += 1
        return job

    def _enqueue(
        self, method: str, direction: int, gpu_ids: list[int], host_ids: list[int]
    ) -> list[Any]:
        if method == "gather":
            return self._enqueue_gather(direction, gpu_ids, host_ids)
        if method == "staged":
            return self._enqueue_staged(direction, gpu_ids, host_ids)
        gidx = torch.tensor(gpu_ids, dtype=torch.int64)
        hidx = torch.tensor(host_ids, dtype=torch.int64)
        if method == "kernel":
            return self._enqueue_kernel(direction, gidx, hidx)
        kv_addr = (gidx[:, None] * self._kv_stride + self._kv_base).reshape(-1)
        host_addr = (self.pool.block_address[hidx][:, None] + self._frag_offset).reshape(-1)
        src, dst = (kv_addr, host_addr) if direction == 0 else (host_addr, kv_addr)
        if method == "batch":
            stream = torch.cuda.current_stream(self.device)
            self._memcpy_batch(stream, direction, src, dst, self.layout.fragment_bytes)
            return []  # the descriptor arrays were consumed by the call
        raise ValueError(f"unknown copy method {method!r}")

    def _enqueue_kernel(self, direction: int, gidx: torch.Tensor, hidx: torch.Tensor) -> list[Any]:
        # The ids go to the device on the copy stream; addresses are computed there.
        n_blocks = gidx.numel()
        ids = self._rings[direction].take(2 * n_blocks)
        ids[:n_blocks] = gidx
        ids[n_blocks:] = hidx
        ids_dev = ids.to(self.device, non_blocking=True)
        self._run_kernel(ids_dev, n_blocks, self._host_addr_dev, store=direction == 0)
        return [ids, ids_dev]

    def _staging_buffer(self, direction: int) -> torch.Tensor:
        staging = self._staging[direction]
        if staging is None:
            staging = torch.empty(
                (self.staging_blocks, self.layout.block_bytes),
                dtype=torch.uint8,
                device=self.device,
            )
            self._staging[direction] = staging
        return staging

    def _enqueue_staged(self, direction: int, gpu_ids: list[int], host_ids: list[int]) -> list[Any]:
        """The kernel gathers blocks into device staging memory (fast: device memory
        only), and the copy engines move whole blocks, one DMA descriptor per host block.

        Two staging buffers per direction form a pipeline across two streams: the kernel
        fills one buffer on the direction's kernel stream while the copy stream moves the
        other; events order each buffer's producer before its consumer, and its consumer
        before its next producer, across transfers too. Everything ends on the copy
        stream, where the transfer's completion marker is recorded.
        """
        copy_stream = torch.cuda.current_stream(self.device)
        kernel_stream = self._kernel_streams[direction]
        staging = self._staging_pair(direction)
        step = self.staging_blocks
        keep: list[Any] = []
        # The kernel stream starts where the copy stream is: after the caller's queued
        # work and after this direction's earlier transfers.
        kernel_stream.wait_stream(copy_stream)
        for k, lo in enumerate(range(0, len(gpu_ids), step)):
            g = gpu_ids[lo : lo + step]
            h = host_ids[lo : lo + step]
            m = len(g)
            buf = k % 2
            rows_dev, rows = staging[buf]
            ids = self._rings[direction].take(2 * m)
            ids[:m] = torch.tensor(g, dtype=torch.int64)
            ids[m:] = torch.arange(m, dtype=torch.int64)  # staging rows 0..m-1
            host = self.pool.block_address[torch.tensor(h, dtype=torch.int64)]
            rows_m = rows[:m]
            src, dst = (rows_m, host) if direction == 0 else (host, rows_m)
            free = self._staging_free[direction][buf]
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            if direction == 0:
                with torch.cuda.stream(kernel_stream):
                    if free is not None:
                        kernel_stream.wait_event(free)  # the DMA that last read buf
                    ids_dev = ids.to(self.device, non_blocking=True)
                    self._run_kernel(ids_dev, m, rows_dev, store=True)
                    ready.record(kernel_stream)
                copy_stream.wait_event(ready)
                self._dma_blocks(copy_stream, direction, src, dst)
                done.record(copy_stream)
            else:
                if free is not None:
                    copy_stream.wait_event(free)  # the kernel that last read buf
                self._dma_blocks(copy_stream, direction, src, dst)
                ready.record(copy_stream)
                with torch.cuda.stream(kernel_stream):
                    kernel_stream.wait_event(ready)
                    ids_dev = ids.to(self.device, non_blocking=True)
                    self._run_kernel(ids_dev, m, rows_dev, store=False)
                    done.record(kernel_stream)
            self._staging_free[direction][buf] = done
            keep += (ids, ids_dev)
        # The transfer ends on the copy stream, after the kernel stream's last work.
        copy_stream.wait_stream(kernel_stream)
        return keep

    def _staging_pair(self, direction: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The direction's two staging buffers: (device table of row addresses, host-side
        int64 row addresses) each; allocated on first use."""
        pair = self._staged[direction]
        if pair is None:
            pair = []
            block = self.layout.block_bytes
            for _ in range(2):
                buf = torch.empty(
                    (self.staging_blocks, block), dtype=torch.uint8, device=self.device
                )
                rows = buf.data_ptr() + torch.arange(self.staging_blocks, dtype=torch.int64) * block
                self._staged_buffers.append(buf)
                pair.append((rows.to(self.device), rows))
            self._staged[direction] = pair
        return pair

    def _run_kernel(
        self, ids_dev: torch.Tensor, n_blocks: int, block_addr: torch.Tensor, store: bool
    ) -> None:
        from asyncoffload.transfer._triton_copy import launch_copy_blocks  # needs Triton

        launch_copy_blocks(
            ids_dev,
            n_blocks,
            self._kv_base_dev,
            self._kv_stride_dev,
            block_addr,
            self.layout.fragment_bytes,
            store,
            self.kernel_programs_by_direction[0 if store else 1] or self.kernel_programs,
        )

    def _dma_blocks(
        self, stream: torch.cuda.Stream, direction: int, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Whole-block copies between staging rows and host slots on ``stream``."""
        self._memcpy_batch(stream, direction, src, dst, self.layout.block_bytes)

    def _memcpy_batch(
        self,
        stream: torch.cuda.Stream,
        direction: int,
        src: torch.Tensor,
        dst: torch.Tensor,
        size: int,
    ) -> None:
        """One ``cuMemcpyBatchAsync`` of ``size`` bytes from each ``src`` address to the
        matching ``dst`` (int64 CPU tensors, read during the call)."""
        assert self._lib is not None  # the batch and staged methods need the helper
        sizes = torch.full_like(src, size)
        rc = self._lib.ao_cuda_memcpy_batch(
            stream.cuda_stream,
            dst.data_ptr(),
            src.data_ptr(),
            sizes.data_ptr(),
            src.numel(),
            direction,
            self.device.index if self.device.index is not None else 0,
            *self.batch_attributes[direction],
        )
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc}")

    def _enqueue_gather(self, direction: int, gpu_ids: list[int], host_ids: list[int]) -> list[Any]:
        frag = self.layout.fragment_bytes
        step = self.staging_blocks
        staging = self._staging_buffer(direction)
        keep: list[Any] = []
        for lo in range(0, len(gpu_ids), step):
            g = gpu_ids[lo : lo + step]
            h = host_ids[lo : lo + step]
            staged = self._rings[direction].take(len(g))
            staged.copy_(torch.tensor(g, dtype=torch.int64))
            gidx = staged.to(self.device, non_blocking=True)
            keep += (staged, gidx)
            part = staging[: len(g)]
            if direction == 0:
                for f, view in enumerate(self._frags):
                    part[:, f * frag : (f + 1) * frag] = view.index_select(0, gidx)
                for pos, first, length in self.pool.runs(h):
                    self.pool.view(first, length).copy_(part[pos : pos + length], non_blocking=True)
            else:
                for pos, first, length in self.pool.runs(h):
                    part[pos : pos + length].copy_(self.pool.view(first, length), non_blocking=True)
                for f, view in enumerate(self._frags):
                    view.index_copy_(0, gidx, part[:, f * frag : (f + 1) * frag])
        return keep

    def close(self) -> None:
        """Wait for queued copies (and their wake-ups), then unpin the host pool. In a
        fork's child: only marks the backend closed (streams and pinning are the
        parent's)."""
        if self._closed:
            return
        self._closed = True
        detached = self._finalizer.detach()
        if detached is not None:
            _, release, args, _ = detached
            release(*args)
        self._staging = [None, None]
        self._staged = [None, None]
        self._staged_buffers.clear()


def _release_streams(
    pid: int,
    streams: tuple[torch.cuda.Stream, ...],
    pool: PinnedHostPool,
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


# --- the Triton copy kernel (imported only where Triton is installed) -------------------

_triton_checked: bool | None = None


def _triton_available() -> bool:
    global _triton_checked
    if _triton_checked is None:
        _triton_checked = importlib.util.find_spec("triton") is not None
    return _triton_checked
