"""The CUDA helper's calling conventions (``cuda_helpers.c``): its feature bits as a
named flag, and the structures its copy entry points take instead of long positional
argument lists. Each structure mirrors a C ``typedef`` field by field; every field is 8
bytes wide, so neither side pads."""

from __future__ import annotations

import ctypes
import enum
from typing import Any

__all__ = [
    "COPY_SIGNATURES",
    "CUDA_ERROR_NOT_READY",
    "CopyCall",
    "CopySpan",
    "CudaFeature",
    "StagingCall",
    "WakeSlot",
    "new_wake_slot",
]

#: ``cuEventQuery``'s answer for work still queued.
CUDA_ERROR_NOT_READY = 600


class CudaFeature(enum.IntFlag):
    """What the helper found in the driver (``ao_cuda_init``), and the spinner."""

    NONE = 0
    #: ``cuLaunchHostFunc``: completion host functions that write the loop's eventfd.
    HOST_WAKE = 1
    #: ``cuMemcpyBatchAsync`` (CUDA 12.8+).
    BATCH_MEMCPY = 2
    #: Pinning through the driver API (``cuMemHostRegister`` and its device pointer).
    HOST_REGISTER = 4
    #: The native spinner thread that polls a job's event around its expected end.
    SPINNER = 8
    #: ``cuMemcpyAsync``: one DMA per descriptor.
    MEMCPY_EACH = 16


class CopySpan(ctypes.Structure):
    """One group of a transfer (``ao_copy_span``): its ref table (device address of an
    int64 ``[5, nref]`` table: kv_base, kv_stride, host offset, page, bytes), ``n``
    blocks at ``gpu_ids`` and their slots at ``slot_ids`` (addresses of int64 arrays, read
    during the call), the sub-blocks its first slot skips, its largest page."""

    _fields_ = [
        ("refs", ctypes.c_uint64),
        ("nref", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("gpu_ids", ctypes.c_void_p),
        ("slot_ids", ctypes.c_void_p),
        ("skip", ctypes.c_int64),
        ("page", ctypes.c_int64),
    ]


class CopyCall(ctypes.Structure):
    """How a transfer is queued (``ao_copy_call``): device, the caller's current stream,
    the copy stream, its fence event, the timing events (or none), the device table of
    host slot addresses, blocks per slot, the direction, thread blocks per launch, the
    wake-up slot (or none) and the spinner's window (``spin_stop`` 0: no spinner)."""

    _fields_ = [
        ("device", ctypes.c_int64),
        ("caller", ctypes.c_void_p),
        ("stream", ctypes.c_void_p),
        ("fence", ctypes.c_void_p),
        ("start", ctypes.c_void_p),
        ("end", ctypes.c_void_p),
        ("rows", ctypes.c_uint64),
        ("bpc", ctypes.c_int64),
        ("store", ctypes.c_int64),
        ("programs", ctypes.c_int64),
        ("slot", ctypes.c_void_p),
        ("spin_start", ctypes.c_int64),
        ("spin_stop", ctypes.c_int64),
    ]


class StagingCall(ctypes.Structure):
    """One direction's staging for a staged transfer (``ao_staging``): rows per buffer,
    the two buffers' bases and device row tables, the row stride, the pipeline's state
    ``[next buffer, used 0, used 1]`` (an ``int[3]``), its ready / done events per buffer
    and the join event, the kernel stream, the host slot addresses (CPU int64), slots per
    pinned chunk, slot bytes, and whether the DMAs go through ``cuMemcpyBatchAsync``."""

    _fields_ = [
        ("rows", ctypes.c_int64),
        ("base", ctypes.c_void_p),
        ("row_tables", ctypes.c_void_p),
        ("row_stride", ctypes.c_int64),
        ("state", ctypes.c_void_p),
        ("ready", ctypes.c_void_p),
        ("done", ctypes.c_void_p),
        ("join", ctypes.c_void_p),
        ("kstream", ctypes.c_void_p),
        ("host_rows", ctypes.c_void_p),
        ("rows_per_chunk", ctypes.c_int64),
        ("slot_bytes", ctypes.c_int64),
        ("use_batch", ctypes.c_int64),
    ]


#: A job's wake-up slot: [state, end ns, fd, host function ran, spinner done] (see
#: ``ao_host_wake`` in cuda_helpers.c).
WakeSlot = ctypes.c_int64 * 5


def new_wake_slot(fd: int) -> ctypes.Array[ctypes.c_int64]:
    """A wake-up slot for a job whose completion writes ``fd``."""
    return WakeSlot(0, 0, fd, 0, 1)


_p = ctypes.POINTER
_void = ctypes.c_void_p

#: argtypes and restype of the copy entry points, set once the path is used.
COPY_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "ao_cuda_copy_init": ([ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "ao_ids_check": ([_void, ctypes.c_int64, ctypes.c_int64, ctypes.c_int], ctypes.c_int64),
    "ao_cuda_event_pair": ([_void], ctypes.c_int),
    "ao_cuda_event_plain": ([_void], ctypes.c_int),
    "ao_cuda_event_query": ([_void], ctypes.c_int),
    "ao_cuda_event_sync": ([_void], ctypes.c_int),
    "ao_cuda_event_destroy": ([_void], ctypes.c_int),
    "ao_cuda_event_elapsed": ([_void, _void, _void], ctypes.c_int),
    "ao_cuda_wake_after": ([_void, _void, _void], ctypes.c_int),
    "ao_cuda_copy_run": ([_p(CopyCall), _p(CopySpan), ctypes.c_int64], ctypes.c_int),
    "ao_cuda_copy_wait": (
        [_p(CopyCall), _p(CopySpan), ctypes.c_int64, _void],
        ctypes.c_int,
    ),
    "ao_cuda_staged_run": ([_p(CopyCall), _p(CopySpan), _p(StagingCall)], ctypes.c_int),
}
