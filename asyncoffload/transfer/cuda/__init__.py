"""The CUDA copy stack: one for the engine's backend and the paged worker.

=============== ==============================================================================
module          concern
=============== ==============================================================================
``hostpool``    pinned host slots in chunks (private or in a shared file), pinned id scratch
``native``      the native copy path: a transfer (kernel, staged, waited for) in one C call
``jobs``        a transfer's job, its completion marker, wake-up slots, the copy streams
``pacing``      expected ends: the spinner's window and the inline wait
``methods``     the copy method of a transfer: one rule for both users
``blocks``      the engine's Triton and torch methods (where the native path does not serve)
``paged_paths`` the worker's Triton, DMA and torch methods (likewise)
``backend``     :class:`CudaCopyBackend`, the engine's user
``paged``       :class:`CudaPagedEngine`, the paged worker's user
=============== ==============================================================================

The names users import from ``asyncoffload.transfer.cuda`` are re-exported here.
"""

from __future__ import annotations

from asyncoffload.transfer.cuda.backend import CudaCopyBackend
from asyncoffload.transfer.cuda.hostpool import PinnedHostPool, PinnedRing
from asyncoffload.transfer.cuda.jobs import CudaJob, mark_completion, start_timing, wait_for_slots
from asyncoffload.transfer.cuda.methods import CopyMethod
from asyncoffload.transfer.cuda.native import NativeCopy, NativeEvent, native_copy_ready

__all__ = [
    "CopyMethod",
    "CudaCopyBackend",
    "CudaJob",
    "NativeCopy",
    "NativeEvent",
    "PinnedHostPool",
    "PinnedRing",
    "mark_completion",
    "native_copy_ready",
    "start_timing",
    "wait_for_slots",
]
