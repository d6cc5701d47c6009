"""What a replay measures: :class:`ReplayResult`, and the tally that builds it request by
request (shared by the manager replay and the engine replay)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from asyncoffload.keys import OffloadKey
from asyncoffload.manager import ManagerStats
from asyncoffload.workloads import Request, summarize

__all__ = ["LLAMA3_8B_BYTES_PER_TOKEN", "Progress", "ReplayResult", "capacity_blocks"]

#: KV bytes per token of a Llama-3-8B-like model (32 layers x K,V x 8 heads x 128 x bf16).
LLAMA3_8B_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ReplayResult:
    """What one replay measured. Rates are over all requests' prompt blocks/tokens."""

    policy: str
    admission: str | None
    #: Slots of the tier.
    capacity: int
    #: ``capacity`` as a share of the workload's unique blocks.
    capacity_share: float
    requests: int
    blocks: int
    hit_blocks: int
    tokens: int
    hit_tokens: int
    #: Blocks written (stores that happened).
    stored: int
    #: Blocks read back (prefix hits).
    loaded: int
    evicted: int
    #: Blocks offered but held back by admission.
    skipped: int
    #: Stores refused for lack of evictable room.
    refused: int
    #: Bytes the stores and loads would move.
    bytes_stored: int
    bytes_loaded: int
    #: Seconds spent in manager calls.
    manager_seconds: float
    extra: dict[str, float] = field(default_factory=dict)
    # The disk tier (``disk_capacity is None``: none modelled, the rest reads 0 / None).
    # ``hit_blocks`` / ``hit_tokens`` count the hits of both tiers; ``stored``, ``evicted``
    # and ``skipped`` stay the CPU tier's (``stored``: blocks written from the GPU side,
    # promotions apart).
    #: Slots of the disk tier, and their share of the workload's unique blocks.
    disk_capacity: int | None = None
    disk_capacity_share: float | None = None
    disk_policy: str | None = None
    #: The disk's admission: ``"frequencyN"`` (write on the N-th offer), a filter's
    #: name, or ``None`` (every block offered).
    disk_admission: str | None = None
    #: Prefix hits served from disk (found there and not in the CPU tier).
    disk_hit_blocks: int = 0
    disk_hit_tokens: int = 0
    #: Blocks written to disk (write-through of CPU stores), and their bytes.
    disk_stored: int = 0
    disk_bytes_stored: int = 0
    disk_evicted: int = 0
    #: Blocks offered to disk and held back by its admission.
    disk_skipped: int = 0
    #: Disk stores refused for lack of evictable room.
    disk_refused: int = 0
    #: Disk hits read back into the CPU tier.
    promoted: int = 0
    #: Requests whose disk hits found no idle CPU slot to come into: the engine fails
    #: such a load, so they hit nothing and recompute their prompt.
    promote_failed: int = 0

    @property
    def label(self) -> str:
        """``policy`` or ``policy+admission``."""
        return f"{self.policy}+{self.admission}" if self.admission else self.policy

    @property
    def has_disk(self) -> bool:
        """Whether a disk tier was modelled."""
        return self.disk_capacity is not None

    @property
    def block_hit_rate(self) -> float:
        """Prefix hits over prompt blocks, both tiers together."""
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Prefix hits over prompt tokens, both tiers together."""
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def cpu_hit_blocks(self) -> int:
        """Prefix hits served from the CPU tier."""
        return self.hit_blocks - self.disk_hit_blocks

    @property
    def cpu_hit_tokens(self) -> int:
        return self.hit_tokens - self.disk_hit_tokens

    @property
    def cpu_block_hit_rate(self) -> float:
        return self.cpu_hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def cpu_token_hit_rate(self) -> float:
        return self.cpu_hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def disk_block_hit_rate(self) -> float:
        return self.disk_hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def disk_token_hit_rate(self) -> float:
        return self.disk_hit_tokens / self.tokens if self.tokens else 0.0

    def hit_rates(self, metric: str = "block") -> tuple[float, float, float]:
        """(CPU, disk, total) prefix hit rates in ``metric`` (``"block"``/``"token"``)."""
        if metric == "block":
            return self.cpu_block_hit_rate, self.disk_block_hit_rate, self.block_hit_rate
        if metric == "token":
            return self.cpu_token_hit_rate, self.disk_token_hit_rate, self.token_hit_rate
        raise ValueError(f"metric must be 'block' or 'token', got {metric!r}")

    @property
    def us_per_block(self) -> float:
        """Manager time per prompt block, microseconds."""
        return self.manager_seconds * 1e6 / self.blocks if self.blocks else 0.0


def capacity_blocks(share: float, unique_blocks: int) -> int:
    """Slots for ``share`` (0 < share) of ``unique_blocks``, at least 1."""
    if not share > 0 or not math.isfinite(share):
        raise ValueError(f"capacity share must be a positive number, got {share!r}")
    return max(1, round(share * unique_blocks))


def _check_capacity(capacity: int, what: str = "capacity") -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"{what} must be a positive number of blocks, got {capacity!r}")


class _Tally:
    """What a replay counts, request by request; shared by :func:`replay` and
    :func:`replay_engine`."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total = total
        self.progress = progress
        self.every = max(1, total // 200)
        self.done = self.blocks = self.hit_blocks = self.tokens = self.hit_tokens = 0
        self.refused = self.stored_tokens = 0
        self.disk_hit_blocks = self.disk_hit_tokens = self.disk_stored_tokens = 0
        self.disk_refused = self.promoted = self.promote_failed = 0
        self.seconds = 0.0

    def add(
        self,
        req: Request,
        hits: int,
        stored: Sequence[OffloadKey] | None,
        dt: float,
        disk_hits: Sequence[int] = (),
        disk_stored: Sequence[OffloadKey] = (),
    ) -> None:
        """Request ``req`` hit ``hits`` blocks and wrote ``stored`` (``None``: refused);
        ``disk_hits`` are the positions of the hits served from disk, ``disk_stored``
        the keys written to disk."""
        tokens = req.block_tokens()
        self.blocks += len(req.keys)
        self.hit_blocks += hits
        self.tokens += req.input_tokens
        self.hit_tokens += sum(tokens[:hits])
        if disk_hits:
            self.disk_hit_blocks += len(disk_hits)
            self.disk_hit_tokens += sum(tokens[i] for i in disk_hits)
        if stored is None:
            self.refused += 1
        elif stored:
            written = set(stored)
            self.stored_tokens += sum(
                t for key, t in zip(req.keys[hits:], tokens[hits:]) if key in written
            )
        if disk_stored:
            written = set(disk_stored)
            self.disk_stored_tokens += sum(
                t for key, t in zip(req.keys[hits:], tokens[hits:]) if key in written
            )
        self.seconds += dt
        self.done += 1
        if self.progress is not None and (self.done % self.every == 0 or self.done == self.total):
            self.progress(self.done, self.total)

    def result(
        self,
        policy: str,
        admission: str | None,
        capacity: int,
        share: float,
        stats: ManagerStats,
        bytes_stored: int,
        bytes_loaded: int,
    ) -> ReplayResult:
        return ReplayResult(
            policy=policy,
            admission=admission,
            capacity=capacity,
            capacity_share=share,
            requests=self.done,
            blocks=self.blocks,
            hit_blocks=self.hit_blocks,
            tokens=self.tokens,
            hit_tokens=self.hit_tokens,
            stored=stats.stored,
            loaded=self.hit_blocks,
            evicted=stats.evicted,
            skipped=stats.store_skipped,
            refused=self.refused,
            bytes_stored=bytes_stored,
            bytes_loaded=bytes_loaded,
            manager_seconds=self.seconds,
        )


def _share(
    share: float | None, capacity: int, requests: Sequence[Request], unique: int | None
) -> float:
    if share is not None:
        return share
    unique = unique if unique is not None else summarize(requests).unique_blocks
    return capacity / unique if unique else 0.0


def _share_label(share: float) -> str:
    pct = share * 100
    return f"{pct:.0f}%" if abs(pct - round(pct)) < 0.05 else f"{pct:.1f}%"
