"""The worker side: vLLM's ``OffloadingWorker`` over asyncoffload's loop-free transfers.

vLLM calls it from each worker's model-runner thread: ``submit_store`` / ``submit_load``
queue a copy and return, ``get_finished`` is polled once per step, ``wait`` fences. The
copies are :class:`~asyncoffload.transfer.paged_worker.PagedTransferWorker`'s: native
copy lanes on CPU tensors (vLLM's CPU platform), batched DMA from a pinned host pool on
CUDA ones. This class only translates vLLM's arguments into ids:

- vLLM 0.32 and 0.33 name the KV blocks by id (``GPULoadStoreSpec``);
- vLLM 0.34 by device pointers (``DevicePointers``): each pointer is checked to be the
  start of a row of the KV tensor its ref names (the same row for every ref of a block),
  and the row is the block id, so a pointer outside the registered KV cache is refused
  (``IndexError``) before anything is copied.

An *expedited* load (vLLM 0.33+: a sync load, waited on within the step) runs on a lane
of its own, behind no store and no other load: a native lane of its own on CPU, a copy
stream of the highest priority on CUDA. :meth:`AsyncOffloadWorker.completion` gives any
job in flight as an ``IOCompletion`` (``done()`` / ``result(timeout)``, vLLM 0.34's
protocol) backed by the job's own completion, with no thread: the native lane's status
word on CPU, the job's CUDA event on GPU; :meth:`~AsyncOffloadWorker.wait` waits on
them.

A copy that fails is retried once on a slower path. If that fails too, what happens
depends on the connector:

- under vLLM 0.32 and 0.33's ``OffloadingConnector``, which treats any failed transfer
  as fatal (it asserts success),
  :class:`~asyncoffload.transfer.paged_worker.PagedTransferError` is raised (from
  ``submit_*``, ``get_finished`` or ``wait``), saying which job, which blocks and why;
- under vLLM 0.34's, which takes failed jobs (it recomputes a failed async load's whole
  request and raises for a failed sync load), the job is reported failed, as below;
- under :class:`~asyncoffload.integrations.vllm.connector.AsyncOffloadConnector`, which
  sets :attr:`AsyncOffloadWorker.report_failures`, the job is reported by
  ``get_finished`` as ``TransferResult(job_id, success=False)`` and its error is kept
  for :meth:`AsyncOffloadWorker.pop_failure`: the connector has vLLM recompute a failed
  load's blocks and drops a failed store's.

Either way success is never reported for bytes that did not land.
"""

# vLLM is imported only once its version is checked:
# ruff: noqa: E402
from __future__ import annotations

import logging
import os
from typing import Any

# The installed vLLM is checked before anything of it is imported (see versions.py).
from asyncoffload.integrations.vllm.versions import installed_api

VLLM = installed_api()

from vllm.v1.kv_offload import base as _vllm_base
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from asyncoffload.integrations.vllm.settings import VllmOffloadSettings
from asyncoffload.transfer.faults import FaultPlan
from asyncoffload.transfer.paged_worker import (
    JobCompletion,
    PagedTransferError,
    PagedTransferWorker,
    PagedWorkerStats,
)

#: vLLM 0.34's flat device pointers of a transfer (``None`` before 0.34).
DevicePointers: type | None = getattr(_vllm_base, "DevicePointers", None)

__all__ = ["AsyncOffloadWorker"]

log = logging.getLogger("asyncoffload.vllm")


class AsyncOffloadWorker(OffloadingWorker):
    """Copies between vLLM's canonical KV caches and ``num_chunks`` host slots of this
    worker (block-major: a slot holds a chunk's pages of every tensor, contiguous).
    ``host_file``: the slots live in a shared-memory file at that path (with lower
    tiers: the scheduler maps it), unlinked at :meth:`shutdown`; ``host_file_owner``
    False: the file another rank's worker makes (a layout replicated across ranks, held
    once), mapped here and left be."""

    #: Whether a job that failed on both copy paths is reported by :meth:`get_finished`
    #: as ``TransferResult(success=False)`` (its error kept for :meth:`pop_failure`)
    #: instead of raising :class:`PagedTransferError`. ``AsyncOffloadConnector`` sets it;
    #: vLLM's own ``OffloadingConnector`` asserts success before 0.34, takes failures
    #: from 0.34 on: on by default where vLLM takes them.
    report_failures: bool = VLLM.failed_jobs

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        settings: VllmOffloadSettings,
        host_file: str | os.PathLike[str] | None = None,
        host_file_owner: bool = True,
    ) -> None:
        if not kv_caches.tensors:
            raise ValueError("vLLM registered no KV cache tensors to offload")
        tensors = [t.tensor for t in kv_caches.tensors]
        page_bytes = [t.page_size_bytes for t in kv_caches.tensors]
        group_refs = [
            [(ref.tensor_idx, ref.page_size_bytes) for ref in refs]
            for refs in kv_caches.group_data_refs
        ]
        self._transfers = PagedTransferWorker(
            tensors,
            page_bytes,
            group_refs,
            blocks_per_chunk,
            num_chunks,
            copy_engine=settings.copy_engine,
            pin=settings.pin_memory,
            chunk_bytes=settings.host_chunk_bytes,
            staging_bytes=settings.staging_bytes,
            host_file=host_file,
            host_file_owner=host_file_owner,
        )
        #: Failed jobs not yet reported by get_finished, and the errors of those reported.
        self._failed: list[TransferResult] = []
        self._errors: dict[int, PagedTransferError] = {}
        log.info(
            "asyncoffload worker: %d host slots of %d B on %s (%s)",
            num_chunks,
            self._transfers.slot_bytes,
            tensors[0].device,
            self._transfers.stats().engine,
        )

    @property
    def transfers(self) -> PagedTransferWorker:
        return self._transfers

    @property
    def slot_bytes(self) -> int:
        return self._transfers.slot_bytes

    def inject_faults(self, plan: FaultPlan | None) -> None:
        """Tests: run this worker's jobs under ``plan`` (``None``: stop); see
        :meth:`PagedTransferWorker.inject_faults`."""
        self._transfers.inject_faults(plan)

    def pop_failure(self, job_id: int) -> PagedTransferError | None:
        """The error of job ``job_id``, which :meth:`get_finished` reported failed
        (forgotten once popped); ``None`` for any other id."""
        return self._errors.pop(job_id, None)

    def _failure(self, error: PagedTransferError) -> None:
        if not self.report_failures:
            raise error
        log.debug("asyncoffload worker: %s", error)
        self._errors[error.job_id] = error
        self._failed.append(TransferResult(error.job_id, False))

    def _blocks(self, spec: object) -> tuple[object, list[int], list[int]]:
        """The KV block ids, group sizes and block indices of vLLM's device side of a
        transfer: a ``GPULoadStoreSpec`` (vLLM 0.32, 0.33) or ``DevicePointers`` (0.34)."""
        if isinstance(spec, GPULoadStoreSpec):
            return spec.block_ids, list(spec.group_sizes), list(spec.block_indices)
        if DevicePointers is not None and isinstance(spec, DevicePointers):
            pointers: Any = spec
            counts = list(pointers.group_block_counts)
            ids = self._transfers.layout.ids_from_pointers(
                pointers.ptrs, pointers.sizes, counts, pointers.group_data_ref_counts
            )
            return ids, counts, list(pointers.block_indices)
        want = "DevicePointers" if DevicePointers is not None else "GPULoadStoreSpec"
        raise TypeError(f"expected vLLM's {want} for the KV side, got {type(spec).__name__}")

    def submit_store(self, job_id: int, src_spec: object, dst_spec: LoadStoreSpec) -> bool:
        """Queue a store of the KV blocks ``src_spec`` names (block ids on vLLM 0.32 and
        0.33, device pointers on 0.34) into the host slots of ``dst_spec``."""
        ids, sizes, starts = self._blocks(src_spec)
        try:
            self._transfers.submit_store(job_id, ids, sizes, starts, _slots(dst_spec))
        except PagedTransferError as exc:  # both copy paths refused it
            self._failure(exc)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: object,
        expedited: bool = False,
    ) -> bool:
        """Queue a load from the host slots of ``src_spec`` into the KV blocks
        ``dst_spec`` names; ``expedited`` (vLLM 0.33+ sync loads) on a lane of its own,
        queued behind no store and no other load."""
        ids, sizes, starts = self._blocks(dst_spec)
        try:
            self._transfers.submit_load(
                job_id, _slots(src_spec), ids, sizes, starts, expedited=bool(expedited)
            )
        except PagedTransferError as exc:
            self._failure(exc)
        return True

    def completion(self, job_id: int) -> JobCompletion:
        """Job ``job_id`` (in flight) as an ``IOCompletion``: ``done()`` polls it,
        ``result(timeout)`` waits for it, no thread involved (see the module
        docstring). ``KeyError`` for an id not in flight."""
        return self._transfers.completion(job_id)

    def get_finished(self) -> list[TransferResult]:
        while True:
            try:
                done = self._transfers.get_finished()
            except PagedTransferError as exc:  # the others are set aside for the next call
                self._failure(exc)
                continue
            break
        results = [TransferResult(job.job_id, True, job.nbytes, job.seconds) for job in done]
        results += self._failed
        self._failed = []
        return results

    def wait(self, job_ids: set[int]) -> None:
        while True:
            try:
                self._transfers.wait(job_ids)
            except PagedTransferError as exc:  # that job is forgotten: wait for the rest
                self._failure(exc)
                continue
            return

    def stats(self) -> PagedWorkerStats:
        return self._transfers.stats()

    def shutdown(self) -> None:
        try:
            self._transfers.shutdown()
        except PagedTransferError as exc:
            if not self.report_failures:
                raise
            log.warning("asyncoffload worker: at shutdown, %s", exc)


def _slots(spec: LoadStoreSpec) -> object:
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"expected a spec of CPU slot ids, got {type(spec).__name__}")
    return spec.block_ids
