"""What the demo reports: :class:`DemoReport`, as a table, and the event counts in it."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncoffload._term import terminal_columns, two_column_table
from asyncoffload.demo.settings import DemoConfig
from asyncoffload.engine import EngineStats, TierStats
from asyncoffload.hostmem import format_bytes

if TYPE_CHECKING:
    from asyncoffload.integrations.kv_events import PublisherStats

__all__ = ["DemoReport", "EventCounts"]

_GB = 1e9


@dataclass
class EventCounts:
    """What the event subscriber saw."""

    events: int = 0
    stored_events: int = 0
    removed_events: int = 0
    stored_keys: int = 0
    removed_keys: int = 0
    lagged: int = 0
    missed: int = 0


@dataclass(frozen=True)
class DemoReport:
    """The outcome of :func:`run_demo`."""

    config: DemoConfig
    loop: str
    requests: int
    failed_requests: int
    prompt_tokens: int
    #: Prompt tokens loaded from the CPU tier instead of computed.
    hit_tokens: int
    #: Blocks this run loaded, and computed, summed over requests.
    hit_blocks: int
    computed_blocks: int
    stores_rejected: int
    verified_blocks: int
    mismatches: int
    unique_blocks: int
    gpu_blocks: int
    wall_s: float
    request_latency_p50_ms: float
    request_latency_p99_ms: float
    events: EventCounts
    stats: EngineStats
    #: What the KV-event publisher did (``config.publish``), and where.
    publisher: PublisherStats | None = None
    publish_endpoints: tuple[str, str | None] | None = None
    #: Where the Prometheus metrics were served (``config.metrics_port``).
    metrics_url: str | None = None
    #: Loads of disk hits refused for want of an idle CPU slot (then recomputed).
    promotions_refused: int = 0
    #: Stores with more new blocks than the CPU tier holds (``CapacityError``): the
    #: front of the prompt that fits was stored instead.
    stores_cut: int = 0
    #: The shared tier's lookup before the workload: distinct blocks asked about, blocks
    #: found on the server (stored by another process), and seconds it took.
    remote_prelookup: tuple[int, int, float] | None = None
    #: Lookup hits counted by that lookup (the engine's, then per tier), left out of
    #: the hits by tier: those count the workload's lookups only.
    prelookup_hits: tuple[int, tuple[int, ...]] = (0, ())
    #: The CPU tier's policy as it ran: ``auto``'s leader at the end and its switches.
    policy_run: str = ""

    @property
    def hit_rate(self) -> float:
        """Prefix-hit rate in tokens: tokens loaded / prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _tier_hits(self, medium: str | None = None) -> int:
        base = self.prelookup_hits[1]
        return sum(
            t.lookup_hits - (base[i] if i < len(base) else 0)
            for i, t in enumerate(self.stats.tiers)
            if medium is None or t.medium == medium
        )

    @property
    def disk_hit_blocks(self) -> int:
        """Blocks that the workload's lookups found only in the disk tier (promoted from
        disk)."""
        return self._tier_hits("DISK")

    @property
    def remote_hit_blocks(self) -> int:
        """Blocks that the workload's lookups found only in the shared tier (neither in
        the CPU tier nor on disk: promoted from the server)."""
        return self._tier_hits("REMOTE")

    @property
    def lookup_hit_blocks(self) -> int:
        """Blocks that the workload's lookups found (the lookup before it left out)."""
        return self.stats.lookup_hits - self.prelookup_hits[0]

    @property
    def cpu_hit_blocks(self) -> int:
        """Blocks that the workload's lookups found in the CPU tier."""
        return self.lookup_hit_blocks - self._tier_hits()

    @property
    def bytes_moved(self) -> int:
        return self.stats.bytes_stored + self.stats.bytes_loaded

    @property
    def copy_gbps(self) -> float:
        """GB per second of copy time (per-copy submit-to-end, summed)."""
        seconds = self.stats.store_seconds + self.stats.load_seconds
        return self.bytes_moved / _GB / seconds if seconds > 0 else 0.0

    @property
    def wall_gbps(self) -> float:
        return self.bytes_moved / _GB / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def events_delivered(self) -> int:
        """Events the subscriber received (Lagged markers not counted)."""
        return self.events.events

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and self.failed_requests == 0

    def rows(self) -> list[tuple[str, str]]:
        s = self.stats
        cfg = self.config
        ev = self.events
        lagged = f", {ev.missed} missed in {ev.lagged} lags" if ev.lagged else ""
        failed = f" ({self.failed_requests} failed)" if self.failed_requests else ""
        verdict = "OK" if self.mismatches == 0 else "FAILED"
        return [
            ("requests", f"{self.requests}{failed}"),
            (
                "prefix-hit rate (tokens)",
                f"{self.hit_rate:.1%}  ({self.hit_tokens:,} of {self.prompt_tokens:,})",
            ),
            *self._tier_hit_rows(),
            (
                "blocks stored / loaded / evicted",
                f"{s.blocks_stored:,} / {s.blocks_loaded:,} / {s.blocks_evicted:,}",
            ),
            ("stores rejected (tier full)", f"{s.stores_rejected:,}"),
            (
                "blocks declined (CPU tier)",
                f"{s.manager.store_skipped:,} offered blocks its admission held back "
                "(written to no tier)",
            ),
            *self._cut_rows(),
            (
                "GB moved (stored + loaded)",
                f"{self.bytes_moved / _GB:.2f}  ({s.bytes_stored / _GB:.2f} + "
                f"{s.bytes_loaded / _GB:.2f})",
            ),
            (
                "GB/s",
                f"{self.copy_gbps:.2f} per copy-second, {self.wall_gbps:.2f} per wall-second",
            ),
            (
                "completion-callback latency",
                f"p50 {s.callback_latency_p50_us:,.0f} us, p99 {s.callback_latency_p99_us:,.0f} us",
            ),
            (
                "request latency",
                f"p50 {self.request_latency_p50_ms:,.1f} ms, p99 "
                f"{self.request_latency_p99_ms:,.1f} ms",
            ),
            (
                "events delivered",
                f"{ev.events:,} of {s.events_published:,} published  ({ev.stored_events:,} "
                f"stored: {ev.stored_keys:,} keys, {ev.removed_events:,} removed: "
                f"{ev.removed_keys:,} keys{lagged})",
            ),
            *self._integration_rows(),
            ("wall time", f"{self.wall_s:.2f} s"),
            ("loop / completion / backend", f"{self.loop} / {s.completion} / {s.backend}"),
            (
                "CPU tier",
                f"{cfg.cpu_blocks:,} blocks x {cfg.block_bytes // 1024} KiB, policy "
                f"{self.policy_run or cfg.policy}  (workload: {self.unique_blocks:,} "
                "distinct blocks)",
            ),
            *self._disk_rows(),
            *self._remote_rows(),
            (
                "verification",
                f"{verdict}: verified {self.verified_blocks:,} blocks, "
                f"{self.mismatches} mismatches",
            ),
        ]

    def _tier_hit_rows(self) -> list[tuple[str, str]]:
        tiers = self.stats.tiers
        if not tiers:
            return []
        parts = [f"CPU {self.cpu_hit_blocks:,}"]
        if any(t.medium == "DISK" for t in tiers):
            parts.append(f"disk {self.disk_hit_blocks:,}")
        if any(t.medium == "REMOTE" for t in tiers):
            parts.append(f"remote {self.remote_hit_blocks:,}")
        return [("hits by tier (blocks)", " / ".join(parts))]

    def _cut_rows(self) -> list[tuple[str, str]]:
        if not self.stores_cut:
            return []
        first = f"their first {self.config.cpu_blocks:,} new blocks offered instead"
        return [("stores larger than the CPU tier", f"{self.stores_cut:,}: {first}")]

    def _refused(self) -> str:
        if not self.promotions_refused:
            return ""
        return f", {self.promotions_refused:,} loads recomputed (no idle CPU slot to promote into)"

    def _remote_rows(self) -> list[tuple[str, str]]:
        rows = []
        for t in self.stats.tiers:
            if t.medium != "REMOTE":
                continue
            failed = t.read_failures + t.write_failures
            failures = f", {failed:,} failed {t.failures}" if failed else ""
            where = t.info.get("url") or f"Mooncake Store, master {t.info.get('master')}"
            rows.append(
                (
                    "remote tier",
                    f"{where}: written {t.blocks_written:,} "
                    f"({t.bytes_written / _GB:.2f} GB), read {t.blocks_read:,} "
                    f"({t.bytes_read / _GB:.2f} GB){failures}{self._refused()}"
                    f"{_declined_above(t)}",
                )
            )
        if rows and self.remote_prelookup is not None:
            asked, found, seconds = self.remote_prelookup
            rows.append(
                (
                    "remote lookup (before the run)",
                    f"{found:,} of {asked:,} distinct blocks already on the server "
                    f"({seconds:.2f} s)",
                )
            )
        return rows

    def _disk_rows(self) -> list[tuple[str, str]]:
        rows = []
        for t in self.stats.tiers:
            if t.medium != "DISK":
                continue
            failed = t.read_failures + t.write_failures
            failures = f", {failed:,} failed I/Os {t.failures}" if failed else ""
            failures += self._refused()
            direct = "O_DIRECT" if t.info.get("direct_io") else "buffered"
            rows.append(
                (
                    "disk tier",
                    f"{t.manager.num_blocks:,} blocks ({format_bytes(self.config.disk_bytes)}, "
                    f"{t.info.get('mode')}, {direct}) in {t.info.get('path')}: written "
                    f"{t.blocks_written:,} ({t.bytes_written / _GB:.2f} GB), read "
                    f"{t.blocks_read:,} ({t.bytes_read / _GB:.2f} GB){failures}"
                    f"{_declined_above(t)}",
                )
            )
        return rows

    def _integration_rows(self) -> list[tuple[str, str]]:
        rows = []
        pub = self.publisher
        if pub is not None and self.publish_endpoints is not None:
            endpoint, replay = self.publish_endpoints
            rows.append(
                (
                    "KV events (vLLM format)",
                    f"{pub.batches_published:,} batches, {pub.events_published:,} events on "
                    f"{endpoint} (replay {replay or 'off'}), last seq {pub.last_seq}, "
                    f"{pub.events_dropped} dropped, {pub.replay_requests} replay requests",
                )
            )
        if self.metrics_url is not None:
            rows.append(("Prometheus metrics", f"served on {self.metrics_url} while it ran"))
        return rows

    def format_table(self, columns: int | None = None) -> str:
        """The report as a two-column table no wider than ``columns`` (default: the
        terminal's width)."""
        return two_column_table(self.rows(), ("metric", "value"), columns)

    def headline(self, columns: int | None = None) -> str:
        """The line above the table: the workload and its seed, wrapped to fit
        ``columns`` (default: the terminal's width)."""
        cfg = self.config
        text = (
            f"asyncoffload demo: {cfg.requests} chat requests ({cfg.turns} turns per session, "
            f"{cfg.system_prompts} system prompts), seed {cfg.seed}"
        )
        width = (terminal_columns() if columns is None else columns) - 1
        return textwrap.fill(text, width, subsequent_indent="  ")

    def failure(self) -> str | None:
        """One line saying what went wrong, or ``None`` when the report is :attr:`ok`."""
        if self.ok:
            return None
        return (
            f"asyncoffload demo: FAILED: {self.mismatches} blocks loaded with wrong bytes, "
            f"{self.failed_requests} requests failed"
        )


def _declined_above(t: TierStats) -> str:
    """A lower tier's blocks the CPU tier declined (never offered to it), if any."""
    if not t.declined_above:
        return ""
    return f", {t.declined_above:,} declined by the CPU tier (never offered)"
