"""The CPU backend: copies between plain (CPU) KV tensors and a host tensor, on threads.

One worker thread per direction runs jobs in submission order; torch releases the GIL
inside its copy kernels, so copies overlap with the event loop. Host memory is one
``[num_host_blocks, block_bytes]`` uint8 tensor, block-major.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch

from asyncoffload.layout import KVLayout
from asyncoffload.transfer.base import CopyJob, TransferBackend

__all__ = ["CpuCopyBackend"]

_STOP = object()


class _Worker:
    """A thread that runs copies of one direction, in order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob, fn: Callable[..., None], args: tuple[object, ...],
               wake: Callable[[], None]) -> None:
        self._queue.put((job, fn, args, wake))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, fn, args, wake = item  # type: ignore[misc]
            try:
                fn(*args)
            except BaseException as exc:  # reported through the job, never lost
                job.finish(exc)
            else:
                job.finish()
            wake()

    def stop(self) -> None:
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()


class CpuCopyBackend(TransferBackend):
    """Thread-pool copies between CPU KV tensors and a host block pool."""

    name = "cpu"

    def __init__(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, num_host_blocks: int
    ) -> None:
        if layout.device.type != "cpu":
            raise ValueError(f"CpuCopyBackend needs CPU tensors, got {layout.device}")
        super().__init__(layout, num_host_blocks)
        self._fragments = layout.fragment_views(kv_caches)
        self.host = torch.zeros((num_host_blocks, layout.block_bytes), dtype=torch.uint8)
        frag = layout.fragment_bytes
        self._host_columns = [
            self.host[:, i * frag : (i + 1) * frag] for i in range(len(self._fragments))
        ]
        self._store_worker = _Worker("asyncoffload-store")
        self._load_worker = _Worker("asyncoffload-load")
        self._closed = False

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(ids, dtype=torch.int64)

    def submit_store(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyJob:
        job = CopyJob(len(gpu_ids), len(gpu_ids) * self.layout.block_bytes)
        self._submit(self._store_worker, job, self._copy_store, gpu_ids, host_ids)
        return job

    def submit_load(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> CopyJob:
        job = CopyJob(len(gpu_ids), len(gpu_ids) * self.layout.block_bytes)
        self._submit(self._load_worker, job, self._copy_load, host_ids, gpu_ids)
        return job

    def _submit(
        self,
        worker: _Worker,
        job: CopyJob,
        fn: Callable[[torch.Tensor, torch.Tensor], None],
        src: Sequence[int],
        dst: Sequence[int],
    ) -> None:
        if self._closed:
            raise RuntimeError("CpuCopyBackend is closed")
        worker.submit(job, fn, (self._index(src), self._index(dst)), self._wake)

    # The copies themselves; tests override these to inject failures.

    def _copy_store(self, gpu_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        for src, dst in zip(self._fragments, self._host_columns):
            dst.index_copy_(0, host_idx, src.index_select(0, gpu_idx))

    def _copy_load(self, host_idx: torch.Tensor, gpu_idx: torch.Tensor) -> None:
        for src, dst in zip(self._host_columns, self._fragments):
            dst.index_copy_(0, gpu_idx, src.index_select(0, host_idx))

    def read_host_block(self, host_id: int) -> bytes:
        return bytes(self.host[host_id].numpy().tobytes())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._store_worker.stop()
        self._load_worker.stop()
