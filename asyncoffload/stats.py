"""What an engine reports: :class:`EngineStats` (``engine.stats()``) and the periodic
summary line (``config.log_summary_s``)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from asyncoffload.copies import Copies
from asyncoffload.events import EventHub, SubscriptionStats
from asyncoffload.histogram import LATENCY_BUCKETS_S, Histogram, HistogramSnapshot
from asyncoffload.manager import CPUOffloadingManager, ManagerStats
from asyncoffload.manager.pins import PinStats
from asyncoffload.tiers.core import TierStats
from asyncoffload.transfer import CompletionBridge, TransferBackend

__all__ = ["EngineStats", "Summary", "TierStats", "engine_stats"]

log = logging.getLogger("asyncoffload")


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time summary of an engine."""

    backend: str
    #: Backend details: copy engine or methods, host memory, pinning.
    backend_info: dict[str, object]
    #: Active completion mechanism: "eventfd", "pipe" or "poll" (None before first use).
    completion: str | None
    #: ``lookup`` calls, keys they asked for, and leading keys found ready.
    lookups: int
    lookup_keys: int
    lookup_hits: int
    stores: int
    loads: int
    stores_rejected: int
    transfers_failed: int
    blocks_stored: int
    blocks_loaded: int
    blocks_evicted: int
    bytes_stored: int
    bytes_loaded: int
    #: Seconds from submission to the end of each copy (queueing included), summed per
    #: direction: a lower bound on throughput when copies queue behind each other.
    store_seconds: float
    load_seconds: float
    in_flight: int
    #: Copy ended -> completion callback ran, microseconds, over recent transfers whose
    #: copy ran on a lane (an inline copy's callback runs as it ends: see
    #: ``EngineConfig.inline_copy_bytes``); NaN before the first.
    callback_latency_p50_us: float
    callback_latency_p99_us: float
    events_published: int
    #: Events lost by overflowing subscriptions, summed over subscriptions (ever).
    events_dropped: int
    subscribers: int
    manager: ManagerStats
    #: Seconds from submission to the end of each successful copy, per direction.
    store_duration: HistogramSnapshot
    load_duration: HistogramSnapshot
    #: Bytes per second of each successful copy (its bytes over its duration).
    store_throughput: HistogramSnapshot
    load_throughput: HistogramSnapshot
    #: Copy ended -> completion callback ran, seconds, every lane transfer since the start.
    callback_latency: HistogramSnapshot
    #: Each live event subscription: buffered events (its lag), drops, deliveries.
    subscriptions: tuple[SubscriptionStats, ...]
    #: Each tier below the CPU tier, highest first.
    tiers: tuple[TierStats, ...] = ()
    #: The CPU tier's retention pins (each lower tier's: ``TierStats.pins``).
    pins: PinStats | None = None


class Summary:
    """One log line every ``period`` seconds while the engine runs: lookups and hit
    rate, stores and loads with their rates, evictions, transfers in flight. The
    summary holds its ``stats`` (the engine's bound method) weakly, and the timer the
    summary: neither keeps an unclosed engine alive."""

    def __init__(self, period: float, stats: Callable[[], EngineStats]) -> None:
        self.period = period
        self._stats = weakref.WeakMethod(stats)
        self.timer: asyncio.TimerHandle | None = None
        self._last: tuple[float, tuple[int, ...]] = (0.0, ())
        self._in_flight = 0

    def _counters(self) -> tuple[int, ...]:
        stats = self._stats()
        if stats is None:
            return self._last[1]
        s = stats()
        self._in_flight = s.in_flight
        return (
            s.lookups,
            s.lookup_keys,
            s.lookup_hits,
            s.stores,
            s.loads,
            s.bytes_stored,
            s.bytes_loaded,
            s.blocks_evicted,
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.timer is not None:
            return
        self._last = (time.monotonic(), self._counters())
        self.timer = loop.call_later(self.period, _tick, weakref.ref(self), loop)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def log(self) -> None:
        now = time.monotonic()
        then, before = self._last
        counters = self._counters()
        self._last = (now, counters)
        lookups, keys, hits, stores, loads, stored, loaded, evicted = (
            a - b for a, b in zip(counters, before)
        )
        seconds = max(now - then, 1e-9)
        rate = f"{100 * hits / keys:.1f}%" if keys else "-"
        log.info(
            "asyncoffload summary (%.1fs): lookups %d, hit rate %s (%d/%d keys); "
            "stores %d (%.2f GB/s); loads %d (%.2f GB/s); evictions %d; in flight %d",
            seconds,
            lookups,
            rate,
            hits,
            keys,
            stores,
            stored / seconds / 1e9,
            loads,
            loaded / seconds / 1e9,
            evicted,
            self._in_flight,
        )


def _tick(ref: weakref.ReferenceType[Summary], loop: asyncio.AbstractEventLoop) -> None:
    """One summary line, then the next tick, until stopped."""
    summary = ref()
    if summary is None or summary.timer is None:
        return
    try:
        summary.log()
    except Exception:  # a summary must never break the loop
        log.exception("the periodic summary failed")
    summary.timer = loop.call_later(summary.period, _tick, ref, loop)


def engine_stats(
    *,
    backend: TransferBackend,
    bridge: CompletionBridge | None,
    lookups: tuple[int, int, int],
    stores_rejected: int,
    copies: Copies,
    hub: EventHub,
    manager: CPUOffloadingManager,
    tiers: tuple[TierStats, ...],
) -> EngineStats:
    """An engine's :class:`EngineStats` from its parts (``lookups``: calls, keys asked,
    leading keys found)."""
    latency = bridge.latency if bridge is not None else None
    store_duration = copies.store_hist.snapshot()
    load_duration = copies.load_hist.snapshot()
    subs = hub.subscribers
    pins = manager.pins.stats()
    manager_stats: ManagerStats = manager.stats()
    return EngineStats(
        backend=backend.name,
        backend_info=backend.describe(),
        completion=bridge.mechanism if bridge is not None else None,
        lookups=lookups[0],
        lookup_keys=lookups[1],
        lookup_hits=lookups[2],
        stores=copies.stores,
        loads=copies.loads,
        stores_rejected=stores_rejected,
        transfers_failed=copies.failed,
        blocks_stored=manager_stats.stored,
        blocks_loaded=manager_stats.loaded,
        blocks_evicted=manager_stats.evicted,
        bytes_stored=copies.bytes_stored,
        bytes_loaded=copies.bytes_loaded,
        store_seconds=store_duration.total,
        load_seconds=load_duration.total,
        in_flight=len(copies.inflight),
        callback_latency_p50_us=latency.percentile_us(50) if latency else math.nan,
        callback_latency_p99_us=latency.percentile_us(99) if latency else math.nan,
        events_published=hub.published,
        events_dropped=hub.dropped,
        subscribers=len(subs),
        manager=manager_stats,
        store_duration=store_duration,
        load_duration=load_duration,
        store_throughput=copies.store_rate.snapshot(),
        load_throughput=copies.load_rate.snapshot(),
        callback_latency=(
            latency.histogram if latency else Histogram(LATENCY_BUCKETS_S)
        ).snapshot(),
        subscriptions=tuple(sub.statistics() for sub in subs),
        tiers=tiers,
        pins=pins,
    )
