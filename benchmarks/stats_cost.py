"""What ``engine.stats()`` costs as the engine's history grows, and what concurrent
Prometheus scrapes (each runs ``stats()`` on the loop) do to the loop.

``stats()`` reports the completion-callback latency p50 and p99 over the last 65,536
transfers. It used to sort that window twice per call; now the completion bridge keeps
it incrementally in log-linear buckets (``asyncoffload.transfer.completion``). The
baseline of every ratio is the old window, reimplemented here (``SortedWindow``) and
swapped into the same engine holding the same samples, so "old" and "now" differ only
in the window. Three parts:

1. ``stats()`` time after 0, 1,000, 65,536 and 1,000,000 transfers of history. The
   samples (log-normal, median 30 us) are fed to the engine's latency window directly;
   the old window gets the same ones.
2. One real engine (CPU backend, tiny blocks) after 65,536 real transfers (stores and
   loads from 32 tasks): ``stats()`` with its window, and with the old window holding
   the same real samples (recorded as they came).
3. At that point, ``EngineMetrics.serve()`` scraped by 16 concurrent clients (threads of
   a separate process, each GET /metrics back to back) for ``--scrape-seconds``: the
   loop lag (how late a 10 ms sleep wakes), scrapes per second and scrape latency, with
   no scrapers, with the engine's window, and with the old window.

Timings are medians of back-to-back calls (``time.perf_counter_ns``) over about
``--budget`` seconds per case, at least 20 calls. Results: docs/benchmarks.md.

    .venv/bin/python benchmarks/stats_cost.py [--loop uvloop|asyncio] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import random
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Sequence
from typing import Any, cast

import torch
from control_plane import machine_info
from soak import LagTicker

import asyncoffload as ao
from asyncoffload.histogram import LATENCY_BUCKETS_S, Histogram
from asyncoffload.integrations.prometheus import EngineMetrics
from asyncoffload.transfer.completion import CompletionBridge, LatencyWindow

WINDOW = 65_536
HISTORIES = (0, 1_000, 65_536, 1_000_000)


class SortedWindow:
    """The completion bridge's latency window before the fix: the last ``size`` samples
    in a ring, each percentile a sort of the whole window (``stats()`` asks for two)."""

    def __init__(self, size: int = WINDOW) -> None:
        self._buf = array("q", bytes(8 * size))
        self._size = size
        self._count = 0
        self.histogram = Histogram(LATENCY_BUCKETS_S)

    def add(self, value_ns: int) -> None:
        self._buf[self._count % self._size] = value_ns
        self._count += 1
        self.histogram.observe(value_ns * 1e-9)

    @property
    def count(self) -> int:
        return self._count

    def percentile_us(self, q: float) -> float:
        n = min(self._count, self._size)
        if n == 0:
            return float("nan")
        data = sorted(self._buf[:n])
        idx = min(n - 1, max(0, round(q / 100 * (n - 1))))
        return data[idx] / 1e3


def tiny_engine(gpu_blocks: int = 256, cpu_blocks: int = 4096) -> ao.AsyncOffloadEngine:
    kv = [torch.zeros((2, gpu_blocks, 1, 1, 8), dtype=torch.float16)]
    return ao.AsyncOffloadEngine(kv, ao.EngineConfig(cpu_blocks=cpu_blocks))


def bridge_of(engine: ao.AsyncOffloadEngine) -> CompletionBridge:
    bridge = engine._bridge
    assert bridge is not None, "use the engine first (async with engine)"
    return bridge


def time_calls(engine: ao.AsyncOffloadEngine, budget_s: float) -> dict[str, float]:
    """``engine.stats()`` back to back for about ``budget_s`` (at least 20 calls): the
    median and the largest call, in microseconds."""
    times: list[int] = []
    end = time.perf_counter() + budget_s
    gc.collect()
    while len(times) < 20 or time.perf_counter() < end:
        t0 = time.perf_counter_ns()
        engine.stats()
        times.append(time.perf_counter_ns() - t0)
        if len(times) >= 100_000:
            break
    return {
        "median_us": statistics.median(times) / 1e3,
        "max_us": max(times) / 1e3,
        "calls": len(times),
    }


def compare(engine: ao.AsyncOffloadEngine, old: SortedWindow, budget_s: float) -> dict[str, Any]:
    """``stats()`` with the engine's own window, then with ``old`` swapped in."""
    bridge = bridge_of(engine)
    now = bridge.latency
    out: dict[str, Any] = {"now": time_calls(engine, budget_s)}
    out["p50_now_us"] = now.percentile_us(50)
    out["p99_now_us"] = now.percentile_us(99)
    bridge.latency = cast(LatencyWindow, old)
    try:
        out["old"] = time_calls(engine, budget_s)
        out["p50_old_us"] = old.percentile_us(50)
        out["p99_old_us"] = old.percentile_us(99)
    finally:
        bridge.latency = now
    out["ratio"] = out["now"]["median_us"] / out["old"]["median_us"]
    return out


def sort_twice_ms(n: int, repeat: int = 5) -> float:
    """Sorting ``n`` random int64 samples twice, alone (median of ``repeat``), ms."""
    rng = random.Random(1)
    buf = array("q", (int(rng.lognormvariate(math.log(30e3), 0.8)) for _ in range(n)))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        sorted(buf[:n])
        sorted(buf[:n])
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6


async def synthetic_histories(
    histories: Sequence[int], budget_s: float
) -> list[tuple[int, dict[str, Any]]]:
    """Part 1: ``stats()`` now and old after each history length (fed samples)."""
    engine = tiny_engine()
    rng = random.Random(0)
    out = []
    async with engine:
        window = bridge_of(engine).latency
        old = SortedWindow()
        fed = 0
        for target in sorted(histories):
            while fed < target:
                value = int(rng.lognormvariate(math.log(30e3), 0.8))
                window.add(value)
                old.add(value)
                fed += 1
            out.append((target, compare(engine, old, budget_s)))
    return out


async def real_engine(
    transfers: int, tasks: int = 32, blocks: int = 4
) -> tuple[ao.AsyncOffloadEngine, SortedWindow, float]:
    """Part 2, the run: an engine after ``transfers`` real transfers, its samples also
    recorded in an old window. Returns the engine (open: close it), the old window and
    the seconds the transfers took."""
    engine = tiny_engine(gpu_blocks=tasks * blocks, cpu_blocks=4096)
    await engine.__aenter__()
    window = bridge_of(engine).latency
    old = SortedWindow()
    add_now = window.add

    def tee(value_ns: int) -> None:
        add_now(value_ns)
        old.add(value_ns)

    window.add = tee  # type: ignore[method-assign]
    per_task = transfers // (2 * tasks)

    async def worker(t: int) -> None:
        gpu = list(range(t * blocks, (t + 1) * blocks))
        for i in range(per_task):
            keys = [
                ao.make_offload_key(t.to_bytes(4, "big") + (i * blocks + j).to_bytes(8, "big"))
                for j in range(blocks)
            ]
            handle = await engine.prepare_store(keys, gpu)
            assert handle is not None
            await handle
            # What the store wrote (the default policy may decline blocks once the tier
            # is full): a declined key is stored nowhere and cannot be loaded.
            stored = handle.keys_to_store
            if stored:
                await (await engine.prepare_load(stored, gpu[: len(stored)]))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(t) for t in range(tasks)))
    elapsed = time.perf_counter() - t0
    window.add = add_now  # type: ignore[method-assign]
    return engine, old, elapsed


SCRAPER = r"""
import json, sys, threading, time, urllib.request
url, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
lat, errors = [], [0]
end = time.monotonic() + seconds
def run():
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                r.read()
            lat.append(time.perf_counter() - t0)
        except Exception:
            errors[0] += 1
threads = [threading.Thread(target=run) for _ in range(n)]
for t in threads: t.start()
for t in threads: t.join()
lat.sort()
q = lambda p: lat[min(len(lat) - 1, int(p / 100 * len(lat)))] * 1e3 if lat else float("nan")
print(json.dumps({"scrapes": len(lat), "errors": errors[0], "p50_ms": q(50), "p99_ms": q(99)}))
"""


async def loop_lag_under_scrapes(
    engine: ao.AsyncOffloadEngine, port: int | None, scrapers: int, seconds: float
) -> dict[str, float]:
    """Part 3, one case: the loop's lag while ``scrapers`` clients scrape ``port`` (none
    when ``port`` is None) for ``seconds``."""
    ticker = LagTicker(0.01)
    ticker.recording = True
    task = asyncio.create_task(ticker.run())
    out: dict[str, float] = {}
    try:
        if port is None:
            await asyncio.sleep(seconds)
        else:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                SCRAPER,
                f"http://127.0.0.1:{port}/metrics",
                str(scrapers),
                str(seconds),
                stdout=subprocess.PIPE,
            )
            stdout, _ = await proc.communicate()
            got = json.loads(stdout)
            out.update(
                scrapes_per_s=got["scrapes"] / seconds,
                errors=got["errors"],
                scrape_p50_ms=got["p50_ms"],
                scrape_p99_ms=got["p99_ms"],
            )
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    lag = ticker.total
    out.update(
        lag_p50_ms=lag.percentile_ms(50),
        lag_p99_ms=lag.percentile_ms(99),
        lag_max_ms=lag.max_ns / 1e6,
        ticks=lag.n,
    )
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"sort_twice_ms": sort_twice_ms(WINDOW)}
    out["histories"] = await synthetic_histories(args.histories, args.budget)
    engine, old, elapsed = await real_engine(args.real_transfers)
    try:
        s = engine.stats()
        out["real"] = {
            "transfers": s.stores + s.loads,
            "window_samples": bridge_of(engine).latency.count,
            "seconds": elapsed,
            **compare(engine, old, args.budget),
        }
        scrape: dict[str, dict[str, float]] = {}
        if args.scrapers:
            bridge = bridge_of(engine)
            now = bridge.latency
            with EngineMetrics(engine) as metrics:
                port = metrics.serve(0)
                scrape["none"] = await loop_lag_under_scrapes(engine, None, 0, args.scrape_seconds)
                scrape["now"] = await loop_lag_under_scrapes(
                    engine, port, args.scrapers, args.scrape_seconds
                )
                bridge.latency = cast(LatencyWindow, old)
                try:
                    scrape["old"] = await loop_lag_under_scrapes(
                        engine, port, args.scrapers, args.scrape_seconds
                    )
                finally:
                    bridge.latency = now
        out["scrape"] = scrape
    finally:
        await engine.aclose()
    return out


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"{k:>13}: {v}" for k, v in machine_info(args.loop)]
    lines.append(
        f"{'baseline':>13}: the old window (sorts {WINDOW:,} samples twice per stats()): "
        f"{res['sort_twice_ms']:.2f} ms for the two sorts alone"
    )
    lines += [
        "",
        "| history (transfers) | stats() now: median / max us | old window: median / max us "
        "| now / old | p99 now / old us |",
        "|---|---:|---:|---:|---:|",
    ]

    def row(label: str, r: dict[str, Any]) -> str:
        now, old = r["now"], r["old"]
        return (
            f"| {label} | {now['median_us']:.1f} / {now['max_us']:.0f} | "
            f"{old['median_us']:,.1f} / {old['max_us']:,.0f} | {r['ratio']:.4f} | "
            f"{r['p99_now_us']:.1f} / {r['p99_old_us']:.1f} |"
        )

    for n, r in res["histories"]:
        lines.append(row(f"{n:,} (fed)", r))
    real = res["real"]
    lines.append(row(f"{real['transfers']:,} (real engine)", real))
    worst = max(r["now"]["median_us"] for _, r in res["histories"])
    lines.append("")
    lines.append(
        f"largest median of stats() now: {worst:.1f} us (goal: under 1 ms at any history); "
        f"the real engine ran {real['transfers']:,} transfers in {real['seconds']:.1f} s, "
        f"{real['window_samples']:,} latency samples"
    )
    scrape = res.get("scrape") or {}
    if scrape:
        lines += [
            "",
            f"| {args.scrapers} scrapers, {args.scrape_seconds:g} s | scrapes/s | scrape p50 / "
            "p99 ms | loop lag p50 / p99 / max ms | lag p99 / old |",
            "|---|---:|---:|---:|---:|",
        ]
        old_p99 = scrape["old"]["lag_p99_ms"]
        for name, label in (("none", "no scraper"), ("now", "stats() now"), ("old", "old window")):
            r = scrape[name]
            rate = f"{r['scrapes_per_s']:.1f}" if "scrapes_per_s" in r else "-"
            lat = f"{r['scrape_p50_ms']:.1f} / {r['scrape_p99_ms']:.1f}" if rate != "-" else "-"
            lines.append(
                f"| {label} | {rate} | {lat} | {r['lag_p50_ms']:.2f} / {r['lag_p99_ms']:.2f} / "
                f"{r['lag_max_ms']:.1f} | {r['lag_p99_ms'] / old_p99:.3f} |"
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    default_loop = "uvloop" if ao.loops.uvloop_available() else "asyncio"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default=default_loop)
    ap.add_argument("--histories", type=int, nargs="+", default=list(HISTORIES))
    ap.add_argument("--real-transfers", type=int, default=WINDOW)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of calls per case")
    ap.add_argument("--scrapers", type=int, default=16, help="concurrent scrapers (0: none)")
    ap.add_argument("--scrape-seconds", type=float, default=10.0)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if min(args.histories) < 0 or args.real_transfers < 64 or args.budget <= 0:
        ap.error("histories must be >= 0, --real-transfers >= 64, --budget > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    res = ao.run(measure(args), use_uvloop=args.loop == "uvloop")
    print(report(res, args))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": dict(machine_info(args.loop)), **res}, f, indent=1)
    print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
