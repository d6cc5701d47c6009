"""The paged engine for CUDA KV tensors: :class:`CudaPagedEngine`, pinned host slots and
one copy stream per direction. Its primary path chooses per job among a Triton gather
into device staging plus one DMA per slot (``staged``), a Triton kernel through UVA
(``kernel``) and one ``cuMemcpyBatchAsync`` (``batch``, small jobs); its fallback is one
``cuMemcpyAsync`` per descriptor, or torch copies where the native helper is missing.
The per-layout tables its kernels and staged DMAs use are built in
:mod:`~asyncoffload.transfer.paged_cuda_tables`.

Where the native CUDA helper builds and a group's addresses and sizes are 16-byte
aligned, ``kernel`` and ``staged`` run natively (:class:`~asyncoffload.transfer.cuda.
NativeCopy`: one C call a job, the ids as kernel parameters, the staged DMA descriptors
built in C), and ``auto`` chooses native staged for one-group jobs of at least
``native_staged_min_blocks`` blocks filling dense slots, the native kernel otherwise.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from asyncoffload._native import load_cuda_helpers
from asyncoffload.transfer.base import CopyJob, check_process, host_bytes
from asyncoffload.transfer.host_file import SharedHostFile, _host_file
from asyncoffload.transfer.paged import CopyPlan, GroupSpan, PageLayout
from asyncoffload.transfer.paged_base import EXPEDITED, STORE, _HostPages, _pid
from asyncoffload.transfer.paged_cuda_tables import (
    _GroupRuns,
    _merge_runs,
    _RefSet,
    build_tables,
    staged_job_runs,
)

if TYPE_CHECKING:
    from asyncoffload.transfer.cuda import NativeCopy, _NativeStaging

__all__ = ["CudaPagedEngine"]

log = logging.getLogger("asyncoffload.transfer")


class _SharedPinnedPool:
    """:class:`~asyncoffload.transfer.cuda.PinnedHostPool`'s interface over a
    :class:`SharedHostFile`: the file's slots in chunks of about ``chunk_bytes`` rows,
    each registered with CUDA (``cudaHostRegister``, portable and mapped) so copies from
    it are asynchronous DMAs; a chunk that cannot be registered stays pageable (logged).
    :meth:`close` unregisters every chunk before the file is unlinked and unmapped."""

    def __init__(
        self, shared: SharedHostFile, chunk_bytes: int = 1 << 30, pin: bool = True
    ) -> None:
        from asyncoffload.transfer.cuda import _current_pid, _Registrar, _unpin

        self.shared = shared
        num_blocks, block_bytes = shared.num_slots, shared.slot_bytes
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.rows_per_chunk = max(1, chunk_bytes // block_bytes)
        self.chunks: list[torch.Tensor] = []
        self._registered: list[int] = []
        self.pinned_chunks = 0
        self.pageable_chunks = 0
        self._registrar = _Registrar() if pin else None
        # Unpins before the memory goes (the file and its map are held until then).
        self._finalizer = weakref.finalize(
            self, _unpin, _current_pid(), self._registrar, self._registered, []
        )
        whole = shared.tensor()
        device_bases: list[int] = []
        for first in range(0, num_blocks, self.rows_per_chunk):
            chunk = whole[first : first + self.rows_per_chunk]
            ptr, nbytes = chunk.data_ptr(), chunk.numel()
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
                        "could not pin a %d MiB chunk of the shared host pool %s (CUDA error "
                        "%s): pageable, copies from it are slower and synchronous",
                        nbytes >> 20,
                        shared.path,
                        err,
                    )
            self.chunks.append(chunk)
        ids = torch.arange(num_blocks, dtype=torch.int64)
        row_offset = (ids % self.rows_per_chunk) * block_bytes
        chunk_of = ids // self.rows_per_chunk
        self.block_address = (
            torch.tensor([c.data_ptr() for c in self.chunks], dtype=torch.int64)[chunk_of]
            + row_offset
        )
        self.device_block_address = (
            torch.tensor(device_bases, dtype=torch.int64)[chunk_of] + row_offset
        )

    @property
    def pinned(self) -> bool:
        return self.pageable_chunks == 0

    def block(self, host_id: int) -> torch.Tensor:
        return self.chunks[host_id // self.rows_per_chunk][host_id % self.rows_per_chunk]

    def runs(self, host_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        from asyncoffload.transfer.cuda import PinnedHostPool

        return PinnedHostPool.runs(self, host_ids)  # type: ignore[arg-type]

    def view(self, first: int, length: int) -> torch.Tensor:
        rows = self.rows_per_chunk
        row = first % rows
        return self.chunks[first // rows][row : row + length]

    def close(self) -> None:
        """Unpin, then unlink and unmap the file. The caller has synchronized every
        stream that touches it. Idempotent."""
        self._finalizer()
        self.chunks.clear()
        self.block_address = self.device_block_address = torch.empty(0, dtype=torch.int64)
        self.shared.close()


class CudaPagedEngine:
    """Copies between KV tensors on one CUDA device and pinned host slots.

    Host slots live in a :class:`~asyncoffload.transfer.cuda.PinnedHostPool` (chunks of
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
    ) -> None:
        from asyncoffload.transfer.cuda import (
            PinnedHostPool,
            _highest_priority,
            _new_stream,
            _PinnedRing,
            _release_streams,
            _triton_available,
        )

        if layout.device.type != "cuda":
            raise ValueError(f"CudaPagedEngine needs CUDA tensors, got {layout.device}")
        self.layout = layout
        self.num_slots = num_slots
        device = layout.device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        with torch.cuda.device(device):
            self.pool: PinnedHostPool | _SharedPinnedPool
            if host_file is None:
                self.pool = PinnedHostPool(num_slots, layout.slot_bytes, chunk_bytes, pin)
            else:
                shared = _host_file(host_file, num_slots, layout.slot_bytes, host_file_owner)
                try:
                    self.pool = _SharedPinnedPool(shared, chunk_bytes, pin)
                except BaseException:
                    shared.close()
                    raise
            # Per lane (store, load, expedited load): the expedited lane's copy stream has
            # the device's highest priority, so its kernels go ahead of the others'.
            self.streams = (
                _new_stream(device),
                _new_stream(device),
                _new_stream(device, priority=_highest_priority()),
            )
            self.kernel_streams = (_new_stream(device), _new_stream(device), _new_stream(device))
        helpers = load_cuda_helpers()
        self._lib = helpers[0] if helpers else None
        features = helpers[1] if helpers else 0
        self.has_batch = bool(features & 2)
        self.has_each = bool(features & 16)
        #: Bytes of device staging memory per direction (two buffers), allocated on the
        #: first staged job of the direction; change it before then.
        self.staging_bytes = staging_bytes
        #: ``auto`` uses the kernel for jobs whose mean page is at most this many bytes.
        self.kernel_max_fragment_bytes = kernel_max_fragment_bytes
        #: ``auto`` uses ``batch`` for jobs of fewer descriptors.
        self.small_copies = small_copies
        if kernel_programs is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            kernel_programs = 2 * sms
        #: Programs per kernel launch (kernel, staged).
        self.kernel_programs = kernel_programs
        triton_ok = _triton_available() and self.pool.pinned
        self.has_kernel = triton_ok
        self.has_staged = triton_ok and (self.has_batch or self.has_each)
        self._native: NativeCopy | None = None  # set up below, once the pool is known
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
        self.primary_method = "auto" if (self.has_kernel or self.has_staged) else base[0]
        #: Jobs submitted per method (primary and fallback attempts).
        self.jobs_by_method: dict[str, int] = dict.fromkeys(
            ("staged", "kernel", "batch", "each", "torch"), 0
        )
        #: cuMemcpyBatchAsync (source access order, flags) per direction: stores read KV
        #: in stream order; loads read slots nothing writes meanwhile, in any order.
        self.batch_attributes: tuple[tuple[int, int], ...] = ((1, 0), (3, 0), (3, 0))
        self._rings = (_PinnedRing(1 << 16), _PinnedRing(1 << 16), _PinnedRing(1 << 12))
        # Staging per direction: two [rows, row_stride] buffers, the next one to fill,
        # and for each the event after which it may be refilled.
        self.row_stride = -(-layout.slot_bytes // 256) * 256
        self._staging: list[list[torch.Tensor] | None] = [None, None, None]
        self._next_buffer = [0, 0, 0]
        # Per direction and buffer: the events after its fill and after its last reader,
        # and whether they were recorded yet.
        self._staging_events: list[tuple[list[torch.cuda.Event], list[torch.cuda.Event]]] = []
        self._staging_used = [[False, False], [False, False], [False, False]]
        self._ref_sets: list[list[_RefSet]] = []
        self._group_runs: list[_GroupRuns] = []
        self._slots_aligned = layout.slot_bytes % 8 == 0
        if triton_ok:
            try:
                self._prepare_kernels()
            except Exception as exc:  # a Triton that cannot compile here: DMA paths only
                log.warning("paged CUDA engine: copy kernels unavailable (%s)", exc)
                self.has_kernel = self.has_staged = False
                self.primary_method = self.base_method
        #: The native copy path (:class:`~asyncoffload.transfer.cuda.NativeCopy`): the
        #: ``kernel`` method in one C call per group, and ``auto``'s choice for every job
        #: whose groups it serves. ``None`` where unavailable.
        self._native_tables: list[tuple[torch.Tensor, int, int] | None] = []
        self._native_dense: list[bool] = []
        self._native_staging: list[_NativeStaging | None] = [None, None, None]
        #: ``auto`` stages jobs of at least this many blocks natively (where it can).
        self.native_staged_min_blocks = 32
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
        # Dropped unclosed, the engine is released by this: its streams are waited for
        # before the memory they touch goes. It must not refer to the engine.
        self._finalizer = weakref.finalize(
            self,
            _release_streams,
            self.pid,
            (*self.kernel_streams, *self.streams),
            self.pool,  # type: ignore[arg-type]  # a _SharedPinnedPool closes alike
            [],
            (
                self._staging,
                self._rings,
                list(layout.tensors),
                self._native_tables,
                self._native_staging,
            ),
        )

    def _setup_native(self) -> None:
        """Per group, the native path's ref table ``[5, nref]`` on the device (kv_base,
        kv_stride, host offset, page, bytes), where every address and size of the group
        (and every host slot) is 16-byte aligned; the path itself where the helper has
        it and the pool is pinned."""
        from asyncoffload.transfer.cuda import NativeCopy, _native_programs, native_copy_ready

        layout = self.layout
        align = NativeCopy.ALIGN
        if not self.pool.pinned or layout.slot_bytes % align:
            return
        if not bool((self.pool.device_block_address % align == 0).all()):
            return
        if not native_copy_ready(self._lib, self.device):
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
            if rows and all(v % align == 0 for row in rows for v in row):
                table = torch.tensor(rows, dtype=torch.int64).t().contiguous().to(self.device)
                tables.append((table, len(rows), max(r[4] for r in rows)))
            else:
                tables.append(None)
        self._native_tables[:] = tables
        self._native_rows = self.pool.device_block_address.to(self.device)
        self._native_tables.append((self._native_rows, 0, 0))  # kept alive with the rest
        self._native = NativeCopy(self._lib, device=self.device, streams=self.streams)
        layout.native_check = self._lib.ao_ids_check  # plan checks in C (one group)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        #: Thread blocks per native launch.
        self.native_programs = _native_programs(sms)
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

    # --- tables ---------------------------------------------------------------------------

    def _prepare_kernels(self) -> None:
        """Per group: the kernel's ref tables (refs with 8-byte aligned addresses and
        sizes apart from the others) and the run templates of the staged DMAs
        (:func:`~asyncoffload.transfer.paged_cuda_tables.build_tables`); then compile the
        kernel variants the layout needs (a first submission would otherwise stall for it)."""
        self._ref_sets, self._group_runs = build_tables(self.layout, self.device)
        self._host_table = self.pool.device_block_address.to(self.device)
        self._warm_up()

    def _warm_up(self) -> None:
        from asyncoffload.transfer._triton_paged import launch_copy_pages  # needs Triton

        dummy = torch.zeros(1, dtype=torch.int64, device=self.device)
        with torch.cuda.device(self.device):
            seen: set[tuple[bool, bool, bool, int]] = set()
            for sets in self._ref_sets:
                for refs in sets:
                    for store in (True, False):
                        for use_table in (True, False):
                            wide = refs.aligned and (self._slots_aligned or not use_table)
                            elems = refs.max_bytes // 8 if wide else refs.max_bytes
                            key = (store, use_table, wide, elems)
                            if key in seen:
                                continue
                            seen.add(key)
                            launch_copy_pages(
                                dummy,
                                refs.table,
                                self._host_table,
                                n_blocks=0,
                                j0=0,
                                g_off=0,
                                s_off=0,
                                skip=0,
                                bpc=1,
                                max_elems=elems,
                                row_base=1 << 40,
                                row_stride=self.row_stride,
                                row_lo=0,
                                store=store,
                                use_table=use_table,
                                wide=wide,
                                programs=1,
                            )
            torch.cuda.synchronize(self.device)

    # --- submission -----------------------------------------------------------------------

    def choose_method(self, plan: CopyPlan) -> str:
        """The method ``auto`` uses for ``plan``: ``batch`` (or the base method) for
        fewer than ``small_copies`` descriptors, ``kernel`` for small pages, else
        ``staged``."""
        copies = plan.num_copies
        if copies and self.native_serves(plan):
            if plan.gpu_ids.numel() >= self.native_staged_min_blocks and self.native_stages(plan):
                return "staged"  # the copy engines' bandwidth, submitted natively
            return "kernel"
        if copies < self.small_copies or not (self.has_kernel or self.has_staged):
            return self.base_method
        if self.has_kernel and plan.nbytes <= copies * self.kernel_max_fragment_bytes:
            return "kernel"
        if self.has_staged and self.row_stride <= self.staging_bytes // 2:
            return "staged"
        return "kernel" if self.has_kernel else self.base_method

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
        from asyncoffload.transfer.cuda import CudaJob, mark_completion, start_timing

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
                    job._keep = self._enqueue(method, direction, plan, stream, current)
            except BaseException:
                # Part of it may be queued: let it end before anyone retries over it.
                self.kernel_streams[direction].synchronize()
                stream.synchronize()
                raise
            mark_completion(job, stream, None, None)
        assert job._event is not None
        for item in job._keep:
            if isinstance(item, torch.Tensor) and item.is_pinned():
                self._rings[direction].release(item, job._event)
        self.jobs_by_method[method] += 1
        return job

    def _submit_native_staged(self, direction: int, plan: CopyPlan) -> CopyJob:
        """The ``staged`` method through the native path (``NativeCopy.staged``): one C
        call computes the merged DMA descriptors, launches the copy kernels between the
        KV pages and staging rows, and orders the two streams and the buffers."""
        from asyncoffload.transfer.cuda import CudaJob, _NativeStaging

        native = self._native
        assert native is not None
        stage = self._native_staging[direction]
        if stage is None:
            rows = max(1, min(self.staging_bytes // 2 // self.row_stride, self.num_slots))
            stage = _NativeStaging(native, self.device, rows, self.row_stride)
            self._native_staging[direction] = stage
        span = plan.spans[0]
        entry = self._native_tables[span.group]
        assert entry is not None
        table, nref, page = entry
        job = CudaJob(plan.num_copies, plan.nbytes, "staged")
        try:
            native.staged(
                job,
                direction,
                int(self.kernel_streams[direction].cuda_stream),
                stage,
                (
                    table.data_ptr(),
                    nref,
                    span.n,
                    plan.gpu_ids.data_ptr() + 8 * span.gpu_lo,
                    plan.slot_ids.data_ptr() + 8 * span.slot_lo,
                    0,
                    page,
                ),
                self.pool.block_address.data_ptr(),
                self.pool.rows_per_chunk,
                self.layout.slot_bytes,
                self.layout.blocks_per_chunk,
                self.native_programs,
                self.has_batch,
            )
        except BaseException:
            self.kernel_streams[direction].synchronize()
            self.streams[direction].synchronize()
            raise
        self.jobs_by_method["staged"] += 1
        return job

    def _submit_native(self, direction: int, plan: CopyPlan) -> CopyJob:
        """The ``kernel`` method through the native path: per group one C call (the
        first also orders the copy stream after the caller's current stream and records
        the start; the last records the end). The ids go as kernel parameters."""
        from asyncoffload.transfer.cuda import CudaJob

        native = self._native
        assert native is not None
        job = CudaJob(plan.num_copies, plan.nbytes, "kernel")
        gpu_at = plan.gpu_ids.data_ptr()
        slot_at = plan.slot_ids.data_ptr()
        spans = []
        for span in plan.spans:
            entry = self._native_tables[span.group]
            assert entry is not None
            table, nref, page = entry
            spans.append(
                (
                    table.data_ptr(),
                    nref,
                    span.n,
                    gpu_at + 8 * span.gpu_lo,
                    slot_at + 8 * span.slot_lo,
                    span.skip,
                    page,
                )
            )
        try:
            native.launch(
                job,
                direction,
                self._native_rows.data_ptr(),
                spans,
                self.layout.blocks_per_chunk,
                self.native_programs,
                None,
                None,
            )
        except BaseException:
            # Part of it may be queued: let it end before anyone retries over it.
            self.streams[direction].synchronize()
            raise
        self.jobs_by_method["kernel"] += 1
        return job

    def _enqueue(
        self,
        method: str,
        direction: int,
        plan: CopyPlan,
        stream: torch.cuda.Stream,
        caller: torch.cuda.Stream,
    ) -> list[torch.Tensor]:
        if method == "staged":
            return self._enqueue_staged(direction, plan, stream, caller)
        if method == "kernel":
            ids, ids_dev = self._upload_ids(direction, plan)
            for span in plan.spans:
                self._launch(span, ids_dev, plan, direction, None, 0, span.n, 0)
            return [ids, ids_dev]
        if method == "torch":
            self._torch_copy(direction, plan)
            return []
        assert self._lib is not None
        host = self.pool.block_address[plan.host_slot] + plan.host_offset
        src, dst = (plan.kv_addr, host) if direction == STORE else (host, plan.kv_addr)
        self._memcpy(method, stream, direction, src, dst, plan.size)
        # The driver reads the descriptor arrays during the call; they are kept until the
        # job ends all the same (cheap insurance).
        return [src, dst, plan.size]

    def _memcpy(
        self,
        method: str,
        stream: torch.cuda.Stream,
        direction: int,
        src: torch.Tensor,
        dst: torch.Tensor,
        size: torch.Tensor,
    ) -> None:
        """Copies ``size[i]`` bytes from ``src[i]`` to ``dst[i]`` (int64 CPU tensors) on
        ``stream``: one ``cuMemcpyBatchAsync`` (``batch``) or ``cuMemcpyAsync`` each."""
        assert self._lib is not None
        if method == "batch":
            rc = self._lib.ao_cuda_memcpy_batch(
                stream.cuda_stream,
                dst.data_ptr(),
                src.data_ptr(),
                size.data_ptr(),
                src.numel(),
                direction,
                self.device.index,
                *self.batch_attributes[direction],
            )
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc}")
        elif method == "each":
            rc = self._lib.ao_cuda_memcpy_each(
                stream.cuda_stream, dst.data_ptr(), src.data_ptr(), size.data_ptr(), src.numel()
            )
            if rc != 0:
                raise RuntimeError(f"cuMemcpyAsync failed: CUresult {rc}")
        else:
            raise ValueError(f"unknown copy method {method!r}")

    def _upload_ids(self, direction: int, plan: CopyPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's gpu ids then slot ids, on the device (copied on the current stream
        from a pinned ring region that is reused once the job has ended)."""
        n, m = plan.gpu_ids.numel(), plan.slot_ids.numel()
        ids = self._rings[direction].take(n + m)
        ids[:n] = plan.gpu_ids
        ids[n:] = plan.slot_ids
        return ids, ids.to(self.device, non_blocking=True)

    def _launch(
        self,
        span: GroupSpan,
        ids_dev: torch.Tensor,
        plan: CopyPlan,
        direction: int,
        staging: torch.Tensor | None,
        j0: int,
        j1: int,
        row_lo: int,
    ) -> None:
        """The kernel over blocks ``j0 .. j1 - 1`` of ``span``, one launch per ref set:
        to or from the host slots (``staging`` None), else staging rows (row 0 holds the
        span's slot position ``row_lo``, relative to ``span.slot_lo``)."""
        from asyncoffload.transfer._triton_paged import launch_copy_pages  # needs Triton

        use_table = staging is None
        row_base = 1 << 40 if staging is None else staging.data_ptr()
        for refs in self._ref_sets[span.group]:
            wide = refs.aligned and (self._slots_aligned or not use_table)
            launch_copy_pages(
                ids_dev,
                refs.table,
                self._host_table,
                n_blocks=j1 - j0,
                j0=j0,
                g_off=span.gpu_lo,
                s_off=plan.gpu_ids.numel() + span.slot_lo,
                skip=span.skip,
                bpc=self.layout.blocks_per_chunk,
                max_elems=refs.max_bytes // 8 if wide else refs.max_bytes,
                row_base=row_base,
                row_stride=self.row_stride,
                row_lo=row_lo,
                store=direction == STORE,
                use_table=use_table,
                wide=wide,
                programs=self.kernel_programs,
            )

    def _staged_kernels(
        self,
        plan: CopyPlan,
        ids_dev: torch.Tensor,
        direction: int,
        staging: torch.Tensor,
        lo: int,
        hi: int,
    ) -> None:
        """Gather (store) or scatter (load) the blocks whose slots are the job's slot
        positions ``lo .. hi - 1``, to or from staging rows ``0 .. hi - lo - 1``."""
        bpc = self.layout.blocks_per_chunk
        for span in plan.spans:
            a = max(lo, span.slot_lo) - span.slot_lo
            b = min(hi, span.slot_lo + span.num_slots) - span.slot_lo
            if a >= b:
                continue
            j0 = max(0, a * bpc - span.skip)
            j1 = min(span.n, b * bpc - span.skip)
            if j0 < j1:
                self._launch(span, ids_dev, plan, direction, staging, j0, j1, lo - span.slot_lo)

    def _staging_buffers(self, direction: int) -> list[torch.Tensor]:
        buffers = self._staging[direction]
        if buffers is None:
            rows = max(1, min(self.staging_bytes // 2 // self.row_stride, self.num_slots))
            buffers = [
                torch.empty((rows, self.row_stride), dtype=torch.uint8, device=self.device)
                for _ in range(2)
            ]
            self._staging[direction] = buffers
            while len(self._staging_events) <= direction:
                self._staging_events.append(
                    (
                        [torch.cuda.Event() for _ in range(2)],  # type: ignore[no-untyped-call]
                        [torch.cuda.Event() for _ in range(2)],  # type: ignore[no-untyped-call]
                    )
                )
        return buffers

    def staged_runs(self, plan: CopyPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The host bytes a staged job moves, as runs ``(slot position, offset in the
        slot, bytes)`` (int64 CPU tensors), by slot position within each group."""
        return staged_job_runs(self.layout, self._group_runs, plan)

    def _enqueue_staged(
        self,
        direction: int,
        plan: CopyPlan,
        stream: torch.cuda.Stream,
        caller: torch.cuda.Stream,
    ) -> list[torch.Tensor]:
        """See the class docstring. The kernel stream starts after the caller's queued
        work; staging buffer ``b`` is refilled only after the work that last read it (the
        DMA of a store, the scatter of a load), across jobs too. Everything ends on the
        copy stream, where the job's completion marker is recorded."""
        kstream = self.kernel_streams[direction]
        kstream.wait_stream(caller)
        buffers = self._staging_buffers(direction)
        ready_events, done_events = self._staging_events[direction]
        used = self._staging_used[direction]
        rows = buffers[0].shape[0]
        store = direction == STORE
        total = plan.slot_ids.numel()
        first = self._next_buffer[direction]
        src, dst, size, counts = self._staged_dmas(plan, rows, buffers, first, store)
        dma = "batch" if self.has_batch else "each"
        # Kernels go to the kernel stream (current here), DMAs and events name their
        # stream. Buffer b's events are re-recorded at each use: a wait takes the most
        # recent record, which is the work that last read the buffer.
        with torch.cuda.stream(kstream):
            ids, ids_dev = self._upload_ids(direction, plan)
            at = 0
            for k, lo in enumerate(range(0, total, rows)):
                hi = min(total, lo + rows)
                buf = (first + k) % 2
                self._next_buffer[direction] = buf ^ 1
                staging, ready, done = buffers[buf], ready_events[buf], done_events[buf]
                # The chunk's DMA descriptors (contiguous slices: their data_ptr is read).
                end = at + counts[k]
                c_src, c_dst, c_size = src[at:end], dst[at:end], size[at:end]
                at = end
                if store:
                    if used[buf]:
                        kstream.wait_event(done)  # the DMA that last read this buffer
                    self._staged_kernels(plan, ids_dev, direction, staging, lo, hi)
                    ready.record(kstream)
                    stream.wait_event(ready)
                    if c_size.numel():
                        self._memcpy(dma, stream, direction, c_src, c_dst, c_size)
                    done.record(stream)
                else:
                    if used[buf]:
                        stream.wait_event(done)  # the scatter that last read this buffer
                    if c_size.numel():
                        self._memcpy(dma, stream, direction, c_src, c_dst, c_size)
                    ready.record(stream)
                    kstream.wait_event(ready)
                    self._staged_kernels(plan, ids_dev, direction, staging, lo, hi)
                    done.record(kstream)
                used[buf] = True
        # The job ends on the copy stream, after the kernel stream's last work.
        stream.wait_stream(kstream)
        return [ids, ids_dev, src, dst, size]

    def _staged_dmas(
        self, plan: CopyPlan, rows: int, buffers: list[torch.Tensor], first: int, store: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """The DMA descriptors (src, dst, size) of a staged job, chunk after chunk (chunk
        ``k``: slot positions ``k * rows ..``, in buffer ``(first + k) % 2``), and how
        many each chunk has. Runs contiguous in staging and in one host chunk merge."""
        pos, off, size = self.staged_runs(plan)
        nchunks = -(-plan.slot_ids.numel() // rows)
        chunk = pos // rows
        if nchunks > 1 and bool((chunk[1:] < chunk[:-1]).any()):
            order = torch.argsort(chunk, stable=True)
            pos, off, size, chunk = pos[order], off[order], size[order], chunk[order]
        slot = plan.slot_ids[pos]
        bases = torch.tensor([buffers[0].data_ptr(), buffers[1].data_ptr()], dtype=torch.int64)
        base = bases[(chunk + first) % 2] if nchunks > 1 else bases[first]
        dev = base + (pos - chunk * rows) * self.row_stride + off
        host = self.pool.block_address[slot] + off
        # A merged run stays in one chunk: host chunks and staging chunks both break it.
        key = (slot // self.pool.rows_per_chunk) * (nchunks + 1) + chunk
        src, dst, size, key = _merge_runs(dev, host, size, key, store=store)
        if nchunks == 1:
            return src, dst, size, [size.numel()]
        counts = torch.bincount(key % (nchunks + 1), minlength=nchunks).tolist()
        return src, dst, size, counts

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

    def wait(self, job: CopyJob, timeout: float | None = None) -> None:
        from asyncoffload.transfer.cuda import CudaJob

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
        self._staging = [None, None, None]
