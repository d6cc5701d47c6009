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

This module gathers them; each lives in its own: :mod:`~asyncoffload.transfer.paged_base`
(the directions, the :class:`PagedEngine` protocol, the torch copies over host slots),
:mod:`~asyncoffload.transfer.paged_cpu`, :mod:`~asyncoffload.transfer.paged_cuda` (with
its per-layout tables in :mod:`~asyncoffload.transfer.paged_cuda_tables`) and
:mod:`~asyncoffload.transfer.host_file`.
"""

from __future__ import annotations

from asyncoffload.transfer.host_file import SharedHostFile
from asyncoffload.transfer.paged_base import EXPEDITED, LANES, LOAD, STORE, PagedEngine
from asyncoffload.transfer.paged_cpu import CpuCopyEngine, CpuPagedEngine
from asyncoffload.transfer.paged_cuda import CudaPagedEngine

__all__ = [
    "EXPEDITED",
    "LANES",
    "LOAD",
    "STORE",
    "CpuCopyEngine",
    "CpuPagedEngine",
    "CudaPagedEngine",
    "PagedEngine",
    "SharedHostFile",
]
