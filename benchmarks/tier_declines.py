"""What the CPU tier's declines cost the tiers below it (issue 40).

The hierarchy is inclusive: lower tiers are written from the CPU tier's slots, so a block
the CPU tier's admission declines (the default policy ``auto`` follows ``kv``, which
declines new blocks worth less than what they would push out, once the tier is full)
never reaches a lower tier. Writing those blocks around the CPU tier would need host
memory to stage them in outside the tier and a second copy path. This measures what it
could win: an engine on the CPU backend with a CPU tier and a disk tier, the default
policy, a workload that fills the CPU tier, its requests served one at a time as the
replay serves them (look up, load the hits, store the rest, then ``flush``).

Per run: the blocks offered to the CPU tier and those it declined (``handle.declined_keys``),
the blocks written to disk and the blocks each tier served, and the optimistic gain of
writing around: the prefix blocks a request would have had if every block declined at an
offer the disk's admission takes (every offer with ``admission=None``; with
``"frequency"``, the ``min_offers``-th, declined offers counted) were still on disk (an
infinite disk: no eviction), past those it had. Its cost: one more disk write per such
block.

    python benchmarks/tier_declines.py [--requests 3000] [--cpu 5%] [--disk 50%]
        [--families chat,agent,mixed] [--admission frequency,none] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
from pathlib import Path
from typing import Any

import asyncoffload as ao
from asyncoffload.cli import capacity_shares
from asyncoffload.replay import capacity_blocks
from asyncoffload.simkv import SimulatedKVCache
from asyncoffload.tiers.base import TierManager
from asyncoffload.tiers.format import block_file_bytes
from asyncoffload.workloads import Request, families, summarize


async def run(
    requests: list[Request], cpu_blocks: int, disk_blocks: int, admission: str | None
) -> dict[str, Any]:
    width = max(len(req.keys) for req in requests)
    cache = SimulatedKVCache(1, width, 16, 1, 8)
    with tempfile.TemporaryDirectory() as path:
        probe = ao.KVLayout.infer(cache.kv_caches)
        tier = ao.DiskTier(
            path,
            (disk_blocks + 1) * block_file_bytes(probe.block_bytes),
            "slab",
            admission=admission,
            direct_io=False,
        )
        config = ao.EngineConfig(cpu_blocks=cpu_blocks, tiers=[tier])  # the default policy
        out: dict[str, Any] = {"policy": config.policy, "disk_admission": admission or "none"}
        blocks = hits = offered = declined = lost = refused = mismatches = 0
        ever_declined: set[ao.OffloadKey] = set()
        async with ao.AsyncOffloadEngine(cache.kv_caches, config) as engine:
            assert engine._tiers is not None
            core = engine._tiers.core
            disk_index = core.tiers[0].index
            assert isinstance(disk_index, TierManager)
            for req in requests:
                keys = list(req.keys)
                ids = list(range(len(keys)))
                n = engine.lookup(keys)
                # Write-around at best: every block ever declined is still on disk.
                m = n
                while m < len(keys):
                    key = keys[m]
                    around = key in ever_declined and engine.manager.block_of(key) is None
                    if not (around or core.lookup(keys, m, count=False) > m):
                        break
                    m += 1
                lost += m - n
                blocks += len(keys)
                hits += n
                if n:
                    await (await engine.prepare_load(keys[:n], ids[:n]))
                    mismatches += cache.check(keys[:n], ids[:n])
                cache.write(keys[n:], ids[n:])
                try:
                    handle = await engine.prepare_store(keys[n:], ids[n:])
                except ao.CapacityError:
                    handle = None
                if handle is None:
                    refused += 1
                else:
                    offered += len(handle.keys_to_store) + len(handle.declined_keys)
                    declined += len(handle.declined_keys)
                    # Written around, a declined block would reach the disk where its
                    # admission takes it at this offer (counted already: count_offers).
                    offers = disk_index._offers
                    ever_declined.update(
                        key
                        for key in handle.declined_keys
                        if offers is None or offers.counts.get(key, 0) >= offers.threshold
                    )
                    await handle
                await engine.flush()
            st = engine.stats()
            disk = st.tiers[0]
            out.update(
                prompt_blocks=blocks,
                hit_blocks=hits,
                disk_hit_blocks=disk.lookup_hits,
                offered=offered,
                declined=declined,
                cpu_store_skipped=st.manager.store_skipped,
                disk_written=disk.blocks_written,
                disk_skipped=disk.manager.store_skipped,
                refused=refused,
                write_around_gain_at_most=lost,
                mismatches=mismatches,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--cpu", default="5%", help="CPU tier, share of the unique blocks")
    ap.add_argument("--disk", default="50%", help="disk tier, share of the unique blocks")
    ap.add_argument("--families", default="chat,agent,mixed")
    ap.add_argument("--admission", default="frequency,none", help="the disk tier's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    (cpu_share,) = capacity_shares(args.cpu)
    (disk_share,) = capacity_shares(args.disk, at_most_all=False)
    rows = []
    for name in args.families.split(","):
        requests = families()[name].generate(args.requests, seed=args.seed)
        unique = summarize(requests).unique_blocks
        cpu, disk = capacity_blocks(cpu_share, unique), capacity_blocks(disk_share, unique)
        for admission in args.admission.split(","):
            r = asyncio.run(run(requests, cpu, disk, None if admission == "none" else admission))
            r.update(family=name, requests=len(requests), cpu_blocks=cpu, disk_blocks=disk)
            rows.append(r)
            gain = r["write_around_gain_at_most"]
            print(
                f"{name:>6} disk {r['disk_admission']:>9}: hits {r['hit_blocks']:,} of "
                f"{r['prompt_blocks']:,} ({r['disk_hit_blocks']:,} from disk); declined "
                f"{r['declined']:,} of {r['offered']:,} offered; disk wrote "
                f"{r['disk_written']:,}; write-around gain at most {gain:,} blocks "
                f"({gain / r['prompt_blocks']:.4f} of prompts)",
                flush=True,
            )
    if args.json:
        meta = {"machine": platform.node(), "processor": platform.processor()}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
