"""Behaviour of ``CPUOffloadingManager``, one behaviour per test, for every registered policy."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import pytest

import asyncoffload as ao
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import BlockStatus
from asyncoffload.manager.policies import LRUPolicy
from asyncoffload.manager.policies import base as policies_base

POLICIES = ao.available_policies()

KEYS = [ao.make_offload_key(bytes([i]) * 8) for i in range(32)]
A, B, C, D, E, F, G = KEYS[:7]

HIT = ao.LookupResult.HIT
MISS = ao.LookupResult.MISS
PENDING = ao.LookupResult.HIT_PENDING


# --- helpers ---------------------------------------------------------------------------


def make(policy: str, num_blocks: int, store_threshold: int = 0) -> ao.CPUOffloadingManager:
    return ao.CPUOffloadingManager(num_blocks, policy=policy, store_threshold=store_threshold)


def prepare(m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey]) -> ao.PrepareStoreOutput:
    out = m.prepare_store(keys)
    assert out is not None
    return out


def store(m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
    """Store ``keys`` successfully; their slots."""
    out = prepare(m, keys)
    m.complete_store(out.keys_to_store)
    return out.store_spec.block_ids


def store_each(m: ao.CPUOffloadingManager, keys: Sequence[OffloadKey]) -> None:
    """Store ``keys`` one call at a time, so the first is the least recently used."""
    for key in keys:
        store(m, [key])


def _norm(value: object) -> object:
    if isinstance(value, BlockStatus):
        return (value.block_id, value.ref_cnt)
    if isinstance(value, dict):
        return [(k, _norm(v)) for k, v in value.items()]
    return value


def fingerprint(m: ao.CPUOffloadingManager) -> tuple[object, ...]:
    """Everything observable about a manager, policy internals (ghosts, targets) included."""
    policy = m.policy
    return (
        m.stats(),
        [(key, block.block_id, block.ref_cnt) for key, block in policy.items()],
        list(m.resident_keys()),
        m.num_free,
        m.last_seq,
        _policy_state(policy),
    )


def _policy_state(policy: object) -> object:
    snapshot = getattr(policy, "snapshot", None)
    if snapshot is not None:  # kv: its own full dump (its C core has no __dict__ to read)
        return snapshot()
    # Bound methods a policy keeps as attributes (its fast ``get``) are not state.
    return sorted((name, repr(_norm(v))) for name, v in vars(policy).items() if not callable(v))


def eviction_order(m: ao.CPUOffloadingManager, n: int) -> list[OffloadKey]:
    """Store ``n`` fresh keys one at a time into a full tier; the keys evicted, in order."""
    evicted: list[OffloadKey] = []
    for key in KEYS[-n:]:
        out = prepare(m, [key])
        evicted.extend(out.evicted_keys)
    return evicted


def replay(events: Sequence[ao.OffloadingEvent]) -> set[OffloadKey]:
    resident: set[OffloadKey] = set()
    for event in events:
        if event.removed:
            resident.difference_update(event.keys)
        else:
            resident.update(event.keys)
    return resident


# --- slots -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_fresh_slots_ascending_then_last_freed_first(policy: str) -> None:
    m = make(policy, 5)
    assert prepare(m, [A, B, C]).store_spec.block_ids == (0, 1, 2)
    m.complete_store([A, B, C], success=False)  # frees 0, then 1, then 2
    assert prepare(m, [D]).store_spec.block_ids == (3,)
    assert prepare(m, [E]).store_spec.block_ids == (4,)
    assert prepare(m, [F, G, A]).store_spec.block_ids == (2, 1, 0)


@pytest.mark.parametrize("policy", POLICIES)
def test_evicted_slots_reused_last_freed_first(policy: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B, C])
    out = prepare(m, [D, E])
    assert out.evicted_keys == [A, B]  # freed slot 0, then slot 1
    assert out.store_spec.block_ids == (1, 0)


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_load_returns_slots_in_key_order(policy: str) -> None:
    m = make(policy, 4)
    assert store(m, [A, B, C]) == (0, 1, 2)
    assert m.prepare_load([C, A, B]).block_ids == (2, 0, 1)
    assert m.prepare_load([]).block_ids == ()


# --- lookup ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_lookup_reports_miss_pending_and_hit(policy: str) -> None:
    m = make(policy, 4)
    assert m.lookup(A) is MISS
    prepare(m, [A])
    assert m.lookup(A) is PENDING
    m.complete_store([A])
    assert m.lookup(A) is HIT
    stats = m.stats()
    assert (stats.lookups, stats.hits) == (3, 2)


@pytest.mark.parametrize("policy", POLICIES)
def test_lookup_prefix_counts_leading_ready_keys(policy: str) -> None:
    m = make(policy, 4)
    store(m, [A, B])
    prepare(m, [C])
    assert m.lookup_prefix([A, B, C]) == 2
    assert m.lookup_prefix([B, D, A]) == 1
    assert m.lookup_prefix([D, A]) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_lookup_does_not_change_recency(policy: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B, C])
    before = list(m.policy.items())
    for _ in range(3):
        assert m.lookup(A) is HIT
        assert m.lookup_prefix([A, B]) == 2
    assert list(m.policy.items()) == before
    assert eviction_order(m, 3) == [A, B, C]


# --- prepare_store ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_skips_present_keys_without_event(policy: str) -> None:
    m = make(policy, 4)
    store(m, [A])
    prepare(m, [B])
    m.take_events()
    out = prepare(m, [A, B, C])
    assert out.keys_to_store == [C]
    assert out.store_spec.block_ids == (2,)
    assert out.evicted_keys == []
    assert m.take_events() == []
    assert (m.lookup(A), m.lookup(B), m.lookup(C)) == (HIT, PENDING, PENDING)


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_of_present_keys_returns_empty_output(policy: str) -> None:
    m = make(policy, 2)
    store(m, [A])
    prepare(m, [B])
    before = fingerprint(m)
    out = m.prepare_store([A, B])
    assert out is not None
    assert (out.keys_to_store, out.store_spec.block_ids, out.evicted_keys) == ([], (), [])
    assert m.prepare_store([]) == out
    assert fingerprint(m) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_offered_keys_protected_from_eviction(policy: str) -> None:
    m = make(policy, 2)
    store_each(m, [A, B])  # A is the eviction candidate
    out = prepare(m, [A, C])  # A is offered, so it is protected
    assert out.evicted_keys == [B]
    assert out.keys_to_store == [C]
    assert m.lookup(A) is HIT


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_returns_none_when_offered_keys_fill_the_tier(policy: str) -> None:
    m = make(policy, 2)
    store_each(m, [A, B])
    before = fingerprint(m)
    m.take_events()
    assert m.prepare_store([A, B, C]) is None
    assert fingerprint(m) == before
    assert m.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_all_or_nothing_returns_none(policy: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B, C])
    m.prepare_load([A])  # 2 idle blocks left, 3 needed
    m.take_events()
    before = fingerprint(m)
    assert m.prepare_store([D, E, F]) is None
    assert fingerprint(m) == before
    assert m.take_events() == []
    # Enough idle blocks in total, but one of them is protected: still nothing evicted.
    m.complete_load([A])
    before = fingerprint(m)
    assert m.prepare_store([A, D, E, F]) is None
    assert fingerprint(m) == before
    assert m.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_larger_than_tier_returns_none(policy: str) -> None:
    m = make(policy, 2)
    before = fingerprint(m)
    assert m.prepare_store([A, B, C]) is None
    assert fingerprint(m) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_reports_victims_in_one_removed_event(policy: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B, C])
    m.take_events()
    out = prepare(m, [D, E])
    assert out.evicted_keys == [A, B]
    (event,) = m.take_events()
    assert event.removed
    assert event.keys == (A, B)
    assert event.medium is ao.Medium.CPU
    assert m.stats().evicted == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_only_evicts_the_shortfall(policy: str) -> None:
    m = make(policy, 4)
    store_each(m, [A, B, C])  # one slot still free
    out = prepare(m, [D, E])
    assert out.evicted_keys == [A]
    assert out.store_spec.block_ids == (3, 0)  # the fresh slot first, then A's


# --- pins and in-flight stores ---------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_blocks_never_evicted(policy: str) -> None:
    m = make(policy, 2)
    store_each(m, [A, B])
    m.prepare_load([A])  # A is the least recently used, but pinned
    assert prepare(m, [C]).evicted_keys == [B]
    assert m.prepare_store([D]) is None  # A pinned, C in flight
    assert m.lookup(A) is HIT
    assert m.stats().pinned == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_in_flight_blocks_never_evicted(policy: str) -> None:
    m = make(policy, 2)
    prepare(m, [A])
    store(m, [B])
    assert prepare(m, [C]).evicted_keys == [B]
    assert m.prepare_store([D]) is None
    assert (m.lookup(A), m.lookup(C)) == (PENDING, PENDING)


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_load_unpins(policy: str) -> None:
    m = make(policy, 1)
    store(m, [A])
    m.prepare_load([A])
    m.prepare_load([A])
    assert m.block_of(A) is not None
    assert m.stats().pinned == 1
    m.complete_load([A])
    assert m.stats().pinned == 1
    assert m.prepare_store([B]) is None  # still pinned by the second load
    m.complete_load([A])
    assert m.stats().pinned == 0
    assert prepare(m, [B]).evicted_keys == [A]


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_load_accepts_a_key_once_per_pin(policy: str) -> None:
    m = make(policy, 2)
    store(m, [A])
    m.prepare_load([A])
    m.prepare_load([A])
    m.complete_load([A, A])
    assert m.stats().pinned == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_load_of_unpinned_key_raises_and_changes_nothing(policy: str) -> None:
    m = make(policy, 3)
    store(m, [A, B])
    prepare(m, [C])
    m.prepare_load([A])
    before = fingerprint(m)
    for keys in ([A, B], [A, A], [C], [D]):
        with pytest.raises(ValueError):
            m.complete_load(keys)
        assert fingerprint(m) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_load_does_not_change_recency(policy: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B, C])
    m.prepare_load([A])
    m.complete_load([A])
    assert eviction_order(m, 3) == [A, B, C]


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_load_unknown_key_changes_nothing(policy: str) -> None:
    m = make(policy, 3)
    store(m, [A, B])
    before = fingerprint(m)
    with pytest.raises(ao.UnknownKeyError) as info:
        m.prepare_load([A, D, B])
    assert isinstance(info.value, KeyError)
    assert D.hex() in str(info.value)
    assert fingerprint(m) == before
    assert m.stats().pinned == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_load_not_ready_key_raises_key_error(policy: str) -> None:
    m = make(policy, 3)
    store(m, [A])
    prepare(m, [B])
    before = fingerprint(m)
    with pytest.raises(ao.KeyNotReadyError) as info:
        m.prepare_load([A, B])
    assert isinstance(info.value, KeyError)
    assert B.hex() in str(info.value)
    assert fingerprint(m) == before


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("method", ["prepare_load", "prepare_store"])
def test_duplicate_keys_rejected(policy: str, method: str) -> None:
    m = make(policy, 4)
    store(m, [A, B])
    m.take_events()
    before = fingerprint(m)
    with pytest.raises(ao.DuplicateKeyError) as info:
        getattr(m, method)([A, C, A])
    assert isinstance(info.value, ValueError)
    assert A.hex() in str(info.value)
    assert fingerprint(m) == before
    assert m.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_duplicate_keys_rejected_before_counting_offers(policy: str) -> None:
    m = make(policy, 4, store_threshold=2)
    with pytest.raises(ao.DuplicateKeyError):
        m.prepare_store([A, A])
    assert prepare(m, [A]).keys_to_store == []  # this is A's first counted offer


def test_unknown_policy_rejected() -> None:
    with pytest.raises(ValueError, match="lru"):
        ao.CPUOffloadingManager(4, policy="no-such-policy")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 0},
        {"num_blocks": -1},
        {"num_blocks": True},
        {"num_blocks": 4, "store_threshold": -1},
        {"num_blocks": 4, "max_tracker_size": 0},
    ],
)
def test_invalid_construction_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ao.CPUOffloadingManager(**kwargs)


# --- touch -----------------------------------------------------------------------------


#: Policies that order blocks by recency alone (S3-FIFO and SIEVE never move a block on a
#: hit; kv orders by learned value first, see tests/test_kv_policy.py).
RECENCY_POLICIES = [p for p in POLICIES if p in ("lru", "arc")]


@pytest.mark.parametrize("policy", RECENCY_POLICIES)
def test_touch_first_key_most_recent(policy: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B, C])
    m.touch([A, B])  # A becomes the most recently used, then B
    assert eviction_order(m, 3) == [C, B, A]


@pytest.mark.parametrize("policy", POLICIES)
def test_touch_ignores_unknown_keys(policy: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B])
    before = fingerprint(m)
    m.touch([D, E])
    m.touch([])
    if policy in ("kv", "auto"):
        # kv remembers keys it has seen requested (that is what it learns from), and
        # auto's shadows run the request, but what is stored, and in what order, does
        # not change.
        assert fingerprint(m)[:5] == before[:5]
    else:
        assert fingerprint(m) == before


# --- complete_store --------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_successful_store_publishes_one_stored_event(policy: str) -> None:
    m = make(policy, 4)
    out = prepare(m, [A, B, C])
    assert m.take_events() == []  # nothing is published before the copy completes
    m.complete_store([C, A, B])
    (event,) = m.take_events()
    assert not event.removed
    assert event.keys == (C, A, B)
    assert event.seq == 1
    assert not event.snapshot
    assert [m.lookup(k) for k in out.keys_to_store] == [HIT, HIT, HIT]
    stats = m.stats()
    assert (stats.ready, stats.write_pending, stats.stored) == (3, 0, 3)


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_store_frees_slots_without_event(policy: str) -> None:
    m = make(policy, 3)
    store(m, [A])
    m.take_events()
    assert prepare(m, [B, C]).store_spec.block_ids == (1, 2)
    m.complete_store([B, C], success=False)
    assert m.take_events() == []
    assert (m.lookup(B), m.lookup(C)) == (MISS, MISS)
    stats = m.stats()
    assert (stats.free, stats.write_pending, stats.store_failed, stats.ready) == (2, 0, 2, 1)
    assert list(m.resident_keys()) == [A]
    # The freed slots are reused (last freed first) and nothing had to be evicted.
    out = prepare(m, [D, E])
    assert out.store_spec.block_ids == (2, 1)
    assert out.evicted_keys == []


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_store_ignores_ready_and_unknown_keys(policy: str) -> None:
    m = make(policy, 3)
    store(m, [A])
    m.take_events()
    before = fingerprint(m)
    m.complete_store([A, D])
    m.complete_store([A, D], success=False)
    assert fingerprint(m) == before
    assert m.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_store_of_a_key_listed_twice_counts_once(policy: str) -> None:
    m = make(policy, 3)
    prepare(m, [A])
    m.complete_store([A, A])
    (event,) = m.take_events()
    assert event.keys == (A,)
    assert m.stats().ready == 1


# --- store_threshold -------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("threshold", [2, 3])
def test_store_threshold_counts_offers(policy: str, threshold: int) -> None:
    m = make(policy, 4, store_threshold=threshold)
    for _ in range(threshold - 1):
        assert prepare(m, [A, B]).keys_to_store == []
    assert m.stats().store_skipped == 2 * (threshold - 1)
    assert prepare(m, [A, C]).keys_to_store == [A]  # A's n-th offer; C's first
    assert prepare(m, [B]).keys_to_store == [B]
    assert (m.lookup(A), m.lookup(B), m.lookup(C)) == (PENDING, PENDING, MISS)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("threshold", [0, 1])
def test_store_threshold_below_two_stores_on_first_offer(policy: str, threshold: int) -> None:
    m = make(policy, 4, store_threshold=threshold)
    assert prepare(m, [A]).keys_to_store == [A]
    assert m.stats().store_skipped == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_store_threshold_ignores_offers_of_present_keys(policy: str) -> None:
    m = make(policy, 4, store_threshold=2)
    prepare(m, [A])
    store(m, [A])
    assert m.stats().store_skipped == 1
    prepare(m, [A])  # already present: not an offer
    assert m.stats().store_skipped == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_refused_store_keeps_offer_count(policy: str) -> None:
    m = make(policy, 1, store_threshold=2)
    assert prepare(m, [A]).keys_to_store == []  # first offer of A
    store(m, [B])
    store(m, [B])
    m.prepare_load([B])  # the only slot is pinned
    before = fingerprint(m)
    assert m.prepare_store([A]) is None  # refused: changes nothing, A's count included
    assert fingerprint(m) == before
    m.complete_load([B])
    out = prepare(m, [A])  # second counted offer of A
    assert out.keys_to_store == [A]
    assert out.evicted_keys == [B]


@pytest.mark.parametrize("policy", POLICIES)
def test_store_threshold_tracker_is_bounded(policy: str) -> None:
    m = ao.CPUOffloadingManager(8, policy=policy, store_threshold=2, max_tracker_size=2)
    for key in (A, B, C):  # A, the oldest, falls out of the tracker
        assert prepare(m, [key]).keys_to_store == []
    assert prepare(m, [A]).keys_to_store == []  # counted from one again
    assert prepare(m, [C]).keys_to_store == [C]


@pytest.mark.parametrize("policy", POLICIES)
def test_store_threshold_offer_count_restarts_after_failed_store(policy: str) -> None:
    m = make(policy, 4, store_threshold=2)
    prepare(m, [A])
    assert prepare(m, [A]).keys_to_store == [A]
    m.complete_store([A], success=False)
    assert prepare(m, [A]).keys_to_store == []
    assert prepare(m, [A]).keys_to_store == [A]


# --- events ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_event_seq_gap_free(policy: str) -> None:
    m = make(policy, 2)
    seqs: list[int] = []
    store(m, [A])
    store(m, [B])
    seqs += [e.seq for e in m.take_events()]
    store(m, [C, D])  # one removed event (A, B), one stored event
    prepare(m, [E])  # one removed event (C)
    m.complete_store([E], success=False)  # no event
    seqs += [e.seq for e in m.take_events()]
    m.reset_cache()  # one removed event (D)
    seqs += [e.seq for e in m.take_events()]
    assert seqs == [1, 2, 3, 4, 5, 6]
    assert m.last_seq == 6
    assert m.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_take_events_drains_the_queue(policy: str) -> None:
    m = make(policy, 2)
    store(m, [A])
    assert len(m.take_events()) == 1
    assert m.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_events_disabled_publishes_nothing(policy: str) -> None:
    m = ao.CPUOffloadingManager(2, policy=policy, enable_events=False)
    store_each(m, [A, B, C])
    m.reset_cache()
    assert m.take_events() == []
    assert m.last_seq == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_replaying_events_rebuilds_resident_set(policy: str) -> None:
    m = make(policy, 4)
    events: list[ao.OffloadingEvent] = []
    for i in range(24):
        out = m.prepare_store([KEYS[i % 7], KEYS[7 + (i * 3) % 11]])
        if out is not None:
            m.complete_store(out.keys_to_store, success=i % 5 != 0)
        if i % 4 == 0:
            m.touch([KEYS[(i * 5) % 7]])
        if i % 6 == 0:
            oldest = list(m.resident_keys())[:1]
            m.prepare_load(oldest)
            m.complete_load(oldest)
        events += m.take_events()
        assert replay(events) == set(m.resident_keys())
    assert m.stats().evicted > 0
    assert any(e.removed for e in events)


# --- reset_cache -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_cache(policy: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B, C])
    m.take_events()
    m.reset_cache()
    (event,) = m.take_events()
    assert event.removed
    assert set(event.keys) == {A, B, C}
    assert [m.lookup(k) for k in (A, B, C)] == [MISS, MISS, MISS]
    stats = m.stats()
    assert (stats.ready, stats.write_pending, stats.pinned, stats.free) == (0, 0, 0, 3)
    assert list(m.policy.items()) == []
    assert prepare(m, [D, E, F]).store_spec.block_ids == (0, 1, 2)  # fresh slots again


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("in_flight", ["store", "load"])
def test_reset_cache_refused_while_transfers_are_in_flight(policy: str, in_flight: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B])
    if in_flight == "store":
        prepare(m, [C])
    else:
        m.prepare_load([A])
    m.take_events()
    before = fingerprint(m)
    with pytest.raises(RuntimeError, match="in flight"):
        m.reset_cache()
    assert fingerprint(m) == before
    assert m.take_events() == []
    if in_flight == "store":
        m.complete_store([C])
    else:
        m.complete_load([A])
    m.reset_cache()
    assert list(m.resident_keys()) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_cache_of_empty_tier_publishes_nothing(policy: str) -> None:
    m = make(policy, 3)
    m.reset_cache()
    assert m.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_cache_forgets_policy_history(policy: str) -> None:
    fresh = make(policy, 2)
    m = make(policy, 2)
    store_each(m, [A, B, C, D])
    m.touch([A, B, C])
    m.reset_cache()
    assert fingerprint(m)[1:4] == fingerprint(fresh)[1:4]
    assert fingerprint(m)[5] == fingerprint(fresh)[5]


# --- stats and registry ----------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_stats_count_blocks_and_operations(policy: str) -> None:
    m = make(policy, 3)
    store_each(m, [A, B, C])
    prepare(m, [D])  # evicts A
    m.prepare_load([B, C])
    m.lookup(A)
    stats = m.stats()
    assert stats == ao.ManagerStats(
        num_blocks=3,
        ready=2,
        write_pending=1,
        pinned=2,
        free=0,
        stored=3,
        store_failed=0,
        loaded=2,
        evicted=1,
        store_skipped=0,
        lookups=1,
        hits=0,
    )
    assert stats.free + stats.ready + stats.write_pending == stats.num_blocks
    assert repr(m).startswith(f"<CPUOffloadingManager policy={policy} ")


def test_registered_policy_is_usable_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policies_base, "_REGISTRY", policies_base._REGISTRY.copy())

    @ao.register_policy("test-mru")
    class MRUPolicy(LRUPolicy):
        """Evicts the most recently used idle block first."""

        def evict(
            self, n: int, protected: Collection[OffloadKey]
        ) -> list[tuple[OffloadKey, BlockStatus]] | None:
            victims = [
                (key, block)
                for key, block in reversed(list(self.items()))
                if block.ref_cnt == 0 and key not in protected
            ][:n]
            if len(victims) < n:
                return None
            for key, _ in victims:
                self.remove(key)
            return victims

    assert "test-mru" in ao.available_policies()
    assert MRUPolicy.name == "test-mru"
    m = make("test-mru", 2)
    store_each(m, [A, B])
    assert prepare(m, [C]).evicted_keys == [B]
    assert isinstance(m.policy, MRUPolicy)


def test_register_policy_rejects_a_taken_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policies_base, "_REGISTRY", policies_base._REGISTRY.copy())
    with pytest.raises(ValueError, match="already registered"):

        @ao.register_policy("lru")
        class Other(LRUPolicy):
            pass


def test_register_policy_rejects_a_non_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policies_base, "_REGISTRY", policies_base._REGISTRY.copy())
    with pytest.raises(TypeError):
        ao.register_policy("bogus")(int)  # type: ignore[type-var]
    assert "bogus" not in ao.available_policies()
