"""What publishing KV events costs the event loop.

Drives an engine on the CPU backend (tiny blocks, so copies cost little and the loop's
own work shows) through stores that each evict, so every store yields a removed and a
stored event, and measures stores per second of loop time:

- without a publisher (the baseline),
- with a ``KVEventPublisher`` (placeholders), and a SUB subscriber reading in a thread,
- the same with self-describing stores (``BlockTokens``: token ids in every BlockStored),
- with a subscriber that never reads (the PUB socket drops at its high-water mark; the
  loop must not stall): the longest gap between two loop ticks is reported.

Runs interleaved, best of ``--repeat``; ratios are against the baseline of the same run.

    python benchmarks/kv_events.py [--stores 4000] [--blocks 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import threading
import time
from typing import Any

import torch
import zmq

import asyncoffload as ao
from asyncoffload.integrations.kv_events import KVEventPublisher, KVEventsConfig

BLOCK_SIZE = 16


def _engine(cpu_blocks: int, gpu_blocks: int) -> ao.AsyncOffloadEngine:
    kv = [torch.zeros(2, gpu_blocks, BLOCK_SIZE, 1, 8, dtype=torch.float16)]
    return ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=cpu_blocks))


async def _ticks(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def _reader(endpoint: str, ctx: zmq.Context[Any], done: threading.Event, got: list[int]) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    n = 0
    while not done.is_set() or sub.poll(50):
        if sub.poll(20):
            sub.recv_multipart()
            n += 1
    got.append(n)
    sub.close(linger=0)


async def run_case(case: str, stores: int, blocks: int) -> dict[str, float]:
    """Stores per second with ``case`` in {"none", "publish", "tokens", "stalled"}."""
    engine = _engine(cpu_blocks=4 * blocks, gpu_blocks=blocks)
    ctx: zmq.Context[Any] = zmq.Context()
    done = threading.Event()
    got: list[int] = []
    reader = None
    stalled = None
    out: dict[str, float] = {}
    async with engine:
        pub = None
        if case != "none":
            cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", hwm=1000)
            pub = KVEventPublisher(engine, cfg, context=ctx)
            await pub.start()
            if case == "stalled":
                stalled = ctx.socket(zmq.SUB)  # subscribed, never reads
                stalled.setsockopt(zmq.SUBSCRIBE, b"")
                stalled.setsockopt(zmq.RCVHWM, 100)
                stalled.connect(pub.endpoint)
            else:
                reader = threading.Thread(target=_reader, args=(pub.endpoint, ctx, done, got))
                reader.start()
            await asyncio.sleep(0.2)
        ids = list(range(blocks))
        stop = asyncio.Event()
        gaps: list[float] = []
        ticker = asyncio.create_task(_ticks(stop, gaps))
        t0 = time.perf_counter()
        for i in range(stores):
            tokens = [(i * 7919 + j) % 32000 for j in range(blocks * BLOCK_SIZE)]
            bt = ao.BlockTokens.from_tokens(tokens, BLOCK_SIZE, salt=i.to_bytes(8, "big"))
            ctx_req = ao.ReqContext(str(i), tokens=bt if case == "tokens" else None)
            handle = await engine.prepare_store(list(bt.keys), ids, ctx_req)
            assert handle is not None
            await handle
        elapsed = time.perf_counter() - t0
        stop.set()
        await ticker
        out["stores_per_s"] = stores / elapsed
        out["max_gap_ms"] = max(gaps) * 1e3 if gaps else 0.0
        if pub is not None:
            await asyncio.sleep(0.1)
            out["batches"] = pub.stats().batches_published
            await pub.aclose()
    done.set()
    if reader is not None:
        reader.join()
        out["received"] = got[0]
    if stalled is not None:
        stalled.close(linger=0)
    ctx.destroy(linger=0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", type=int, default=4000)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per store")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    cases = ["none", "publish", "tokens", "stalled"]
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeat):
        for case in cases:
            r = asyncio.run(run_case(case, args.stores, args.blocks))
            if case not in best or r["stores_per_s"] > best[case]["stores_per_s"]:
                best[case] = r
    print(f"python {platform.python_version()} on {platform.machine()} {platform.processor()}")
    print(f"{args.stores} stores of {args.blocks} blocks, each evicting; best of {args.repeat}")
    base = best["none"]["stores_per_s"]
    for case in cases:
        r = best[case]
        extra = ", ".join(f"{k} {v:,.1f}" for k, v in r.items() if k != "stores_per_s")
        print(
            f"{case:8} {r['stores_per_s']:9,.0f} stores/s  {r['stores_per_s'] / base:5.2f}x  "
            f"({extra})"
        )


if __name__ == "__main__":
    main()
