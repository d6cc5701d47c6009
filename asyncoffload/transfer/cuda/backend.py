"""The engine's CUDA backend: KV tensors on a GPU, the host tier in pinned memory.

- **Host pool** (:class:`~asyncoffload.transfer.cuda.hostpool.PinnedHostPool`): one slot a
  block, pinned, mapped for UVA.
- **Streams.** One copy stream per direction. A transfer first waits for the work queued
  on the caller's current stream, so a store reads finished KV and a load does not race
  writes queued before it. A direction's transfers complete in order.
- **Methods** (:mod:`~asyncoffload.transfer.cuda.methods`, the rule the paged worker
  uses too): where the native path serves the layout (16-byte aligned, the helper built),
  ``kernel`` is one C call and ``staged`` one C call through two staging buffers; ``auto``
  takes the native kernel for jobs of up to 32 blocks of large fragments and native
  staging above. Elsewhere the Triton and torch paths of
  :class:`~asyncoffload.transfer.cuda.blocks.BlockCopies` run.
- **Completion** (:mod:`~asyncoffload.transfer.cuda.jobs`,
  :mod:`~asyncoffload.transfer.cuda.pacing`): each transfer records a CUDA event; where
  the native helper is built, a host function after it stamps the job and writes the
  loop's eventfd without the GIL, and a native spinner polls the event around the
  transfer's expected end. A small native copy expected to end within ``inline_wait_us``
  is waited for in the call.
"""

from __future__ import annotations

import logging
import os
import weakref
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncoffload._native import CudaFeature, load_cuda_helpers
from asyncoffload._native.cuda_abi import CUDA_ERROR_NOT_READY, CopySpan
from asyncoffload.hostmem import check_host_bytes, format_bytes
from asyncoffload.layout import KVLayout
from asyncoffload.transfer.base import CopyJob, TransferBackend, forked_since, host_bytes
from asyncoffload.transfer.cuda.blocks import BlockCopies
from asyncoffload.transfer.cuda.hostpool import PinnedHostPool
from asyncoffload.transfer.cuda.jobs import (
    CudaJob,
    mark_completion,
    new_stream,
    release_streams,
    start_timing,
)
from asyncoffload.transfer.cuda.methods import (
    CopyMethod,
    JobShape,
    MethodTuning,
    choose_method,
    triton_available,
)
from asyncoffload.transfer.cuda.native import NativeCopy, NativeStaging, aligned, native_copy_ready
from asyncoffload.transfer.cuda.pacing import Expected, Pacer
from asyncoffload.transfer.settings import TransferSettings

__all__ = ["CudaCopyBackend"]

log = logging.getLogger("asyncoffload.transfer")


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
        settings: TransferSettings | None = None,
    ) -> None:
        if layout.device.type != "cuda":
            raise ValueError(f"CudaCopyBackend needs CUDA tensors, got {layout.device}")
        super().__init__(layout, num_host_blocks)
        self.device = layout.device
        self.settings = settings if settings is not None else TransferSettings.from_env()
        self._kv = list(kv_caches)
        self._frags = layout.fragment_views(self._kv)
        with torch.cuda.device(self.device):
            check_host_bytes(
                num_host_blocks * layout.block_bytes,
                f"the CPU tier ({num_host_blocks} blocks of "
                f"{format_bytes(layout.block_bytes)}: cpu_blocks)",
            )
            self.pool = PinnedHostPool(num_host_blocks, layout.block_bytes, chunk_bytes, pin)
            self._streams = (new_stream(self.device), new_stream(self.device))
        self._features(layout)
        #: Rows of each staging buffer: rows beyond the KV cache's block count would serve
        #: only stores that repeat ids.
        self.staging_blocks = max(1, min(staging_bytes // layout.block_bytes, layout.num_blocks))
        self._python = BlockCopies(
            layout, self._frags, self.pool, self._lib, self.staging_blocks, kernel_programs
        )
        self._pacer = Pacer(2, int(inline_wait_us * 1000))
        #: Waits that gave up (the copy then completed through its wake-up).
        self.inline_waits_missed = 0
        self.copy_method: CopyMethod = copy_method
        #: Per-direction overrides of ``copy_method`` (store, load); ``None`` keeps it.
        self.method_by_direction: list[CopyMethod | None] = [None, None]
        self.tuning = MethodTuning(
            kernel_max_fragment_bytes=kernel_max_fragment_bytes, native_small_fragments=False
        )
        self.transfers_by_method: dict[str, int] = dict.fromkeys(
            ("batch", "kernel", "staged", "gather"), 0
        )
        self._native: NativeCopy | None = None
        self._native_stage: list[NativeStaging | None] = [None, None]
        self._native_refs: torch.Tensor | None = None
        self._setup_native()
        if copy_method != "auto" and not self._available(copy_method):
            raise RuntimeError(f"copy_method={copy_method!r} is not available here")
        if self.has_kernel:
            self._python.warm_up_kernel()
        self._closed = False
        # Duplicates of the bound wake-up fd that host functions write (see ``bind``).
        self._fds: list[int] = []
        # Dropped unclosed, the backend is released by this; it must not refer to the
        # backend (that would keep it alive), only to what the streams touch.
        self._finalizer = weakref.finalize(
            self,
            release_streams,
            self.pid,
            (*self._streams, *self._python.kernel_streams),
            self.pool,
            self._fds,
            (self._kv, self._python.memory(), self._native_refs, self._native_stage),
        )
        self._log_ready()

    def _features(self, layout: KVLayout) -> None:
        """What the native helper, Triton and the pool allow here."""
        helpers = load_cuda_helpers()
        self._lib = helpers[0] if helpers else None
        features = helpers[1] if helpers else CudaFeature.NONE
        self.has_host_wake = bool(features & CudaFeature.HOST_WAKE)
        self.has_batch = bool(features & CudaFeature.BATCH_MEMCPY)
        frag = layout.fragment_bytes
        self.has_kernel = triton_available() and self.pool.pinned and frag % 8 == 0
        self.can_wake = self.has_host_wake
        #: Poll each transfer's event natively around its expected end (see
        #: ``mark_completion``).
        self.spin = bool(features & CudaFeature.SPINNER) and self.has_host_wake

    def _log_ready(self) -> None:
        log.info(
            "CUDA backend on %s: %d host blocks of %d B (%s), methods: batch=%s kernel=%s "
            "native=%s, host-function wake-ups=%s",
            self.device,
            self.num_host_blocks,
            self.layout.block_bytes,
            "pinned" if self.pool.pinned else f"{self.pool.pageable_chunks} pageable chunks",
            self.has_batch,
            self.has_kernel,
            self._native is not None,
            self.has_host_wake,
        )

    # --- settings kept as attributes (tuning runs and benchmarks set them) ---

    @property
    def kernel_programs(self) -> int:
        return self._python.kernel_programs

    @kernel_programs.setter
    def kernel_programs(self, value: int) -> None:
        self._python.kernel_programs = value

    @property
    def kernel_programs_by_direction(self) -> list[int | None]:
        return self._python.kernel_programs_by_direction

    @kernel_programs_by_direction.setter
    def kernel_programs_by_direction(self, value: list[int | None]) -> None:
        self._python.kernel_programs_by_direction = value

    @property
    def batch_attributes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return self._python.batch_attributes

    @batch_attributes.setter
    def batch_attributes(self, value: tuple[tuple[int, int], tuple[int, int]]) -> None:
        self._python.batch_attributes = value

    @property
    def kernel_max_fragment_bytes(self) -> int:
        return self.tuning.kernel_max_fragment_bytes

    @kernel_max_fragment_bytes.setter
    def kernel_max_fragment_bytes(self, value: int) -> None:
        self.tuning.kernel_max_fragment_bytes = value

    @property
    def inline_wait_ns(self) -> int:
        return self._pacer.inline_wait_ns

    @property
    def _rate(self) -> list[float | None]:
        """Bytes per ns measured per direction (``None`` before a measurement)."""
        return self._pacer.rate

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

    # --- the native path ---

    def _setup_native(self) -> None:
        """Use the native copy path if the helper has it, the pool is pinned and every
        fragment address, stride and size (and every host slot) is 16-byte aligned."""
        frag = self.layout.fragment_bytes
        ok = (
            aligned(frag, self.layout.block_bytes)
            and all(aligned(v.data_ptr(), v.stride(0)) for v in self._frags)
            and bool((self.pool.device_block_address % 16 == 0).all())
        )
        if not (ok and self.pool.pinned):
            return
        if not native_copy_ready(self._lib, self.device, self.settings):
            return
        assert self._lib is not None
        py = self._python
        nfrag = len(self._frags)
        table = torch.stack(
            [
                py._kv_base,
                py._kv_stride,
                py._frag_offset,
                torch.zeros(nfrag, dtype=torch.int64),
                torch.full((nfrag,), frag, dtype=torch.int64),
            ]
        )
        self._native_refs = table.contiguous().to(self.device)
        self._native = NativeCopy(self._lib, self.device, self._streams, self.settings)
        torch.cuda.synchronize(self.device)

    @property
    def has_native(self) -> bool:
        """Whether the native copy path serves the ``kernel`` method here."""
        return self._native is not None

    @property
    def _native_staged(self) -> bool:
        """Whether the native path can run the ``staged`` method (a DMA method here)."""
        return self._native is not None and self.has_batch

    def _available(self, method: str) -> bool:
        return {
            "batch": self.has_batch,
            "kernel": self.has_kernel or self._native is not None,
            "staged": (self.has_kernel and self.has_batch) or self._native_staged,
            "gather": True,
        }[method]

    def choose_method(self, num_blocks: int, direction: int = 0) -> str:
        """The copy method a transfer of ``num_blocks`` blocks uses in ``direction``
        (0: store, 1: load). ``method_by_direction`` entries override ``copy_method``."""
        forced = self.method_by_direction[direction] or self.copy_method
        if forced != "auto":
            return forced
        per_block = self.layout.fragments_per_block
        job = JobShape(
            copies=num_blocks * per_block,
            nbytes=num_blocks * per_block * self.layout.fragment_bytes,
            blocks=num_blocks,
            native=self._native is not None,
            native_staged=self._native_staged,
        )
        base = "batch" if self.has_batch else ("kernel" if self.has_kernel else "gather")
        return choose_method(
            job,
            self.tuning,
            kernel=self.has_kernel,
            staged=self.has_kernel and self.has_batch,
            base=base,
        )

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
        job = CudaJob(n, n * self.layout.block_bytes, method)
        native = n and self._native is not None
        if native and (method == "kernel" or (method == "staged" and self._native_staged)):
            self._queue_native(job, direction, gpu_ids, host_ids)
        else:
            self._queue_python(job, direction, gpu_ids, host_ids)
        self.transfers_by_method[method] += 1
        return job

    def _spin_window(self, expected: Expected | None) -> tuple[int, int] | None:
        if not (self.spin and self._wake_fd is not None):
            return None
        return self._pacer.spin_window(expected)

    def _queue_python(
        self, job: CudaJob, direction: int, gpu_ids: Sequence[int], host_ids: Sequence[int]
    ) -> None:
        """``job`` through the Triton and torch paths, on the direction's copy stream."""
        stream = self._streams[direction]
        # Order after the caller's queued work: a store reads finished KV, a load does not
        # overwrite blocks that earlier kernels still read or write.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            try:
                start_timing(job, stream)
                if job.num_blocks:
                    job._keep = self._enqueue(job.method, direction, list(gpu_ids), list(host_ids))
                lib = self._lib if self.has_host_wake else None
                spin = self._spin_window(self._pacer.expect(job, direction))
                mark_completion(job, stream, lib, self._wake_fd, spin_ns=spin)
            except BaseException:
                # Part of the transfer may be queued: its slots must not be freed (the
                # caller does, on failure) before the device is done with them.
                self._python.kernel_streams[direction].synchronize()
                stream.synchronize()
                raise
            assert job._event is not None
            self._python.release(job._event, job._keep, direction)

    def _enqueue(
        self, method: str, direction: int, gpu_ids: list[int], host_ids: list[int]
    ) -> list[Any]:
        """Queue ``method``'s copy on the current (copy) stream; what must outlive it."""
        return self._python.enqueue(method, direction, gpu_ids, host_ids)

    def _queue_native(
        self, job: CudaJob, direction: int, gpu_ids: Sequence[int], host_ids: Sequence[int]
    ) -> None:
        """``job`` through :class:`NativeCopy`: one C call queues the wait for the caller's
        stream, the timing events, the kernel (ids as its parameters; staged: through
        the direction's staging buffers) and the completion host function; a small copy
        expected to end soon is waited for here instead (``inline_wait_us``)."""
        native = self._native
        assert native is not None and self._native_refs is not None
        gids = array("q", gpu_ids)
        hids = array("q", host_ids)
        wake_fd = self._wake_fd if self.has_host_wake else None
        small_staged = job.method == "kernel" and self.settings.native_small == "staged"
        staged = job.method == "staged" or (small_staged and self._native_staged)
        expected = self._pacer.expect(job, direction)
        wait_ns = 0 if staged else self._pacer.wait_here(expected)
        span = CopySpan(
            refs=self._native_refs.data_ptr(),
            nref=len(self._frags),
            n=job.num_blocks,
            gpu_ids=gids.buffer_info()[0],
            slot_ids=hids.buffer_info()[0],
            skip=0,
            page=self.layout.fragment_bytes,
        )
        rows = self._python._host_addr_dev.data_ptr()
        try:
            if wait_ns:
                rc = native.copy_wait(job, direction, rows, span, wait_ns)
                self._settle(native, job, direction, rc, wake_fd)
            elif staged:
                stage = self._stage(native, direction)
                native.staged(job, direction, stage, span, 1, wake_fd, self._spin_window(expected))
            else:
                spin = self._spin_window(expected)
                native.launch(job, direction, rows, (span,), 1, wake_fd, spin)
        except BaseException:
            # Part of the transfer may be queued: its slots must not be freed (the
            # caller does, on failure) before the device is done with them.
            if wait_ns:
                torch.cuda.current_stream(self.device).synchronize()
            self._python.kernel_streams[direction].synchronize()
            self._streams[direction].synchronize()
            raise

    def _stage(self, native: NativeCopy, direction: int) -> NativeStaging:
        """The direction's native staging (two buffers of ``staging_blocks`` rows, a
        block a row), made at its first use."""
        stage = self._native_stage[direction]
        if stage is None:
            stage = NativeStaging(
                native,
                self.device,
                self.staging_blocks,
                self.layout.block_bytes,
                kernel_stream=int(self._python.kernel_streams[direction].cuda_stream),
                host_rows=self.pool.block_address,
                rows_per_chunk=self.pool.rows_per_chunk,
                slot_bytes=self.layout.block_bytes,
                use_batch=True,
            )
            self._native_stage[direction] = stage
        return stage

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
        if rc != CUDA_ERROR_NOT_READY:  # the copy failed; its event says so
            job.finish_inline(RuntimeError(f"CUDA error {rc} surfaced by a copy's event"))
            job.stamped = False
            return
        self.inline_waits_missed += 1
        if wake_fd is not None:
            native.arm(job, direction, wake_fd)

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
        self._python.drop_staging()
        self._native_stage[:] = [None, None]
