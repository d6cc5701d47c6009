"""The scheduler side: asyncoffload's CPU-tier manager behind vLLM's ``OffloadingManager``.

vLLM's scheduler thread calls it synchronously, once per step for most methods; it never
blocks and never touches a device. Decisions are those of
:class:`~asyncoffload.manager.CPUOffloadingManager` in request-scoped mode: vLLM 0.32's
connector never calls ``touch``, so each request's loads and stores are remembered and
reported to the policy when the request ends (``lru`` and ``arc`` then decide exactly as
vLLM's own manager does; see docs/vllm.md for what differs and why).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from asyncoffload.keys import OffloadKey as OurOffloadKey
from asyncoffload.manager import CPUOffloadingManager, ManagerStats
from asyncoffload.manager import LookupResult as OurLookupResult
from asyncoffload.manager import ReqContext as OurReqContext

__all__ = ["AsyncOffloadManager", "metric_definitions"]

_PREFIX = "vllm:kv_offload_"
# vLLM's CPU-spec metrics, same names and meaning, so its dashboards keep working.
CPU_CACHE_USAGE_PERC = _PREFIX + "cpu_cache_usage_perc"
CPU_CACHE_WRITE_USAGE_PERC = _PREFIX + "cpu_cache_write_usage_perc"
CPU_CACHE_READ_USAGE_PERC = _PREFIX + "cpu_cache_read_usage_perc"
CPU_ALLOCATION_SIZE = _PREFIX + "cpu_allocation_size"
STORES_SKIPPED = _PREFIX + "stores_skipped"
# asyncoffload's own.
_OURS = "vllm:asyncoffload_"
BLOCKS_STORED = _OURS + "blocks_stored"
BLOCKS_LOADED = _OURS + "blocks_loaded"
BLOCKS_EVICTED = _OURS + "blocks_evicted"
BLOCKS_STORE_FAILED = _OURS + "blocks_store_failed"
BLOCKS_DECLINED = _OURS + "blocks_declined"
LOOKUPS = _OURS + "lookups"
LOOKUP_HITS = _OURS + "lookup_hits"
READY_BLOCKS = _OURS + "ready_blocks"
FREE_BLOCKS = _OURS + "free_blocks"

# Counter metric -> the ManagerStats field it reports (as increments).
_COUNTERS: dict[str, str] = {
    BLOCKS_STORED: "stored",
    BLOCKS_LOADED: "loaded",
    BLOCKS_EVICTED: "evicted",
    BLOCKS_STORE_FAILED: "store_failed",
    BLOCKS_DECLINED: "store_skipped",
    LOOKUPS: "lookups",
    LOOKUP_HITS: "hits",
}

_LOOKUP = {
    OurLookupResult.MISS: LookupResult.MISS,
    OurLookupResult.HIT_PENDING: LookupResult.HIT_PENDING,
    OurLookupResult.HIT: LookupResult.HIT,
}


def metric_definitions(store_threshold: int = 0) -> dict[str, OffloadingMetricMetadata]:
    """Every metric :meth:`AsyncOffloadManager.get_stats` reports, for vLLM's registry."""
    definitions: dict[str, OffloadingMetricMetadata] = {
        CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
            "Fraction of the CPU tier's slots held by transfers in flight (stores being "
            "written and blocks being loaded), as in vLLM's CPU spec."
        ),
        CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
            "Fraction of the CPU tier's slots held by stores in flight."
        ),
        CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
            "Fraction of the CPU tier's slots pinned by loads in flight."
        ),
        CPU_ALLOCATION_SIZE: OffloadingHistogramMetadata(
            "Slots asked for by each prepare_store that had blocks to store (granted or "
            "not), as in vLLM's CPU spec.",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144),
        ),
        BLOCKS_STORED: OffloadingCounterMetadata("Blocks made loadable by stores."),
        BLOCKS_LOADED: OffloadingCounterMetadata("Blocks handed to loads."),
        BLOCKS_EVICTED: OffloadingCounterMetadata("Blocks evicted to make room."),
        BLOCKS_STORE_FAILED: OffloadingCounterMetadata("Blocks dropped by failed stores."),
        BLOCKS_DECLINED: OffloadingCounterMetadata(
            "Blocks offered to a store and held back by the policy, the admission "
            "filter or store_threshold."
        ),
        LOOKUPS: OffloadingCounterMetadata("lookup calls."),
        LOOKUP_HITS: OffloadingCounterMetadata("lookup calls that found the block."),
        READY_BLOCKS: OffloadingGaugeMetadata("Loadable blocks in the CPU tier."),
        FREE_BLOCKS: OffloadingGaugeMetadata("Free slots of the CPU tier."),
    }
    if store_threshold >= 2:
        definitions[STORES_SKIPPED] = OffloadingCounterMetadata(
            "Blocks not stored because store_threshold was not reached, as in vLLM's CPU spec."
        )
    return definitions


class AsyncOffloadManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over asyncoffload's CPU-tier manager.

    ``num_chunks`` slots; ``policy`` any registered cache policy (``lru``, ``arc``,
    ``kv``, ``s3fifo``, ``sieve``); ``admission`` / ``store_threshold`` as
    :class:`~asyncoffload.manager.CPUOffloadingManager`. Events are kept for
    :meth:`take_events` only when ``enable_events`` (vLLM drains them only when its KV
    events are on). Bad calls raise what the manager raises
    (:class:`~asyncoffload.UnknownKeyError`, ...) and change nothing.
    """

    def __init__(
        self,
        num_chunks: int,
        policy: str = "lru",
        *,
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        admission: str | None = None,
    ) -> None:
        self.medium = Medium.CPU
        self._manager = CPUOffloadingManager(
            num_chunks,
            policy,
            store_threshold,
            enable_events=enable_events,
            max_tracker_size=max_tracker_size,
            admission=admission,
            request_scoped=True,
        )
        self._allocation_sizes: list[int] = []
        self._reported = self._manager.stats()

    @property
    def manager(self) -> CPUOffloadingManager:
        """The asyncoffload manager behind the adapter (inspect, do not mutate)."""
        return self._manager

    def __repr__(self) -> str:
        return f"<AsyncOffloadManager {self._manager!r}>"

    # --- requests ------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._manager.on_new_request(_ours(req_context))
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        positions = getattr(req_context, "_offload_key_positions", None)
        self._manager.on_request_finished(_ours(req_context), positions or None)

    # --- lookups and loads ---------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self._manager.lookup(cast(OurOffloadKey, key))]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self._manager.prepare_load(_seq(keys), _ours(req_context))
        return CPULoadStoreSpec(list(spec.block_ids))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._manager.touch(_seq(keys), _ours(req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._manager.complete_load(_seq(keys))

    # --- stores --------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        m = self._manager
        out = m.prepare_store(_seq(keys), _ours(req_context))
        if m.last_store_size:  # as vLLM's: every allocation asked for, refused or not
            self._allocation_sizes.append(m.last_store_size)
        if out is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=cast(list[OffloadKey], out.keys_to_store),
            store_spec=CPULoadStoreSpec(list(out.store_spec.block_ids)),
            evicted_keys=cast(list[OffloadKey], out.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._manager.complete_store(_seq(keys), None, success=success)

    # --- events, stats, lifecycle --------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        return [
            OffloadingEvent(
                keys=cast(list[OffloadKey], list(event.keys)),
                medium=Medium.CPU,
                removed=event.removed,
            )
            for event in self._manager.take_events()
        ]

    def reset_cache(self) -> None:
        # vLLM's scheduler fences every in-flight job and drops their completions.
        self._manager.reset_cache(force=True)

    def get_stats(self) -> OffloadingConnectorStats:
        m = self._manager
        now = m.stats()
        stats = OffloadingConnectorStats()
        num = now.num_blocks
        write = now.write_pending / num
        read = now.pinned / num
        stats.set_gauge(CPU_CACHE_USAGE_PERC, write + read)
        stats.set_gauge(CPU_CACHE_WRITE_USAGE_PERC, write)
        stats.set_gauge(CPU_CACHE_READ_USAGE_PERC, read)
        stats.set_gauge(READY_BLOCKS, now.ready)
        stats.set_gauge(FREE_BLOCKS, now.free)
        for size in self._allocation_sizes:
            stats.observe_histogram(CPU_ALLOCATION_SIZE, size)
        self._allocation_sizes.clear()
        before = self._reported
        for name, field in _COUNTERS.items():
            delta = getattr(now, field) - getattr(before, field)
            if delta:
                stats.increase_counter(name, delta)
        if m.store_threshold >= 2:
            stats.increase_counter(STORES_SKIPPED, now.store_skipped - before.store_skipped)
        self._reported = now
        return stats

    def stats(self) -> ManagerStats:
        return self._manager.stats()


def _ours(req_context: ReqContext) -> OurReqContext:
    # The manager reads only ``req_id`` of a context, which vLLM's has too.
    return cast(OurReqContext, req_context)


def _seq(keys: Collection[OffloadKey]) -> Any:
    """vLLM passes lists, and sets where order does not matter; the manager takes
    sequences."""
    return keys if isinstance(keys, (list, tuple)) else list(keys)
