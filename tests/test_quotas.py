"""Tenant quotas and opt-out in a tier's index (asyncoffload.manager.quotas), with no I/O."""

from __future__ import annotations

import logging

import pytest

import asyncoffload as ao
from asyncoffload.manager import CPUOffloadingManager, ReqContext
from asyncoffload.manager.quotas import (
    NO_STORE_KEY,
    Tenancy,
    check_quota_table,
    parse_quota,
    resolve_quotas,
    tenancy,
)

A = ReqContext("a", tenant="A")
B = ReqContext("b", tenant="B")


def keys(tag: int, n: int) -> list[ao.OffloadKey]:
    return [ao.make_offload_key(bytes([tag, i]) * 16) for i in range(n)]


def store(m: CPUOffloadingManager, ks: list[ao.OffloadKey], ctx: ReqContext) -> list[ao.OffloadKey]:
    out = m.prepare_store(ks, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    return out.keys_to_store


def resident(m: CPUOffloadingManager) -> set[ao.OffloadKey]:
    return set(m.resident_keys())


@pytest.mark.parametrize("policy", ["lru", "arc", "kv", "auto", "s3fifo", "sieve"])
def test_over_quota_a_tenant_evicts_its_own_blocks_never_another_tenants(policy: str) -> None:
    m = CPUOffloadingManager(8, policy, quotas={"A": 4})
    b = store(m, keys(2, 4), B)
    assert store(m, keys(1, 4), A) == keys(1, 4)
    for round in range(3, 8):  # A floods: each store pushes out A's own blocks
        fresh = keys(round, 2)
        out = m.prepare_store(fresh, A)
        assert out is not None and out.keys_to_store == fresh
        assert set(out.evicted_keys) <= set(keys(1, 4)) | {
            k for r in range(3, 8) for k in keys(r, 2)
        }
        m.complete_store(fresh, A)
        assert set(b) <= resident(m), "tenant B lost a block to A's flood"
    stats = {t.tenant: t for t in m.stats().tenants}
    assert stats["A"].held == 4 and stats["A"].quota == 4
    assert stats["A"].evicted == 10 and stats["A"].refused == 0


def test_own_blocks_go_in_policy_order() -> None:
    m = CPUOffloadingManager(16, "lru", quotas={"A": 3})
    old, mid, new = keys(1, 1), keys(2, 1), keys(3, 1)
    for k in (old, mid, new):
        store(m, k, A)
    m.touch(old)  # now mid is A's least recently used
    out = m.prepare_store(keys(4, 1), A)
    assert out is not None and out.evicted_keys == mid


def test_what_does_not_fit_is_refused_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    m = CPUOffloadingManager(8, "lru", quotas={"A": 3})
    first = keys(1, 3)
    out = m.prepare_store(first, A)  # pending: not evictable
    assert out is not None
    with caplog.at_level(logging.WARNING, "asyncoffload.quotas"):
        more = m.prepare_store(keys(2, 2), A)
    assert more is not None and more.keys_to_store == [] and more.evicted_keys == []
    assert "tenant 'A'" in caplog.text and "tier CPU" in caplog.text
    m.complete_store(first, A)
    out = m.prepare_store(keys(3, 5), A)  # 5 keys, quota 3: the head is kept
    assert out is not None and out.keys_to_store == keys(3, 5)[:3]
    s = m.stats()
    assert s.quota_refused == 2 + 2
    assert s.tenants[0].refused == 4 and s.tenants[0].held == 3


def test_a_store_never_evicts_its_own_keys_for_the_quota() -> None:
    m = CPUOffloadingManager(8, "lru", quotas={"A": 2})
    ks = keys(1, 2)
    store(m, ks, A)
    # The call lists A's two stored keys and two new ones: the stored ones are protected.
    out = m.prepare_store([*ks, *keys(2, 2)], A)
    assert out is not None and out.keys_to_store == [] and out.evicted_keys == []
    assert set(ks) <= resident(m)


def test_pinned_own_blocks_are_not_evicted_and_the_idle_ones_are() -> None:
    m = CPUOffloadingManager(8, "lru", quotas={"A": 4})
    ks = keys(1, 4)
    store(m, ks, A)
    m.prepare_load(ks[:3])  # three pinned by a load
    out = m.prepare_store(keys(2, 3), A)
    assert out is not None and out.evicted_keys == [ks[3]] and out.keys_to_store == keys(2, 3)[:1]
    assert m.stats().tenants[0].refused == 2


def test_below_quota_and_without_tenant_nothing_changes() -> None:
    m = CPUOffloadingManager(4, "lru", quotas={"A": 2})
    store(m, keys(9, 4), ReqContext("x"))  # no tenant: not capped
    out = m.prepare_store(keys(1, 2), A)  # A below its quota takes room as any store
    assert out is not None and out.keys_to_store == keys(1, 2) and len(out.evicted_keys) == 2


def test_promotions_count_for_the_tenant_all_or_nothing() -> None:
    m = CPUOffloadingManager(8, "lru", quotas={"A": 2})
    store(m, keys(1, 2), A)
    out = m.reserve(keys(2, 2), (), A)
    assert out is not None and sorted(out.evicted_keys) == sorted(keys(1, 2))
    m.complete_store(keys(2, 2))
    assert m.reserve(keys(3, 3), (), A) is None  # 3 blocks can never fit a quota of 2
    assert m.stats().tenants[0].refused == 3
    assert m.reserve(keys(3, 2), keys(2, 1), A) is None  # protect: one of A's stays
    assert m.stats().tenants[0].held == 2
    assert m.reserve(keys(4, 2), (), B) is not None  # B has no quota


def test_failed_stores_evictions_and_reset_give_the_quota_back() -> None:
    m = CPUOffloadingManager(8, "lru", quotas={"A": 3})
    out = m.prepare_store(keys(1, 3), A)
    assert out is not None
    m.complete_store(keys(1, 3), A, success=False)
    assert m.stats().tenants[0].held == 0
    store(m, keys(2, 3), A)
    store(m, keys(3, 5), B)  # B fills the tier; its evictions may take A's blocks
    held = m.stats().tenants[0].held
    assert held == len(resident(m) & set(keys(2, 3)))
    m.reset_cache()
    assert m.stats().tenants[0].held == 0
    assert store(m, keys(4, 3), A) == keys(4, 3)


def test_opt_out_stores_nothing_and_is_counted() -> None:
    m = CPUOffloadingManager(8, "lru", quotas={"A": 4})
    out = m.prepare_store(keys(1, 3), ReqContext("a", tenant="A", no_store=True))
    assert out is not None and out.keys_to_store == []
    params = ReqContext("b", kv_transfer_params={NO_STORE_KEY: True})
    out = m.prepare_store(keys(2, 2), params)
    assert out is not None and out.keys_to_store == []
    s = m.stats()
    assert s.opted_out == 5 and s.tenants[0].opted_out == 3 and s.ready == 0
    assert store(m, keys(2, 2), ReqContext("c", kv_transfer_params={NO_STORE_KEY: False}))


@pytest.mark.parametrize(
    ("ctx", "error"),
    [
        (ReqContext("a", kv_transfer_params={NO_STORE_KEY: "yes"}), ValueError),
        (ReqContext("a", no_store=1), TypeError),  # type: ignore[arg-type]
        (ReqContext("a", tenant=7), TypeError),  # type: ignore[arg-type]
    ],
)
def test_bad_contexts_raise_and_change_nothing(ctx: ReqContext, error: type[Exception]) -> None:
    m = CPUOffloadingManager(4, "lru", store_threshold=2, quotas={"A": 2})
    before = m.stats()
    with pytest.raises(error):
        m.prepare_store(keys(1, 2), ctx)
    assert m.stats() == before
    assert store(m, keys(1, 2), A) == []  # the bad call counted no offer
    assert store(m, keys(1, 2), A) == keys(1, 2)


def test_framework_contexts_carry_tenancy_in_their_state() -> None:
    class Framework:  # vLLM's ReqContext: no tenant field, a per-type state
        def __init__(self) -> None:
            self.state: dict[type, object] = {}

        def get_state(self, cls: type) -> object:
            return self.state.get(cls)

    ctx = Framework()
    assert tenancy(ctx) == Tenancy(None, False)
    ctx.state[Tenancy] = Tenancy("A", True)
    assert tenancy(ctx) == Tenancy("A", True)


def test_quota_settings_parse_resolve_and_name_what_is_wrong() -> None:
    assert parse_quota(4, "q") == ("blocks", 4)
    assert parse_quota("25%", "q") == ("share", 25.0)
    assert parse_quota("1MiB", "q") == ("bytes", 1 << 20)
    got = resolve_quotas({"A": 4, "B": "25%", "C": "1MiB"}, 64, 1 << 16, "quotas")
    assert got == {"A": 4, "B": 16, "C": 16}
    cases: list[tuple[object, str]] = [
        (0, "positive"),
        (-3, "positive"),
        ("0%", "above 0%"),
        ("150%", "at most 100%"),
        ("a lot", "not a byte size"),
        ("x%", "not a share"),
        (True, "a quota is"),
        (2.5, "a quota is"),
    ]
    for value, words in cases:
        with pytest.raises(ValueError, match=words) as info:
            resolve_quotas({"A": value}, 64, 1 << 16, "tiers[0].quotas")  # type: ignore[dict-item]
        assert "tiers[0].quotas['A']" in str(info.value)
    with pytest.raises(ValueError, match=r"quotas\['A'\].*larger than the tier \(64 blocks\)"):
        resolve_quotas({"A": 65}, 64, 1 << 16, "quotas")
    with pytest.raises(ValueError, match="larger than the tier"):
        resolve_quotas({"A": "8MiB"}, 64, 1 << 16, "quotas")
    with pytest.raises(ValueError, match="less than one block"):
        resolve_quotas({"A": "1KiB"}, 64, 1 << 16, "quotas")
    with pytest.raises(ValueError, match="'C' is not a known tenant; known: 'A', 'B'"):
        check_quota_table({"A": 1, "C": 2}, ["A", "B"], "quotas")
    with pytest.raises(ValueError, match="known: none"):
        check_quota_table({"A": 1}, [], "quotas")


def test_a_manager_rejects_bad_quotas() -> None:
    with pytest.raises(ValueError, match=r"quotas\['A'\].*1 to 8 blocks"):
        CPUOffloadingManager(8, quotas={"A": 9})
    with pytest.raises(ValueError, match=r"quotas\['A'\]"):
        CPUOffloadingManager(8, quotas={"A": 0})


def test_the_admission_filter_hears_of_a_tenants_own_evictions() -> None:
    m = CPUOffloadingManager(8, "lru", admission="ghost", quotas={"A": 2})
    first, second = keys(1, 2), keys(2, 2)
    for ks in (first, second):
        assert store(m, ks, A) == []  # the ghost filter: stored at the second offer
        assert store(m, ks, A) == ks  # the second: over quota, A's first two go
    assert not set(first) & resident(m)
    out = m.prepare_store(first[:1], A)  # evicted before: the ghost admits it at once
    assert out is not None and out.keys_to_store == first[:1]
    assert out.evicted_keys == second[:1]  # and A's oldest block goes for it
