"""benchmarks/tier_contention.py's setup: every block it stores reaches the tier, even
where the tier's writes lag and backpressure sheds (``--reads 400`` on a Valkey server
once failed its first load: ``UnknownKeyError``, a read key shed on its way down)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tier_contention

import asyncoffload as ao

pytestmark = pytest.mark.long


async def test_the_setup_stores_every_block_in_a_lagging_tier(tmp_path: Path) -> None:
    # Every write lags 1 us: past the first write, a first offer is shed while one is in
    # flight (the tier is calm only with none in flight).
    tier = ao.DiskTier(tmp_path / "d", "8MiB", admission=None, write_lag_s=1e-6)
    kv = [torch.zeros((8, 4096), dtype=torch.uint8)]
    layout = ao.KVLayout.infer(kv, kv_split=False)
    cfg = ao.EngineConfig(cpu_blocks=64, tiers=[tier], model="bench", policy="lru")
    keys = tier_contention.make_keys(1, 256)
    async with ao.AsyncOffloadEngine(kv, cfg, layout=layout) as engine:
        await tier_contention._store(engine, keys, 8)
        assert engine.stats().tiers[0].write_shed == 0
        assert await engine.alookup(keys) == len(keys)
