"""Two tenants on one engine, one flooding and one steady (issue 40's quotas), over any
list of lower tiers: run by tests/test_quota_tiers.py (CPU, disk, Valkey) and by
tests/mooncake_engines.py's ``quotas`` scenario (CPU, disk, Valkey, Mooncake).

Nothing here decides anything: :func:`run` reports what the engine did, the tests
assert. Each round, the steady tenant looks up its 6 blocks, loads those found and
stores the others; the flood stores 10 new blocks in one call (more than its CPU
quota of 8); an opted-out request of the steady tenant stores 3 blocks once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

import asyncoffload as ao
from tests.helpers import tier_index

NUM_KV = 32
FRAG = 4096
ROUNDS = 6
STEADY = [ao.make_offload_key(b"steady" + bytes([i]) * 26) for i in range(6)]
OPTED = [ao.make_offload_key(b"opted" + bytes([i]) * 27) for i in range(3)]
#: Each wait, at most.
WAIT_S = 30.0


def flood_keys(r: int) -> list[ao.OffloadKey]:
    return [ao.make_offload_key(b"flood" + bytes([r, i]) * 13 + b"!") for i in range(10)]


def config(tiers: list[Any]) -> ao.EngineConfig:
    """16 CPU blocks, 8 for each tenant; each lower tier its own quotas (its settings)."""
    return ao.EngineConfig(
        cpu_blocks=16,
        policy="lru",
        tenants=["flood", "steady"],
        quotas={"flood": 8, "steady": "50%"},
        tiers=tiers,
        model="m",
    )


async def run(tiers: list[Any], flood: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    kv = [torch.randint(0, 256, (NUM_KV, FRAG), dtype=torch.uint8, generator=gen) for _ in range(2)]
    steady = ao.ReqContext("steady", tenant="steady")
    hits = 0
    flood_declined = 0
    out: dict[str, Any] = {}
    async with ao.AsyncOffloadEngine(kv, config(tiers)) as eng:
        for r in range(ROUNDS):
            n = eng.lookup(STEADY, steady)
            hits += n
            if n:
                await asyncio.wait_for(
                    await eng.prepare_load(STEADY[:n], range(20, 20 + n), steady), WAIT_S
                )
            handle = await eng.prepare_store(STEADY, range(6), steady)
            assert handle is not None
            await asyncio.wait_for(handle, WAIT_S)
            if flood:
                ctx = ao.ReqContext(f"flood{r}", tenant="flood")
                handle = await eng.prepare_store(flood_keys(r), range(6, 16), ctx)
                assert handle is not None
                flood_declined += len(handle.declined_keys)
                await asyncio.wait_for(handle, WAIT_S)
            if r == 1:
                ctx = ao.ReqContext("opted", tenant="steady", no_store=True)
                handle = await eng.prepare_store(OPTED, range(16, 19), ctx)
                assert handle is not None and handle.keys_to_store == []
                out["opted_declined"] = len(handle.declined_keys)
                await asyncio.wait_for(handle, WAIT_S)
            await asyncio.wait_for(eng.flush(), WAIT_S)
        out["hits"] = hits
        out["lookups"] = ROUNDS * len(STEADY)
        out["flood_declined"] = flood_declined
        # The flood's last blocks: found by the flood, never by the steady tenant.
        last = flood_keys(ROUNDS - 1)
        out["flood_sees_own"] = eng.lookup(last, ao.ReqContext("f", tenant="flood"))
        out["steady_sees_flood"] = eng.lookup(last, steady)
        filed = {
            "flood": {ao.tenant_key(k, "flood") for r in range(ROUNDS) for k in flood_keys(r)},
            "steady": {ao.tenant_key(k, "steady") for k in STEADY},
            "opted": {ao.tenant_key(k, "steady") for k in OPTED},
        }
        stats = eng.stats()
        indices = [("CPU", eng.manager, stats.manager)]
        indices += [(t.name, tier_index(eng, i), t.manager) for i, t in enumerate(stats.tiers)]
        out["tiers"] = {}
        for name, index, m in indices:
            resident = set(index.resident_keys())
            out["tiers"][name] = {
                "resident": len(resident),
                "flood": len(resident & filed["flood"]),
                "steady": len(resident & filed["steady"]),
                "opted": len(resident & filed["opted"]),
                "other": len(resident - filed["flood"] - filed["steady"]),
                "quota_refused": m.quota_refused,
                "opted_out": m.opted_out,
                "tenants": {t.tenant: t._asdict() for t in m.tenants},
            }
    return out
