"""The paged worker's CUDA engine: :class:`CudaPagedEngine`, pinned host slots and one
copy stream per lane (store, load, expedited load), the second user of the CUDA copy
stack beside the engine's backend.

Where the native CUDA helper builds and a group's addresses and sizes are 16-byte
aligned, ``kernel`` and ``staged`` run natively (:class:`~asyncoffload.transfer.cuda.
native.NativeCopy`: one C call a job, the ids as kernel parameters, the staged DMA
descriptors built in C), and ``auto`` chooses native staged for one-group jobs of more
than 31 blocks filling dense slots, the native kernel otherwise. Elsewhere the Python
methods of :class:`~asyncoffload.transfer.cuda.paged_paths.PageCopies` run: the Triton
kernel, the Triton staged pipeline, ``cuMemcpyBatchAsync`` for small jobs; the fallback
is one ``cuMemcpyAsync`` per descriptor, or torch copies where the helper is missing.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

import torch

from asyncoffload._native import CudaFeature, load_cuda_helpers
from asyncoffload._native.cuda_abi import CopySpan
from asyncoffload.transfer.base import CopyJob, check_process, host_bytes
from asyncoffload.transfer.cuda.hostpool import PinnedHostPool
from asyncoffload.transfer.cuda.jobs import (
    CudaJob,
    highest_priority,
    mark_completion,
    new_stream,
    release_streams,
    start_timing,
)
from asyncoffload.transfer.cuda.methods import (
    NATIVE_KERNEL_MAX_BLOCKS,
    JobShape,
    MethodTuning,
    choose_method,
    triton_available,
)
from asyncoffload.transfer.cuda.native import (
    NativeCopy,
    NativeStaging,
    aligned,
    native_copy_ready,
)
from asyncoffload.transfer.cuda.paged_paths import PageCopies
from asyncoffload.transfer.host_file import _host_file
from asyncoffload.transfer.paged import CopyPlan, PageLayout
from asyncoffload.transfer.paged_base import EXPEDITED, _pid
from asyncoffload.transfer.settings import TransferSettings

__all__ = ["CudaPagedEngine"]

log = logging.getLogger("asyncoffload.transfer")


class CudaPagedEngine:
    """Copies between KV tensors on one CUDA device and pinned host slots.

    Host slots live in a :class:`~asyncoffload.transfer.cuda.hostpool.PinnedHostPool` (chunks of
    about ``chunk_bytes``, page-aligned, pinned; pageable if pinning fails, logged). Each
    direction has one copy stream (and a kernel stream for the staged method); a transfer
    first waits for the caller's current stream. Methods, per transfer:

    - ``staged``: a Triton kernel gathers the job's pages into rows of device staging
      memory laid out like host slots (device memory only: fast), and the copy engines
      move each slot's bytes (one DMA descriptor per run of written bytes: one per slot,
      or per run of consecutive slots, for a group that fills its slots), double-buffered
      across the kernel and copy streams when the job is larger than the staging buffer;
      a load is the mirror (DMA into staging, then a scatter kernel). Only the bytes the
      job moves are copied: a store leaves the rest of its slots alone, a load writes only
      the job's KV pages. Staging (``staging_bytes`` per direction, two buffers) is
      allocated on first use;
    - ``kernel``: the Triton kernel copies every page through UVA straight between the
      KV tensors and the pinned slots (best for small pages);
    - ``batch``: one ``cuMemcpyBatchAsync`` over one descriptor per (block, ref) (CUDA
      12.8+): fine for a few descriptors, CPU-bound for many;
    - ``each``: one ``cuMemcpyAsync`` per descriptor: the fallback path;
    - ``torch``: torch gathers on the device and index copies on the host, synchronous
      (where the native CUDA helper cannot be built).

    ``auto`` (the primary path where Triton is installed and the pool is pinned) chooses
    per job (:meth:`choose_method`): ``batch`` under ``small_copies`` descriptors, else
    ``kernel`` if the mean page moved is at most ``kernel_max_fragment_bytes``, else
    ``staged``. The kernels and the staged path send the job's ids to the device (two
    small arrays), never one descriptor per (block, ref), so submitting costs about the
    same for any job size.

    ``host_file``: keep the slots in a :class:`SharedHostFile` made at that path (each
    chunk of it registered with ``cudaHostRegister``, unregistered and the file unlinked
    at :meth:`close`) instead of private pinned memory; with ``host_file_owner`` False,
    map (and register) the one another worker makes there, waiting for it.
    """

    def __init__(
        self,
        layout: PageLayout,
        num_slots: int,
        *,
        pin: bool = True,
        chunk_bytes: int = 1 << 30,
        staging_bytes: int = 256 << 20,
        kernel_max_fragment_bytes: int = 16 << 10,
        small_copies: int = 64,
        kernel_programs: int | None = None,
        host_file: str | os.PathLike[str] | None = None,
        host_file_owner: bool = True,
        settings: TransferSettings | None = None,
    ) -> None:
        if layout.device.type != "cuda":
            raise ValueError(f"CudaPagedEngine needs CUDA tensors, got {layout.device}")
        self.layout = layout
        self.num_slots = num_slots
        device = layout.device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.settings = settings if settings is not None else TransferSettings.from_env()
        with torch.cuda.device(device):
            if host_file is None:
                self.pool = PinnedHostPool(num_slots, layout.slot_bytes, chunk_bytes, pin)
            else:
                shared = _host_file(host_file, num_slots, layout.slot_bytes, host_file_owner)
                try:
                    self.pool = PinnedHostPool.shared(shared, chunk_bytes, pin)
                except BaseException:
                    shared.close()
                    raise
            # Per lane (store, load, expedited load): the expedited lane's copy stream has
            # the device's highest priority, so its kernels go ahead of the others'.
            self.streams = (
                new_stream(device),
                new_stream(device),
                new_stream(device, priority=highest_priority()),
            )
            self.kernel_streams = (new_stream(device), new_stream(device), new_stream(device))
        helpers = load_cuda_helpers()
        self._lib = helpers[0] if helpers else None
        features = helpers[1] if helpers else CudaFeature.NONE
        self.has_batch = bool(features & CudaFeature.BATCH_MEMCPY)
        self.has_each = bool(features & CudaFeature.MEMCPY_EACH)
        #: ``auto``'s thresholds (:func:`~asyncoffload.transfer.cuda.methods.choose_method`):
        #: ``batch`` under ``small_copies`` descriptors, the kernel for mean pages up to
        #: ``kernel_max_fragment_bytes``; native jobs of more than 31 blocks staged.
        self.tuning = MethodTuning(
            small_copies=small_copies,
            kernel_max_fragment_bytes=kernel_max_fragment_bytes,
            native_kernel_max_blocks=NATIVE_KERNEL_MAX_BLOCKS - 1,
        )
        if kernel_programs is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            kernel_programs = 2 * sms
        self.copies = PageCopies(
            layout,
            device,
            self.pool,
            self._lib,
            num_slots,
            staging_bytes=staging_bytes,
            kernel_programs=kernel_programs,
            kernel_streams=self.kernel_streams,
            has_batch=self.has_batch,
        )
        self._choose_methods(triton_available() and self.pool.pinned)
        #: The native copy path (:class:`~asyncoffload.transfer.cuda.native.NativeCopy`):
        #: the ``kernel`` method in one C call per group, and ``auto``'s choice for every
        #: job whose groups it serves. ``None`` where unavailable.
        self._native: NativeCopy | None = None
        self._native_tables: list[tuple[torch.Tensor, int, int] | None] = []
        self._native_dense: list[bool] = []
        self._native_staging: list[NativeStaging | None] = [None, None, None]
        self._setup_native()
        if self._native is not None and self._primary_method == self.base_method:
            self.primary_method = "auto"  # no Triton here: the native kernel serves auto
        if not self.pool.pinned:
            log.warning(
                "paged CUDA engine: %d of %d host chunks are pageable; copies from them are "
                "slower and synchronous",
                self.pool.pageable_chunks,
                len(self.pool.chunks),
            )
        self.pid = _pid()
        self._finalizer = self._release_when_dropped()

    def _release_when_dropped(self) -> weakref.finalize:  # type: ignore[type-arg]
        """Dropped unclosed, the engine is released by this: its streams are waited for
        before the memory they touch goes. It must not refer to the engine."""
        return weakref.finalize(
            self,
            release_streams,
            self.pid,
            (*self.kernel_streams, *self.streams),
            self.pool,
            [],
            (
                self.copies.memory(),
                list(self.layout.tensors),
                self._native_tables,
                self._native_staging,
            ),
        )

    def _choose_methods(self, triton_ok: bool) -> None:
        """The primary and fallback methods here; the Triton kernels compiled."""
        self.has_kernel = triton_ok
        self.has_staged = triton_ok and (self.has_batch or self.has_each)
        base = [m for m, ok in (("batch", self.has_batch), ("each", self.has_each)) if ok]
        base.append("torch")
        #: The method of small jobs under ``auto`` (and the primary path without Triton).
        self.base_method = base[0]
        fallback = "each" if self.has_each else "torch"
        if fallback == self.base_method and not (self.has_kernel or self.has_staged):
            fallback = base[1] if len(base) > 1 else "torch"
        self.fallback_method = fallback
        self.fallback_name = f"cuda-{fallback}"
        self.primary_name = ""
        self._native = None  # the setter below asks
        self.primary_method = "auto" if (self.has_kernel or self.has_staged) else base[0]
        #: Jobs submitted per method (primary and fallback attempts).
        self.jobs_by_method: dict[str, int] = dict.fromkeys(
            ("staged", "kernel", "batch", "each", "torch"), 0
        )
        if triton_ok:
            try:
                self.copies.prepare_kernels()
            except Exception as exc:  # a Triton that cannot compile here: DMA paths only
                log.warning("paged CUDA engine: copy kernels unavailable (%s)", exc)
                self.has_kernel = self.has_staged = False
                self.primary_method = self.base_method

    # --- settings kept as attributes (tests and tuning runs set them) ---

    @property
    def staging_bytes(self) -> int:
        """Bytes of device staging memory per direction (two buffers), allocated on the
        first staged job of the direction; change it before then."""
        return self.copies.staging_bytes

    @staging_bytes.setter
    def staging_bytes(self, value: int) -> None:
        self.copies.staging_bytes = value

    @property
    def row_stride(self) -> int:
        return self.copies.row_stride

    @property
    def kernel_programs(self) -> int:
        return self.copies.kernel_programs

    @kernel_programs.setter
    def kernel_programs(self, value: int) -> None:
        self.copies.kernel_programs = value

    @property
    def batch_attributes(self) -> tuple[tuple[int, int], ...]:
        return self.copies.batch_attributes

    @batch_attributes.setter
    def batch_attributes(self, value: tuple[tuple[int, int], ...]) -> None:
        self.copies.batch_attributes = value

    @property
    def kernel_max_fragment_bytes(self) -> int:
        return self.tuning.kernel_max_fragment_bytes

    @kernel_max_fragment_bytes.setter
    def kernel_max_fragment_bytes(self, value: int) -> None:
        self.tuning.kernel_max_fragment_bytes = value

    @property
    def small_copies(self) -> int:
        return self.tuning.small_copies

    @small_copies.setter
    def small_copies(self, value: int) -> None:
        self.tuning.small_copies = value

    @property
    def _staging(self) -> list[list[torch.Tensor] | None]:
        return self.copies._staging

    @property
    def native_programs(self) -> int:
        """Thread blocks per native launch."""
        return self._native.programs if self._native is not None else 0

    def _setup_native(self) -> None:
        """Per group, the native path's ref table ``[5, nref]`` on the device (kv_base,
        kv_stride, host offset, page, bytes), where every address and size of the group
        (and every host slot) is 16-byte aligned; the path itself where the helper has
        it and the pool is pinned."""
        layout = self.layout
        if not self.pool.pinned or not aligned(layout.slot_bytes):
            return
        if not bool((self.pool.device_block_address % 16 == 0).all()):
            return
        if not native_copy_ready(self._lib, self.device, self.settings):
            return
        assert self._lib is not None
        tables: list[tuple[torch.Tensor, int, int] | None] = []
        bpc = layout.blocks_per_chunk
        for refs in layout.group_refs:
            # Dense: whole pages that tile the slot in order (a full slot is one run).
            full = sorted((layout.tensor_offset[t], layout.page_bytes[t]) for t, _ in refs)
            self._native_dense.append(
                bool(refs)
                and all(nb == layout.page_bytes[t] for t, nb in refs)
                and sum(bpc * p for _, p in full) == layout.slot_bytes
                and all(
                    off == (full[i - 1][0] + bpc * full[i - 1][1] if i else 0)
                    for i, (off, _) in enumerate(full)
                )
            )
            rows = [
                [
                    layout.tensors[t].data_ptr(),
                    layout.tensors[t].stride(0),
                    layout.tensor_offset[t],
                    layout.page_bytes[t],
                    nb,
                ]
                for t, nb in refs
            ]
            if rows and all(aligned(*row) for row in rows):
                table = torch.tensor(rows, dtype=torch.int64).t().contiguous().to(self.device)
                tables.append((table, len(rows), max(r[4] for r in rows)))
            else:
                tables.append(None)
        self._native_tables[:] = tables
        self._native_rows = self.pool.device_block_address.to(self.device)
        self._native_tables.append((self._native_rows, 0, 0))  # kept alive with the rest
        self._native = NativeCopy(self._lib, self.device, self.streams, self.settings)
        layout.native_check = self._lib.ao_ids_check  # plan checks in C (one group)
        torch.cuda.synchronize(self.device)

    def native_serves(self, plan: CopyPlan) -> bool:
        """Whether the native path can run ``plan`` (every group it moves is aligned)."""
        if self._native is None:
            return False
        tables = self._native_tables
        return all(tables[span.group] is not None for span in plan.spans)

    def native_stages(self, plan: CopyPlan) -> bool:
        """Whether the native staged path can run ``plan``: one group, of dense slots it
        fills whole, served by the native path, with a DMA method here."""
        if len(plan.spans) != 1 or not (self.has_batch or self.has_each):
            return False
        span = plan.spans[0]
        return (
            self.native_serves(plan)
            and self._native_dense[span.group]
            and span.skip == 0
            and span.n == span.num_slots * self.layout.blocks_per_chunk
        )

    @property
    def primary_method(self) -> str:
        return self._primary_method

    @primary_method.setter
    def primary_method(self, method: str) -> None:
        ok = {
            "auto": self.has_kernel or self.has_staged or self._native is not None,
            "staged": self.has_staged,
            "kernel": self.has_kernel or self._native is not None,
            "batch": self.has_batch,
            "each": self.has_each,
            "torch": True,
        }
        if not ok.get(method, False):
            raise ValueError(f"copy method {method!r} is unknown or unavailable here")
        self._primary_method = method
        self.primary_name = f"cuda-{method}"

    # --- submission -----------------------------------------------------------------------

    def choose_method(self, plan: CopyPlan) -> str:
        """The method ``auto`` uses for ``plan`` (the rule of
        :func:`~asyncoffload.transfer.cuda.methods.choose_method`): ``batch`` (or the base
        method) for fewer than ``small_copies`` descriptors, ``kernel`` for small pages,
        else ``staged``; where the native path serves the plan, native staging for jobs
        it can stage of more than 31 blocks, else the native kernel."""
        blocks = plan.gpu_ids.numel()
        native = self.native_serves(plan)
        large = blocks > self.tuning.native_kernel_max_blocks
        job = JobShape(
            copies=plan.num_copies,
            nbytes=plan.nbytes,
            blocks=blocks,
            native=native,
            native_staged=native and large and self.native_stages(plan),
        )
        return choose_method(
            job,
            self.tuning,
            kernel=self.has_kernel,
            staged=self.has_staged and self.row_stride <= self.staging_bytes // 2,
            base=self.base_method,
        )

    def submit_primary(self, direction: int, plan: CopyPlan) -> CopyJob:
        method = self._primary_method
        if method == "auto":
            method = self.choose_method(plan)
            if method == "staged" and direction == EXPEDITED:
                # Expedited loads keep no staging memory of their own: the kernel (or the
                # DMA method) serves them.
                method = (
                    "kernel" if self.has_kernel or self.native_serves(plan) else (self.base_method)
                )
        return self._submit(direction, plan, method)

    def submit_fallback(self, direction: int, plan: CopyPlan) -> CopyJob:
        return self._submit(direction, plan, self.fallback_method)

    def _submit(self, direction: int, plan: CopyPlan, method: str) -> CopyJob:
        check_process(self.pid, "CudaPagedEngine")
        if method == "kernel" and plan.num_copies and self.native_serves(plan):
            return self._submit_native(direction, plan)
        if method == "staged" and plan.num_copies and self.native_stages(plan):
            return self._submit_native_staged(direction, plan)
        stream = self.streams[direction]
        job = CudaJob(plan.num_copies, plan.nbytes, method)
        # A store reads finished KV; a load overwrites blocks only after the work queued
        # before it (the zeroing of fresh blocks, earlier reads) has run.
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            start_timing(job, stream)
            try:
                if plan.num_copies:
                    job._keep = self.copies.enqueue(method, direction, plan, stream, current)
            except BaseException:
                # Part of it may be queued: let it end before anyone retries over it.
                self.kernel_streams[direction].synchronize()
                stream.synchronize()
                raise
            mark_completion(job, stream, None, None)
        assert job._event is not None
        self.copies.release(job._event, job._keep, direction)
        self.jobs_by_method[method] += 1
        return job

    def _span(self, plan: CopyPlan, k: int) -> CopySpan:
        """The native call's description of ``plan``'s ``k``-th group."""
        span = plan.spans[k]
        entry = self._native_tables[span.group]
        assert entry is not None
        table, nref, page = entry
        return CopySpan(
            refs=table.data_ptr(),
            nref=nref,
            n=span.n,
            gpu_ids=plan.gpu_ids.data_ptr() + 8 * span.gpu_lo,
            slot_ids=plan.slot_ids.data_ptr() + 8 * span.slot_lo,
            skip=span.skip,
            page=page,
        )

    def _submit_native_staged(self, direction: int, plan: CopyPlan) -> CopyJob:
        """The ``staged`` method through the native path (``NativeCopy.staged``): one C
        call computes the merged DMA descriptors, launches the copy kernels between the
        KV pages and staging rows, and orders the two streams and the buffers."""
        native = self._native
        assert native is not None
        stage = self._native_staging[direction]
        if stage is None:
            stage = NativeStaging(
                native,
                self.device,
                max(1, min(self.staging_bytes // 2 // self.row_stride, self.num_slots)),
                self.row_stride,
                kernel_stream=int(self.kernel_streams[direction].cuda_stream),
                host_rows=self.pool.block_address,
                rows_per_chunk=self.pool.rows_per_chunk,
                slot_bytes=self.layout.slot_bytes,
                use_batch=self.has_batch,
            )
            self._native_staging[direction] = stage
        job = CudaJob(plan.num_copies, plan.nbytes, "staged")
        try:
            native.staged(job, direction, stage, self._span(plan, 0), self.layout.blocks_per_chunk)
        except BaseException:
            self.kernel_streams[direction].synchronize()
            self.streams[direction].synchronize()
            raise
        self.jobs_by_method["staged"] += 1
        return job

    def _submit_native(self, direction: int, plan: CopyPlan) -> CopyJob:
        """The ``kernel`` method through the native path: per group one launch (the
        first also orders the copy stream after the caller's current stream and records
        the start; the last records the end), all in one C call. The ids go as kernel
        parameters."""
        native = self._native
        assert native is not None
        job = CudaJob(plan.num_copies, plan.nbytes, "kernel")
        spans = [self._span(plan, k) for k in range(len(plan.spans))]
        try:
            native.launch(
                job, direction, self._native_rows.data_ptr(), spans, self.layout.blocks_per_chunk
            )
        except BaseException:
            # Part of it may be queued: let it end before anyone retries over it.
            self.streams[direction].synchronize()
            raise
        self.jobs_by_method["kernel"] += 1
        return job

    def wait(self, job: CopyJob, timeout: float | None = None) -> None:
        check_process(self.pid, "CudaPagedEngine")
        if job.query():
            return
        event = job._event if isinstance(job, CudaJob) else None
        if event is None:
            raise RuntimeError(f"{job!r} cannot be waited for")
        if timeout is not None:
            # A bounded wait polls the job's event from this thread (CUDA events have no
            # timed wait), backing off from 20 us to 1 ms between polls.
            deadline = time.monotonic() + timeout
            pause = 20e-6
            while not (job.query() or job.check_failed()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{job!r} did not end within {timeout} s")
                time.sleep(min(pause, left))
                pause = min(pause * 2, 1e-3)
            return
        try:
            event.synchronize()
        except RuntimeError as exc:  # a CUDA error surfaced by the event
            job.finish(exc)
        job.query()

    def quiesce(self, direction: int) -> None:
        check_process(self.pid, "CudaPagedEngine")
        self.kernel_streams[direction].synchronize()
        self.streams[direction].synchronize()

    def read_slot(self, slot_id: int) -> bytes:
        return host_bytes(self.pool.block(slot_id))

    def close(self) -> None:
        detached = self._finalizer.detach()
        if detached is not None:
            _, release, args, _ = detached
            release(*args)  # waits for the streams, then unpins the pool
        self.copies.drop_staging()
