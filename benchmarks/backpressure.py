"""Write-through backpressure on one workload: ours, an emulation of vLLM 0.34's EMA drop,
and none, in one run.

The workload is the demo's (``asyncoffload.demo``: multi-turn conversations over shared
system prompts, verified KV bytes) with a disk tier that writes ``--write-rate`` blocks
a second (each write job ends once the real one did and an emulated device, one job
after the other, wrote its blocks: a slow or busy disk; reads keep their speed), its
CPU tier far smaller than the working set. Each policy runs the same requests (same
seed), ``--repeat`` times; a run without the disk tier is the baseline. Per policy: the
hit rate (median of the runs), the blocks shed, the blocks whose waiting write gave its
CPU slots back (``yielded``), the stores the CPU tier refused and the
promotions refused for want of a CPU slot (a lagging tier's writes pin CPU slots), and
the blocks written.

Policies:

- ``none``: ``DiskTier(backpressure=False)``: every block is written through, its CPU
  slot pinned until the write ends;
- ``ours``: the default (``asyncoffload.tiers.core.backpressure``): once its writes take
  5 ms, a window of ``write_pin_share`` of the CPU tier's slots in flight, the other
  writes waiting unpinned (a waiting block the CPU tier evicts is not written:
  ``yielded``); a tier lagging (``write_lag_s``, or its writes queued past
  ``write_pin_share`` while the CPU tier misses slots) sheds first offers, and at twice
  the share every block;
- ``ours+guard``: the same with ``read_guard=True`` (writes held back while reads beside
  them are slower than idle ones and the writes lag);
- ``ema-drop``: vLLM 0.34's ``EMABackpressureDetector`` with ``DropStorePolicy``,
  re-implemented here from its description: an EMA (alpha 0.15, seeded by the mean of
  the first 10 completions) of each completed store's seconds per MiB (submission to
  completion); pressure above 0.010 s/MiB, cleared below 0.002 s/MiB (its ``LOCAL``
  watermarks, the ``fs`` tier's default); the EMA halves every 2 s without completions;
  under pressure every store to the tier is dropped (counted as shed here). It does not
  look at the CPU tier.

Run: ``.venv/bin/python benchmarks/backpressure.py [--write-rate 1000] [--repeat 3]
[--requests 400] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package

import asyncoffload as ao
from asyncoffload.demo import DemoConfig, run_demo
from asyncoffload.demo import run as demo_run
from asyncoffload.keys import OffloadKey
from asyncoffload.tiers.core import Backpressure, WritePressure
from asyncoffload.tiers.core.backpressure import CpuRoom, TierIo, TierState
from asyncoffload.tiers.disk import DiskStore

MIB = 1 << 20
#: ``ours``' write_pin_share (``--pin-share``).
PIN_SHARE = [Backpressure().write_pin_share]


class EmaDrop(WritePressure):
    """vLLM 0.34's EMA detector with its drop-every-store policy (see the docstring)."""

    def __init__(
        self,
        block_bytes: int,
        high: float = 0.010,
        low: float = 0.002,
        alpha: float = 0.15,
        warmup: int = 10,
        half_life_s: float = 2.0,
    ) -> None:
        super().__init__()
        self.block_bytes = block_bytes
        self.high, self.low, self.alpha = high, low, alpha
        self.warmup, self.half_life_s = warmup, half_life_s
        self.ema = 0.0
        self.samples: list[float] = []
        self.pressure = False
        self.updated = 0.0

    def _window(self, cpu: CpuRoom) -> float | None:
        """No window: every write is handed out at once (vLLM holds none back)."""
        return None

    def ended(self, io: TierIo, now: float, failed: bool = False) -> None:
        self.queued = max(0, self.queued - len(io.keys))
        self.flying = max(0, self.flying - len(io.keys))
        s_per_mib = max(0.0, now - io.sent) / (len(io.keys) * self.block_bytes / MIB)
        self._now = max(self._now, now)
        if len(self.samples) < self.warmup:
            self.samples.append(s_per_mib)
            if len(self.samples) == self.warmup:
                self.ema = statistics.fmean(self.samples)
                self.updated = now
            return
        self.ema = self.alpha * s_per_mib + (1 - self.alpha) * self.ema
        self.updated = now
        if self.ema > self.high:
            self.pressure = True
        elif self.ema < self.low:
            self.pressure = False

    def admit(self, tier: TierState, keys: Sequence[OffloadKey], cpu: CpuRoom) -> list[OffloadKey]:
        if self.pressure:  # idle decay, at the latest time seen
            self.ema *= 0.5 ** (max(0.0, self._now - self.updated) / self.half_life_s)
            self.updated = max(self.updated, self._now)
            if self.ema < self.low:
                self.pressure = False
        if not self.pressure:
            return list(keys)
        new = [key for key in keys if tier.index.block_of(key) is None]
        self.shed += len(new)
        tier.counters.write_shed += len(new)
        return []


class _Late:
    """A write job that ends once its real job ended and the emulated device wrote it."""

    def __init__(self, job: Any, at: float) -> None:
        self._job = job
        self._at = at

    def query(self) -> bool:
        return bool(self._job.query()) and time.monotonic() >= self._at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)


def _slow_writes(engine: ao.AsyncOffloadEngine, store: DiskStore, blocks_per_s: float) -> None:
    """The disk tier's writes end as on a device that writes ``blocks_per_s`` blocks a
    second, one job after the other (reads keep their speed)."""
    real = store.submit_write
    free_at = [0.0]

    def submit_write(keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]) -> Any:
        job = real(keys, slots, host)
        now = time.monotonic()
        free_at[0] = at = max(now, free_at[0]) + len(keys) / blocks_per_s
        tiers = engine._tiers
        assert tiers is not None and tiers._bridge is not None
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + (at - now) + 1e-4, tiers._bridge.notify)
        return _Late(job, at)

    store.submit_write = submit_write  # type: ignore[method-assign]


def _slow_engines(blocks_per_s: float, policy: str) -> Any:
    """``_open_engine`` whose disk tier writes slowly and has ``policy``."""
    real = demo_run._open_engine

    def open_engine(cfg: DemoConfig, kv: Any) -> ao.AsyncOffloadEngine:
        engine = real(cfg, kv)
        tiers = engine._tiers
        if tiers is not None:
            (store,) = tiers.stores
            assert isinstance(store, DiskStore)
            _slow_writes(engine, store, blocks_per_s)
            (state,) = tiers.core.tiers
            if policy == "ema-drop":
                state.pressure = EmaDrop(state.block_bytes)
            elif policy == "none":
                state.pressure = WritePressure(Backpressure(backpressure=False))
            else:
                guard = policy == "ours+guard"
                settings = Backpressure(write_pin_share=PIN_SHARE[0], read_guard=guard)
                state.pressure = WritePressure(settings)
        return engine

    return open_engine


def demo_config(args: argparse.Namespace, disk: Path | None, seed: int) -> DemoConfig:
    return DemoConfig(
        requests=args.requests,
        system_prompts=4,
        system_prompt_blocks=8,
        turns=4,
        blocks_per_turn=3.0,
        output_tokens=24.0,
        arrival_rate=400.0,
        think_time_s=0.02,
        cpu_blocks=args.cpu_blocks,
        layers=2,
        kv_heads=1,
        head_dim=16,
        concurrency=args.concurrency,
        time_scale=0.0,
        seed=seed,
        **({"disk_path": disk, "disk_bytes": "64MiB"} if disk is not None else {}),
    )


async def one(args: argparse.Namespace, policy: str, seed: int) -> dict[str, Any]:
    if policy == "no disk":
        report = await run_demo(demo_config(args, None, seed), progress=False)
        return {"hit_rate": report.hit_rate, "shed": 0, "yielded": 0, "written": 0,
                "stores_rejected": report.stores_rejected,
                "promotions_refused": report.promotions_refused}  # fmt: skip
    path = Path(tempfile.mkdtemp(prefix="bp-bench-"))
    real = demo_run._open_engine
    demo_run._open_engine = _slow_engines(args.write_rate, policy)
    try:
        report = await run_demo(demo_config(args, path / "tier", seed), progress=False)
    finally:
        demo_run._open_engine = real
        shutil.rmtree(path, ignore_errors=True)
    assert report.ok, (report.failed_requests, report.mismatches)
    (disk,) = report.stats.tiers
    return {
        "hit_rate": report.hit_rate,
        "shed": disk.write_shed,
        "yielded": disk.write_yielded,
        "written": disk.blocks_written,
        "stores_rejected": report.stores_rejected,
        "promotions_refused": report.promotions_refused,
    }


POLICIES = ("no disk", "none", "ours", "ours+guard", "ema-drop")


async def main_async(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for r in range(args.repeat):
        for policy in POLICIES:  # the same requests (seed) for every policy of a repetition
            out[policy].append(await one(args, policy, seed=r))
    return out


def write_rate(text: str) -> float:
    """``--write-rate``: blocks a second, more than 0 (``inf``: unthrottled)."""
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise argparse.ArgumentTypeError(
            f"must be a number of blocks a second above 0 (inf: unthrottled), got {text!r}"
        )
    return rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--write-rate",
        type=write_rate,
        default=1000.0,
        help="blocks/s the disk writes (inf: unthrottled)",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--cpu-blocks", type=int, default=80)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--pin-share", type=float, default=PIN_SHARE[0], help="ours' write_pin_share")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    PIN_SHARE[0] = args.pin_share
    runs = asyncio.run(main_async(args))
    print(
        f"# {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"demo workload, {args.requests} requests, concurrency {args.concurrency}, CPU tier "
        f"{args.cpu_blocks} blocks, disk writes {args.write_rate:.0f} blocks/s; medians of "
        f"{args.repeat} runs"
    )
    head = f"{'policy':14} {'hit rate':>9} {'shed':>7} {'yielded':>8} {'written':>8} "
    head += f"{'stores refused':>15} "
    head += f"{'promotions refused':>19}"
    print(head)
    print("-" * len(head))
    for policy, rows in runs.items():

        def med(k: str, rows: list[dict[str, Any]] = rows) -> float:
            return float(statistics.median(r[k] for r in rows))

        print(
            f"{policy:14} {med('hit_rate'):9.3f} {med('shed'):7.0f} {med('yielded'):8.0f} "
            f"{med('written'):8.0f} "
            f"{med('stores_rejected'):15.0f} {med('promotions_refused'):19.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
