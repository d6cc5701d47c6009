"""``AsyncOffloadConnector``: vLLM's ``OffloadingConnector`` where a failed load costs only
the blocks that failed, never a worker.

vLLM 0.32 and 0.33's ``OffloadingConnector`` asserts that every transfer succeeds, so a
load that fails kills the worker. vLLM 0.34's reports a failed async load per request
(``failed_recving``): under ``kv_load_failure_policy="recompute"`` the whole request is
recomputed from token 0; a failed sync (expedited) load still raises. vLLM's scheduler
can do better on every version: it recomputes from the first block a connector reports
through ``get_block_ids_with_load_errors()``, keeping the valid prefix, for async and
sync loads alike. This subclass changes only the failure path::

    --kv-transfer-config '{"kv_connector": "AsyncOffloadConnector",
      "kv_connector_module_path": "asyncoffload.integrations.vllm",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "AsyncOffloadSpec",
                                    "spec_module_path": "asyncoffload.integrations.vllm",
                                    "cpu_bytes_to_use": 8589934592}}'

- **A failed load** (a copy that failed on both paths, see
  :class:`~asyncoffload.integrations.vllm.worker.AsyncOffloadWorker`) is reported done, so
  its request leaves the transfer wait, and its GPU block ids go to
  ``get_block_ids_with_load_errors()`` in the same step. Under ``"recompute"`` vLLM
  recomputes them; under ``"fail"`` (vLLM's default) it fails the requests that need
  them with finish reason ``error``. Either way the worker logs the job, the blocks and
  the cause, and the engine keeps serving. A request whose load failed is not offered
  offloaded blocks again (it recomputes rather than retrying the load). Models with
  several KV cache groups get the request-level channel (``failed_recving``: vLLM
  recomputes the whole request) since vLLM maps block ids back only for one group; for
  them sync loads are turned off (``sync_load_budget_bytes`` 0, logged), since a failed
  sync load has no request-level channel.
- **Only the blocks that failed**: a load whose copy failed on both paths is retried one
  host slot at a time, so the blocks of the slots that copy are kept and only the
  others are reported (vLLM recomputes from the first of those: its scheduler can resume
  a request only at a block boundary, never skip a block in the middle).
- **A sync (expedited) load** (vLLM 0.33+) that fails is reported the same way, in the
  step that waited for it: vLLM discards that step's output for the request and
  recomputes from the first failed block. It never raises.
- **A failed store** is skipped: its blocks never become loadable
  (``complete_store(success=False)``) and it is counted.
- Counters (vLLM's Prometheus registry and ``get_kv_connector_stats``):
  ``vllm:asyncoffload_load_jobs_failed``, ``vllm:asyncoffload_load_blocks_failed``,
  ``vllm:asyncoffload_blocks_recomputed`` (under ``"recompute"``) and
  ``vllm:asyncoffload_store_jobs_failed``.

Any ``OffloadingSpec`` works under it; only a worker that reports
``TransferResult(success=False)`` (ours does once the connector sets
``report_failures``) ever takes the failure path. On vLLM 0.32 and 0.33 it reads the
scheduler's job table (``OffloadingConnectorScheduler._jobs``) to drop a failed store's
keys and keep a failed request from loading again; vLLM 0.34's scheduler does both
itself (``failed_jobs``).
"""

# vLLM is imported only once its version is checked:
# ruff: noqa: E402
from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

# The installed vLLM is checked before anything of it is imported (see versions.py).
from asyncoffload.integrations.vllm.versions import installed_api

VLLM = installed_api()

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    OffloadingCounterMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from asyncoffload.integrations.vllm.worker import AsyncOffloadWorker

__all__ = [
    "BLOCKS_RECOMPUTED",
    "LOAD_BLOCKS_FAILED",
    "LOAD_JOBS_FAILED",
    "STORE_JOBS_FAILED",
    "AsyncOffloadConnector",
    "AsyncOffloadConnectorWorker",
    "AsyncOffloadWorkerMetadata",
    "failure_metric_definitions",
]

log = logging.getLogger("asyncoffload.vllm")

LOAD_JOBS_FAILED = "vllm:asyncoffload_load_jobs_failed"
LOAD_BLOCKS_FAILED = "vllm:asyncoffload_load_blocks_failed"
BLOCKS_RECOMPUTED = "vllm:asyncoffload_blocks_recomputed"
STORE_JOBS_FAILED = "vllm:asyncoffload_store_jobs_failed"

_POLICIES = ("recompute", "fail")


def failure_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The counters :class:`AsyncOffloadConnector` adds to vLLM's registry."""
    return {
        LOAD_JOBS_FAILED: OffloadingCounterMetadata(
            "Load jobs whose copy failed (after its retry) and were reported to vLLM."
        ),
        LOAD_BLOCKS_FAILED: OffloadingCounterMetadata(
            "GPU blocks those failed loads should have filled."
        ),
        BLOCKS_RECOMPUTED: OffloadingCounterMetadata(
            "GPU blocks vLLM recomputes because their load failed "
            "(kv_load_failure_policy='recompute')."
        ),
        STORE_JOBS_FAILED: OffloadingCounterMetadata(
            "Store jobs whose copy failed (after its retry); their blocks were dropped."
        ),
    }


@dataclass
class AsyncOffloadWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker-to-scheduler job report, plus the jobs that failed.

    A failed job is also in ``completed_jobs`` (it is over); ``failed_loads`` maps a
    failed load's job id to its GPU block count, ``failed_stores`` holds failed stores.
    Aggregated over workers: a job failed if it failed on any worker."""

    failed_loads: dict[int, int] = field(default_factory=dict)
    failed_stores: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        out = AsyncOffloadWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            failed_loads=dict(self.failed_loads),
            failed_stores=set(self.failed_stores),
        )
        if VLLM.failed_jobs:  # vLLM 0.34's own record of failed jobs
            out.failed_jobs = set(merged.failed_jobs)  # type: ignore[attr-defined]
        if isinstance(other, AsyncOffloadWorkerMetadata):
            for job_id, blocks in other.failed_loads.items():
                out.failed_loads[job_id] = max(blocks, out.failed_loads.get(job_id, 0))
            out.failed_stores |= other.failed_stores
        return out


class AsyncOffloadConnectorWorker(OffloadingConnectorWorker):
    """The worker side: vLLM's, with failed jobs reported instead of asserted.

    ``recompute``: vLLM's ``kv_load_failure_policy`` is ``"recompute"`` (only the log
    wording depends on it). ``per_request``: report failed loads through
    ``failed_recving`` (request ids) rather than GPU block ids (models with several KV
    cache groups)."""

    def __init__(
        self,
        spec: OffloadingSpec,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        recompute: bool,
        per_request: bool = False,
    ) -> None:
        super().__init__(spec, vllm_config, kv_cache_config)
        self.recompute = recompute
        self.per_request = per_request
        self._connector_worker_meta = AsyncOffloadWorkerMetadata()
        #: job id -> GPU block ids, for loads in flight.
        self._load_block_ids: dict[int, list[int]] = {}
        self._invalid_block_ids: set[int] = set()
        self._failed_req_ids: set[str] = set()
        #: Counters since the worker was made.
        self.load_jobs_failed = 0
        self.load_blocks_failed = 0
        self.store_jobs_failed = 0

    def _init_worker(self, kv_caches: CanonicalKVCaches) -> None:
        super()._init_worker(kv_caches)
        if isinstance(self.worker, AsyncOffloadWorker):
            self.worker.report_failures = True

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata) -> None:
        for job_id, entry in metadata.load_jobs.items():
            dst = entry.dst_spec
            assert isinstance(dst, GPULoadStoreSpec)
            self._load_block_ids[job_id] = [int(b) for b in dst.block_ids]
        super().start_kv_transfers(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """As vLLM's, but a failed job is reported done and recorded as failed (see
        :meth:`take_block_ids_with_load_errors`) instead of asserted or raised; a failed
        sync load (no request id: its request already ran this step) too."""
        assert self.worker is not None
        meta = self._connector_worker_meta
        assert isinstance(meta, AsyncOffloadWorkerMetadata)
        finished_recving: set[str] = set()
        for result in self.worker.get_finished():
            job_id = result.job_id
            is_load = job_id in self._load_jobs
            block_ids = self._load_block_ids.pop(job_id, [])
            if not result.success:
                self._record_failure(meta, job_id, is_load, block_ids)
                if VLLM.failed_jobs:
                    meta.mark_completed(job_id, success=False)  # type: ignore[call-arg]
                else:
                    meta.mark_completed(job_id)
            else:
                if result.transfer_time is not None and result.transfer_size is not None:
                    stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
                    stats.record(result.transfer_size, result.transfer_time)
                meta.mark_completed(job_id)
            req_id = self._load_jobs.pop(job_id, None)
            if req_id is not None:
                finished_recving.add(req_id)
        return set(), finished_recving

    def _record_failure(
        self,
        meta: AsyncOffloadWorkerMetadata,
        job_id: int,
        is_load: bool,
        block_ids: list[int],
    ) -> None:
        error = (
            self.worker.pop_failure(job_id) if isinstance(self.worker, AsyncOffloadWorker) else None
        )
        direction = "load" if is_load else "store"
        cause = str(error) if error is not None else f"{direction} job {job_id} failed"
        if not is_load:
            self.store_jobs_failed += 1
            meta.failed_stores.add(job_id)
            log.warning("asyncoffload: %s; its blocks are dropped, not stored", cause)
            return
        if error is not None and error.failed_gpu_ids and block_ids:
            # Slots retried alone that landed: only the others' blocks are lost.
            failed = set(error.failed_gpu_ids)
            block_ids = [b for b in block_ids if b in failed]
        self.load_jobs_failed += 1
        self.load_blocks_failed += len(block_ids)
        meta.failed_loads[job_id] = len(block_ids)
        req_id = self._load_jobs[job_id]  # None for a sync load (vLLM 0.33+)
        if self.per_request and req_id is not None:
            self._failed_req_ids.add(req_id)
        else:
            self._invalid_block_ids.update(block_ids)
        kind = "sync load" if req_id is None else "load"
        what = f"{kind} job {job_id} of request {req_id}, GPU blocks {block_ids}"
        if self.recompute:
            log.warning(
                "asyncoffload: %s: %s; vLLM recomputes them (kv_load_failure_policy='recompute')",
                what,
                cause,
            )
        else:
            log.error(
                "asyncoffload: %s: %s; vLLM fails the requests that need them "
                "(kv_load_failure_policy='fail'; 'recompute' would recompute them)",
                what,
                cause,
            )

    def take_block_ids_with_load_errors(self) -> set[int]:
        """GPU block ids of the loads found failed since the last call."""
        out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out

    def take_failed_req_ids(self) -> set[str]:
        """Requests whose load was found failed since the last call (``per_request``)."""
        out, self._failed_req_ids = self._failed_req_ids, set()
        return out

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = self._connector_worker_meta
        if not meta.completed_jobs:
            return None
        self._connector_worker_meta = AsyncOffloadWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        self._load_block_ids.clear()
        super().shutdown()


class _StoreOutcomes:
    """The scheduler's manager while completions are processed: ``complete_store`` of
    a failed store's keys (the job's own key set, by identity) passes
    ``success=False``; everything else goes to ``manager`` unchanged."""

    def __init__(
        self, manager: OffloadingManager, failed: Sequence[Collection[OffloadKey]]
    ) -> None:
        self._manager = manager
        self._failed = failed

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        if any(keys is failed for failed in self._failed):
            success = False
        self._manager.complete_store(keys, req_context, success=success)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


class AsyncOffloadConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` with failed loads recomputed (or failed per
    request) and failed stores skipped; see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        transfer_config = vllm_config.kv_transfer_config
        if transfer_config is None:
            raise ValueError("AsyncOffloadConnector needs a kv_transfer_config")
        policy = transfer_config.kv_load_failure_policy
        if policy not in _POLICIES:
            raise ValueError(
                f"kv_transfer_config.kv_load_failure_policy must be one of {_POLICIES}, "
                f"got {policy!r}"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        self.load_failure_policy: str = policy
        #: Requests whose load failed: they are offered no offloaded blocks again.
        self._no_load_req_ids: set[str] = set()
        #: Failed jobs the scheduler still tracks (a job completes once every worker
        #: reported it, maybe over several steps).
        self._failed_jobs: set[int] = set()
        self._failure_stats = OffloadingConnectorStats()
        per_request = len(kv_cache_config.kv_cache_groups) > 1
        if self.connector_worker is not None:
            self.connector_worker = AsyncOffloadConnectorWorker(
                self.connector_worker.spec,
                vllm_config,
                kv_cache_config,
                recompute=policy == "recompute",
                per_request=per_request,
            )
        scheduler = self.connector_scheduler
        if per_request and scheduler is not None and VLLM.expedited_loads:
            config = scheduler.config
            budget = getattr(config, "sync_load_budget_bytes", 0)
            if budget:
                # A failed sync load of several groups could only be reported per
                # request, and vLLM has no per-request channel for a request that ran.
                log.warning(
                    "asyncoffload: sync loads are off (sync_load_budget_bytes %d -> 0): "
                    "with %d KV cache groups a failed one could not be recomputed",
                    budget,
                    len(kv_cache_config.kv_cache_groups),
                )
                replace: Any = config._replace
                scheduler.config = replace(sync_load_budget_bytes=0)

    # --- scheduler side ----------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """A request's ``cache_salt`` is its tenant: our manager learns it before vLLM
        makes the request's context (which has no salt), for tenant quotas."""
        scheduler = self.connector_scheduler
        expect = getattr(getattr(scheduler, "manager", None), "expect_request", None)
        if expect is not None:
            expect(request.request_id, getattr(request, "cache_salt", None))
        super().on_new_request(request)

    # --- worker side -------------------------------------------------------------------

    @property
    def _worker_side(self) -> AsyncOffloadConnectorWorker:
        worker = self.connector_worker
        assert isinstance(worker, AsyncOffloadConnectorWorker)
        return worker

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self._worker_side.take_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self.connector_worker is not None:
            failed = self._worker_side.take_failed_req_ids()
            results.failed_recving = failed
            results.finished_recving |= failed
        return results

    # --- scheduler side ----------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        scheduler = self.scheduler
        jobs = scheduler._jobs
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, AsyncOffloadWorkerMetadata):
            stats = self._failure_stats
            for job_id, blocks in meta.failed_loads.items():
                status = jobs.get(job_id)
                if status is None or job_id in self._failed_jobs:
                    continue
                self._failed_jobs.add(job_id)
                self._no_load_req_ids.add(status.req_id)
                stats.increase_counter(LOAD_JOBS_FAILED, 1)
                stats.increase_counter(LOAD_BLOCKS_FAILED, blocks)
                if self.load_failure_policy == "recompute":
                    stats.increase_counter(BLOCKS_RECOMPUTED, blocks)
            for job_id in meta.failed_stores:
                if job_id in jobs and job_id not in self._failed_jobs:
                    self._failed_jobs.add(job_id)
                    stats.increase_counter(STORE_JOBS_FAILED, 1)
        failed_stores = [jobs[j].keys for j in self._failed_jobs if j in jobs and jobs[j].is_store]
        if not failed_stores or VLLM.failed_jobs:  # vLLM 0.34 drops a failed store itself
            super().update_connector_output(connector_output)
        else:
            manager = scheduler.manager
            scheduler.manager = cast(OffloadingManager, _StoreOutcomes(manager, failed_stores))
            try:
                super().update_connector_output(connector_output)
            finally:
                scheduler.manager = manager
        if self._failed_jobs:
            self._failed_jobs = {j for j in self._failed_jobs if j in jobs}

    def _max_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        if request.request_id in self._no_load_req_ids:
            return 0  # its load failed: recompute rather than load again
        return super()._max_loadable_tokens(request, num_computed_tokens)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._no_load_req_ids.discard(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._no_load_req_ids.discard(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = super().get_kv_connector_stats()
        if self._failure_stats.is_empty():
            return stats
        mine, self._failure_stats = self._failure_stats, OffloadingConnectorStats()
        return mine if stats is None else stats.aggregate(mine)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return _PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class _PromMetrics(OffloadPromMetrics):
    """vLLM's offloading metrics plus :func:`failure_metric_definitions`."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        for name, metadata in failure_metric_definitions().items():
            if name not in self._offloading_metric_defs:
                self._offloading_metric_metadata[name] = metadata
                self._offloading_metric_defs[name] = self._create_metric(name, metadata)
