"""``AsyncOffloadSpec``: the class vLLM loads by name from ``kv_connector_extra_config``.

vLLM builds one in the scheduler process (``get_manager``), one in each worker process
(``get_worker``) and calls ``build_metric_definitions`` in the API process. Unlike vLLM's
own CPU spec, it runs on vLLM's CPU platform as well as on CUDA.
"""

# vLLM is imported only once its version is checked:
# ruff: noqa: E402
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

# The installed vLLM is checked before anything of it is imported (see versions.py).
from asyncoffload.integrations.vllm.versions import installed_api

VLLM = installed_api()

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
from asyncoffload.manager.quotas import resolve_quotas
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.format import Namespace
from asyncoffload.tiers.ports import open_tiers

__all__ = ["AsyncOffloadSpec"]


class AsyncOffloadSpec(OffloadingSpec):
    """asyncoffload's CPU tier as a vLLM offloading backend.

    ``cpu_bytes_to_use`` is shared by the engine's workers as in vLLM's CPU spec: each of
    ``world_size`` workers keeps ``num_chunks`` host slots of its own share of a chunk
    (``blocks_per_chunk`` blocks), and the scheduler's manager tracks ``num_chunks``.
    Settings are checked when the spec is built; an error names the key.

    ``tiers`` (as ``EngineConfig.tiers``) adds disk and shared (Redis / Valkey) tiers
    below the CPU tier: each worker then keeps its host slots in a shared-memory file
    (:meth:`host_pool_path`) that the manager maps, to write blocks through to the tiers
    and promote them back (see docs/vllm.md, "Tiers under vLLM"). With tensor
    parallelism, a block in a lower tier is one value holding every rank's slice of it,
    in rank order: written from the same slot of each worker's pool, read back into
    each, checked whole, so it is there for every rank or for none.
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        settings = VllmOffloadSettings.from_extra_config(extra_config)
        return dict(metric_definitions(settings.store_threshold, bool(settings.tiers)))

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings = VllmOffloadSettings.from_extra_config(config.extra_config)
        per_block = config.worker_kv_bytes_per_block
        world = max(1, config.parallel.world_size)
        self.world_size = world
        #: vLLM marks a KV layout that every rank holds the same (MLA's latent under
        #: tensor parallelism): one copy is kept, in rank 0's host pool, which every
        #: rank's worker maps; vLLM's connector has only rank 0 store it, and the lower
        #: tiers hold one slice per block. (vLLM's base spec sets the attribute False.)
        self.replicated_layout = bool(getattr(config, "replicated_layout", False)) and world > 1
        copies = 1 if self.replicated_layout else world
        #: This worker's bytes of one chunk (one host slot).
        self.chunk_bytes = per_block * self.blocks_per_chunk
        if self.chunk_bytes <= 0:
            raise ValueError(f"vLLM reports {per_block} KV bytes per block: nothing to offload")
        self.num_chunks = self.settings.cpu_bytes_to_use // (self.chunk_bytes * copies)
        if self.num_chunks <= 0:
            raise ValueError(
                f"kv_connector_extra_config['cpu_bytes_to_use'] = "
                f"{self.settings.cpu_bytes_to_use} holds no chunk: one chunk takes "
                f"{self.chunk_bytes} B on each of {copies} worker(s)"
            )
        self._manager: AsyncOffloadManager | None = None
        self._worker: AsyncOffloadWorker | None = None

    def host_pool_path(self, rank: int | None = None) -> Path:
        """The shared host pool file of worker ``rank`` (this spec's rank by default)."""
        from asyncoffload.integrations.vllm.tiers import host_pool_path

        if rank is None:
            rank = self.config.parallel.rank
        return host_pool_path(self.settings.host_pool_dir, self.config.engine_id, rank)

    def host_pool_paths(self) -> list[Path]:
        """The shared host pool files the scheduler maps: every worker's, rank order
        (rank 0's alone for a replicated layout: the only copy)."""
        ranks = 1 if self.replicated_layout else self.world_size
        return [self.host_pool_path(rank) for rank in range(ranks)]

    @property
    def shared_pool(self) -> bool:
        """Whether the host slots live in shared-memory files (with lower tiers, or a
        replicated layout that every rank's worker maps) rather than private memory."""
        return bool(self.settings.tiers) or self.replicated_layout

    def namespace(self) -> Namespace:
        """The identity of this engine's blocks in lower tiers: the model, the KV dtype
        and layout, the bytes and tokens of a chunk, the world size (a block holds
        every rank's slice: ``block_bytes`` is the chunk bytes of all ranks), the
        tenant. Another tensor-parallel size never reads these blocks."""
        config = self.config
        layers = [name for group in config.groups for name in group.layer_names]
        layer_hash = hashlib.blake2b("\0".join(layers).encode(), digest_size=8).hexdigest()
        layout = (
            f"vllm,groups={len(config.groups)},layers={len(layers)}:{layer_hash},"
            f"kv_cache_layout={config.kv_cache_layout},"
            f"bytes_per_block={config.worker_kv_bytes_per_block},"
            f"blocks_per_chunk={self.blocks_per_chunk}"
        )
        world = self.world_size
        slices = 1 if self.replicated_layout else world
        if self.replicated_layout:
            layout += f",replicated_over={world}"
        elif world > 1:
            layout += f",rank_slices={world}x{self.chunk_bytes}"
        return Namespace(
            model=config.model.name,
            kv_dtype=str(config.model.dtype),
            layout=layout,
            block_bytes=self.chunk_bytes * slices,
            tokens_per_block=self.tokens_per_hash * self.blocks_per_chunk,
            rank=0,  # every rank's slice is in the block
            world_size=world,
            tenant=self.settings.tenant,
        )

    def _open_tiers(self) -> list[LowerTier]:
        # The host pools are mapped later, by the scheduler's tiers (HostPools).
        return open_tiers(self.settings.tiers, self.namespace(), cpu_blocks=self.num_chunks)

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
                tiers=self._open_tiers() if s.tiers else (),
                host_pool=(self.host_pool_paths(), self.chunk_bytes) if s.tiers else None,
                unlink_pools=not self.replicated_layout,
                pin_budget=s.pin_budget,
                quotas=resolve_quotas(s.quotas, self.num_chunks, self.chunk_bytes, "quotas"),
            )
            if self._manager.tiers is not None:  # load or recompute, by measured cost
                tokens = self.tokens_per_hash * self.blocks_per_chunk
                self._manager.tiers.configure_cost(
                    s.load_or_recompute,
                    tokens,
                    s.recompute_tokens_per_s,
                    s.load_deadline_factor,
                    s.load_deadline_floor_s,
                    s.load_probe_every_s,
                )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            # A replicated layout: rank 0's worker makes the one pool, the others map it.
            owner = not self.replicated_layout or rank == 0
            pool_rank = 0 if self.replicated_layout else rank
            self._worker = AsyncOffloadWorker(
                kv_caches,
                self.blocks_per_chunk,
                self.num_chunks,
                self.settings,
                host_file=self.host_pool_path(pool_rank) if self.shared_pool else None,
                host_file_owner=owner,
            )
        return self._worker
