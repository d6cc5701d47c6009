"""vLLM's own CPU-manager scenarios, run on vLLM's manager and on ours through the adapter.

The scenarios are those of vLLM's manager tests for the 0.32 API (request-scoped recency
through ``on_request_finished``, ``LookupResult.HIT_PENDING``, ``num_chunks``), rewritten
here. Each test runs on both managers: vLLM's run shows the scenario states what vLLM
does, ours that :class:`AsyncOffloadManager` does the same. Where ours deliberately
differs, the test asserts each manager's own behaviour and says why.

Policy-independent scenarios (lookup states, pinning, events, failures, reset, stats)
also run on our policies vLLM lacks (``kv``, ``s3fifo``, ``sieve``). Ours runs on the
Python manager and, for the configurations it runs, on the C core (``native``). vLLM
0.32's connector never calls ``touch``, but both managers honour it, and vLLM's scenarios
use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import pytest
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from asyncoffload.errors import DuplicateKeyError
from asyncoffload.integrations.vllm.manager import AsyncOffloadManager
from asyncoffload.integrations.vllm.versions import installed_api
from asyncoffload.manager.native import (
    NATIVE_POLICIES,
    NativeManager,
    native_manager_available,
    native_unsupported,
)
from asyncoffload.manager.policies.arc import ARCPolicy

# These are vLLM 0.32's scenarios: vLLM 0.33 changed its LRU (a running request's blocks
# ranked together) and its failed-store events, and 0.34 the offer count; vLLM's own
# manager then fails some of them too. From 0.33 on, vLLM's own manager tests run
# against ours instead (tests/vllm_upstream, `make test-vllm`).
pytestmark = pytest.mark.skipif(
    installed_api().release != (0, 32),
    reason="vLLM 0.32's manager scenarios; vLLM 0.33+'s own tests run in tests/vllm_upstream",
)

# --- the two managers ------------------------------------------------------------------


class MakeManager(Protocol):
    def __call__(
        self,
        num_chunks: int = 4,
        policy: str = "lru",
        *,
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
    ) -> OffloadingManager: ...


def vllm_manager(
    num_chunks: int = 4,
    policy: str = "lru",
    *,
    enable_events: bool = False,
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
) -> OffloadingManager:
    return CPUOffloadingManager(
        num_chunks=num_chunks,
        cache_policy=policy,
        enable_events=enable_events,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
    )


def our_manager(
    num_chunks: int = 4,
    policy: str = "lru",
    *,
    enable_events: bool = False,
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
) -> OffloadingManager:
    manager: OffloadingManager = AsyncOffloadManager(
        num_chunks,
        policy,
        enable_events=enable_events,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
        native=False,
    )
    return manager


def our_native_manager(
    num_chunks: int = 4,
    policy: str = "lru",
    *,
    enable_events: bool = False,
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
) -> OffloadingManager:
    assert native_unsupported(policy, store_threshold) is None
    manager = AsyncOffloadManager(
        num_chunks,
        policy,
        enable_events=enable_events,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
        native=True,
    )
    assert manager.native
    return manager


def is_ours(manager: OffloadingManager) -> bool:
    return isinstance(manager, AsyncOffloadManager)


_NEEDS_CORE = pytest.mark.skipif(
    not native_manager_available(), reason="the native manager core cannot be built here"
)
_NATIVE = pytest.param(our_native_manager, id="asyncoffload-native", marks=_NEEDS_CORE)
BOTH = pytest.mark.parametrize(
    "make", [vllm_manager, our_manager, _NATIVE], ids=["vllm", "asyncoffload", None]
)
#: For store_threshold, which only the Python manager has.
VLLM_AND_PYTHON = pytest.mark.parametrize(
    "make", [vllm_manager, our_manager], ids=["vllm", "asyncoffload"]
)
LRU_ARC = pytest.mark.parametrize("policy", ["lru", "arc"])
#: vLLM's manager with its policies, ours with all of ours (in C where the core has them).
ANY_POLICY = pytest.mark.parametrize(
    ("make", "policy"),
    [pytest.param(vllm_manager, p, id=f"vllm-{p}") for p in ("lru", "arc")]
    + [
        pytest.param(our_manager, p, id=f"asyncoffload-{p}")
        for p in ("lru", "arc", "kv", "s3fifo", "sieve")
    ]
    + [
        pytest.param(our_native_manager, p, id=f"asyncoffload-native-{p}", marks=_NEEDS_CORE)
        for p in NATIVE_POLICIES
    ],
)

# --- helpers ---------------------------------------------------------------------------


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(str(i).encode(), group)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def req(req_id: str) -> ReqContext:
    return ReqContext(req_id=req_id)


def slots(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(i) for i in spec.block_ids]


class Store(NamedTuple):
    keys_to_store: list[OffloadKey]
    slots: list[int]
    evicted: list[OffloadKey]


def prepare(manager: OffloadingManager, offered: Sequence[OffloadKey], ctx: ReqContext) -> Store:
    out = manager.prepare_store(offered, ctx)
    assert out is not None
    return unpack(out)


def unpack(out: PrepareStoreOutput) -> Store:
    return Store(out.keys_to_store, slots(out.store_spec), out.evicted_keys)


def store(manager: OffloadingManager, offered: Sequence[OffloadKey], ctx: ReqContext) -> Store:
    """prepare_store then complete_store (success) of what it allocated."""
    out = prepare(manager, offered, ctx)
    manager.complete_store(out.keys_to_store, ctx)
    return out


def lookups(manager: OffloadingManager, ids: Sequence[int]) -> list[LookupResult]:
    probe = req("probe")
    return [manager.lookup(key(i), probe) for i in ids]


def events(manager: OffloadingManager) -> list[tuple[str, list[OffloadKey]]]:
    """take_events() as ("removed" / "stored", keys)."""
    out = []
    for event in manager.take_events():
        assert event.medium is Medium.CPU
        out.append(("removed" if event.removed else "stored", list(event.keys)))
    return out


def reduced(manager: OffloadingManager) -> dict[str, int | float]:
    stats = manager.get_stats()
    assert stats is not None
    return stats.reduce()


def usage(manager: OffloadingManager) -> tuple[float, float, float]:
    """(write, read, total) usage gauges."""
    values = reduced(manager)
    return (
        values[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC],
        values[CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC],
        values[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC],
    )


class ArcLists(NamedTuple):
    t1: list[OffloadKey]
    t2: list[OffloadKey]
    b1: list[OffloadKey]
    b2: list[OffloadKey]
    target: float


def arc_lists(manager: OffloadingManager) -> ArcLists:
    """ARC's lists, least recent first, and T1's target size, from either manager."""
    if isinstance(manager, AsyncOffloadManager):
        mine = manager.manager
        if isinstance(mine, NativeManager):
            state = mine.snapshot()
            t1, t2, b1, b2 = state["lists"]
            return ArcLists([e[0] for e in t1], [e[0] for e in t2], b1, b2, state["target_t1"])
        ours = mine.policy
        assert isinstance(ours, ARCPolicy)
        return ArcLists(
            [OffloadKey(k) for k in ours.t1],
            [OffloadKey(k) for k in ours.t2],
            [OffloadKey(k) for k in ours.b1],
            [OffloadKey(k) for k in ours.b2],
            ours.target_t1,
        )
    assert isinstance(manager, CPUOffloadingManager)
    theirs = manager._policy
    assert isinstance(theirs, ARCCachePolicy)
    return ArcLists(
        list(theirs.t1),
        list(theirs.t2),
        list(theirs.b1),
        list(theirs.b2),
        theirs.target_t1_size,
    )


# --- lookups, stores and loads (any policy) ----------------------------------------------


@ANY_POLICY
def test_store_takes_fresh_slots_in_offer_order(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    assert prepare(manager, keys(1, 2), req("r")) == Store(keys(1, 2), [0, 1], [])


@ANY_POLICY
def test_lookup_is_hit_pending_while_store_in_flight(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    prepare(manager, keys(1, 2), req("r"))
    assert lookups(manager, [1, 2]) == [LookupResult.HIT_PENDING] * 2


@ANY_POLICY
def test_lookup_is_hit_once_store_completes(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    store(manager, keys(1, 2), req("r"))
    assert lookups(manager, [1, 2, 3]) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


@ANY_POLICY
def test_store_skips_ready_keys(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    store(manager, keys(1, 2), req("a"))
    assert prepare(manager, keys(2, 3), req("b")) == Store(keys(3), [2], [])


@ANY_POLICY
def test_store_skips_key_already_in_flight(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    assert prepare(manager, keys(7), req("a")).keys_to_store == keys(7)
    assert prepare(manager, keys(7), req("b")) == Store([], [], [])
    assert lookups(manager, [7]) == [LookupResult.HIT_PENDING]
    manager.complete_store(keys(7), req("a"))
    assert lookups(manager, [7]) == [LookupResult.HIT]
    assert prepare(manager, keys(7), req("c")) == Store([], [], [])


@ANY_POLICY
def test_load_returns_slots_in_key_order(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    out = store(manager, keys(0, 1, 2), req("seed"))
    slot_of = dict(zip(out.keys_to_store, out.slots))
    ctx = req("load")
    for order in (keys(0, 1, 2), keys(1, 2, 0)):
        assert slots(manager.prepare_load(order, ctx)) == [slot_of[k] for k in order]
        manager.complete_load(order, ctx)


@ANY_POLICY
def test_store_is_refused_while_loads_pin_every_block(make: MakeManager, policy: str) -> None:
    manager = make(2, policy)
    store(manager, keys(1, 2), req("seed"))
    manager.prepare_load(keys(1, 2), req("load"))
    assert manager.prepare_store(keys(3), req("r")) is None
    assert lookups(manager, [1, 2, 3]) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


@ANY_POLICY
def test_complete_load_makes_blocks_evictable_again(make: MakeManager, policy: str) -> None:
    manager = make(2, policy)
    store(manager, keys(1, 2), req("seed"))
    manager.prepare_load(keys(1, 2), req("load"))
    manager.complete_load(keys(1, 2), req("load"))
    out = prepare(manager, keys(3), req("r"))
    assert out.keys_to_store == keys(3)
    assert len(out.evicted) == 1 and out.evicted[0] in keys(1, 2)


@ANY_POLICY
def test_block_loaded_twice_stays_pinned_until_both_loads_complete(
    make: MakeManager, policy: str
) -> None:
    manager = make(1, policy)
    store(manager, keys(1), req("seed"))
    manager.prepare_load(keys(1), req("a"))
    manager.prepare_load(keys(1), req("b"))
    manager.complete_load(keys(1), req("a"))
    assert manager.prepare_store(keys(2), req("r")) is None
    manager.complete_load(keys(1), req("b"))
    assert prepare(manager, keys(2), req("r")) == Store(keys(2), [0], keys(1))


@ANY_POLICY
def test_store_is_refused_when_offer_protects_every_evictable_block(
    make: MakeManager, policy: str
) -> None:
    manager = make(2, policy)
    store(manager, keys(1, 2), req("seed"))
    assert manager.prepare_store(keys(1, 2, 3), req("r")) is None
    assert lookups(manager, [1, 2, 3]) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


@ANY_POLICY
def test_failed_store_drops_only_keys_still_pending(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    store(manager, keys(7), req("a"))
    prepare(manager, keys(9), req("b"))
    manager.complete_store(keys(7, 9), req("b"), success=False)
    assert lookups(manager, [7, 9]) == [LookupResult.HIT, LookupResult.MISS]


@ANY_POLICY
def test_failed_store_frees_its_slots_last_freed_first(make: MakeManager, policy: str) -> None:
    manager = make(2, policy)
    prepare(manager, keys(1, 2), req("a"))
    manager.complete_store(keys(1, 2), req("a"), success=False)
    assert prepare(manager, keys(3, 4), req("b")) == Store(keys(3, 4), [1, 0], [])


@ANY_POLICY
def test_load_source_is_host(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    store(manager, keys(1), req("r"))
    assert manager.get_load_source(key(1), req("r")) is CacheHitSource.HOST


@ANY_POLICY
def test_new_request_offloads_chunk_by_chunk(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    assert manager.on_new_request(req("r")).policy is OffloadPolicy.CHUNK_LEVEL


# --- events (any policy) -------------------------------------------------------------------


@ANY_POLICY
def test_no_event_while_store_in_flight(make: MakeManager, policy: str) -> None:
    manager = make(4, policy, enable_events=True)
    prepare(manager, keys(1, 2), req("r"))
    assert events(manager) == []


@ANY_POLICY
def test_completed_store_publishes_one_stored_event(make: MakeManager, policy: str) -> None:
    manager = make(4, policy, enable_events=True)
    store(manager, keys(1, 2), req("r"))
    assert events(manager) == [("stored", keys(1, 2))]
    assert events(manager) == []


@ANY_POLICY
def test_stored_event_lists_only_keys_the_completion_made_ready(
    make: MakeManager, policy: str
) -> None:
    manager = make(4, policy, enable_events=True)
    store(manager, keys(7), req("a"))
    prepare(manager, keys(9), req("b"))
    events(manager)
    manager.complete_store(keys(7, 9), req("b"))
    assert events(manager) == [("stored", keys(9))]


@ANY_POLICY
def test_failed_store_publishes_nothing(make: MakeManager, policy: str) -> None:
    manager = make(4, policy, enable_events=True)
    prepare(manager, keys(1, 2), req("r"))
    manager.complete_store(keys(1, 2), req("r"), success=False)
    assert events(manager) == []


@ANY_POLICY
def test_eviction_is_published_before_the_store_that_reuses_it(
    make: MakeManager, policy: str
) -> None:
    manager = make(2, policy, enable_events=True)
    store(manager, keys(1, 2), req("a"))
    events(manager)
    out = store(manager, keys(3), req("b"))
    assert events(manager) == [("removed", out.evicted), ("stored", keys(3))]


@ANY_POLICY
def test_events_are_off_unless_enabled(make: MakeManager, policy: str) -> None:
    manager = make(2, policy)
    store(manager, keys(1, 2), req("a"))
    store(manager, keys(3), req("b"))
    assert events(manager) == []


# --- metrics (any policy) ------------------------------------------------------------------


@ANY_POLICY
def test_stores_in_flight_count_as_write_usage(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    prepare(manager, keys(1, 2), req("r"))
    assert usage(manager) == pytest.approx((0.5, 0.0, 0.5))
    manager.complete_store(keys(1, 2), req("r"))
    assert usage(manager) == pytest.approx((0.0, 0.0, 0.0))


@ANY_POLICY
def test_pinned_blocks_count_as_read_usage(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    store(manager, keys(1, 2), req("seed"))
    manager.prepare_load(keys(1), req("load"))
    assert usage(manager) == pytest.approx((0.0, 0.25, 0.25))
    manager.complete_load(keys(1), req("load"))
    assert usage(manager) == pytest.approx((0.0, 0.0, 0.0))


@ANY_POLICY
def test_write_and_read_usage_add_up(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    store(manager, keys(1, 2), req("seed"))
    prepare(manager, keys(3, 4), req("r"))
    manager.prepare_load(keys(2), req("load"))
    assert usage(manager) == pytest.approx((0.5, 0.25, 0.75))


@ANY_POLICY
def test_failed_store_clears_write_usage(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    prepare(manager, keys(1, 2), req("r"))
    manager.complete_store(keys(1, 2), req("r"), success=False)
    assert usage(manager) == pytest.approx((0.0, 0.0, 0.0))


@ANY_POLICY
def test_allocation_size_histogram_observes_each_allocating_store(
    make: MakeManager, policy: str
) -> None:
    manager = make(4, policy)
    store(manager, keys(1, 2), req("a"))
    prepare(manager, keys(1, 2, 3), req("b"))
    name = CPUOffloadingMetrics.CPU_ALLOCATION_SIZE
    values = reduced(manager)
    assert (values[f"{name}_count"], values[f"{name}_sum"]) == (2, 3)
    assert f"{name}_count" not in reduced(manager)  # samples are reported once


@ANY_POLICY
def test_allocation_size_histogram_observes_a_refused_store(make: MakeManager, policy: str) -> None:
    # vLLM records the allocation it attempted even when prepare_store returns None.
    manager = make(1, policy)
    prepare(manager, keys(1), req("a"))
    reduced(manager)
    assert manager.prepare_store(keys(2), req("b")) is None
    name = CPUOffloadingMetrics.CPU_ALLOCATION_SIZE
    values = reduced(manager)
    assert (values.get(f"{name}_count"), values.get(f"{name}_sum")) == (1, 1)


@VLLM_AND_PYTHON
def test_stores_skipped_counter_reports_threshold_skips_once(make: MakeManager) -> None:
    manager = make(4, store_threshold=2)
    assert prepare(manager, keys(1, 2, 3), req("r")) == Store([], [], [])
    assert reduced(manager)[CPUOffloadingMetrics.STORES_SKIPPED] == 3
    assert reduced(manager)[CPUOffloadingMetrics.STORES_SKIPPED] == 0


@VLLM_AND_PYTHON
def test_stats_report_vllms_cpu_metrics(make: MakeManager) -> None:
    manager = make(4, store_threshold=2)
    store(manager, keys(1), req("r"))
    names = set(reduced(manager))
    cpu_metrics = {
        CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC,
        CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC,
        CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC,
        CPUOffloadingMetrics.STORES_SKIPPED,
    }
    if is_ours(manager):
        # Deliberate: ours adds its own counters and gauges, all under vllm:asyncoffload_.
        assert cpu_metrics < names
        assert all(n.startswith("vllm:asyncoffload_") for n in names - cpu_metrics)
    else:
        assert names == cpu_metrics


@BOTH
def test_zero_capacity(make: MakeManager) -> None:
    if make is not vllm_manager:
        # Ours refuses a tier without a slot (AsyncOffloadSpec refuses num_chunks <= 0 too).
        with pytest.raises(ValueError, match="num_blocks"):
            make(0)
        return
    manager = make(0)
    assert usage(manager) == (0.0, 0.0, 0.0)
    assert manager.prepare_store(keys(1), req("r")) is None


# --- duplicate keys ------------------------------------------------------------------------


@BOTH
def test_key_listed_twice_in_one_store(make: MakeManager) -> None:
    manager = make(4)
    if is_ours(manager):
        # Deliberate: ours rejects the call and changes nothing.
        with pytest.raises(DuplicateKeyError):
            manager.prepare_store(keys(1, 1), req("r"))
        assert lookups(manager, [1]) == [LookupResult.MISS]
        assert usage(manager) == (0.0, 0.0, 0.0)
    else:
        # vLLM allocates the key twice (its first slot leaks).
        assert prepare(manager, keys(1, 1), req("r")) == Store(keys(1, 1), [0, 1], [])


@BOTH
def test_key_listed_twice_in_one_load(make: MakeManager) -> None:
    manager = make(4)
    store(manager, keys(1), req("seed"))
    if is_ours(manager):
        # Deliberate: ours rejects the call and pins nothing.
        with pytest.raises(DuplicateKeyError):
            manager.prepare_load(keys(1, 1), req("r"))
        assert usage(manager) == (0.0, 0.0, 0.0)
    else:
        # vLLM pins the block twice.
        assert slots(manager.prepare_load(keys(1, 1), req("r"))) == [0, 0]
        assert usage(manager) == pytest.approx((0.0, 0.25, 0.25))


# --- reset_cache (any policy) --------------------------------------------------------------


@ANY_POLICY
def test_reset_cache_drops_every_block(make: MakeManager, policy: str) -> None:
    manager = make(4, policy)
    store(manager, keys(1, 2), req("a"))
    prepare(manager, keys(3), req("b"))
    manager.prepare_load(keys(1), req("c"))
    manager.reset_cache()
    assert lookups(manager, [1, 2, 3]) == [LookupResult.MISS] * 3
    assert usage(manager) == (0.0, 0.0, 0.0)
    assert prepare(manager, keys(4), req("d")) == Store(keys(4), [0], [])


@ANY_POLICY
def test_reset_cache_events(make: MakeManager, policy: str) -> None:
    manager = make(4, policy, enable_events=True)
    store(manager, keys(1, 2), req("a"))
    prepare(manager, keys(3), req("b"))
    events(manager)
    manager.reset_cache()
    if is_ours(manager):
        # Deliberate: ours reports the ready blocks it dropped (the in-flight one was
        # never published), so event consumers do not keep stale blocks.
        assert events(manager) == [("removed", keys(1, 2))]
    else:
        assert events(manager) == []


@BOTH
def test_reset_cache_forgets_what_requests_did_before(make: MakeManager) -> None:
    manager = make(1, "arc")
    resumed, replacement = req("resumed"), req("replacement")
    store(manager, keys(1), resumed)
    manager.reset_cache()
    store(manager, keys(1), replacement)
    manager.on_request_finished(replacement)
    assert arc_lists(manager).t1 == keys(1)
    # The store before the reset no longer makes this load an insertion: it is a reuse.
    manager.prepare_load(keys(1), resumed)
    manager.complete_load(keys(1), resumed)
    manager.on_request_finished(resumed)
    assert arc_lists(manager).t2 == keys(1)


# --- LRU eviction order ----------------------------------------------------------------------


def lru_after_load(make: MakeManager) -> OffloadingManager:
    """vLLM's LRU walk-through up to a request that loaded [2, 3]: 4 slots, [1, 2]
    stored, then [2, 3, 4, 5] (evicting 1), then request "load" reads [2, 3] and ends.
    Recency, oldest first: 4, 5, 3, 2; slots 2: 1, 3: 2, 4: 3, 5: 0."""
    manager = make(4, "lru", enable_events=True)
    anon = req("")
    store(manager, keys(1, 2), anon)
    store(manager, keys(2, 3, 4, 5), anon)
    load = req("load")
    manager.prepare_load(keys(2, 3), load)
    manager.complete_load(keys(2, 3), load)
    manager.on_request_finished(load)
    return manager


@BOTH
def test_lru_store_evicts_oldest_and_reuses_its_slot(make: MakeManager) -> None:
    manager = make(4, "lru", enable_events=True)
    store(manager, keys(1, 2), req("a"))
    events(manager)
    assert prepare(manager, keys(2, 3, 4, 5), req("b")) == Store(keys(3, 4, 5), [2, 3, 0], keys(1))
    assert events(manager) == [("removed", keys(1))]


@BOTH
def test_lru_store_is_refused_while_other_blocks_are_being_written(make: MakeManager) -> None:
    manager = make(4, "lru")
    store(manager, keys(1, 2), req("a"))
    prepare(manager, keys(2, 3, 4, 5), req("b"))
    # 3, 4 and 5 are being written: only 2 is evictable, and 1 and 6 need two slots.
    assert manager.prepare_store(keys(1, 6), req("c")) is None


@BOTH
def test_lru_pinned_blocks_refuse_a_store_that_needs_them(make: MakeManager) -> None:
    manager = make(4, "lru")
    anon = req("")
    store(manager, keys(1, 2), anon)
    store(manager, keys(2, 3, 4, 5), anon)
    manager.prepare_load(keys(2, 3), req("load"))
    assert manager.prepare_store(keys(6, 7, 8), req("r")) is None


@BOTH
def test_lru_request_that_loaded_blocks_makes_them_recent_head_last(make: MakeManager) -> None:
    manager = lru_after_load(make)
    # Of the loaded prefix [2, 3] the tail goes before the head.
    assert prepare(manager, keys(6, 7, 8), req("r")) == Store(
        keys(6, 7, 8), [2, 0, 3], keys(4, 5, 3)
    )


@BOTH
def test_lru_touch_makes_blocks_recent_first_key_last(make: MakeManager) -> None:
    manager = lru_after_load(make)
    store(manager, keys(6, 7, 8), req("r"))
    manager.touch(keys(2, 6, 7), req("r"))
    assert prepare(manager, keys(9), req("s")) == Store(keys(9), [3], keys(8))


@BOTH
def test_lru_walkthrough_publishes_stores_and_evictions(make: MakeManager) -> None:
    manager = lru_after_load(make)
    store(manager, keys(6, 7, 8), req("r"))
    manager.touch(keys(2, 6, 7), req("r"))
    prepare(manager, keys(9), req("s"))
    manager.complete_store(keys(7, 9), req("s"), success=False)  # 9's store is not published
    assert events(manager) == [
        ("stored", keys(1, 2)),
        ("removed", keys(1)),
        ("stored", keys(3, 4, 5)),
        ("removed", keys(4, 5, 3)),
        ("stored", keys(6, 7, 8)),
        ("removed", keys(8)),
    ]


@BOTH
@LRU_ARC
@pytest.mark.parametrize("recency", ["touch", "request"])
def test_ready_key_in_the_offer_is_never_its_victim(
    make: MakeManager, policy: str, recency: str
) -> None:
    manager = make(4, policy)
    store(manager, keys(1, 2), req("seed"))
    # Make 1 more recent (and, for ARC, frequent) than 2, so 2 is the natural victim.
    if recency == "touch":
        manager.touch(keys(1), req("seed"))
    else:
        reader = req("reader")
        manager.prepare_load(keys(1), reader)
        manager.complete_load(keys(1), reader)
        manager.on_request_finished(reader)
    assert prepare(manager, keys(2, 3, 4, 5), req("r")) == Store(keys(3, 4, 5), [2, 3, 0], keys(1))
    manager.complete_store(keys(2, 3, 4, 5), req("r"))
    assert lookups(manager, [2]) == [LookupResult.HIT]


@BOTH
@pytest.mark.parametrize("finish_first", [False, True], ids=["complete-first", "finish-first"])
def test_lru_stored_prefix_is_cut_from_its_tail_whatever_completes_first(
    make: MakeManager, finish_first: bool
) -> None:
    manager = make(4, "lru")
    prefix, ctx = keys(1, 2, 3, 4), req("prefix")
    prepare(manager, prefix, ctx)
    if finish_first:
        manager.on_request_finished(ctx)
    manager.complete_store(set(prefix), ctx)  # vLLM completes with a set
    if not finish_first:
        manager.on_request_finished(ctx)
    assert prepare(manager, keys(5), req("evict")).evicted == keys(4)


@BOTH
@pytest.mark.parametrize("finish_first", [False, True], ids=["complete-first", "finish-first"])
def test_lru_loaded_prefix_is_cut_from_its_tail_whatever_completes_first(
    make: MakeManager, finish_first: bool
) -> None:
    manager = make(4, "lru")
    prefix = keys(1, 2, 3, 4)
    store(manager, prefix, req("seed"))
    reuse = req("reuse")
    manager.prepare_load(prefix, reuse)
    if finish_first:
        manager.on_request_finished(reuse)
    manager.complete_load(set(prefix), reuse)
    if not finish_first:
        manager.on_request_finished(reuse)
    assert prepare(manager, keys(5), req("evict")).evicted == keys(4)


@BOTH
def test_lru_late_completion_keeps_an_older_request_older(make: MakeManager) -> None:
    manager = make(4, "lru")
    old, new = req("old"), req("new")
    prepare(manager, keys(1, 2), old)
    manager.on_request_finished(old)
    store(manager, keys(3, 4), new)
    manager.on_request_finished(new)
    manager.complete_store(keys(1, 2), old)
    assert prepare(manager, keys(5), req("evict")).evicted == keys(2)


@BOTH
def test_lru_refused_store_still_counts_as_the_requests_access(make: MakeManager) -> None:
    manager = make(2, "lru")
    store(manager, keys(1), req("seed-1"))
    store(manager, keys(3), req("seed-3"))  # recency, oldest first: 1, 3
    manager.prepare_load(keys(3), req("pin"))
    ctx = req("refused")
    # 2 needs a slot: 3 is pinned, 1 is in the offer.
    assert manager.prepare_store(keys(2, 1), ctx) is None
    manager.on_request_finished(ctx)  # 1 was used: it becomes the most recent
    manager.complete_load(keys(3), req("pin"))
    assert prepare(manager, keys(4), req("evict")).evicted == keys(3)


@BOTH
def test_lru_key_positions_order_a_request_whose_stores_came_tail_first(
    make: MakeManager,
) -> None:
    manager = make(2, "lru")
    head, tail = keys(1, 2)
    ctx = req("backfill")
    ctx.set_offload_key_position(head, 16)
    ctx.set_offload_key_position(tail, 32)
    prepare(manager, [tail], ctx)
    prepare(manager, [head], ctx)
    manager.on_request_finished(ctx)
    manager.complete_store([head, tail], ctx)
    assert prepare(manager, keys(3), req("evict")).evicted == [tail]


@BOTH
def test_lru_request_orders_kv_groups_by_group_index(make: MakeManager) -> None:
    manager = make(4, "lru")
    existing, g0_new = key(10, 0), key(11, 0)
    g1_head, g1_tail = key(20, 1), key(21, 1)
    store(manager, [existing], req("seed"))
    ctx = req("grouped")
    # Group 1 is seen first; later offers repeat keys and extend group 1.
    prepare(manager, [g1_head, existing, g0_new], ctx)
    prepare(manager, [g0_new, g1_head, g1_tail], ctx)
    manager.complete_store([g1_head, g0_new, g1_tail], ctx)
    manager.on_request_finished(ctx)
    # Head to tail: group 0 (existing, g0_new), then group 1 (g1_head, g1_tail).
    assert prepare(manager, keys(1, 2), req("evict")).evicted == [g1_tail, g1_head]


@BOTH
def test_lru_key_positions_order_tails_across_kv_groups(make: MakeManager) -> None:
    manager = make(4, "lru")
    g0_head, g0_tail = key(1, 0), key(2, 0)
    g1_head, g1_tail = key(1, 1), key(2, 1)
    ctx = req("hybrid")
    for k in (g0_head, g1_head):
        ctx.set_offload_key_position(k, 16)
    for k in (g0_tail, g1_tail):
        ctx.set_offload_key_position(k, 32)
    store(manager, [g0_head, g0_tail, g1_head, g1_tail], ctx)
    manager.on_request_finished(ctx)
    assert set(prepare(manager, keys(10, 11), req("evict")).evicted) == {g0_tail, g1_tail}


@BOTH
@LRU_ARC
def test_lookups_leave_recency_alone(make: MakeManager, policy: str) -> None:
    manager = make(2, policy)
    store(manager, keys(1, 2), req("seed"))
    assert lookups(manager, [1, 1, 2, 1]) == [LookupResult.HIT] * 4
    assert prepare(manager, keys(3), req("r")).evicted == keys(1)


@BOTH
def test_lru_refused_eviction_evicts_nothing(make: MakeManager) -> None:
    manager = make(4, "lru", enable_events=True)
    store(manager, keys(1, 2, 3, 4), req("seed"))
    events(manager)
    # Two slots needed; only 1 is evictable outside the offer.
    assert manager.prepare_store(keys(2, 3, 4, 5, 6), req("r")) is None
    assert events(manager) == []
    assert lookups(manager, [1, 2, 3, 4]) == [LookupResult.HIT] * 4
    assert prepare(manager, keys(5), req("s")) == Store(keys(5), [0], keys(1))


@BOTH
def test_lru_block_stays_evictable_after_many_load_cycles(make: MakeManager) -> None:
    manager = make(1, "lru")
    store(manager, keys(1), req("seed"))
    for _ in range(128):
        manager.prepare_load(keys(1), req("r"))
        manager.complete_load(keys(1), req("r"))
    assert prepare(manager, keys(2), req("s")) == Store(keys(2), [0], keys(1))


@BOTH
def test_lru_request_finished_twice_counts_once(make: MakeManager) -> None:
    manager = make(2, "lru")
    store(manager, keys(1, 2), req("seed"))
    first, second = req("first"), req("second")
    for ctx, k in ((first, 1), (second, 2)):
        manager.prepare_load(keys(k), ctx)
        manager.complete_load(keys(k), ctx)
        manager.on_request_finished(ctx)
    manager.on_request_finished(first)  # ignored: 1 stays older than 2
    assert prepare(manager, keys(3), req("evict")).evicted == keys(1)


# --- ARC -----------------------------------------------------------------------------------


@BOTH
def test_arc_stores_enter_t1(make: MakeManager) -> None:
    manager = make(4, "arc")
    store(manager, keys(1, 2), req("r"))
    assert arc_lists(manager)[:2] == (keys(1, 2), [])


@BOTH
def test_arc_touch_moves_a_ready_block_to_t2(make: MakeManager) -> None:
    manager = make(4, "arc")
    store(manager, keys(1), req("r"))
    manager.touch(keys(1), req("r"))
    assert arc_lists(manager)[:2] == ([], keys(1))


@BOTH
def test_arc_touch_of_a_block_being_written_keeps_it_in_t1(make: MakeManager) -> None:
    manager = make(4, "arc")
    prepare(manager, keys(1, 2), req("r"))
    manager.touch(keys(1), req("r"))
    assert arc_lists(manager)[:2] == (keys(2, 1), [])


@BOTH
def test_arc_request_reuse_promotes_once_and_own_stores_stay_in_t1(make: MakeManager) -> None:
    manager = make(4, "arc")
    prefix = keys(1, 2, 3, 4)
    seed = req("seed")
    store(manager, prefix, seed)
    # Offering again, or reading back what the request itself stored, is no reuse.
    prepare(manager, prefix, seed)
    manager.prepare_load(prefix, seed)
    manager.complete_load(prefix, seed)
    manager.on_request_finished(seed)
    assert arc_lists(manager)[:2] == (keys(4, 3, 2, 1), [])
    reuse = req("reuse")
    for _ in range(2):  # a second read by the same request counts once
        manager.prepare_load(prefix, reuse)
        manager.complete_load(prefix, reuse)
    manager.on_request_finished(reuse)
    assert arc_lists(manager)[:2] == ([], keys(4, 3, 2, 1))


@BOTH
def test_arc_reuse_wins_when_the_request_later_stores_the_key_again(make: MakeManager) -> None:
    manager = make(1, "arc")
    seed = req("seed")
    store(manager, keys(1), seed)
    manager.on_request_finished(seed)
    ctx = req("reuse-then-store")
    manager.prepare_load(keys(1), ctx)
    manager.complete_load(keys(1), ctx)
    other = req("other")
    store(manager, keys(2), other)  # evicts 1
    manager.on_request_finished(other)
    store(manager, keys(1), ctx)
    manager.on_request_finished(ctx)
    assert arc_lists(manager)[:2] == ([], keys(1))


@BOTH
def test_arc_offer_of_a_block_being_written_is_no_reuse(make: MakeManager) -> None:
    manager = make(2, "arc")
    prepare(manager, keys(1), req("writer"))
    observer = req("observer")
    assert prepare(manager, keys(1), observer) == Store([], [], [])
    manager.on_request_finished(observer)
    assert arc_lists(manager)[:2] == (keys(1), [])


@BOTH
def test_arc_evicts_t1_lru_while_t1_reaches_its_target(make: MakeManager) -> None:
    manager = make(4, "arc")
    store(manager, keys(1, 2, 3, 4), req("r"))
    manager.touch(keys(3, 4), req("r"))
    assert arc_lists(manager)[:2] == (keys(1, 2), keys(4, 3))
    assert store(manager, keys(5), req("s")).evicted == keys(1)
    lists = arc_lists(manager)
    assert key(1) in lists.b1 and key(5) in lists.t1


@BOTH
def test_arc_touch_moves_t2_blocks_to_its_recent_end(make: MakeManager) -> None:
    manager = make(4, "arc")
    store(manager, keys(1, 2, 3, 4), req("r"))
    manager.touch(keys(3, 4), req("r"))
    manager.touch(keys(1, 3, 4), req("r"))
    assert arc_lists(manager)[:2] == (keys(2), keys(4, 3, 1))
    assert prepare(manager, keys(5), req("s")) == Store(keys(5), [1], keys(2))


@BOTH
def test_arc_touch_of_a_b1_ghost_raises_t1_target(make: MakeManager) -> None:
    manager = make(2, "arc")
    store(manager, keys(1, 2), req("r"))
    store(manager, keys(3), req("r"))  # evicts 1 into B1
    assert arc_lists(manager).b1 == keys(1)
    manager.touch(keys(1), req("r"))
    assert arc_lists(manager).target == 1


@BOTH
def test_arc_touch_of_a_b2_ghost_lowers_t1_target(make: MakeManager) -> None:
    manager = make(2, "arc")
    store(manager, keys(1, 2), req("r"))
    manager.touch(keys(1, 2), req("r"))  # T2: 2, 1
    store(manager, keys(3), req("r"))  # T1 is empty: evicts 2 from T2 into B2
    store(manager, keys(4), req("r"))  # evicts 3 from T1 into B1
    assert arc_lists(manager) == ArcLists(keys(4), keys(1), keys(3), keys(2), 0)
    manager.touch(keys(3), req("r"))
    assert arc_lists(manager).target == 1
    manager.touch(keys(2), req("r"))
    assert arc_lists(manager).target == 0


@BOTH
def test_arc_store_miss_of_a_ghost_adapts_once_per_request(make: MakeManager) -> None:
    manager = make(2, "arc")
    seed = req("seed")
    store(manager, keys(1, 2), seed)
    manager.on_request_finished(seed)
    evict = req("make-ghost")
    [ghost] = store(manager, keys(3), evict).evicted
    manager.on_request_finished(evict)
    assert arc_lists(manager).b1 == [ghost]
    residents = [k for k in keys(1, 2, 3) if k != ghost]
    manager.prepare_load(residents, req("pin"))
    ctx = req("ghost-hit")
    assert manager.prepare_store([ghost], ctx) is None  # refused, yet the policy learned
    assert arc_lists(manager).target == 1
    assert manager.prepare_store([ghost], ctx) is None
    assert arc_lists(manager).target == 1
    manager.complete_load(residents, req("pin"))
    store(manager, [ghost], ctx)
    manager.on_request_finished(ctx)
    lists = arc_lists(manager)
    assert lists.target == 1
    assert ghost in lists.t1 and ghost not in lists.t2


@BOTH
@pytest.mark.parametrize(
    ("pinned", "protected", "new", "evicted"),
    [
        ([], [], [7, 8, 9], [6, 5, 3]),
        ([], [], [7, 8, 9, 10], [6, 5, 3, 4]),
        ([5, 6], [], [7, 8], [3, 4]),
        ([], [5, 6], [7, 8], [3, 4]),
        ([5, 6], [3], [7], [4]),
        ([5, 6], [3], [7, 8], None),
    ],
)
def test_arc_prefers_t2_below_target_and_falls_back_to_t1(
    make: MakeManager,
    pinned: list[int],
    protected: list[int],
    new: list[int],
    evicted: list[int] | None,
) -> None:
    manager = make(4, "arc")
    store(manager, keys(1, 2, 3, 4), req("r"))
    store(manager, keys(5, 6), req("r"))  # evicts 1, 2 into B1
    manager.touch(keys(1, 2), req("r"))  # two B1 hits: target 2
    manager.touch(keys(1), req("r"))  # target 3
    manager.touch(keys(5, 6), req("r"))
    before = arc_lists(manager)
    assert before == ArcLists(keys(3, 4), keys(6, 5), keys(2, 1), [], 3)
    manager.prepare_load(keys(*pinned), req("pin"))
    out = manager.prepare_store(keys(*protected, *new), req("s"))
    if evicted is None:
        assert out is None
        assert arc_lists(manager) == before  # a refused eviction changes nothing
    else:
        assert out is not None
        got = unpack(out)
        assert (got.keys_to_store, got.evicted) == (keys(*new), keys(*evicted))
        manager.complete_store(keys(*new), req("s"))
    manager.complete_load(keys(*pinned), req("pin"))


@BOTH
def test_arc_pinned_blocks_refuse_a_store_until_their_load_completes(make: MakeManager) -> None:
    manager = make(4, "arc")
    assert store(manager, keys(1, 2, 3, 4), req("r")) == Store(keys(1, 2, 3, 4), [0, 1, 2, 3], [])
    assert slots(manager.prepare_load(keys(2, 3), req("load"))) == [1, 2]
    assert manager.prepare_store(keys(5, 6, 7), req("s")) is None
    manager.complete_load(keys(2, 3), req("load"))
    assert prepare(manager, keys(5, 6, 7), req("s")).evicted == keys(1, 2, 3)


@BOTH
def test_arc_failed_store_leaves_no_entry_and_keeps_the_victims_ghost(make: MakeManager) -> None:
    manager = make(4, "arc")
    store(manager, keys(1, 2, 3, 4), req("r"))
    [victim] = prepare(manager, keys(5), req("s")).evicted
    manager.complete_store(keys(5), req("s"), success=False)
    lists = arc_lists(manager)
    assert key(5) not in lists.t1 + lists.t2
    assert victim in lists.b1
    assert lookups(manager, [5]) == [LookupResult.MISS]


@BOTH
def test_arc_ghost_lists_stay_within_capacity(make: MakeManager) -> None:
    manager = make(2, "arc")
    store(manager, keys(1, 2), req("r"))
    for i in range(3, 20):
        store(manager, keys(i), req("r"))
    lists = arc_lists(manager)
    assert lists.b1 == keys(16, 17) and lists.b2 == []


@BOTH
def test_arc_full_walkthrough_keeps_t2_blocks(make: MakeManager) -> None:
    manager = make(4, "arc", enable_events=True)
    store(manager, keys(1, 2), req("r"))
    assert store(manager, keys(3, 4, 5), req("r")).evicted == keys(1)
    manager.touch(keys(2, 3), req("r"))
    assert arc_lists(manager)[:2] == (keys(4, 5), keys(3, 2))
    assert store(manager, keys(6), req("r")).evicted == keys(4)
    assert lookups(manager, [2, 3]) == [LookupResult.HIT] * 2
    assert events(manager) == [
        ("stored", keys(1, 2)),
        ("removed", keys(1)),
        ("stored", keys(3, 4, 5)),
        ("removed", keys(4)),
        ("stored", keys(6)),
    ]


# --- store_threshold -----------------------------------------------------------------------


@VLLM_AND_PYTHON
def test_store_threshold_stores_a_key_at_its_nth_offer(make: MakeManager) -> None:
    manager = make(4, store_threshold=2)
    assert prepare(manager, keys(1, 2), req("a")).keys_to_store == []
    assert prepare(manager, keys(1, 2), req("b")).keys_to_store == keys(1, 2)


@VLLM_AND_PYTHON
def test_store_threshold_ignores_lookups(make: MakeManager) -> None:
    manager = make(4, store_threshold=2)
    assert lookups(manager, [1, 1]) == [LookupResult.MISS] * 2
    assert prepare(manager, keys(1), req("a")).keys_to_store == []


@VLLM_AND_PYTHON
def test_store_threshold_tracker_forgets_its_oldest_key(make: MakeManager) -> None:
    manager = make(4, store_threshold=2, max_tracker_size=2)
    for i in (1, 2, 3):  # 3 pushes 1 out of the tracker
        assert prepare(manager, keys(i), req("a")).keys_to_store == []
    assert prepare(manager, keys(1), req("b")).keys_to_store == []
    assert prepare(manager, keys(1), req("c")).keys_to_store == keys(1)


@VLLM_AND_PYTHON
def test_store_threshold_offer_larger_than_the_tracker_makes_progress(make: MakeManager) -> None:
    manager = make(4, store_threshold=2, max_tracker_size=3)
    wanted = keys(1, 2, 3, 4)
    stored: list[OffloadKey] = []
    for _ in range(4):
        stored += store(manager, [k for k in wanted if k not in stored], req("r")).keys_to_store
    assert sorted(stored) == sorted(wanted)


@VLLM_AND_PYTHON
def test_store_threshold_does_not_hide_reuse_of_a_ready_block(make: MakeManager) -> None:
    manager = make(2, store_threshold=2, max_tracker_size=2)
    head, tail, noise_1, noise_2, replacement = keys(0, 1, 2, 3, 4)
    seed = req("seed")
    assert prepare(manager, [head, tail], seed).keys_to_store == []
    assert store(manager, [head, tail], seed).keys_to_store == [head, tail]
    manager.on_request_finished(seed)
    # The noise ages head and tail out of vLLM's tracker (ours dropped them on admission).
    assert prepare(manager, [noise_1, noise_2], req("noise")).keys_to_store == []
    reduced(manager)
    reuse = req("reuse")
    assert prepare(manager, [tail], reuse) == Store([], [], [])
    assert reduced(manager)[CPUOffloadingMetrics.STORES_SKIPPED] == 0  # a reuse, no skip
    manager.on_request_finished(reuse)  # tail is now more recent than head
    other = req("replacement")
    assert prepare(manager, [replacement], other).keys_to_store == []
    assert prepare(manager, [replacement], other).evicted == [head]


@VLLM_AND_PYTHON
def test_store_threshold_after_eviction(make: MakeManager) -> None:
    manager = make(1, store_threshold=2)
    for i in (1, 2):
        assert prepare(manager, keys(i), req("a")).keys_to_store == []
        assert store(manager, keys(i), req("b")).keys_to_store == keys(i)  # 2 evicts 1
    again = prepare(manager, keys(1), req("c"))
    if is_ours(manager):
        # Deliberate: an admitted key leaves our offer tracker, so once evicted it must
        # reach the threshold again.
        assert again == Store([], [], [])
    else:
        # vLLM keeps counting every offer: 1 is still over the threshold.
        assert again == Store(keys(1), [0], keys(2))


@VLLM_AND_PYTHON
def test_store_threshold_counts_offers_of_stored_keys(make: MakeManager) -> None:
    manager = make(4, store_threshold=2, max_tracker_size=2)
    assert prepare(manager, keys(1), req("a")).keys_to_store == []
    assert store(manager, keys(1), req("b")).keys_to_store == keys(1)
    assert prepare(manager, keys(2), req("c")).keys_to_store == []
    assert prepare(manager, keys(3), req("d")).keys_to_store == []
    assert prepare(manager, keys(1), req("e")) == Store([], [], [])  # 1 is stored
    second = prepare(manager, keys(2), req("f")).keys_to_store
    if is_ours(manager):
        # Deliberate: ours counts offers of keys not stored only, so 2 is at its 2nd offer.
        assert second == keys(2)
    else:
        # vLLM counted the offer of stored 1, which pushed 2 out of its 2-key tracker.
        assert second == []


@VLLM_AND_PYTHON
def test_store_threshold_and_the_offers_of_a_refused_store(make: MakeManager) -> None:
    manager = make(1, store_threshold=2)
    assert prepare(manager, keys(1), req("a")).keys_to_store == []
    assert store(manager, keys(1), req("b")).keys_to_store == keys(1)
    manager.prepare_load(keys(1), req("pin"))
    assert prepare(manager, keys(2), req("c")).keys_to_store == []
    # 2 reaches the threshold but needs pinned 1's slot: refused; 3 is offered a 1st time.
    assert manager.prepare_store(keys(2, 3), req("d")) is None
    manager.complete_load(keys(1), req("pin"))
    # Deliberate difference: a refused prepare_store changes no offer count in ours (a
    # call answered None changes no state of the tier), so 3 is at its first offer
    # again; vLLM counted the refused offer.
    expected = [] if make is our_manager else keys(3)
    assert prepare(manager, keys(3), req("e")).keys_to_store == expected


@VLLM_AND_PYTHON
def test_stores_skipped_counter_and_a_refused_store(make: MakeManager) -> None:
    manager = make(1, store_threshold=2)
    assert prepare(manager, keys(1), req("a")).keys_to_store == []
    store(manager, keys(1), req("b"))
    manager.prepare_load(keys(1), req("pin"))
    assert prepare(manager, keys(2), req("c")).keys_to_store == []
    reduced(manager)
    assert manager.prepare_store(keys(2, 3), req("d")) is None  # 3 is held back
    # Deliberate difference (see above): ours counts nothing for a refused call.
    expected = 0 if make is our_manager else 1
    assert reduced(manager)[CPUOffloadingMetrics.STORES_SKIPPED] == expected
