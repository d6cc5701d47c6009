"""Copy engines of the PagedTransferWorker: they run a :class:`CopyPlan` between paged KV
tensors and host slots, one ordered lane per direction, by a fast primary path and an
independent fallback path that a failed copy is retried on.

- :class:`CpuPagedEngine`: CPU tensors. Primary: the native copy lanes (a native thread
  per direction runs ``memcpy`` over the descriptors, never taking the GIL). Fallback:
  torch index copies on the calling thread.
- :class:`CudaPagedEngine`: CUDA tensors, pinned host slots, one copy stream per
  direction. Primary: one ``cuMemcpyBatchAsync`` per transfer. Fallback: one
  ``cuMemcpyAsync`` per descriptor, or torch copies where the native helper is missing.

Jobs are :class:`~asyncoffload.transfer.base.CopyJob` objects: ``query()`` polls,
``engine.wait(job)`` blocks without spinning in Python.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Sequence
from typing import Literal, Protocol

import torch

from asyncoffload._native import load_copy_engine, load_cuda_helpers
from asyncoffload.transfer.base import CopyJob, host_bytes
from asyncoffload.transfer.paged import CopyPlan, PageLayout

__all__ = ["LOAD", "STORE", "CpuCopyEngine", "CpuPagedEngine", "CudaPagedEngine", "PagedEngine"]

log = logging.getLogger("asyncoffload.transfer")

#: Directions: a store copies KV -> host, a load host -> KV.
STORE, LOAD = 0, 1

CpuCopyEngine = Literal["auto", "native", "threads", "torch"]


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
        """Finish queued copies and release host memory."""


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


class CpuPagedEngine:
    """Copies between CPU KV tensors and a page-aligned host buffer of ``num_slots``
    slots (anonymous memory: zero-filled, committed as it is touched).

    ``copy_engine``: ``"native"`` (the native copy lanes: one thread per direction runs
    ``memcpy`` over the plan's descriptors without the GIL; failed copies are retried
    with torch index copies on the calling thread), ``"threads"`` or ``"torch"`` (torch
    index copies on the calling thread, the retry being the same once more), ``"auto"``
    (native where the C helper builds).
    """

    def __init__(self, layout: PageLayout, num_slots: int, copy_engine: CpuCopyEngine) -> None:
        if layout.device.type != "cpu":
            raise ValueError(f"CpuPagedEngine needs CPU tensors, got {layout.device}")
        if copy_engine not in ("auto", "native", "threads", "torch"):
            raise ValueError(
                f"copy_engine must be 'auto', 'native', 'threads' or 'torch', got {copy_engine!r}"
            )
        self.layout = layout
        self.num_slots = num_slots
        nbytes = num_slots * layout.slot_bytes
        self._map: mmap.mmap | None = mmap.mmap(-1, nbytes)
        self.host = torch.frombuffer(self._map, dtype=torch.uint8).view(
            num_slots, layout.slot_bytes
        )
        self._host_base = self.host.data_ptr()
        self._pages = _HostPages(layout, [self.host], num_slots)
        lib = None if copy_engine in ("threads", "torch") else load_copy_engine()
        if copy_engine == "native" and lib is None:
            raise RuntimeError("copy_engine='native' but the native copy engine can't be built")
        self._lib = lib
        self._lanes: list[int] = []
        if lib is not None:
            for _ in range(2):
                handle = lib.ao_lane_create(-1)
                if not handle:
                    self._stop_lanes()
                    raise OSError("ao_lane_create failed")
                self._lanes.append(int(handle))
        self.primary_name = "cpu-native" if lib is not None else "cpu-torch"
        self.fallback_name = "cpu-torch"

    def submit_primary(self, direction: int, plan: CopyPlan) -> CopyJob:
        if self._lib is None:
            return self.submit_fallback(direction, plan)
        host = self.host_addresses(plan)
        src, dst = (plan.kv_addr, host) if direction == STORE else (host, plan.kv_addr)
        job = _NativeCopies(plan.nbytes, plan.num_copies, self._lib, self._lanes[direction])
        rc = self._lib.ao_lane_submit_copies(
            self._lanes[direction],
            plan.num_copies,
            src.data_ptr(),
            dst.data_ptr(),
            plan.size.data_ptr(),
            ctypes.addressof(job._status),
        )
        if rc != 0:
            raise RuntimeError(f"native copy lane refused the job (code {rc})")
        return job

    def host_addresses(self, plan: CopyPlan) -> torch.Tensor:
        return self._host_base + plan.host_slot * self.layout.slot_bytes + plan.host_offset

    def submit_fallback(self, direction: int, plan: CopyPlan) -> CopyJob:
        job = CopyJob(plan.num_copies, plan.nbytes)
        self._pages.copy_cpu(direction, plan)
        job.finish()
        return job

    def wait(self, job: CopyJob) -> None:
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

    def _stop_lanes(self) -> None:
        lanes, self._lanes = self._lanes, []
        if self._lib is not None:
            for handle in lanes:
                self._lib.ao_lane_destroy(handle)  # finishes queued jobs, joins the thread

    def close(self) -> None:
        self._stop_lanes()
        # The tensors that view the map go first; the map then closes with its last
        # reference (closing it while a stray view lives would raise BufferError).
        self.host = torch.empty((0, self.layout.slot_bytes), dtype=torch.uint8)
        self._pages = _HostPages(self.layout, [], 1)
        self._map = None


class CudaPagedEngine:
    """Copies between KV tensors on one CUDA device and pinned host slots.

    Host slots live in a :class:`~asyncoffload.transfer.cuda.PinnedHostPool` (chunks of
    about ``chunk_bytes``, page-aligned, pinned; pageable if pinning fails, logged). Each
    direction has one copy stream; a transfer first waits for the caller's current
    stream. Paths, per transfer:

    - ``cuda-batch`` (primary where the driver has it, CUDA 12.8+): one
      ``cuMemcpyBatchAsync`` over every descriptor of the plan;
    - ``cuda-each``: one ``cuMemcpyAsync`` per descriptor (primary without the batch
      call, else the fallback);
    - ``cuda-torch``: torch gathers on the device and index copies on the host,
      synchronous (where the native CUDA helper cannot be built).
    """

    def __init__(
        self, layout: PageLayout, num_slots: int, *, pin: bool = True, chunk_bytes: int = 1 << 30
    ) -> None:
        from asyncoffload.transfer.cuda import PinnedHostPool, _new_stream

        if layout.device.type != "cuda":
            raise ValueError(f"CudaPagedEngine needs CUDA tensors, got {layout.device}")
        self.layout = layout
        self.num_slots = num_slots
        device = layout.device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        with torch.cuda.device(device):
            self.pool = PinnedHostPool(num_slots, layout.slot_bytes, chunk_bytes, pin)
            self.streams = (_new_stream(device), _new_stream(device))
        helpers = load_cuda_helpers()
        self._lib = helpers[0] if helpers else None
        features = helpers[1] if helpers else 0
        self.has_batch = bool(features & 2)
        self.has_each = bool(features & 16)
        methods = [m for m, ok in (("batch", self.has_batch), ("each", self.has_each)) if ok]
        methods.append("torch")
        self.primary_method = methods[0]
        self.fallback_method = methods[1] if len(methods) > 1 else "torch"
        self.primary_name = f"cuda-{self.primary_method}"
        self.fallback_name = f"cuda-{self.fallback_method}"
        #: cuMemcpyBatchAsync (source access order, flags) per direction: stores read KV
        #: in stream order; loads read slots nothing writes meanwhile, in any order.
        self.batch_attributes: tuple[tuple[int, int], tuple[int, int]] = ((1, 0), (3, 0))
        if not self.pool.pinned:
            log.warning(
                "paged CUDA engine: %d of %d host chunks are pageable; copies from them are "
                "slower and synchronous",
                self.pool.pageable_chunks,
                len(self.pool.chunks),
            )

    def submit_primary(self, direction: int, plan: CopyPlan) -> CopyJob:
        return self._submit(direction, plan, self.primary_method)

    def submit_fallback(self, direction: int, plan: CopyPlan) -> CopyJob:
        return self._submit(direction, plan, self.fallback_method)

    def _submit(self, direction: int, plan: CopyPlan, method: str) -> CopyJob:
        from asyncoffload.transfer.cuda import CudaJob, mark_completion, start_timing

        stream = self.streams[direction]
        job = CudaJob(plan.num_copies, plan.nbytes, method)
        # A store reads finished KV; a load overwrites blocks only after the work queued
        # before it (the zeroing of fresh blocks, earlier reads) has run.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            start_timing(job, stream)
            try:
                if plan.num_copies:
                    job._keep = self._enqueue(method, direction, plan, stream)
            except BaseException:
                # Part of it may be queued: let it end before anyone retries over it.
                stream.synchronize()
                raise
            mark_completion(job, stream, None, None)
        return job

    def _enqueue(
        self, method: str, direction: int, plan: CopyPlan, stream: torch.cuda.Stream
    ) -> list[torch.Tensor]:
        if method == "torch":
            self._torch_copy(direction, plan)
            return []
        assert self._lib is not None
        host = self.pool.block_address[plan.host_slot] + plan.host_offset
        src, dst = (plan.kv_addr, host) if direction == STORE else (host, plan.kv_addr)
        size = plan.size
        if method == "batch":
            rc = self._lib.ao_cuda_memcpy_batch(
                stream.cuda_stream,
                dst.data_ptr(),
                src.data_ptr(),
                size.data_ptr(),
                plan.num_copies,
                direction,
                self.device.index,
                *self.batch_attributes[direction],
            )
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc}")
        elif method == "each":
            rc = self._lib.ao_cuda_memcpy_each(
                stream.cuda_stream, dst.data_ptr(), src.data_ptr(), size.data_ptr(), plan.num_copies
            )
            if rc != 0:
                raise RuntimeError(f"cuMemcpyAsync failed: CUresult {rc}")
        else:
            raise ValueError(f"unknown copy method {method!r}")
        # The driver reads the descriptor arrays during the call; they are kept until the
        # job ends all the same (cheap insurance).
        return [src, dst, size]

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
        self.streams[direction].synchronize()

    def read_slot(self, slot_id: int) -> bytes:
        return host_bytes(self.pool.block(slot_id))

    def close(self) -> None:
        for stream in self.streams:
            stream.synchronize()
        self.pool.close()
