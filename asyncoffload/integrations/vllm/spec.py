"""``AsyncOffloadSpec``: the class vLLM loads by name from ``kv_connector_extra_config``.

vLLM builds one in the scheduler process (``get_manager``), one in each worker process
(``get_worker``) and calls ``build_metric_definitions`` in the API process. Unlike vLLM's
own CPU spec, it runs on vLLM's CPU platform as well as on CUDA.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from asyncoffload.integrations.vllm.manager import AsyncOffloadManager, metric_definitions
from asyncoffload.integrations.vllm.settings import VllmOffloadSettings
from asyncoffload.integrations.vllm.worker import AsyncOffloadWorker

__all__ = ["AsyncOffloadSpec"]


class AsyncOffloadSpec(OffloadingSpec):
    """asyncoffload's CPU tier as a vLLM offloading backend.

    ``cpu_bytes_to_use`` is shared by the engine's workers as in vLLM's CPU spec: each of
    ``world_size`` workers keeps ``num_chunks`` host slots of its own share of a chunk
    (``blocks_per_chunk`` blocks), and the scheduler's manager tracks ``num_chunks``.
    Settings are checked when the spec is built; an error names the key.
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        settings = VllmOffloadSettings.from_extra_config(extra_config)
        return dict(metric_definitions(settings.store_threshold))

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings = VllmOffloadSettings.from_extra_config(config.extra_config)
        per_block = config.worker_kv_bytes_per_block
        world = max(1, config.parallel.world_size)
        #: This worker's bytes of one chunk (one host slot).
        self.chunk_bytes = per_block * self.blocks_per_chunk
        if self.chunk_bytes <= 0:
            raise ValueError(f"vLLM reports {per_block} KV bytes per block: nothing to offload")
        self.num_chunks = self.settings.cpu_bytes_to_use // (self.chunk_bytes * world)
        if self.num_chunks <= 0:
            raise ValueError(
                f"kv_connector_extra_config['cpu_bytes_to_use'] = "
                f"{self.settings.cpu_bytes_to_use} holds no chunk: one chunk takes "
                f"{self.chunk_bytes} B on each of {world} worker(s)"
            )
        self._manager: AsyncOffloadManager | None = None
        self._worker: AsyncOffloadWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            s = self.settings
            self._manager = AsyncOffloadManager(
                self.num_chunks,
                s.cache_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=s.store_threshold,
                max_tracker_size=s.max_tracker_size,
                admission=s.admission,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = AsyncOffloadWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks, self.settings
            )
        return self._worker
