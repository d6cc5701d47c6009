"""Tenant quotas and retention pins and classes together in one tier's index (issue 40):
over its quota a tenant evicts only its own idle blocks, never a pinned one and the low
ones first; another tenant's block never goes for it, pinned or not; an expired pin
keeps nothing. Time is a fake clock: nothing here waits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

import asyncoffload as ao
from asyncoffload.manager import CPUOffloadingManager, ReqContext, available_policies
from asyncoffload.manager.retention import Retention
from asyncoffload.tiers.disk import DiskTier
from tests.helpers import FakeClock, make_keys, tier_index
from tests.test_tiers import SLOT, keys, kv_caches


def manager(
    n: int, policy: str = "lru", quotas: dict[str, int] | None = None
) -> tuple[CPUOffloadingManager, FakeClock]:
    clock = FakeClock(100.0)
    m = CPUOffloadingManager(n, policy, pin_budget=1.0, clock=clock, quotas=quotas)
    return m, clock


def ctx(tenant: str | None, ttl: float | None = None, klass: str = "normal") -> ReqContext:
    hint = Retention(ttl, klass) if ttl is not None or klass != "normal" else None
    return ReqContext(f"req-{tenant}", tenant=tenant, retention=hint)


def store(m: CPUOffloadingManager, keys: Sequence[ao.OffloadKey], c: ReqContext) -> None:
    out = m.prepare_store(keys, c)
    assert out is not None and out.keys_to_store == list(keys)
    m.complete_store(out.keys_to_store, c)


def resident(m: CPUOffloadingManager) -> set[ao.OffloadKey]:
    return set(m.resident_keys())


def tenant_stats(m: CPUOffloadingManager, tenant: str) -> ao.manager.base.TenantStats:
    return next(t for t in m.stats().tenants if t.tenant == tenant)


@pytest.mark.parametrize("policy", sorted(available_policies()))
def test_over_quota_with_its_own_blocks_pinned_a_tenant_is_refused_and_nobody_loses_one(
    policy: str,
) -> None:
    m, clock = manager(8, policy, quotas={"A": 3})
    pinned = make_keys(3, b"A-pinned")
    other = make_keys(3, b"B")
    store(m, pinned, ctx("A", ttl=30.0))
    store(m, other, ctx("B"))
    assert m.pins.stats().pinned == 3

    out = m.prepare_store(make_keys(2, b"A-new"), ctx("A"))
    assert out is not None and out.keys_to_store == [] and out.evicted_keys == []
    assert m.reserve(make_keys(1, b"A-promoted"), (), ctx("A")) is None  # a promotion too
    assert resident(m) == {*pinned, *other}, "a block went for a tenant over its quota"
    a = tenant_stats(m, "A")
    assert (a.held, a.refused, a.evicted) == (3, 3, 0)
    assert m.stats().quota_refused == 3

    clock.now += 30.0  # the pins expire: they keep nothing, the next store evicts A's own
    fresh = make_keys(2, b"A-late")
    out = m.prepare_store(fresh, ctx("A"))
    assert out is not None and out.keys_to_store == fresh
    assert len(out.evicted_keys) == 2 and set(out.evicted_keys) <= set(pinned)
    m.complete_store(fresh, ctx("A"))
    assert set(other) <= resident(m)
    assert m.pins.stats().expired == 3 and tenant_stats(m, "A").evicted == 2


@pytest.mark.parametrize("policy", sorted(available_policies()))
def test_over_quota_a_tenant_evicts_its_unpinned_blocks_and_refuses_the_rest(
    policy: str,
) -> None:
    m, _ = manager(8, policy, quotas={"A": 4})
    pinned = make_keys(2, b"A-pinned")
    loose = make_keys(2, b"A-loose")
    other = make_keys(2, b"B")
    store(m, pinned, ctx("A", ttl=30.0))
    store(m, loose, ctx("A"))
    store(m, other, ctx("B"))
    new = make_keys(3, b"A-new")
    out = m.prepare_store(new, ctx("A"))
    assert out is not None
    assert out.keys_to_store == new[:2]  # the head fits the room its loose blocks left
    assert set(out.evicted_keys) == set(loose)
    m.complete_store(out.keys_to_store, ctx("A"))
    assert resident(m) == {*pinned, *new[:2], *other}
    a = tenant_stats(m, "A")
    assert (a.held, a.refused, a.evicted) == (4, 1, 2)


@pytest.mark.parametrize("policy", sorted(available_policies()))
def test_a_pinned_block_of_another_tenant_is_never_taken(policy: str) -> None:
    m, _ = manager(8, policy, quotas={"A": 4, "B": 4})
    b_pinned = make_keys(4, b"B")
    store(m, b_pinned, ctx("B", ttl=60.0))
    nobody = make_keys(2, b"none")
    store(m, nobody, ctx(None))
    store(m, make_keys(2, b"A-0"), ctx("A"))
    for i in range(1, 12):  # the tier is full: below or over its quota, A never takes B's
        out = m.prepare_store(make_keys(2, b"A-%d" % i), ctx("A"))
        assert out is not None
        m.complete_store(out.keys_to_store, ctx("A"))
        assert set(b_pinned) <= resident(m), f"store {i} took a pinned block of B"
    assert tenant_stats(m, "B").held == 4 and m.pins.stats().pinned == 4


@pytest.mark.parametrize("policy", sorted(available_policies()))
def test_over_quota_a_tenants_low_blocks_go_first_and_another_tenants_low_ones_stay(
    policy: str,
) -> None:
    m, _ = manager(16, policy, quotas={"A": 3})
    b_low = make_keys(2, b"B-low")
    store(m, b_low, ctx("B", klass="low"))
    a_normal = make_keys(2, b"A-normal")
    a_low = make_keys(1, b"A-low")
    store(m, a_normal, ctx("A"))
    store(m, a_low, ctx("A", klass="low"))  # A's newest block, and its low one
    out = m.prepare_store(make_keys(1, b"A-new"), ctx("A"))
    assert out is not None and out.evicted_keys == a_low
    assert set(b_low) <= resident(m)


@pytest.mark.parametrize("policy", sorted(available_policies()))
def test_a_promotion_over_quota_takes_normal_blocks_then_high_ones_never_pinned_ones(
    policy: str,
) -> None:
    m, _ = manager(16, policy, quotas={"A": 4})
    pinned = make_keys(1, b"A-pinned")
    high = make_keys(2, b"A-high")
    normal = make_keys(1, b"A-normal")
    store(m, pinned, ctx("A", ttl=30.0))
    store(m, high, ctx("A", klass="high"))
    store(m, normal, ctx("A"))
    promoted = make_keys(4, b"A-promoted")
    assert m.reserve(promoted, (), ctx("A")) is None  # 4 for its 3 unpinned ones: refused
    assert resident(m) == {*pinned, *high, *normal}
    out = m.reserve(promoted[:2], (), ctx("A"))  # all or none: the normal one, one high one
    assert out is not None
    assert set(out.evicted_keys) & set(normal) == set(normal)
    assert len(set(out.evicted_keys) & set(high)) == 1 and len(out.evicted_keys) == 2
    assert set(pinned) <= resident(m)
    assert tenant_stats(m, "A").refused == 4


async def test_on_disk_a_tenant_whose_blocks_are_pinned_is_refused_and_another_keeps_its_own(
    tmp_path: Path,
) -> None:
    """Through the engine: a hinted store's pins are carried to the disk tier, where the
    tenant's quota then refuses its next write-through (counted) rather than evict a
    pinned block, and the other tenant's blocks there stay."""
    cfg = ao.EngineConfig(
        cpu_blocks=8,
        policy="lru",
        tenants=["A", "B"],
        tiers=[
            DiskTier(
                tmp_path, 16 * SLOT, "slab", admission=None, policy="lru", quotas={"A": 4, "B": 8}
            )
        ],
        model="test-model",
    )
    eng = ao.AsyncOffloadEngine(kv_caches(), cfg)
    try:
        hinted = ao.ReqContext("a1", tenant="A", retention=ao.Retention(600.0))
        for ks, ids, c in (
            (keys(4, 0), [0, 1, 2, 3], hinted),
            (keys(4, 100), [4, 5, 6, 7], ao.ReqContext("b1", tenant="B")),
            (keys(2, 200), [8, 9], ao.ReqContext("a2", tenant="A")),
        ):
            handle = await eng.prepare_store(ks, ids, c)
            assert handle is not None
            await handle
            await eng.flush()
        index = tier_index(eng)
        disk = {t.tenant: t for t in eng.stats().tiers[0].manager.tenants}
        assert (disk["A"].held, disk["A"].refused, disk["A"].evicted) == (4, 2, 0)
        assert disk["B"].held == 4 and disk["B"].refused == 0
        assert sum(1 for key in index.resident_keys() if key in index.pins) == 4
        assert len(list(index.resident_keys())) == 8  # A's pinned 4 and B's 4
    finally:
        await eng.aclose()
