"""The demo: a simulated serving loop on the CPU backend, moving and checking real bytes.

A synthetic multi-turn chat workload (:func:`~asyncoffload.workloads.synthetic_chat`)
arrives as concurrent tasks. Each request looks up its prompt's prefix in the CPU tier,
loads the hit blocks into a simulated GPU KV cache (CPU tensors), checks them bit for
bit, "computes" the rest (writes their deterministic content and sleeps for a time
proportional to the tokens), and stores its new blocks. An event subscriber counts
what the engine publishes. The result is a :class:`DemoReport`.

Below the CPU tier there may be a disk tier (``disk_path``) and a shared tier on Redis /
Valkey (``remote_url``, below the disk tier). With a shared tier, every prompt is first
looked up with :meth:`~asyncoffload.AsyncOffloadEngine.alookup`, so blocks that another
demo process (same seed, same model settings) stored are found and loaded from the
server, checked bit for bit like the others.

Every block's content is a function of its key, so a load is checked exactly: block
``b`` of layer ``l``, half ``h`` (K or V) holds the int64 words
``(w(key) XOR salt[l, h]) + j``
for ``j`` in the fragment.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TextIO

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from asyncoffload._term import terminal_columns, two_column_table
from asyncoffload.config import EngineConfig, byte_setting
from asyncoffload.engine import AsyncOffloadEngine, EngineStats
from asyncoffload.errors import CapacityError, HostMemoryError, PromotionError, TransferError
from asyncoffload.events import EventSubscription, Lagged
from asyncoffload.hostmem import available_host_bytes, check_host_bytes, format_bytes
from asyncoffload.integrations import check_endpoint, shift_tcp_port
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import ReqContext, available_policies
from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.remote import RemoteTier
from asyncoffload.workloads import Request, summarize, synthetic_chat

if TYPE_CHECKING:
    from asyncoffload.integrations.kv_events import KVEventPublisher, PublisherStats

__all__ = [
    "BlockAllocator",
    "DemoConfig",
    "DemoConfigError",
    "DemoReport",
    "EventCounts",
    "SimulatedKVCache",
    "run_demo",
]

ProgressMode = Literal["auto", "always", "never"]

_WORD_MASK = (1 << 62) - 1
_GB = 1e9


class DemoConfigError(ValueError):
    """The settings do not fit together (found once the workload is known)."""


class DemoConfig(BaseModel):
    """Settings of :func:`run_demo`. The defaults finish in well under a minute."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Workload (see synthetic_chat).
    requests: int = Field(1500, ge=1, description="Requests in the workload.")
    system_prompts: int = Field(4, ge=1, description="Distinct system prompts.")
    system_prompt_blocks: int = Field(32, ge=0, description="Blocks of each system prompt.")
    turns: int = Field(5, ge=1, description="Turns per chat session.")
    blocks_per_turn: float = Field(6.0, gt=0, description="Mean user message, in blocks.")
    output_tokens: float = Field(128.0, gt=0, description="Mean reply length, in tokens.")
    arrival_rate: float = Field(150.0, gt=0, description="Requests per workload second.")
    think_time_s: float = Field(1.0, ge=0, description="Mean gap between turns of a session.")
    seed: int = Field(
        0,
        description="Seed of the workload and the block contents: any int (the contents "
        "take it modulo 2**64).",
    )
    # The engine.
    cpu_blocks: int = Field(4096, gt=0, description="Slots of the CPU tier.")
    policy: str = Field("lru", description="Cache policy of the CPU tier.")
    completion: Literal["auto", "eventfd", "poll"] = "auto"
    event_buffer: int = Field(1 << 16, gt=0, description="The subscriber's event buffer.")
    disk_path: Path | None = Field(
        None,
        description="A disk tier below the CPU tier, its files in this directory (a "
        "slab, unlinked once open); None: no disk tier.",
    )
    disk_bytes: int = Field(
        2 << 30,
        gt=0,
        description="Capacity of the disk tier, bytes (or '2GiB'). The tier is inclusive: "
        "it must be larger than the CPU tier to add hits.",
    )
    remote_url: str | None = Field(
        None,
        description="A shared tier on Redis / Valkey at this URL (redis://host:port/db), "
        "below the CPU tier and the disk tier; every stored block is written to it, and "
        "prompts are looked up there first. None: no shared tier.",
    )
    # The simulated model and server.
    layers: int = Field(8, ge=1, description="KV layers.")
    block_size: int = Field(16, ge=1, description="Tokens per block.")
    kv_heads: int = Field(4, ge=1)
    head_dim: int = Field(64, ge=1)
    gpu_blocks: int | None = Field(
        None,
        ge=1,
        description="Blocks of the simulated GPU KV cache (default: enough "
        "for `concurrency` of the largest request).",
    )
    concurrency: int = Field(16, ge=1, description="Requests served at once.")
    time_scale: float = Field(
        1.0,
        ge=0,
        description="Wall seconds per workload second (arrivals and compute); "
        "0 runs as fast as possible.",
    )
    torch_threads: int | None = Field(
        1,
        ge=1,
        description="torch intra-op threads while the demo runs (the copy threads "
        "and the checks already run in parallel); None leaves torch's setting.",
    )
    prefill_us_per_token: float = Field(20.0, ge=0, description="Compute per prompt token.")
    decode_us_per_token: float = Field(50.0, ge=0, description="Compute per output token.")
    # Integrations.
    publish: str | None = Field(
        None,
        description="Publish vLLM-compatible KV events on this ZMQ endpoint while the "
        "demo runs (needs asyncoffload[events]).",
    )
    publish_replay: str | None = Field(
        None,
        description="The replay (ROUTER) endpoint; default: the publish port + 1 for a "
        "tcp endpoint, none otherwise.",
    )
    publish_topic: str = Field("", description="Topic frame of the published batches.")
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics on 127.0.0.1:PORT while the demo runs "
        "(0: any free port; needs asyncoffload[prometheus]).",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        known = available_policies()
        if value not in known:
            raise ValueError(f"unknown cache policy {value!r}; known: {', '.join(known)}")
        return value

    @field_validator("disk_bytes", mode="before")
    @classmethod
    def _byte_size(cls, value: object) -> object:
        return byte_setting(value, "disk_bytes")

    @field_validator("remote_url")
    @classmethod
    def _remote_url(cls, value: str | None) -> str | None:
        if value is not None:
            RemoteTier(value)  # its own checks (the scheme)
        return value

    @field_validator("publish", "publish_replay")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        check_endpoint(value)
        port = value.rpartition(":")[2]
        # ZeroMQ binds a port above 65535 as another one (modulo 2**16), silently.
        if value.startswith("tcp://") and port.isdigit() and int(port) > 65535:
            raise ValueError(f"endpoint {value!r}: port {port} is not a TCP port (0 to 65535)")
        return value

    @model_validator(mode="after")
    def _whole_words(self) -> DemoConfig:
        if (self.block_size * self.kv_heads * self.head_dim * 2) % 8:
            raise ValueError(
                "block_size * kv_heads * head_dim must be a multiple of 4 "
                "(a block fragment is checked as int64 words)"
            )
        return self

    @property
    def replay_endpoint(self) -> str | None:
        """Where the publisher answers replay requests (None: no replay socket)."""
        if self.publish is None:
            return None
        if self.publish_replay is not None:
            return self.publish_replay
        return shift_tcp_port(self.publish, 1)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (one CPU slot)."""
        return self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * 2

    def workload(self) -> list[Request]:
        return synthetic_chat(
            self.requests,
            num_system_prompts=self.system_prompts,
            system_prompt_blocks=self.system_prompt_blocks,
            turns=self.turns,
            blocks_per_turn=self.blocks_per_turn,
            output_tokens=self.output_tokens,
            block_size=self.block_size,
            arrival_rate=self.arrival_rate,
            think_time_s=self.think_time_s,
            seed=self.seed,
        )


# --- the simulated GPU -----------------------------------------------------------------


class SimulatedKVCache:
    """Per-layer K/V tensors ``[2, num_blocks, block_size, kv_heads, head_dim]`` bf16,
    views of one tensor, whose blocks are written and checked by key."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        seed: int = 0,
    ) -> None:
        shape = (layers, 2, num_blocks, block_size, kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=torch.bfloat16)
        #: What the engine sees: one contiguous tensor per layer.
        self.kv_caches: list[torch.Tensor] = list(self.storage.unbind(0))
        self.num_blocks = num_blocks
        self._words = self.storage.view(layers, 2, num_blocks, -1).view(torch.int64)
        n_words = self._words.shape[-1]
        # torch takes 64-bit seeds and reduces negative ones modulo 2**64: so for any int.
        gen = torch.Generator().manual_seed(seed % (1 << 64))
        self._salt = torch.randint(0, 1 << 61, (layers, 2, 1, 1), generator=gen)
        self._ramp = torch.arange(n_words, dtype=torch.int64)

    def _expected(self, keys: Sequence[OffloadKey]) -> torch.Tensor:
        words = [int.from_bytes(key[:8], "little") & _WORD_MASK for key in keys]
        base = torch.tensor(words, dtype=torch.int64).view(1, 1, -1, 1) ^ self._salt
        return base + self._ramp

    def write(self, keys: Sequence[OffloadKey], blocks: Sequence[int]) -> None:
        """Fill ``blocks`` with the content of ``keys`` (as a forward pass would)."""
        if keys:
            idx = torch.tensor(blocks, dtype=torch.int64)
            self._words.index_copy_(2, idx, self._expected(keys))

    def check(self, keys: Sequence[OffloadKey], blocks: Sequence[int]) -> int:
        """How many of ``blocks`` do not hold exactly the content of ``keys``."""
        if not keys:
            return 0
        idx = torch.tensor(blocks, dtype=torch.int64)
        equal = self._words.index_select(2, idx) == self._expected(keys)
        if bool(equal.all()):
            return 0
        per_block = equal.all(dim=3).all(dim=1).all(dim=0)
        return int((~per_block).sum())


class BlockAllocator:
    """A free list of KV blocks; ``allocate`` waits, first come first served, while
    too few are free."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._waiters: deque[tuple[int, asyncio.Future[list[int]]]] = deque()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _take(self, n: int) -> list[int]:
        free = self._free
        ids = free[len(free) - n :]
        del free[len(free) - n :]
        return ids

    async def allocate(self, n: int) -> list[int]:
        if n > self.num_blocks:
            raise ValueError(f"{n} blocks asked for, the KV cache has {self.num_blocks}")
        if not self._waiters and n <= len(self._free):
            return self._take(n)
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.free(fut.result())  # handed over just as we were cancelled
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)
        self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= len(self._free):
            n, fut = waiters.popleft()
            if not fut.done():
                fut.set_result(self._take(n))


# --- results ---------------------------------------------------------------------------


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


@dataclass
class _Progress:
    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    computed_blocks: int = 0
    bytes_moved: int = 0
    stores_rejected: int = 0
    stores_cut: int = 0
    promotions_refused: int = 0
    verified_blocks: int = 0
    mismatches: int = 0
    latencies_s: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    idx = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[idx]


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
                f"{cfg.policy}  (workload: {self.unique_blocks:,} distinct blocks)",
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
            rows.append(
                (
                    "remote tier",
                    f"{t.info.get('url')}: written {t.blocks_written:,} "
                    f"({t.bytes_written / _GB:.2f} GB), read {t.blocks_read:,} "
                    f"({t.bytes_read / _GB:.2f} GB){failures}{self._refused()}",
                )
            )
            if self.remote_prelookup is not None:
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
                    f"{t.blocks_read:,} ({t.bytes_read / _GB:.2f} GB){failures}",
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


# --- the run ---------------------------------------------------------------------------


def _loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def _count_events(sub: EventSubscription, counts: EventCounts) -> None:
    async for item in sub:
        if isinstance(item, Lagged):
            counts.lagged += 1
            counts.missed += item.missed
        elif item.removed:
            counts.events += 1
            counts.removed_events += 1
            counts.removed_keys += len(item.keys)
        else:
            counts.events += 1
            counts.stored_events += 1
            counts.stored_keys += len(item.keys)


def _render(p: _Progress, total: int, elapsed: float, columns: int = 80) -> str:
    """One progress line, shorter than ``columns`` (a line as wide as the terminal
    wraps, and then every update starts a new line)."""
    parts = [
        f"{p.done}/{total} requests",
        f"hit {p.hit_rate:4.0%}",
        f"{p.bytes_moved / _GB:6.2f} GB moved",
        f"{elapsed:5.1f} s",
    ]
    text = "  ".join(parts)
    while len(parts) > 1 and len(text) + 13 > columns - 1:  # room for a 10-wide bar
        parts.pop(2 if len(parts) > 2 else 1)
        text = "  ".join(parts)
    width = max(0, min(30, columns - 1 - len(text) - 3))
    if width < 10:
        return f"\r{text[: columns - 1]}"
    filled = width * p.done // total if total else width
    bar = "#" * filled + "." * (width - filled)
    return f"\r[{bar}] {text}"


async def _show_progress(
    p: _Progress, total: int, stream: TextIO, finished: asyncio.Event, interval: float = 0.2
) -> None:
    t0 = time.perf_counter()
    columns = terminal_columns()
    try:
        while not finished.is_set():
            stream.write(_render(p, total, time.perf_counter() - t0, columns))
            stream.flush()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(finished.wait(), interval)
    finally:
        stream.write(_render(p, total, time.perf_counter() - t0, columns) + "\n")
        stream.flush()


class _Server:
    """Serves requests against one engine."""

    def __init__(
        self,
        cfg: DemoConfig,
        engine: AsyncOffloadEngine,
        kv: SimulatedKVCache,
        progress: _Progress,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.kv = kv
        self.p = progress
        self.alloc = BlockAllocator(kv.num_blocks)
        self.sem = asyncio.Semaphore(cfg.concurrency)
        self.block_bytes = engine.layout.block_bytes
        scale = cfg.time_scale * 1e-6
        self.prefill_s = cfg.prefill_us_per_token * scale
        self.decode_s = cfg.decode_us_per_token * scale

    async def serve(self, req: Request, arrived: float) -> None:
        engine, p = self.engine, self.p
        keys = req.keys
        async with self.sem:
            blocks = await self.alloc.allocate(len(keys))
            try:
                ctx = ReqContext(req.req_id)
                # No await between the lookup and prepare_load: the hits stay resident.
                n = engine.lookup(keys, ctx)
                if n:
                    try:
                        load = await engine.prepare_load(keys[:n], blocks[:n], ctx)
                    except PromotionError:
                        # Disk (or remote) hits need CPU slots to come up through, and every slot
                        # is pinned or being written: recompute, as the engine advises.
                        p.promotions_refused += 1
                        n = 0
                if n:
                    await load
                    # Checks and writes run off the loop, as a GPU's kernels would.
                    # (Not `p.mismatches += await ...`: that reads the counter before
                    # the await and loses the updates of concurrent requests.)
                    bad = await asyncio.to_thread(self.kv.check, keys[:n], blocks[:n])
                    p.mismatches += bad
                    p.verified_blocks += n
                    p.bytes_moved += n * self.block_bytes
                # "Compute" the rest of the prompt and the reply.
                if n < len(keys):
                    await asyncio.to_thread(self.kv.write, keys[n:], blocks[n:])
                hit_tokens = min(n * self.cfg.block_size, req.input_tokens)
                compute_s = (
                    req.input_tokens - hit_tokens
                ) * self.prefill_s + req.output_tokens * self.decode_s
                if compute_s > 0:
                    await asyncio.sleep(compute_s)
                if n < len(keys):
                    try:
                        handle = await engine.prepare_store(keys[n:], blocks[n:], ctx)
                    except CapacityError as exc:
                        # More new blocks than the CPU tier holds: store the part of the
                        # prompt that fits, its front (what a later lookup can hit).
                        p.stores_cut += 1
                        end = n + exc.num_blocks
                        handle = await engine.prepare_store(keys[n:end], blocks[n:end], ctx)
                    if handle is None:
                        p.stores_rejected += 1
                    else:
                        result = await handle
                        p.bytes_moved += result.nbytes
            except TransferError:
                p.failed += 1
                return
            finally:
                self.alloc.free(blocks)
        p.done += 1
        p.prompt_tokens += req.input_tokens
        p.hit_tokens += hit_tokens
        p.hit_blocks += n
        p.computed_blocks += len(keys) - n
        p.latencies_s.append(time.perf_counter() - arrived)

    async def run(self, requests: Sequence[Request]) -> None:
        """Start every request as a task at its (scaled) arrival time; wait for all."""
        tasks: list[asyncio.Task[None]] = []
        errors: list[BaseException] = []

        def on_done(task: asyncio.Task[None]) -> None:
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                errors.append(exc)

        scale = self.cfg.time_scale
        t0 = time.perf_counter()
        try:
            for req in requests:
                if errors:
                    break
                delay = t0 + req.arrival_s * scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(self.serve(req, time.perf_counter()))
                task.add_done_callback(on_done)
                tasks.append(task)
            if tasks and not errors:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
        if errors:
            raise errors[0]


async def run_demo(
    cfg: DemoConfig | None = None,
    progress: bool | ProgressMode = "auto",
    *,
    stream: TextIO | None = None,
) -> DemoReport:
    """Run the demo on the running loop and report.

    ``progress``: ``"auto"`` (or ``True``) draws a progress bar on ``stream`` (default
    stderr) when it is a terminal, ``"always"`` draws it anyway, ``"never"`` (or
    ``False``) never. While it runs, torch's intra-op thread count is
    ``cfg.torch_threads`` (process-wide; restored afterwards). Raises
    :class:`DemoConfigError` when the settings don't fit the workload.
    """
    cfg = cfg if cfg is not None else DemoConfig()
    mode: ProgressMode = "auto" if progress is True else "never" if progress is False else progress
    out = stream if stream is not None else sys.stderr
    show = mode == "always" or (mode == "auto" and out.isatty())
    saved_threads = torch.get_num_threads()
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    try:
        return await _run(cfg, out if show else None)
    finally:
        torch.set_num_threads(saved_threads)


#: Lower bounds of what generating the workload holds in memory (CPython, 64 bits): a
#: generated token (a list slot and an int object), a key in a request's prompt (a
#: tuple slot), and a request (its object, ids and tuple), a system prompt's lists.
_TOKEN_BYTES = 36
_KEY_REF_BYTES = 8
_REQUEST_BYTES = 300
_PROMPT_BYTES = 200


def _check_workload_size(cfg: DemoConfig) -> None:
    """Refuse, before generating anything, a workload whose generation would take more
    memory than the machine has (it would allocate until ``MemoryError``, or longer):
    :class:`DemoConfigError` naming the options of the largest part and both sizes.

    The figures are lower bounds: the whole system prompts, one session's tokens (a
    session is generated whole, every turn) and the prompts of at least
    ``requests / turns`` whole sessions (they are cut to ``requests`` at the end)."""
    big = 1e300  # ints of any size, as floats that cannot overflow

    def f(x: float) -> float:
        return min(float(min(x, 10**300)) if isinstance(x, int) else x, big)

    bs, turns = f(cfg.block_size), f(cfg.turns)
    user, reply = f(cfg.blocks_per_turn), f(cfg.output_tokens) / bs
    system = f(cfg.system_prompt_blocks)
    sessions = max(1.0, math.ceil(f(cfg.requests) / turns))
    keys = turns * system + user * turns * (turns + 1) / 2 + reply * turns * (turns - 1) / 2
    parts = {
        f"--requests {cfg.requests} in sessions of --turns {cfg.turns} (their prompts: "
        f"--blocks-per-turn {cfg.blocks_per_turn:g}, --system-prompt-blocks "
        f"{cfg.system_prompt_blocks})": sessions * (keys * _KEY_REF_BYTES + turns * _REQUEST_BYTES),
        f"--turns {cfg.turns} of --blocks-per-turn {cfg.blocks_per_turn:g} (one session's "
        "tokens)": (turns * user + (turns - 1) * reply) * bs * _TOKEN_BYTES,
        f"--system-prompts {cfg.system_prompts} of --system-prompt-blocks "
        f"{cfg.system_prompt_blocks}": f(cfg.system_prompts)
        * (system * bs * _TOKEN_BYTES + _PROMPT_BYTES),
    }
    need = min(sum(parts.values()), big)
    available = available_host_bytes()
    if available is None or need <= available:
        return
    largest = max(parts, key=lambda k: parts[k])
    shown = format_bytes(min(need, 1 << 60))
    raise DemoConfigError(
        f"{largest}: generating the workload needs at least {shown} of host memory; this "
        f"machine has {format_bytes(available)} available"
    )


async def _run(cfg: DemoConfig, progress_stream: TextIO | None) -> DemoReport:
    _check_workload_size(cfg)
    requests = cfg.workload()
    summary = summarize(requests)
    largest = summary.max_request_blocks
    gpu_blocks = cfg.gpu_blocks if cfg.gpu_blocks is not None else cfg.concurrency * largest
    if gpu_blocks < largest:
        raise DemoConfigError(
            f"gpu_blocks={gpu_blocks} cannot hold the largest request of the workload "
            f"({largest} blocks)"
        )
    block_bytes = cfg.block_bytes
    try:
        check_host_bytes(
            (max(gpu_blocks, 1) + cfg.cpu_blocks) * block_bytes,
            f"the demo ({max(gpu_blocks, 1)} simulated GPU blocks and {cfg.cpu_blocks} CPU "
            f"blocks of {format_bytes(block_bytes)} each: --layers {cfg.layers})",
        )
    except HostMemoryError as exc:
        raise DemoConfigError(f"{exc}; lower --layers, --cpu-blocks or --concurrency") from None
    if cfg.remote_url is not None:
        await _check_server(cfg.remote_url)
    kv = SimulatedKVCache(
        cfg.layers, max(gpu_blocks, 1), cfg.block_size, cfg.kv_heads, cfg.head_dim, cfg.seed
    )
    engine_cfg = EngineConfig(
        cpu_blocks=cfg.cpu_blocks,
        policy=cfg.policy,
        completion=cfg.completion,
        event_buffer=cfg.event_buffer,
        tiers=[*_disk_tiers(cfg), *_remote_tiers(cfg)],
        model="asyncoffload-demo",
    )
    try:
        engine = AsyncOffloadEngine(kv.kv_caches, engine_cfg)
    except (OSError, RuntimeError, ValueError) as exc:
        if not engine_cfg.tiers:
            raise
        where = f"the disk tier in {cfg.disk_path}" if cfg.disk_path else "the remote tier"
        raise DemoConfigError(f"{where}: {exc}") from None
    state = _Progress()
    counts = EventCounts()
    finished = asyncio.Event()
    loop = asyncio.get_running_loop()
    bar: asyncio.Task[None] | None = None
    integrations = _Integrations(cfg, engine)
    async with contextlib.AsyncExitStack() as stack:
        # Started before the first request, closed after the engine: the publisher sends
        # every event, the last ones included.
        await integrations.start(stack)
        async with engine:
            # Subscribed before the first request: the subscriber sees every event. The
            # subscription ends when the engine closes, after its buffered events.
            counter = asyncio.create_task(_count_events(engine.events(), counts))
            if progress_stream is not None:
                bar = asyncio.create_task(
                    _show_progress(state, len(requests), progress_stream, finished)
                )
            t0 = time.perf_counter()
            prelookup = None
            prelookup_hits: tuple[int, tuple[int, ...]] = (0, ())
            if cfg.remote_url is not None:
                prelookup = await _remote_prelookup(engine, requests)
                before = engine.stats()
                prelookup_hits = (before.lookup_hits, tuple(t.lookup_hits for t in before.tiers))
            try:
                await _Server(cfg, engine, kv, state).run(requests)
            finally:
                finished.set()
                if bar is not None:
                    await bar
        # aclose waited for every copy.
        wall = time.perf_counter() - t0
    await counter
    stats = engine.stats()
    lat = sorted(state.latencies_s)
    return DemoReport(
        config=cfg,
        loop=_loop_name(loop),
        requests=state.done + state.failed,
        failed_requests=state.failed,
        prompt_tokens=state.prompt_tokens,
        hit_tokens=state.hit_tokens,
        hit_blocks=state.hit_blocks,
        computed_blocks=state.computed_blocks,
        stores_rejected=state.stores_rejected,
        verified_blocks=state.verified_blocks,
        mismatches=state.mismatches,
        unique_blocks=summary.unique_blocks,
        gpu_blocks=gpu_blocks,
        wall_s=wall,
        request_latency_p50_ms=_percentile(lat, 50) * 1e3,
        request_latency_p99_ms=_percentile(lat, 99) * 1e3,
        events=counts,
        stats=stats,
        publisher=integrations.publisher.stats() if integrations.publisher else None,
        publish_endpoints=integrations.endpoints,
        metrics_url=integrations.metrics_url,
        promotions_refused=state.promotions_refused,
        stores_cut=state.stores_cut,
        remote_prelookup=prelookup,
        prelookup_hits=prelookup_hits,
    )


def _disk_tiers(cfg: DemoConfig) -> list[DiskTier]:
    """The disk tier of ``cfg.disk_path``: a slab that writes every block the CPU tier
    stores (no admission filter: the demo stores each block once, so the default
    second-offer rule would write almost nothing)."""
    if cfg.disk_path is None:
        return []
    from asyncoffload.tiers.format import block_file_bytes

    slot = block_file_bytes(cfg.block_bytes)
    if cfg.disk_bytes < slot:
        raise DemoConfigError(
            f"--disk-bytes {cfg.disk_bytes} holds no block: one takes {format_bytes(slot)} on disk"
        )
    try:
        return [DiskTier(cfg.disk_path, cfg.disk_bytes, "slab", admission=None)]
    except ValueError as exc:
        # The tier's own checks (a capacity no file can have...): one line, no traceback.
        problems = (
            [str(e["msg"]).removeprefix("Value error, ") for e in exc.errors()]
            if isinstance(exc, ValidationError)
            else [str(exc)]
        )
        raise DemoConfigError(
            f"the disk tier (--disk, --disk-bytes): {'; '.join(problems)}"
        ) from None


def _remote_tiers(cfg: DemoConfig) -> list[RemoteTier]:
    """The shared tier at ``cfg.remote_url``: every block the CPU tier stores is written
    to it (no admission filter, as for the disk tier: a shared tier is for sharing)."""
    if cfg.remote_url is None:
        return []
    return [RemoteTier(cfg.remote_url, admission=None)]


async def _check_server(url: str) -> None:
    """Fail early, with the URL in the message, when the server does not answer."""
    from redis.asyncio import Redis

    client = Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        await client.ping()
    except Exception as exc:
        host = url.split("@")[-1]  # never a password
        raise DemoConfigError(f"the remote tier at {host} does not answer: {exc}") from None
    finally:
        await client.aclose()


async def _remote_prelookup(
    engine: AsyncOffloadEngine, requests: Sequence[Request]
) -> tuple[int, int, float]:
    """Every prompt looked up with ``alookup`` before the workload starts, so that the
    blocks another process stored on the server join the shared tier's index (and load
    from it). Returns (distinct blocks, blocks found on the server, seconds)."""
    t0 = time.perf_counter()
    distinct: set[OffloadKey] = set()
    seen: set[tuple[OffloadKey, ...]] = set()
    # The longest prompt of a prefix chain first: its lookup covers the shorter ones.
    for req in sorted(requests, key=lambda r: len(r.keys), reverse=True):
        keys = tuple(req.keys)
        if not keys or keys in seen:
            continue
        seen.add(keys)
        fresh = [key for key in keys if key not in distinct]
        if not fresh:
            continue
        distinct.update(fresh)
        await engine.alookup(keys)
    tier = next(t for t in engine.stats().tiers if t.medium == "REMOTE")
    return len(distinct), tier.manager.ready, time.perf_counter() - t0


class _Integrations:
    """The demo's optional KV-event publisher and Prometheus endpoint."""

    def __init__(self, cfg: DemoConfig, engine: AsyncOffloadEngine) -> None:
        self.cfg = cfg
        self.engine = engine
        self.publisher: KVEventPublisher | None = None
        self.endpoints: tuple[str, str | None] | None = None
        self.metrics_url: str | None = None

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        cfg = self.cfg
        if cfg.publish is not None:
            try:
                from asyncoffload.integrations.kv_events import KVEventPublisher, KVEventsConfig
            except ImportError as exc:
                raise DemoConfigError(
                    f"--publish needs pyzmq and msgspec ({exc}): pip install 'asyncoffload[events]'"
                ) from None
            pub_cfg = KVEventsConfig(
                endpoint=cfg.publish, replay_endpoint=cfg.replay_endpoint, topic=cfg.publish_topic
            )
            try:
                pub = KVEventPublisher(self.engine, pub_cfg)
                await pub.start()
            except OSError as exc:
                raise DemoConfigError(str(exc)) from None
            stack.push_async_callback(pub.aclose)
            self.publisher = pub
            self.endpoints = (pub.endpoint, pub.replay_endpoint)
        if cfg.metrics_port is not None:
            try:
                from asyncoffload.integrations.prometheus import EngineMetrics
            except ImportError as exc:
                raise DemoConfigError(
                    f"--metrics-port needs prometheus_client ({exc}): "
                    "pip install 'asyncoffload[prometheus]'"
                ) from None
            metrics = EngineMetrics(
                self.engine, publishers=[self.publisher] if self.publisher else ()
            )
            try:
                port = metrics.serve(cfg.metrics_port)
            except OSError as exc:
                metrics.close()
                raise DemoConfigError(
                    f"cannot serve metrics on port {cfg.metrics_port}: {exc}"
                ) from None
            stack.callback(metrics.close)
            self.metrics_url = f"http://127.0.0.1:{port}/metrics"
