"""The paged worker's copy methods without the native path (:class:`PageCopies`): the
Triton kernel through UVA (``kernel``), the Triton gather into device staging rows laid
out like host slots plus one DMA per run of slot bytes, double-buffered across a kernel
stream and the copy stream (``staged``), ``cuMemcpyBatchAsync`` (``batch``) or
``cuMemcpyAsync`` (``each``) per descriptor, and synchronous torch copies (``torch``).
The per-layout tables its kernels and staged DMAs use are built in
:mod:`~asyncoffload.transfer.paged_cuda_tables`."""

from __future__ import annotations

import ctypes

import torch

from asyncoffload.transfer.cuda.hostpool import PinnedHostPool, PinnedRing
from asyncoffload.transfer.paged import CopyPlan, GroupSpan, PageLayout
from asyncoffload.transfer.paged_base import STORE, _HostPages
from asyncoffload.transfer.paged_cuda_tables import (
    _GroupRuns,
    _merge_runs,
    _RefSet,
    build_tables,
    staged_job_runs,
)

__all__ = ["PageCopies"]


class PageCopies:
    """One paged layout's Python copy methods (see the module) on ``pool``'s slots, per
    lane (store, load, expedited load) its pinned id ring and staging."""

    def __init__(
        self,
        layout: PageLayout,
        device: torch.device,
        pool: PinnedHostPool,
        lib: ctypes.CDLL | None,
        num_slots: int,
        *,
        staging_bytes: int,
        kernel_programs: int,
        kernel_streams: tuple[torch.cuda.Stream, ...],
        has_batch: bool,
    ) -> None:
        self.layout = layout
        self.device = device
        self.pool = pool
        self._lib = lib
        self.num_slots = num_slots
        #: Bytes of device staging memory per direction (two buffers), allocated on the
        #: first staged job of the direction; change it before then.
        self.staging_bytes = staging_bytes
        #: Programs per kernel launch (kernel, staged).
        self.kernel_programs = kernel_programs
        self.kernel_streams = kernel_streams
        self.has_batch = has_batch
        #: cuMemcpyBatchAsync (source access order, flags) per direction: stores read KV
        #: in stream order; loads read slots nothing writes meanwhile, in any order.
        self.batch_attributes: tuple[tuple[int, int], ...] = ((1, 0), (3, 0), (3, 0))
        self._rings = (PinnedRing(1 << 16), PinnedRing(1 << 16), PinnedRing(1 << 12))
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

    def memory(self) -> tuple[object, ...]:
        """What queued copies may still touch (kept until the streams are done)."""
        return (self._staging, self._rings)

    def release(self, job_event: object, keep: list[torch.Tensor], direction: int) -> None:
        """The pinned ring regions in ``keep`` are free once ``job_event`` has completed."""
        for item in keep:
            if isinstance(item, torch.Tensor) and item.is_pinned():
                self._rings[direction].release(item, job_event)  # type: ignore[arg-type]

    def drop_staging(self) -> None:
        self._staging[:] = [None, None, None]

    def prepare_kernels(self) -> None:
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

    def enqueue(
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
        self.memcpy(method, stream, direction, src, dst, plan.size)
        # The driver reads the descriptor arrays during the call; they are kept until the
        # job ends all the same (cheap insurance).
        return [src, dst, plan.size]

    def memcpy(
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
                        self.memcpy(dma, stream, direction, c_src, c_dst, c_size)
                    done.record(stream)
                else:
                    if used[buf]:
                        stream.wait_event(done)  # the scatter that last read this buffer
                    if c_size.numel():
                        self.memcpy(dma, stream, direction, c_src, c_dst, c_size)
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
