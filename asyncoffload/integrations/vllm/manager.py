"""The scheduler side: asyncoffload's CPU-tier manager behind vLLM's ``OffloadingManager``.

vLLM's scheduler thread calls it synchronously, once per step for most methods; it never
blocks and never touches a device. Decisions are those of
:class:`~asyncoffload.manager.CPUOffloadingManager` in request-scoped mode: vLLM 0.32's
connector never calls ``touch``, so each request's loads and stores are remembered and
reported to the policy when the request ends (``lru`` and ``arc`` then decide exactly as
vLLM's own manager does; see docs/vllm.md for what differs and why).

Where it builds, the C core (:class:`~asyncoffload.manager.native.NativeManager`: the
same decisions, call for call) runs every policy (``kv`` with its default options)
without an admission filter or ``store_threshold``; everything else runs on the Python
manager. Both answer in raw form (slot ids, ``(keys, removed)`` events) and the adapter
builds vLLM's objects from that.
"""

# vLLM is imported only once its version is checked:
# ruff: noqa: E402
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

# The installed vLLM is checked before anything of it is imported (see versions.py).
from asyncoffload.integrations.vllm.versions import installed_api

VLLM = installed_api()

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload import base as _vllm_base
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
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from asyncoffload.integrations.vllm.hints import RequestHints
from asyncoffload.keys import OffloadKey as OurOffloadKey
from asyncoffload.manager import CPUOffloadingManager, ManagerStats
from asyncoffload.manager import LookupResult as OurLookupResult
from asyncoffload.manager import ReqContext as OurReqContext
from asyncoffload.manager.base import Medium as OurMedium
from asyncoffload.manager.native import (
    NativeManager,
    RawEvent,
    RawStore,
    native_manager_available,
    native_unsupported,
)
from asyncoffload.manager.policies.lru_ranked import RankedLRUPolicy
from asyncoffload.manager.quotas import Tenancy, no_store_param, tenancy
from asyncoffload.manager.retention import DEFAULT_PIN_BUDGET

if TYPE_CHECKING:
    from asyncoffload.integrations.vllm.tiers import SchedulerTiers
    from asyncoffload.tiers.base import LowerTier
    from asyncoffload.tiers.core import TierState, TierStats

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
BLOCKS_QUOTA_REFUSED = _OURS + "blocks_quota_refused"
BLOCKS_OPTED_OUT = _OURS + "blocks_opted_out"
LOOKUPS = _OURS + "lookups"
LOOKUP_HITS = _OURS + "lookup_hits"
READY_BLOCKS = _OURS + "ready_blocks"
FREE_BLOCKS = _OURS + "free_blocks"
# Lower tiers (summed over them), with tiers only.
TIER_BLOCKS_WRITTEN = _OURS + "tier_blocks_written"
TIER_BLOCKS_READ = _OURS + "tier_blocks_read"
TIER_WRITE_FAILURES = _OURS + "tier_write_failures"
TIER_READ_FAILURES = _OURS + "tier_read_failures"
TIER_SKIPPED = _OURS + "tier_skipped"
TIER_READY_BLOCKS = _OURS + "tier_ready_blocks"
# Load or recompute (tiers.core.cost), in blocks, with tiers only.
TIER_LOADED = _OURS + "tier_loaded"
TIER_RECOMPUTED_BY_CHOICE = _OURS + "tier_recomputed_by_choice"
TIER_RECOMPUTED_AFTER_DEADLINE = _OURS + "tier_recomputed_after_deadline"
# Retention pins of the CPU tier (kv_transfer_params' asyncoffload_retention).
PINNED_BLOCKS = _OURS + "pinned_blocks"
PINS_REFUSED = _OURS + "pins_refused"
PINS_EXPIRED = _OURS + "pins_expired"

# Counter metric -> the ManagerStats field it reports (as increments).
_COUNTERS: dict[str, str] = {
    BLOCKS_STORED: "stored",
    BLOCKS_LOADED: "loaded",
    BLOCKS_EVICTED: "evicted",
    BLOCKS_STORE_FAILED: "store_failed",
    BLOCKS_DECLINED: "store_skipped",
    BLOCKS_QUOTA_REFUSED: "quota_refused",
    BLOCKS_OPTED_OUT: "opted_out",
    LOOKUPS: "lookups",
    LOOKUP_HITS: "hits",
}

_LOOKUP = {
    OurLookupResult.MISS: LookupResult.MISS,
    OurLookupResult.HIT_PENDING: LookupResult.HIT_PENDING,
    OurLookupResult.HIT: LookupResult.HIT,
}
_VLLM_RESULTS = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING)
#: A lookup that promotes promotes at most this many of the request's later keys too.
_LOOKAHEAD = 256
_ALL_TIERS = getattr(getattr(_vllm_base, "TierFilter", None), "ALL", None)
_LOCALITY = getattr(_vllm_base, "Locality", None)
_PENDING = LookupResult.HIT_PENDING
_MISS = LookupResult.MISS
_NO_REQUEST = ReqContext(req_id="")
log = logging.getLogger("asyncoffload.vllm")


def metric_definitions(
    store_threshold: int = 0, tiers: bool = False
) -> dict[str, OffloadingMetricMetadata]:
    """Every metric :meth:`AsyncOffloadManager.get_stats` reports, for vLLM's registry
    (``tiers``: with lower tiers configured)."""
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
        BLOCKS_QUOTA_REFUSED: OffloadingCounterMetadata(
            "Blocks refused by a tenant's (cache_salt's) quota in the CPU tier."
        ),
        BLOCKS_OPTED_OUT: OffloadingCounterMetadata(
            "Blocks not stored because their request opted out (asyncoffload_no_store)."
        ),
        LOOKUPS: OffloadingCounterMetadata("lookup calls."),
        LOOKUP_HITS: OffloadingCounterMetadata("lookup calls that found the block."),
        READY_BLOCKS: OffloadingGaugeMetadata("Loadable blocks in the CPU tier."),
        FREE_BLOCKS: OffloadingGaugeMetadata("Free slots of the CPU tier."),
        PINNED_BLOCKS: OffloadingGaugeMetadata(
            "CPU-tier blocks held by retention pins (kv_transfer_params' asyncoffload_retention)."
        ),
        PINS_REFUSED: OffloadingCounterMetadata(
            "Retention pins refused: over pin_budget (the block is stored unpinned), or "
            "a request's hint refused whole (retention off: no pin_budget; or malformed)."
        ),
        PINS_EXPIRED: OffloadingCounterMetadata("Retention pins that expired."),
    }
    if tiers:
        definitions.update(
            {
                TIER_BLOCKS_WRITTEN: OffloadingCounterMetadata(
                    "Blocks written through to the lower tiers (disk)."
                ),
                TIER_BLOCKS_READ: OffloadingCounterMetadata(
                    "Blocks read back from the lower tiers into the CPU tier (promotions)."
                ),
                TIER_WRITE_FAILURES: OffloadingCounterMetadata(
                    "Blocks whose write to a lower tier failed (skipped)."
                ),
                TIER_READ_FAILURES: OffloadingCounterMetadata(
                    "Blocks whose read from a lower tier failed its checks or the system "
                    "call (misses, dropped from the tier)."
                ),
                TIER_SKIPPED: OffloadingCounterMetadata(
                    "Lower-tier I/O skipped: no CPU slot for a promotion, the host pool "
                    "not mapped yet, the tier full of blocks in flight."
                ),
                TIER_READY_BLOCKS: OffloadingGaugeMetadata("Loadable blocks in the lower tiers."),
                TIER_LOADED: OffloadingCounterMetadata(
                    "Blocks promoted from the lower tiers (promotions that ended well)."
                ),
                TIER_RECOMPUTED_BY_CHOICE: OffloadingCounterMetadata(
                    "Lower-tier blocks recomputed because reading them was expected to be "
                    "slower (load or recompute)."
                ),
                TIER_RECOMPUTED_AFTER_DEADLINE: OffloadingCounterMetadata(
                    "Lower-tier blocks recomputed because their read overran its deadline."
                ),
            }
        )
    if store_threshold >= 2:
        definitions[STORES_SKIPPED] = OffloadingCounterMetadata(
            "Blocks not stored because store_threshold was not reached, as in vLLM's CPU spec."
        )
    return definitions


class _Calls(Protocol):
    """The raw calls of a request-scoped manager: the C core's methods, or
    :class:`_PythonCalls` over the Python manager. Keys are passed as vLLM gives them."""

    @property
    def last_store_size(self) -> int: ...

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult: ...

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> list[int]: ...

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None: ...

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None: ...

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> RawStore | None: ...

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None: ...

    def on_new_request(self, req_context: ReqContext) -> None: ...

    def on_request_finished(
        self, req_context: ReqContext, positions: Mapping[OffloadKey, int] | None
    ) -> None: ...

    def take_events(self) -> list[RawEvent]: ...

    def reset_cache(self, force: bool) -> None: ...


class _PythonCalls:
    """:class:`_Calls` over the Python manager (events through its sink)."""

    def __init__(self, manager: CPUOffloadingManager, events: list[RawEvent]) -> None:
        self._m = manager
        self._events = events

    @property
    def last_store_size(self) -> int:
        return self._m.last_store_size

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self._m.lookup(cast(OurOffloadKey, key))]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> list[int]:
        return list(self._m.prepare_load(_seq(keys), _ours(req_context)).block_ids)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._m.complete_load(_seq(keys))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._m.touch(_seq(keys), _ours(req_context))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> RawStore | None:
        out = self._m.prepare_store(_seq(keys), _ours(req_context))
        if out is None:
            return None
        return out.keys_to_store, list(out.store_spec.block_ids), out.evicted_keys

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._m.complete_store(_seq(keys), None, success=success)

    def on_new_request(self, req_context: ReqContext) -> None:
        self._m.on_new_request(_ours(req_context))

    def on_request_finished(
        self, req_context: ReqContext, positions: Mapping[OffloadKey, int] | None
    ) -> None:
        self._m.on_request_finished(_ours(req_context), cast(Any, positions))

    def take_events(self) -> list[RawEvent]:
        events = self._events[:]
        self._events.clear()
        return events

    def reset_cache(self, force: bool) -> None:
        self._m.reset_cache(force=force)


class AsyncOffloadManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over asyncoffload's CPU-tier manager.

    ``num_chunks`` slots; ``policy`` any registered cache policy (``lru``, ``arc``,
    ``kv``, ``s3fifo``, ``sieve``); ``admission`` / ``store_threshold`` as
    :class:`~asyncoffload.manager.CPUOffloadingManager`. Events are kept for
    :meth:`take_events` only when ``enable_events`` (vLLM drains them only when its KV
    events are on). Bad calls raise what the manager raises
    (:class:`~asyncoffload.UnknownKeyError`, ...) and change nothing.

    ``native`` picks the C core (:class:`~asyncoffload.manager.native.NativeManager`):
    ``True`` requires it (``ValueError`` for a configuration it does not run,
    ``RuntimeError`` where it cannot be built), ``False`` never uses it, ``None`` uses it
    where it can. The decisions are the same either way.

    ``pin_budget`` turns retention on (requests' ``kv_transfer_params``
    ``asyncoffload_retention``, see :mod:`asyncoffload.integrations.vllm.hints`), on the
    Python manager; ``None`` leaves it off and refuses hints, counted. ``quotas`` caps
    tenants (requests' ``cache_salt``, :meth:`expect_request`) at that many chunks each,
    on the Python manager too (:mod:`asyncoffload.manager.quotas`); a tenant's pinned
    chunks count in its quota and are never evicted for it.
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
        native: bool | None = None,
        tiers: Sequence[LowerTier] = (),
        host_pool: tuple[str | os.PathLike[str] | Sequence[str | os.PathLike[str]], int]
        | None = None,
        unlink_pools: bool = True,
        pin_budget: float | None = None,
        quotas: Mapping[str, int] | None = None,
    ) -> None:
        self.medium = Medium.CPU
        self.store_threshold = store_threshold
        self._enable_events = enable_events
        #: vLLM 0.33+'s LRU ranks a running request's blocks together; its failed stores
        #: are metadata-only removals (and 0.34's stored events carry the request).
        ranked = VLLM.ranked_lru and policy == "lru"
        self._v033_events = VLLM.metadata_only_events
        why_not = native_unsupported(policy, store_threshold, admission)
        if why_not is None and ranked:
            why_not = f"vLLM {VLLM.version}'s lru (request ranks) runs on the Python manager"
        if tiers:
            if host_pool is None:
                raise ValueError("lower tiers need host_pool=(path, slot_bytes)")
            why_not = why_not or "lower tiers run on the Python manager"
        if pin_budget is not None:
            why_not = why_not or "retention pins run on the Python manager"
        #: Requests' retention hints (kv_transfer_params), with pin_budget set.
        self.hints = RequestHints(pin_budget is not None)
        if quotas:
            why_not = why_not or "tenant quotas run on the Python manager"
        if native and why_not is not None:
            raise ValueError(why_not)
        if native and not native_manager_available():
            raise RuntimeError("the native manager core is unavailable (see the log)")
        self._manager: CPUOffloadingManager | NativeManager
        calls: _Calls
        if native is not False and why_not is None and native_manager_available():
            self._manager = NativeManager(
                num_chunks, policy, enable_events=enable_events, lookup_results=_VLLM_RESULTS
            )
            calls = self._manager.core
        else:
            events: list[RawEvent] = []
            self._manager = CPUOffloadingManager(
                num_chunks,
                RankedLRUPolicy(num_chunks) if ranked else policy,
                store_threshold,
                enable_events=enable_events,
                max_tracker_size=max_tracker_size,
                admission=admission,
                request_scoped=True,
                count_once_per_request=VLLM.count_once,
                event_sink=lambda keys, removed: events.append((list(keys), removed)),
                pin_budget=pin_budget if pin_budget is not None else DEFAULT_PIN_BUDGET,
                quotas=quotas,
            )
            calls = _PythonCalls(self._manager, events)
        self._calls = calls
        #: With vLLM 0.34's events: CPU-tier events already taken from the manager, in
        #: order, each as (keys, removed, the request whose store it reports or None,
        #: metadata-only: the freed slots of a failed store).
        self._cpu_events: list[tuple[list[OurOffloadKey], bool, ReqContext | None, bool]] = []
        # vLLM's hottest calls (lookup: once per key) go straight to the implementation.
        self.lookup = calls.lookup  # type: ignore[method-assign]
        self.touch = calls.touch  # type: ignore[method-assign]
        self.complete_load = calls.complete_load  # type: ignore[method-assign]
        if not (self._v033_events and enable_events):
            self.complete_store = calls.complete_store  # type: ignore[method-assign]
        self._allocation_sizes: list[int] = []
        #: Each new request's cache salt, from the connector (:meth:`expect_request`).
        self._salts: dict[str, str] = {}
        #: Blocks that opted-out requests did not store, under the native core.
        self._opted_native = 0
        self._reported = self._manager.stats()
        self._tiers: SchedulerTiers | None = None
        #: The current lookup walk: a request id and the keys it looked up, in order.
        self._walk: tuple[object, dict[OurOffloadKey, None]] = (None, {})
        #: Per request, the key whose run load-or-recompute declined last (counted).
        self._declined: dict[object, OurOffloadKey] = {}
        self._tier_reported: tuple[int, ...] = (0,) * 8
        if tiers:
            from asyncoffload.integrations.vllm.tiers import SchedulerTiers

            assert host_pool is not None and isinstance(self._manager, CPUOffloadingManager)
            paths, slot_bytes = host_pool
            self._tiers = SchedulerTiers(
                self._manager, tiers, paths, num_chunks, slot_bytes, unlink_pools=unlink_pools
            )
            # Every call first finishes the tier I/O that ended (see _tick).
            del self.lookup, self.touch, self.complete_load
            self.__dict__.pop("complete_store", None)

    @property
    def manager(self) -> CPUOffloadingManager | NativeManager:
        """The asyncoffload manager behind the adapter (inspect, do not mutate)."""
        return self._manager

    @property
    def tiers(self) -> SchedulerTiers | None:
        """The lower tiers, driven from here (None without tiers)."""
        return self._tiers

    def tier_stats(self) -> tuple[TierStats, ...]:
        """Each lower tier's contents and counters, highest first."""
        if self._tiers is None:
            return ()
        self._tick()
        return self._tiers.stats()

    def _tick(self) -> None:
        """With tiers: finish the I/O that ended, submit the promotions found by the
        lookups since the last call. Cheap when nothing is in flight."""
        tiers = self._tiers
        if tiers is not None:
            tiers.poll()
            tiers.flush()
            if not self._enable_events:
                tiers.take_events()  # nobody drains them

    @property
    def native(self) -> bool:
        """Whether the C core runs this manager."""
        return isinstance(self._manager, NativeManager)

    def __repr__(self) -> str:
        return f"<AsyncOffloadManager {self._manager!r}>"

    # --- requests ------------------------------------------------------------------

    def expect_request(self, req_id: str, cache_salt: str | None) -> None:
        """The connector saw request ``req_id`` arrive with ``cache_salt``: its tenant,
        which its ``on_new_request`` context carries from then on (vLLM's context has
        no salt). The salt already keeps its blocks apart (vLLM mixes it into the
        first block's hash); here it is what tenant quotas count."""
        if cache_salt:
            self._salts[req_id] = cache_salt

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._tick()
        _carry_tenancy(req_context, self._salts.pop(req_context.req_id, None))
        self.hints.start(self._manager, req_context)
        self._calls.on_new_request(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._tick()
        self._salts.pop(req_context.req_id, None)  # one whose on_new_request never came
        self._declined.pop(req_context.req_id, None)
        positions = getattr(req_context, "_offload_key_positions", None)
        self._calls.on_request_finished(req_context, positions or None)
        self.hints.end(self._manager, req_context)

    # --- lookups and loads ---------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        tiers = self._tiers
        if tiers is None:
            return self._calls.lookup(key, req_context)
        # Promotions found now are submitted together at the step's end (on_schedule_end)
        # or at the next other call.
        tiers.poll()
        result = self._calls.lookup(key, req_context)
        ours = cast(OurOffloadKey, key)
        if result is _PENDING and tiers.stalled(ours):
            return _MISS  # its read outlived its deadline: the core failed the promotion
        # The keys this request's lookup walk found so far: a promotion must not evict
        # them (vLLM looks a request's keys up one by one, in order).
        req_id = getattr(req_context, "req_id", None)
        walk = self._walk
        if walk[0] != req_id or ours in walk[1]:  # another request, or a new pass
            walk = self._walk = (req_id, {})
        if result is LookupResult.MISS:
            allow = _tier_filter(req_context)
            later = functools.partial(_later, ours, req_context, _LOOKAHEAD)
            # vLLM walks a request again each step while it waits (for GPU blocks): its
            # run declined is counted once (recomputed once).
            first = self._declined.get(req_id) != ours
            if not tiers.worth(ours, later, allow, count=first):
                self._declined[req_id] = ours
                return _MISS  # recomputing the run is expected to beat reading it
            protect = list(walk[1])
            if tiers.promote(ours, protect, allow, ctx=_tenant_ctx(req_context)):
                result = LookupResult.HIT_PENDING
                if not tiers.waits_for_slot(ours):  # no slot for it, none for later keys
                    self._promote_ahead(ours, req_context, protect, allow)
        walk[1][ours] = None
        return result

    def _promote_ahead(
        self,
        key: OurOffloadKey,
        req_context: ReqContext,
        protect: list[OurOffloadKey],
        allow: Callable[[TierState], bool] | None,
    ) -> None:
        """Lookahead: the request's keys after ``key`` (vLLM names every full block of a
        request with its position before it looks any up) that a lower tier holds are
        promoted with ``key``, in one read per tier at the step's end. vLLM stops a
        lookup walk at the first pending key and walks again next step, so without
        this a prefix of N blocks below the CPU tier would take N steps to come up.
        A lookahead promotion never evicts a key of the request (the CPU tier may be
        too small for its whole prefix: then fewer come up, as without lookahead).
        Stops at the first key that is in no tier (or not promotable: no CPU slot)."""
        tiers = self._tiers
        later = _later(key, req_context)
        if not later or tiers is None:
            return
        held = [*protect, key, *later]
        lookup = self._calls.lookup
        ctx = _tenant_ctx(req_context)
        for nxt in later[:_LOOKAHEAD]:
            missing = lookup(cast(OffloadKey, nxt), req_context) is LookupResult.MISS
            if missing and not tiers.promote(nxt, held, allow, ask=False, ctx=ctx):
                return

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        self._tick()
        return CPULoadStoreSpec(self._calls.prepare_load(keys, req_context))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._tick()
        self._calls.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._tick()
        self._calls.complete_load(keys, req_context)

    # --- stores --------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._tick()
        if self._tiers is not None:
            self._tiers.computed(len(keys))  # vLLM offers the chunks it just computed
        calls = self._calls
        opted_out = tenancy(req_context).no_store
        if opted_out and self.native:  # the C core knows no tenancy: nothing to store
            self._opted_native += sum(calls.lookup(k, req_context) is _MISS for k in keys)
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        out = calls.prepare_store(keys, req_context)
        size = calls.last_store_size
        if size:  # as vLLM's: every allocation asked for, refused or not
            self._allocation_sizes.append(size)
        if out is None:
            return None
        to_store, slots, evicted = out
        if self._tiers is not None and not opted_out:  # the keys held go down again
            self._tiers.reoffer(cast(list[OurOffloadKey], _seq(keys)), to_store)
        return PrepareStoreOutput(
            keys_to_store=cast(list[OffloadKey], to_store),
            store_spec=CPULoadStoreSpec(slots),
            evicted_keys=cast(list[OffloadKey], evicted),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._tick()
        calls = self._calls
        if self._v033_events and self._enable_events:
            # vLLM 0.33+: a failed store's freed slots are reported as a metadata-only
            # removal; 0.34: a stored event carries the request that stored it.
            pending = (
                [] if success else [k for k in keys if calls.lookup(k, req_context) is _PENDING]
            )
            self._keep_cpu_events(None)
            calls.complete_store(keys, req_context, success)
            self._keep_cpu_events(req_context)
            if pending:
                self._cpu_events.append((cast(list[OurOffloadKey], pending), True, None, True))
        else:
            calls.complete_store(keys, req_context, success)
        if success and self._tiers is not None:
            self._tiers.write_through(_seq(keys))

    def _keep_cpu_events(self, req_context: ReqContext | None) -> None:
        """Take the manager's events now, its stored ones as ``req_context``'s."""
        for keys, removed in self._calls.take_events():
            self._cpu_events.append((keys, removed, None if removed else req_context, False))

    # --- events, stats, lifecycle --------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._tick()
        if self._v033_events:
            events = self._cpu_events_v033()
        else:
            events = [
                OffloadingEvent(
                    keys=cast(list[OffloadKey], keys), medium=Medium.CPU, removed=removed
                )
                for keys, removed in self._calls.take_events()
            ]
        if self._tiers is not None:
            # Lower tiers publish their own removals (evictions, dropped blocks).
            events += [
                OffloadingEvent(
                    keys=cast(list[OffloadKey], keys),
                    medium=Medium.STORAGE,
                    removed=removed,
                    removal_expected=not removed,
                )
                for keys, removed in self._tiers.take_events()
            ]
        return events

    def _cpu_events_v033(self) -> list[OffloadingEvent]:
        """The CPU tier's events as vLLM 0.33+'s manager gives them: a failed store's
        keys come as a metadata-only removal (less the keys stored again since); on
        0.34 a stored event carries its request and says its removal will be
        published."""
        self._keep_cpu_events(None)
        taken, self._cpu_events = self._cpu_events, []
        events: list[OffloadingEvent] = []
        lookup = self._calls.lookup
        for keys, removed, ctx, metadata_only in taken:
            if metadata_only:
                # A store of the key since (a retry) owns it now: nothing to release.
                keys = [k for k in keys if lookup(cast(OffloadKey, k), _NO_REQUEST) is _MISS]
                if not keys:
                    continue
            extra: dict[str, Any] = {"metadata_only": metadata_only}
            if VLLM.event_request:
                extra.update(removal_expected=not removed, req_context=ctx)
            events.append(
                OffloadingEvent(
                    keys=cast(list[OffloadKey], keys), medium=Medium.CPU, removed=removed, **extra
                )
            )
        return events

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._tiers is not None:
            self._tiers.step_ended()  # times the step before: vLLM's prefill throughput
        self._tick()  # submits the promotions this step's lookups found

    def has_pending_work(self) -> bool:
        if self._tiers is None:
            return False
        self._tick()
        return self._tiers.pending()

    def reset_cache(self) -> None:
        # vLLM's scheduler fences every in-flight job and drops their completions. Tier
        # I/O reads and writes CPU slots: it ends first (the lower tiers keep their blocks).
        if self._tiers is not None:
            self._tiers.drain()
        self._calls.reset_cache(True)

    def shutdown(self) -> None:
        """Finish the tiers' I/O, close them (their lanes joined), unmap the host pool."""
        if self._tiers is not None:
            self._tiers.close()

    def get_stats(self) -> OffloadingConnectorStats:
        self._tick()
        now = self._manager.stats()
        if self._opted_native:
            now = now._replace(opted_out=self._opted_native)
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
        if self.store_threshold >= 2:
            stats.increase_counter(STORES_SKIPPED, now.store_skipped - before.store_skipped)
        self.hints.report(stats, self._manager, (PINNED_BLOCKS, PINS_REFUSED, PINS_EXPIRED))
        self._reported = now
        if self._tiers is not None:
            tier_stats = self._tiers.stats()
            totals = (
                sum(t.blocks_written for t in tier_stats),
                sum(t.blocks_read for t in tier_stats),
                sum(t.write_failures for t in tier_stats),
                sum(t.read_failures for t in tier_stats),
                sum(
                    n
                    for t in tier_stats
                    for cause, n in t.failures.items()
                    if cause in ("no_slot", "no_pool", "full")
                ),
                sum(t.loaded for t in tier_stats),
                sum(t.recomputed_by_choice for t in tier_stats),
                sum(t.recomputed_after_deadline for t in tier_stats),
            )
            names = (
                TIER_BLOCKS_WRITTEN,
                TIER_BLOCKS_READ,
                TIER_WRITE_FAILURES,
                TIER_READ_FAILURES,
                TIER_SKIPPED,
                TIER_LOADED,
                TIER_RECOMPUTED_BY_CHOICE,
                TIER_RECOMPUTED_AFTER_DEADLINE,
            )
            for name, value, was in zip(names, totals, self._tier_reported):
                if value - was:
                    stats.increase_counter(name, value - was)
            self._tier_reported = totals
            stats.set_gauge(TIER_READY_BLOCKS, sum(t.manager.ready for t in tier_stats))
        return stats

    def stats(self) -> ManagerStats:
        return self._manager.stats()


def _later(
    key: OurOffloadKey, req_context: ReqContext, most: int | None = None
) -> list[OurOffloadKey]:
    """The request's keys after ``key`` in its KV cache group, in order (vLLM names every
    full block of a request with its position before it looks any up), the first
    ``most`` of them; none without positions."""
    positions: Mapping[OurOffloadKey, int] | None = getattr(
        req_context, "_offload_key_positions", None
    )
    at = positions.get(key) if positions else None
    if positions is None or at is None:
        return []
    group = key[-4:]
    ranked = sorted((p, k) for k, p in positions.items() if p > at and k[-4:] == group)
    return [k for _, k in ranked[:most]]


def _tier_filter(req_context: ReqContext) -> Callable[[TierState], bool] | None:
    """The request's ``kv_load_tiers`` (vLLM's ``load_tier_filter``) as a test of our
    tiers, or None for every tier. A disk tier is vLLM's local storage, a shared tier
    (Redis / Valkey, Mooncake) remote storage; the CPU tier is always looked up, as in
    vLLM's own tiering."""
    flt = getattr(req_context, "load_tier_filter", None)
    if flt is None or flt is _ALL_TIERS:
        return None
    allows = flt.allows
    local = _LOCALITY.LOCAL if _LOCALITY is not None else None
    remote = _LOCALITY.REMOTE if _LOCALITY is not None else None

    def allow(tier: TierState) -> bool:
        where = local if tier.medium is OurMedium.DISK else remote
        return bool(allows(Medium.STORAGE, where))

    return allow


def _carry_tenancy(req_context: ReqContext, salt: str | None) -> None:
    """A new request's tenant (its cache salt) and opt-out (``kv_transfer_params``'
    :data:`~asyncoffload.manager.quotas.NO_STORE_KEY`), kept in its context's state,
    where the manager reads them (:func:`~asyncoffload.manager.quotas.tenancy`). A bad
    opt-out value is logged and opts the request out: never store what a caller may
    have asked not to be stored."""
    try:
        no_store = no_store_param(req_context.kv_transfer_params)
    except ValueError as exc:
        log.warning("asyncoffload: request %s: %s; it is not cached", req_context.req_id, exc)
        no_store = True
    set_state = getattr(req_context, "set_state", None)
    if (salt or no_store) and set_state is not None:
        set_state(Tenancy(salt or None, no_store))


def _tenant_ctx(req_context: ReqContext) -> OurReqContext | None:
    """Our context for a promotion of the request's blocks: its tenant, if it has one."""
    tenant = tenancy(req_context).tenant
    return None if tenant is None else OurReqContext(req_context.req_id, tenant=tenant)


def _ours(req_context: ReqContext) -> OurReqContext:
    # The manager reads only ``req_id`` of a context, which vLLM's has too.
    return cast(OurReqContext, req_context)


def _seq(keys: Collection[OffloadKey]) -> Any:
    """vLLM passes lists, and sets where order does not matter; the Python manager takes
    sequences (the C core takes any iterable)."""
    return keys if isinstance(keys, (list, tuple)) else list(keys)
