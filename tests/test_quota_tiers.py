"""Tenant quotas in every tier, end to end (issue 40): a flooding tenant and a steady one
on one engine with CPU, disk and Valkey tiers (tests/quota_flood.py; the Mooncake tier
joins them in tests/test_mooncake_tier.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import asyncoffload as ao
from tests import quota_flood
from tests.servers import Server, valkey_binary

pytestmark = pytest.mark.skipif(
    not valkey_binary().exists(), reason="valkey-server is not installed"
)

FLOOD_LOWER = 4  # the flood's quota in each lower tier: half of what one flood store offers


def tiers(tmp_path: Path, url: str) -> list[Any]:
    quotas = {"flood": FLOOD_LOWER, "steady": "50%"}
    return [
        ao.DiskTier(tmp_path / "disk", "1MiB", "slab", admission=None, quotas=quotas),
        ao.RemoteTier(url=url, index_blocks=64, timeout_s=5.0, quotas=quotas),
    ]


def check_flood_and_steady(calm: dict[str, Any], flood: dict[str, Any], names: list[str]) -> None:
    """What issue 40 asks of quotas, for the tiers named ``names`` (CPU first)."""
    rounds = quota_flood.ROUNDS
    # The steady tenant's hit rate is the same with and without the flood.
    assert flood["hits"] == calm["hits"] == (rounds - 1) * len(quota_flood.STEADY)
    # The flood's refusals are counted: 2 of each 10-block store in the CPU tier (its
    # quota is 8), on the handle and per tenant; 4 of each 8-block write-through below.
    assert flood["flood_declined"] == 2 * rounds
    cpu = flood["tiers"]["CPU"]
    assert cpu["quota_refused"] == 2 * rounds
    assert cpu["tenants"]["flood"]["refused"] == 2 * rounds
    assert cpu["tenants"]["flood"]["held"] == cpu["flood"] == 8
    for name in names[1:]:
        tier = flood["tiers"][name]
        assert tier["tenants"]["flood"]["refused"] == tier["quota_refused"] == 4 * rounds, name
        assert tier["tenants"]["flood"]["held"] == tier["flood"] == FLOOD_LOWER, name
    # No block crosses tenants: each tier holds only blocks filed for their own tenant,
    # all of the steady tenant's, and the steady tenant never finds the flood's.
    assert flood["flood_sees_own"] == 10 - 2 and flood["steady_sees_flood"] == 0
    for run in (calm, flood):
        assert list(run["tiers"]) == names
        for name, tier in run["tiers"].items():
            assert tier["other"] == 0 and tier["opted"] == 0, name
            assert tier["steady"] == len(quota_flood.STEADY), name
            assert tier["tenants"]["steady"]["refused"] == 0, name
    # The opted-out request stored nothing anywhere, and was counted.
    assert calm["opted_declined"] == 3
    assert calm["tiers"]["CPU"]["opted_out"] == 3
    assert calm["tiers"]["CPU"]["tenants"]["steady"]["opted_out"] == 3


def test_a_flood_leaves_the_steady_tenant_alone_in_cpu_disk_and_valkey(
    tmp_path: Path, valkey_server: Server
) -> None:
    calm = asyncio.run(quota_flood.run(tiers(tmp_path / "a", valkey_server.url), flood=False))
    valkey_server.command("FLUSHALL")
    flood = asyncio.run(quota_flood.run(tiers(tmp_path / "b", valkey_server.url), flood=True))
    names = list(flood["tiers"])
    assert len(names) == 3
    check_flood_and_steady(calm, flood, names)


def test_quota_settings_name_what_is_wrong(tmp_path: Path) -> None:
    base = {"cpu_blocks": 16, "tenants": ["a"], "model": "m"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"quotas": {"b": 4}}, r"quotas: 'b' is not a known tenant; known: 'a'"),
        ({"quotas": {"a": 17}}, r"quotas\['a'\]: quota 17 \(17 blocks\) is larger than the tier"),
        ({"quotas": {"a": 0}}, r"quotas\['a'\]: a quota must be positive"),
        ({"quotas": {"a": "-5%"}}, r"quotas\['a'\]: a share must be above 0%"),
        ({"quotas": {"a": "lots"}}, r"quotas\['a'\]: 'lots' is not a byte size"),
        (
            {"tiers": [ao.DiskTier(tmp_path, "1MiB", quotas={"z": 1})]},
            r"tiers\[0\]\.quotas: 'z' is not a known tenant",
        ),
    ]
    for extra, words in cases:
        with pytest.raises(ValueError, match=words):
            ao.EngineConfig(**{**base, **extra})
    with pytest.raises(ValueError, match=r"quotas\['a'\]: a share must be above 0%"):
        ao.DiskTier(tmp_path, "1MiB", quotas={"a": "0%"})


async def test_a_quota_larger_than_its_tier_fails_the_engine_and_closes_its_tiers(
    tmp_path: Path,
) -> None:
    import torch

    kv = [torch.zeros(8, 4096, dtype=torch.uint8)]
    cfg = ao.EngineConfig(
        cpu_blocks=8,
        tenants=["a"],
        quotas={"a": "64KiB"},  # 16 blocks of 4 KiB: larger than the CPU tier's 8
        model="m",
    )
    with pytest.raises(ValueError, match=r"quotas\['a'\]: quota '64KiB' \(16 blocks\) is larger"):
        ao.AsyncOffloadEngine(kv, cfg)
    disk = ao.DiskTier(tmp_path, "256KiB", "slab", quotas={"a": "1GiB"})
    cfg = ao.EngineConfig(cpu_blocks=8, tenants=["a"], tiers=[disk], model="m")
    with pytest.raises(ValueError, match=r"tiers\[0\]\.quotas\['a'\]: quota '1GiB'"):
        ao.AsyncOffloadEngine(kv, cfg)


async def test_an_opted_out_request_offers_nothing_to_the_tiers_below(tmp_path: Path) -> None:
    """A block the CPU tier holds already is offered below again by a later store of it
    (the disk's "frequency" admission writes it at its ``min_offers``-th offer); an
    opted-out request's store is no such offer: it counts nowhere."""
    import torch

    from tests.helpers import tier_index

    kv = [torch.zeros(8, 4096, dtype=torch.uint8)]
    disk = ao.DiskTier(tmp_path, "256KiB", "slab", min_offers=3)
    cfg = ao.EngineConfig(cpu_blocks=8, tiers=[disk], model="m")
    keys = [ao.make_offload_key(bytes([i]) * 16) for i in range(2)]
    opted = ao.ReqContext("o", kv_transfer_params={"asyncoffload_no_store": True})
    async with ao.AsyncOffloadEngine(kv, cfg) as engine:
        for ctx in (None, opted, None):  # offers 1 and 2 below; the opted-out one is none
            handle = await engine.prepare_store(keys, [0, 1], ctx)
            assert handle is not None
            await handle
            await engine.flush()
            assert list(tier_index(engine).resident_keys()) == []
        handle = await engine.prepare_store(keys, [0, 1])  # the third offer writes
        assert handle is not None
        await engine.flush()
        assert sorted(tier_index(engine).resident_keys()) == sorted(keys)
        assert engine.stats().tiers[0].manager.opted_out == 0
