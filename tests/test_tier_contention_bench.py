"""benchmarks/tier_contention.py's own bookkeeping: every block its setup stores reaches
the tier, even where the tier's writes lag and backpressure sheds (``--reads 400`` on a
Valkey server once failed its first load: ``UnknownKeyError``, a read key shed on its way
down); and a load of a block the tier evicted meanwhile is counted as missed, not raised
(1 MiB blocks on a 2 GiB disk ended the run)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tier_contention

import asyncoffload as ao

pytestmark = pytest.mark.long


async def test_the_setup_stores_every_block_in_a_lagging_tier(tmp_path: Path) -> None:
    # Every write lags 1 us: past the first write, a first offer is shed while one is in
    # flight (the tier is calm only with none in flight).
    tier = ao.DiskTier(tmp_path / "d", "8MiB", admission=None, write_lag_s=1e-6)
    keys = tier_contention.make_keys(1, 256)
    async with tier_contention.make_engine(tier, 4096, 8, 64) as engine:
        await tier_contention._store(engine, keys, 8)
        assert engine.stats().tiers[0].write_shed == 0
        assert await engine.alookup(keys) == len(keys)


async def test_a_load_of_a_block_the_tier_evicted_counts_as_missed(tmp_path: Path) -> None:
    # A disk of 8 blocks: storing 32 evicts the first ones (the busy phase of a run with
    # large blocks did that to its read keys, and the run ended in UnknownKeyError).
    block = 4096
    tier = ao.DiskTier(tmp_path / "d", 8 * (block + 4096), admission=None)
    keys = tier_contention.make_keys(2, 32)
    async with tier_contention.make_engine(tier, block, 8, 8) as engine:
        await tier_contention._store(engine, keys, 8)
        assert engine.lookup(keys[:1]) == 0, "the first block is still held"
        row = tier_contention.Row("disk", "test")
        rng = random.Random(1)
        ms, refused = await tier_contention._reads(engine, keys[:1] + keys[-1:], 7, rng, row)
        assert (row.dropped, row.missed, len(ms), refused) == (1, 0, 1, 0)


async def test_the_stores_only_control_stores_at_its_rate_and_writes_nothing_through(
    tmp_path: Path,
) -> None:
    # The control for what the engine's own stores cost the loads: its writer stores at
    # the rate asked (here 2,000 blocks a second, over the busy phase's 40 loads and
    # 0.2 s warm-up), and the tier is offered none of them.
    tier = ao.DiskTier(tmp_path / "d", "16MiB", admission=None)
    args = argparse.Namespace(
        reads=40, write_batch=8, queue_blocks=64, warmup_s=0.2, block_bytes=4096, cpu_blocks=64
    )
    row = await tier_contention.run_variant("disk", "stores-only", tier, args, stores_rate=2000.0)
    assert row.written_per_s == 0 and row.shed == 0
    assert len(row.busy_ms) + row.missed + row.dropped == 40
    assert 0 < row.stored_per_s <= 2000 * 1.1, row.stored_per_s
