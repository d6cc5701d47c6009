"""Retention pins held in the tiers below the CPU tier, through the engine (issue 40): a
hinted request's blocks are pinned on disk and in a Valkey tier's index as they are
written through, hold there through a flood, are refreshed by a promotion, and go once
their pin expires. The pins' clocks are fake where a test lets time pass."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import asyncoffload as ao
from asyncoffload.manager.base import Medium
from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.remote import RemoteTier
from tests.helpers import tier_index
from tests.test_tiers import SLOT, block, engine, keys, kv_caches

HINT = ao.ReqContext("hinted", retention=ao.Retention(60.0))


class Clock:
    """Monotonic time plus an offset that a test moves forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def disk_config(path: Path, **kw: Any) -> ao.EngineConfig:
    return ao.EngineConfig(
        cpu_blocks=4,
        policy="lru",
        tiers=[DiskTier(path, 16 * SLOT, "slab", admission=None, policy="lru")],
        model="test-model",
        **kw,
    )


async def store(
    eng: ao.AsyncOffloadEngine, ks: list[ao.OffloadKey], ids: list[int], ctx: Any = None
) -> None:
    handle = await eng.prepare_store(ks, ids, ctx)
    assert handle is not None
    await handle
    await eng.flush()


async def flood(eng: ao.AsyncOffloadEngine, n: int, start: int = 1000) -> None:
    """``n`` unhinted blocks, two a store: more than the lower tier holds."""
    for i in range(0, n, 2):
        await store(eng, keys(2, start + i), [30, 31])


def pinned_below(eng: ao.AsyncOffloadEngine) -> set[ao.OffloadKey]:
    index = tier_index(eng)
    return {key for key in index.resident_keys() if key in index.pins}


async def test_a_hinted_store_is_pinned_on_disk_and_outlives_a_flood(tmp_path: Path) -> None:
    async with engine(disk_config(tmp_path, pin_budget=0.25)) as eng:  # 1 CPU pin
        sub = eng.events()
        kept = keys(2)
        await store(eng, kept, [0, 1], HINT)
        assert pinned_below(eng) == set(kept)
        await flood(eng, 40)
        index = tier_index(eng)
        assert all(index.ready(key) for key in kept)
        stats = eng.stats()
        assert stats.tiers[0].pins is not None
        assert stats.tiers[0].pins.pinned == 2
        cpu_pins = stats.pins
        assert cpu_pins is not None and (cpu_pins.pinned, cpu_pins.refused) == (1, 1)
        await eng.aclose()
        events = [e async for e in sub if isinstance(e, ao.OffloadingEvent)]
    pins = {(e.medium, k) for e in events if e.retention == "pinned" for k in e.keys}
    assert {(Medium.DISK, k) for k in kept} <= pins


async def test_without_a_hint_the_flood_evicts_them_from_disk(tmp_path: Path) -> None:
    async with engine(disk_config(tmp_path)) as eng:
        kept = keys(2)
        await store(eng, kept, [0, 1])
        await flood(eng, 40)
        index = tier_index(eng)
        assert not any(index.ready(key) for key in kept)


async def test_a_disk_pin_is_refreshed_by_a_promotion_and_expires_after(tmp_path: Path) -> None:
    kv = kv_caches()
    want = [block(kv, i) for i in range(2)]
    # The CPU tier's budget (a fifth of 4 slots) holds no pin: the blocks leave it.
    async with engine(disk_config(tmp_path, pin_budget=0.2), kv) as eng:
        index = tier_index(eng)
        clock = index.pins.clock = Clock()
        kept = keys(2)
        await store(eng, kept, [0, 1], HINT)
        await flood(eng, 4)  # out of the CPU tier, still on disk
        assert all(eng.manager.block_of(key) is None for key in kept)
        clock.offset += 50.0
        for t in kv:
            t[8:10].zero_()
        await (await eng.prepare_load(kept, [8, 9], HINT))  # a promotion: a hit on disk
        assert [block(kv, 8), block(kv, 9)] == want
        assert index.pins.stats().refreshed >= 2
        clock.offset += 50.0  # 100 s after the store, 50 s after the hit
        await flood(eng, 40, start=2000)
        assert all(index.ready(key) for key in kept)
        clock.offset += 10.0
        await flood(eng, 40, start=3000)
        assert not any(index.ready(key) for key in kept)
        assert index.pins.stats().expired == 2


async def test_the_disk_pin_budget_refuses_and_counts(tmp_path: Path) -> None:
    cfg = ao.EngineConfig(
        cpu_blocks=4,
        policy="lru",
        tiers=[DiskTier(tmp_path, 16 * SLOT, "slab", admission=None, pin_budget=0.125)],
        model="test-model",
    )
    async with engine(cfg) as eng:
        await store(eng, keys(4), [0, 1, 2, 3], HINT)
        pins = eng.stats().tiers[0].pins
        assert pins is not None and (pins.limit, pins.pinned, pins.refused) == (2, 2, 2)


async def test_a_hinted_store_is_pinned_in_a_valkey_tiers_index(valkey_server: Any) -> None:
    cfg = ao.EngineConfig(
        cpu_blocks=4,
        policy="lru",
        tiers=[RemoteTier(valkey_server.url, index_blocks=16, policy="lru")],
        model="m",
    )
    async with engine(cfg) as eng:
        kept = keys(2)
        await store(eng, kept, [0, 1], HINT)
        await flood(eng, 40)
        index = tier_index(eng)
        assert index.medium is Medium.REMOTE
        assert all(index.ready(key) and key in index.pins for key in kept)
        assert eng.lookup(kept, HINT) == 2
        await (await eng.prepare_load(kept, [8, 9], HINT))  # a hit in the CPU tier
        assert all(key in index.pins for key in kept)


@pytest.mark.parametrize("budget", [0.0, 1.5])
def test_a_lower_tiers_bad_pin_budget_names_it(budget: float) -> None:
    with pytest.raises(ValueError, match=r"RemoteTier\.pin_budget must be a share"):
        RemoteTier("redis://localhost:6379/0", pin_budget=budget)
