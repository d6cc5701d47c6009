"""The engine's copy methods without the native path (:class:`BlockCopies`): the Triton
kernel through UVA (``kernel``), the Triton gather into device staging plus one DMA per
block, double-buffered across a kernel stream and the copy stream (``staged``), one
``cuMemcpyBatchAsync`` over every fragment (``batch``), and torch gathers (``gather``).
The backend runs them on the direction's copy stream (current while they queue)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from asyncoffload.layout import KVLayout
from asyncoffload.transfer.cuda.hostpool import PinnedHostPool, PinnedRing
from asyncoffload.transfer.cuda.jobs import new_stream

__all__ = ["BlockCopies"]


class BlockCopies:
    """The block-major layout's tables on the host and the device, and the Python copy
    methods over them (see the module). ``lib``: the native helper (the DMA methods)."""

    def __init__(
        self,
        layout: KVLayout,
        frags: list[torch.Tensor],
        pool: PinnedHostPool,
        lib: ctypes.CDLL | None,
        staging_blocks: int,
        kernel_programs: int,
    ) -> None:
        device = layout.device
        self.layout = layout
        self.device = device
        self.pool = pool
        self._lib = lib
        self._frags = frags
        frag = layout.fragment_bytes
        self._kv_base = torch.tensor([v.data_ptr() for v in frags], dtype=torch.int64)
        self._kv_stride = torch.tensor([v.stride(0) for v in frags], dtype=torch.int64)
        self._frag_offset = torch.arange(len(frags), dtype=torch.int64) * frag
        # Device copies of the address tables, for the copy kernel.
        self._kv_base_dev = self._kv_base.to(device)
        self._kv_stride_dev = self._kv_stride.to(device)
        self._host_addr_dev = pool.device_block_address.to(device)
        self._rings = (PinnedRing(1 << 18), PinnedRing(1 << 18))
        self.staging_blocks = staging_blocks
        self.kernel_programs = kernel_programs
        #: Per-direction overrides of ``kernel_programs`` (store, load); ``None`` keeps it.
        self.kernel_programs_by_direction: list[int | None] = [None, None]
        #: cuMemcpyBatchAsync attributes per direction, (source access order, flags).
        #: Stores read in stream order (their source was written by earlier work on the
        #: stream); loads read host slots nothing writes while they are pinned, so any
        #: order. No overlap-with-compute hint: it cost both-direction bandwidth (75 GB/s
        #: against 86 without, H200).
        self.batch_attributes: tuple[tuple[int, int], tuple[int, int]] = ((1, 0), (3, 0))
        self._staging: list[torch.Tensor | None] = [None, None]
        # The staged method: per direction a kernel stream, two buffers, and for each
        # buffer the event after which it may be refilled.
        self._kernel_streams = (new_stream(device), new_stream(device))
        self._staged: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None, None]
        self._staged_buffers: list[torch.Tensor] = []
        self._staging_free: list[list[torch.cuda.Event | None]] = [[None, None], [None, None]]

    @property
    def kernel_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        return self._kernel_streams

    def memory(self) -> tuple[object, ...]:
        """What queued copies may still touch (kept until the streams are done)."""
        return (self._staging, self._staged, self._staged_buffers, self._rings)

    def release(self, job_event: Any, keep: list[Any], direction: int) -> None:
        """The pinned ring regions in ``keep`` are free once ``job_event`` has completed."""
        for item in keep:
            if isinstance(item, torch.Tensor) and item.is_pinned():
                self._rings[direction].release(item, job_event)

    def drop_staging(self) -> None:
        self._staging = [None, None]
        self._staged = [None, None]
        self._staged_buffers.clear()

    def warm_up_kernel(self) -> None:
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

    def enqueue(
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
