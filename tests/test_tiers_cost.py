"""Load or recompute, by measured cost (``asyncoffload.tiers.core.cost``): the read and
recompute models, the decision, and the invariant on a real engine with a disk tier: a
slow tier is no worse than no tier (its promotions are declined once measured, and a read
past its deadline falls back to recompute), a fast one is used."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

import asyncoffload as ao
from asyncoffload.engine_tiers import LoopTiers, cost_model
from asyncoffload.integrations.vllm.steps import PrefillClock
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.manager.base import Medium
from asyncoffload.tiers import _io
from asyncoffload.tiers.base import TierManager
from asyncoffload.tiers.core import (
    STALL_GRACE_S,
    CostedHierarchy,
    CostModel,
    Exists,
    ReadModel,
    RecomputeModel,
    TierIo,
    TierState,
)
from asyncoffload.tiers.disk import DiskStore
from tests.test_tier_core import (
    BLOCK,
    DEADLINE_S,
    cpu_stored,
    key,
    of,
    ok,
    stored,
    tier,
)
from tests.test_tiers import config, engine, keys, store_to_disk_only

BLOCK_BYTES = 8192


def _tier() -> TierState:
    return TierState("disk", Medium.DISK, BLOCK_BYTES, 1.0, TierManager(4, Medium.DISK))


# --- the models -----------------------------------------------------------------------


def test_a_read_model_separates_latency_from_bandwidth() -> None:
    model = ReadModel()
    for n in (1, 8, 2, 16, 4) * 4:  # 2 ms a read, 1 GB/s
        model.observe(0.002 + n * BLOCK_BYTES / 1e9, n * BLOCK_BYTES)
    assert model.latency_s == pytest.approx(0.002, rel=0.01)
    assert model.bytes_per_s == pytest.approx(1e9, rel=0.01)
    assert model.expect(100 * BLOCK_BYTES) == pytest.approx(0.002 + 100 * BLOCK_BYTES / 1e9)


def test_a_read_model_starts_optimistic_floors_and_follows_a_slower_tier() -> None:
    model = ReadModel()
    assert model.expect(10**9) == model.floor_s  # nothing measured: as fast as the floor
    model.observe(0.0, BLOCK_BYTES)
    assert model.expect(BLOCK_BYTES) == model.floor_s  # never below the floor
    for _ in range(20):
        model.observe(0.5, BLOCK_BYTES)  # one size only: all of it is latency
    assert model.expect(BLOCK_BYTES) == pytest.approx(0.5, rel=0.01)
    model.observe(float("nan"), BLOCK_BYTES)
    model.observe(-1.0, BLOCK_BYTES)
    assert model.expect(BLOCK_BYTES) == pytest.approx(0.5, rel=0.01)


def test_a_recompute_model_is_configured_or_measured() -> None:
    model = RecomputeModel(tokens_per_block=16)
    assert model.seconds(4) is None  # unknown
    model.observe(1000, 0.5)
    assert model.seconds(4) == pytest.approx(64 / 2000)
    for _ in range(30):
        model.observe(1000, 1.0)
    assert model.seconds(4) == pytest.approx(64 / 1000, rel=0.01)
    fixed = RecomputeModel(tokens_per_block=16, tokens_per_s=160.0, configured=True)
    fixed.observe(10_000, 0.001)
    assert fixed.seconds(1) == pytest.approx(0.1)


def test_a_promotion_is_taken_only_when_reading_beats_recomputing() -> None:
    tier = _tier()
    cost = CostModel(recompute=RecomputeModel(16, 1600.0, configured=True))  # 10 ms a block
    assert cost.worth({tier: 4}, now=0.0)  # nothing measured yet: taken
    for _ in range(10):
        cost.read_model(tier).observe(0.1, 4 * BLOCK_BYTES)
    cost.read_at[tier] = 0.0
    assert not cost.worth({tier: 4}, now=1.0)  # 100 ms against 40 ms
    assert cost.worth({tier: 20}, now=1.0)  # 100 ms against 200 ms
    assert tier.counters.recomputed_by_choice == 4
    assert cost.deadline(4, now=1.0) == pytest.approx(1.0 + cost.min_deadline_s)
    assert cost.deadline(20, now=1.0) == pytest.approx(1.2)


def test_a_tier_judged_slow_is_probed_now_and_then() -> None:
    tier = _tier()
    cost = CostModel(recompute=RecomputeModel(16, 1600.0, configured=True))
    cost.read_model(tier).observe(1.0, BLOCK_BYTES)
    cost.read_at[tier] = 0.0
    assert not cost.worth({tier: 1}, now=1.0)
    assert cost.worth({tier: 1}, now=cost.probe_every_s)  # a probe: measured again
    assert not cost.worth({tier: 1}, now=cost.probe_every_s + 1.0)
    assert tier.counters.recomputed_by_choice == 2


def test_without_a_recompute_rate_or_with_the_rule_off_every_promotion_is_taken() -> None:
    tier = _tier()
    unknown = CostModel(recompute=RecomputeModel(16))
    off = CostModel(enabled=False, recompute=RecomputeModel(16, 1600.0, configured=True))
    for cost in (unknown, off):
        cost.read_model(tier).observe(10.0, BLOCK_BYTES)
        cost.read_at[tier] = 0.0
        assert cost.worth({tier: 1}, now=1.0)
        assert cost.deadline(1, now=1.0) is None
    assert tier.counters.recomputed_by_choice == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("load_deadline_factor", 0.0),
        ("load_deadline_factor", -1.0),
        ("load_deadline_factor", math.inf),
        ("load_deadline_factor", 1000.0),
        ("load_deadline_floor_s", -0.01),
        ("load_deadline_floor_s", math.nan),
        ("load_deadline_floor_s", 120.0),
        ("load_probe_every_s", 0.0),
        ("load_probe_every_s", -1.0),
        ("load_probe_every_s", math.inf),
        ("load_probe_every_s", 7200.0),
    ],
)
def test_bad_load_deadline_settings_are_errors_naming_the_setting(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ao.EngineConfig(**{field: value})


def test_the_load_deadline_settings_reach_the_rule() -> None:
    cfg = ao.EngineConfig(
        tokens_per_block=16,
        recompute_tokens_per_s=1600.0,
        load_deadline_factor=3.0,
        load_deadline_floor_s=0.2,
        load_probe_every_s=30.0,
    )
    model = cost_model(cfg)
    assert (model.deadline_factor, model.min_deadline_s) == (3.0, 0.2)
    # A tier judged slow (1 s a read against 10 ms): probed 30 s after its last read.
    tier = _tier()
    model.read_model(tier).observe(1.0, BLOCK_BYTES)
    model.read_at[tier] = 0.0
    assert not model.worth({tier: 1}, now=29.0)  # the default's 5 s would probe
    assert model.worth({tier: 1}, now=30.0)
    # 10 blocks: 0.1 s to recompute, 0.3 s to load; 1 block: 10 ms, the floor 0.2 s.
    assert model.deadline(10, 5.0) == pytest.approx(5.3)
    assert model.deadline(1, 5.0) == pytest.approx(5.2)
    default = cost_model(ao.EngineConfig(tokens_per_block=16, recompute_tokens_per_s=1600.0))
    assert (default.deadline_factor, default.min_deadline_s) == (1.0, 0.05)
    assert default.probe_every_s == 5.0


def test_recompute_tokens_per_s_needs_tokens_per_block() -> None:
    with pytest.raises(ValueError, match=r"recompute_tokens_per_s=.*needs tokens_per_block"):
        ao.EngineConfig(recompute_tokens_per_s=1000.0)
    with pytest.raises(ValueError, match="recompute_tokens_per_s"):
        ao.EngineConfig(recompute_tokens_per_s=0.0, tokens_per_block=16)
    assert ao.EngineConfig(recompute_tokens_per_s=1e4, tokens_per_block=16).load_or_recompute


# --- the invariant, on an engine with a disk tier ----------------------------------------

needs_lanes = pytest.mark.skipif(not _io.available(), reason="native I/O lanes not built")

PROMPTS = 6
PER_PROMPT = 2


async def _serve(eng: ao.AsyncOffloadEngine, prompts: list[list[ao.OffloadKey]]) -> list[int]:
    """Serve each prompt as a serving engine does: look up, load the prefix found (a
    failed load is recomputed: no hit). The blocks each prompt got from the cache."""
    hits = []
    for ks in prompts:
        n = eng.lookup(ks)
        if n:
            try:
                await (await eng.prepare_load(ks[:n], list(range(20, 20 + n))))
            except ao.TransferError:
                n = 0
        hits.append(n)
    return hits


async def _on_disk(eng: ao.AsyncOffloadEngine) -> list[list[ao.OffloadKey]]:
    prompts = [keys(PER_PROMPT, start=10 * i) for i in range(PROMPTS)]
    for ks in prompts:
        await store_to_disk_only(eng, ks, [0, 1])
    return prompts


def _cost(eng: ao.AsyncOffloadEngine) -> CostModel:
    tiers = eng._tiers
    assert isinstance(tiers, LoopTiers)
    return tiers.core.cost


@needs_lanes
async def test_a_slow_tier_is_no_worse_than_none_and_its_decisions_are_counted(
    tmp_path: Path,
) -> None:
    """Each read takes 2 s; recomputing a prompt's blocks, 2 ms. The first promotion is
    taken (nothing measured yet) and falls back to recompute at its deadline, well
    before the read ends; every later one is declined at lookup: the lookups find what
    they find without the tier (nothing), and no request waits for the disk."""
    cfg = config(
        tmp_path, cpu_blocks=4, blocks=64, tokens_per_block=16, recompute_tokens_per_s=16_000.0
    )
    async with engine(cfg) as eng:
        prompts = await _on_disk(eng)
        _cost(eng).probe_every_s = math.inf  # no probe within the test
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        tier.pool.set_delay(2.0)
        try:
            started = time.monotonic()
            hits = await _serve(eng, prompts)
            waited = time.monotonic() - started
        finally:
            tier.pool.set_delay(0)
        stats = eng.stats().tiers[0]
    assert hits == [0] * PROMPTS  # what no tier gives: none is worse
    assert waited < 1.5  # the deadline (50 ms), not the 2 s read
    assert stats.recomputed_after_deadline == PER_PROMPT
    assert stats.recomputed_by_choice == (PROMPTS - 1) * PER_PROMPT
    assert stats.loaded == 0
    # At least the deadline (now - handed out, in floats: 0.049999999999954525 once).
    assert stats.read_latency_s is not None and stats.read_latency_s >= 0.05 - 1e-9


@needs_lanes
async def test_a_fast_tier_is_read_and_its_promotions_counted(tmp_path: Path) -> None:
    """Recomputing a block takes 16 s: reading it from disk wins, every time (and no
    read on a busy machine comes near that deadline)."""
    cfg = config(tmp_path, cpu_blocks=4, blocks=64, tokens_per_block=16, recompute_tokens_per_s=1.0)
    async with engine(cfg) as eng:
        prompts = await _on_disk(eng)
        hits = await _serve(eng, prompts)
        stats = eng.stats().tiers[0]
    assert hits == [PER_PROMPT] * PROMPTS
    assert stats.loaded == PROMPTS * PER_PROMPT
    assert stats.recomputed_by_choice == stats.recomputed_after_deadline == 0
    assert stats.read_latency_s is not None


@needs_lanes
async def test_with_the_rule_off_a_slow_tier_is_read_every_time(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        cpu_blocks=4,
        blocks=64,
        tokens_per_block=16,
        recompute_tokens_per_s=16_000.0,
        load_or_recompute=False,
    )
    async with engine(cfg) as eng:
        prompts = await _on_disk(eng)
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        tier.pool.set_delay(0.05)
        try:
            hits = await _serve(eng, prompts[:2])
        finally:
            tier.pool.set_delay(0)
        stats = eng.stats().tiers[0]
    assert hits == [PER_PROMPT] * 2
    assert stats.loaded == 2 * PER_PROMPT
    assert stats.recomputed_by_choice == stats.recomputed_after_deadline == 0


# --- the rule in the tier core (a fake clock, real indices) ------------------------------


def _core(tokens_per_s: float | None = 1600.0) -> tuple[CPUOffloadingManager, CostedHierarchy]:
    """A CPU tier of 8 slots over a disk tier and a shared tier; recomputing a block
    takes 10 ms (16 tokens at 1,600 tokens/s)."""
    cpu = CPUOffloadingManager(8, "lru")
    core = CostedHierarchy(cpu, [tier("disk0"), tier("remote1", shared=True)])
    core.cost.recompute = RecomputeModel(16, tokens_per_s, configured=tokens_per_s is not None)
    return cpu, core


def test_a_lookup_stops_before_a_run_that_reading_would_make_slower() -> None:
    cpu, core = _core()
    disk = core.tiers[0]
    cpu_stored(cpu, [key(0)])
    stored(disk, [key(1), key(2)])
    ks = [key(0), key(1), key(2)]
    assert core.lookup(ks, 1, now=0.0) == 3  # nothing measured: taken
    core.cost.read_model(disk).observe(0.5, 2 * BLOCK)
    core.cost.read_at[disk] = 0.0
    assert core.lookup(ks, 1, now=1.0) == 1  # 500 ms against 20 ms: the CPU prefix only
    assert disk.counters.recomputed_by_choice == 2
    assert disk.counters.lookup_hits == 2  # the first lookup's; the second counted none
    assert core.lookup(ks, 1) == 3  # no time: the plain rule (a first pass, a test)


def test_a_read_past_the_recompute_deadline_falls_back_and_is_measured() -> None:
    _, core = _core()
    disk = core.tiers[0]
    stored(disk, [key(1), key(2)])
    promotion = core.promote(core.sources([key(1), key(2)]))
    assert promotion is not None
    (io,) = of(TierIo, core.take_io(10.0))
    due = 10.0 + core.cost.min_deadline_s  # 20 ms of recompute: the 50 ms floor
    assert core.next_deadline() == pytest.approx(due)
    assert core.check(due - 0.001) == []
    assert core.check(due) == [promotion] and promotion.stalled
    assert disk.counters.recomputed_after_deadline == 2
    assert core.cost.read_model(disk).expect(2 * BLOCK) >= core.cost.min_deadline_s
    assert core.read_done(io, ok(io), 12.0) == [promotion]
    assert disk.counters.loaded == 0
    assert core.cost.read_model(disk).expect(2 * BLOCK) > core.cost.min_deadline_s
    assert core.stats()[0].recomputed_after_deadline == 2


def test_a_promotion_in_time_counts_loaded_and_feeds_the_read_model() -> None:
    _, core = _core()
    disk = core.tiers[0]
    stored(disk, [key(1)])
    promotion = core.promote(core.sources([key(1)]))
    (io,) = of(TierIo, core.take_io(0.0))
    assert core.read_done(io, ok(io), 0.004) == [promotion]
    assert core.read_done(io, ok(io), 9.0) == []  # a second hand-back changes nothing
    (stats, _) = core.stats()
    assert stats.loaded == 1 and stats.read_latency_s == pytest.approx(0.004)
    assert core.cost.read_model(disk).samples == 1


def test_without_a_recompute_rate_the_tiers_own_deadline_holds() -> None:
    _, core = _core(tokens_per_s=None)
    stored(core.tiers[0], [key(1)])
    core.promote(core.sources([key(1)]))
    core.take_io(0.0)
    assert core.next_deadline() == DEADLINE_S + STALL_GRACE_S


def test_a_question_waits_no_longer_than_recomputing_its_keys() -> None:
    _, core = _core()
    assert core.promote_key(key(1), 0.0)
    (q,) = of(Exists, core.take_io(0.0))
    assert q.deadline == pytest.approx(core.cost.min_deadline_s)
    core.check(q.deadline)
    assert q.settled and core.tiers[1].counters.failures == {"lookup_failed": 1}


def test_a_prefill_clock_times_steps_and_skips_idle_gaps() -> None:
    clock = PrefillClock()
    assert clock.step(0.0, 512, None) is None  # no step before
    assert clock.step(0.1, 512, None) == pytest.approx((512, 0.1))
    assert clock.step(0.2, 0, 5120.0) is None  # a decode step: nothing of a prefill
    assert clock.step(5.0, 512, 5120.0) is None  # idle for seconds, not a 0.1 s step
    assert clock.step(5.2, 1024, 5120.0) == pytest.approx((1024, 0.2))


@needs_lanes
async def test_a_recompute_rate_fed_by_the_serving_engine_drives_the_rule(tmp_path: Path) -> None:
    """No rate configured: every promotion is taken (the tier's deadline only) until the
    serving engine reports its prefill throughput; then a slow tier is declined."""
    cfg = config(tmp_path, cpu_blocks=4, blocks=64, tokens_per_block=16)
    async with engine(cfg) as eng:
        prompts = await _on_disk(eng)
        _cost(eng).probe_every_s = math.inf
        for bad in ((-1, 1.0), (True, 1.0), (16, 0.0), (16, math.inf), (16, math.nan)):
            with pytest.raises(ValueError, match="observe_prefill"):
                eng.observe_prefill(*bad)
        tier = eng.tiers[0]
        assert isinstance(tier, DiskStore)
        tier.pool.set_delay(0.05)
        try:
            assert await _serve(eng, prompts[:1]) == [PER_PROMPT]  # no rate: taken
            eng.observe_prefill(16_000, 1.0)  # 1 ms a block
            assert await _serve(eng, prompts[1:3]) == [0, 0]
        finally:
            tier.pool.set_delay(0)
        stats = eng.stats().tiers[0]
    assert stats.loaded == PER_PROMPT
    assert stats.recomputed_by_choice == 2 * PER_PROMPT
