"""The copy method of a transfer: one rule for the engine's backend and the paged worker.

Methods:

- ``kernel``: a kernel copies every (block, fragment) straight between the KV tensors and
  the pinned host slots through UVA (the native one in one C call, else Triton): best
  for small fragments and small jobs;
- ``staged``: the kernel gathers the job's fragments into device staging rows laid out
  like host slots (device memory only: fast), and the copy engines move whole slots (one
  DMA descriptor per run of consecutive slots): the copy engines' bandwidth, and the
  best for both directions at once;
- ``batch``: one ``cuMemcpyBatchAsync`` over one descriptor per fragment (CUDA 12.8+):
  fine for a few descriptors, CPU-bound for many;
- the fallbacks: ``gather`` (the engine: torch gathers into staging, one copy per run of
  slots), ``each`` and ``torch`` (the worker: ``cuMemcpyAsync`` per descriptor; torch
  copies).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "NATIVE_KERNEL_MAX_BLOCKS",
    "CopyMethod",
    "JobShape",
    "MethodTuning",
    "choose_method",
    "triton_available",
]

#: The engine's methods (``EngineConfig.copy_method``).
CopyMethod = Literal["auto", "batch", "kernel", "staged", "gather"]

#: Jobs of up to this many blocks take the native kernel rather than native staging:
#: staging's two streams and DMAs cost more than they save there (H200, 2 MiB blocks).
NATIVE_KERNEL_MAX_BLOCKS = 32


@dataclass
class MethodTuning:
    """The thresholds of :func:`choose_method`.

    ``small_copies``: fewer descriptors go to the ``base`` DMA method;
    ``kernel_max_fragment_bytes``: jobs whose mean fragment is at most this take the
    kernel; ``native_kernel_max_blocks``: native jobs of at most this many blocks take the
    native kernel, larger ones native staging where the job can be staged;
    ``native_small_fragments``: whether native serves jobs of small fragments too (the
    worker) or leaves them to the rule for small fragments (the engine).
    """

    small_copies: int = 64
    kernel_max_fragment_bytes: int = 16 << 10
    native_kernel_max_blocks: int = NATIVE_KERNEL_MAX_BLOCKS
    native_small_fragments: bool = True


@dataclass(frozen=True)
class JobShape:
    """What the choice needs to know of a job: its descriptors (``copies``), bytes and
    blocks; whether the native path serves it (``native``) and can stage it
    (``native_staged``: one group filling whole, dense slots)."""

    copies: int
    nbytes: int
    blocks: int
    native: bool = False
    native_staged: bool = False


def choose_method(
    job: JobShape,
    tuning: MethodTuning,
    *,
    kernel: bool,
    staged: bool,
    base: str,
) -> str:
    """The method ``auto`` takes for ``job``, where the Triton ``kernel`` and ``staged``
    methods are available or not, and ``base`` is the DMA method of small jobs (and the
    last resort)."""
    small = job.nbytes <= job.copies * tuning.kernel_max_fragment_bytes
    if job.copies and job.native and (tuning.native_small_fragments or not small):
        if job.native_staged and job.blocks > tuning.native_kernel_max_blocks:
            return "staged"  # the copy engines' bandwidth, submitted natively
        return "kernel"
    if job.copies < tuning.small_copies or not (kernel or staged):
        return base
    if kernel and small:
        return "kernel"
    if staged:
        return "staged"
    return "kernel" if kernel else base


_triton_checked: bool | None = None


def triton_available() -> bool:
    """Whether Triton is installed (the Triton kernels are imported only then)."""
    global _triton_checked
    if _triton_checked is None:
        _triton_checked = importlib.util.find_spec("triton") is not None
    return _triton_checked
