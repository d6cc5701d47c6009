"""Replay a workload through the CPU tier's manager and measure what its policy keeps.

:func:`replay` drives a real :class:`~asyncoffload.manager.CPUOffloadingManager` through
the sequence a scheduler runs for every request, in arrival order:

1. ``lookup_prefix`` of the prompt's blocks: the leading stored blocks are prefix hits;
2. ``touch`` of all the prompt's blocks (the hits become the most recently used);
3. ``prepare_load`` / ``complete_load`` of the hits;
4. ``prepare_store`` / ``complete_store`` of the rest (stores complete at once: the
   replay measures what the tier holds, not how fast it copies).

It reports prefix hits in tokens and blocks, blocks written / evicted / held back by
admission, and the bytes the copies would move. :func:`replay_engine` runs the same
sequence through the full async engine on the CPU backend, with real bytes.

With ``disk_capacity``, a disk tier sits below the CPU tier, indexed by a second
:class:`~asyncoffload.manager.CPUOffloadingManager` (the bookkeeping the engine's tier
uses), driven as the engine drives its tiers: the prefix walk goes on while each key is
ready in the CPU tier or on disk, and each hit counts in the tier it is served from, the
CPU tier first; the touch goes to both tiers; blocks served from disk are promoted, read
back into slots the CPU tier reserves for them (``CPUOffloadingManager.reserve``:
possibly evicting there, past the CPU tier's admission, not written to disk again);
blocks the CPU tier stores are written through to disk (inclusive), gated by the disk's
admission (default :data:`DISK_ADMISSION`, a block's second offer; ``None``: every
block).

:func:`belady` is the offline bound over the same access stream: Belady's MIN (evict the
block whose next use is furthest away), which also declines to store a block that is
never used again. It needs the future, so it is not a registered policy.

:func:`replay_matrix` runs policies x capacities; :func:`format_table` and
:func:`plot` (:func:`figure`) present the results. :func:`parse_family_source` reads the
replay's ``family:NAME[:N][:PARAM=VALUE]...`` sources (a seeded trace family of
:mod:`asyncoffload.workloads`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncoffload._term import fitted_table
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import CPUOffloadingManager, ManagerStats
from asyncoffload.manager.admission import AdmissionFilter
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies import CachePolicy
from asyncoffload.workloads import Request, families, summarize, trace_family

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "BELADY",
    "DISK_ADMISSION",
    "FAMILY_REQUESTS",
    "FAMILY_SOURCE",
    "LLAMA3_8B_BYTES_PER_TOKEN",
    "BeladyPolicy",
    "FamilySource",
    "NeverAgainAdmission",
    "ReplayResult",
    "belady",
    "capacity_blocks",
    "figure",
    "format_table",
    "infinite_tier_hit_rate",
    "is_family_source",
    "parse_disk_admission",
    "parse_family_source",
    "parse_spec",
    "plot",
    "replay",
    "replay_engine",
    "replay_matrix",
]

#: Name under which :func:`replay_matrix` reports the offline bound.
BELADY = "belady"
#: Default admission of the disk tier: a block is written to disk on its second offer
#: (like Dynamo KVBM's frequency filter). ``"frequencyN"`` writes on the N-th offer.
DISK_ADMISSION = "frequency2"
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


def parse_disk_admission(spec: str | None) -> tuple[int, str | None]:
    """The disk tier's admission ``spec`` as ``(store_threshold, filter name)`` for its
    :class:`~asyncoffload.manager.CPUOffloadingManager`: ``"frequencyN"`` (N >= 2) writes
    a block on its N-th offer (``"frequency"``: the second, as ``DiskTier``'s default),
    a registered filter name (``"ghost"``...) uses that filter, ``None`` or ``"none"``
    writes every block. ``ValueError`` naming the choices otherwise."""
    from asyncoffload.manager.admission import available_admissions, get_admission_cls

    if spec is None or spec == "none":
        return 0, None
    if spec == "frequency":  # DiskTier's name for it (min_offers=2)
        return 2, None
    if spec.startswith("frequency"):
        count = spec[len("frequency") :]
        if count.isdigit() and int(count) >= 2:
            return int(count), None
    elif spec:
        try:
            get_admission_cls(spec)
        except ValueError:
            pass
        else:
            return 0, spec
    raise ValueError(
        f"unknown disk admission {spec!r}: use frequencyN (a block is written on its N-th "
        f"offer, N >= 2; default {DISK_ADMISSION}), none (every block), or a filter: "
        f"{', '.join(available_admissions())}"
    )


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


def replay(
    requests: Sequence[Request],
    capacity: int,
    *,
    policy: str | CachePolicy = "lru",
    admission: str | AdmissionFilter | None = None,
    store_threshold: int = 0,
    bytes_per_token: int = LLAMA3_8B_BYTES_PER_TOKEN,
    unique_blocks: int | None = None,
    share: float | None = None,
    progress: Progress | None = None,
    before_request: Callable[[int], None] | None = None,
    disk_capacity: int | None = None,
    disk_policy: str = "lru",
    disk_admission: str | None = DISK_ADMISSION,
    disk_share: float | None = None,
) -> ReplayResult:
    """Replay ``requests`` in order through a manager of ``capacity`` slots.

    Tokens per block are each request's own (``Request.block_tokens``). ``share`` is the
    capacity share to report (default: ``capacity`` over the unique blocks). ``progress`` is
    called as ``progress(done, total)`` every few hundred requests; ``before_request(i)``
    before request ``i`` (the offline bound uses it to advance its clock).

    ``disk_capacity`` (blocks) adds a disk tier below the CPU tier, with its own
    ``disk_policy`` and ``disk_admission`` (see :func:`parse_disk_admission`; default: write a
    block on its second offer; ``None``: every block); ``disk_share`` is its capacity
    share to report (default: ``disk_capacity`` over the unique blocks). Without it the
    replay is the CPU tier's alone, as it always was.
    """
    _check_capacity(capacity)
    if disk_capacity is not None:
        _check_capacity(disk_capacity, "disk capacity")
        return _replay_tiers(
            requests,
            capacity,
            policy=policy,
            admission=admission,
            store_threshold=store_threshold,
            bytes_per_token=bytes_per_token,
            unique_blocks=unique_blocks,
            share=share,
            progress=progress,
            disk_capacity=disk_capacity,
            disk_policy=disk_policy,
            disk_admission_spec=disk_admission,
            disk_share=disk_share,
        )
    manager = CPUOffloadingManager(
        capacity,
        policy,
        store_threshold,
        enable_events=False,
        admission=admission,
    )
    tally = _Tally(len(requests), progress)
    lookup, touch = manager.lookup_prefix, manager.touch
    prepare_load, complete_load = manager.prepare_load, manager.complete_load
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    clock = time.perf_counter
    for i, req in enumerate(requests):
        if before_request is not None:
            before_request(i)
        keys = req.keys
        t0 = clock()
        n = lookup(keys)
        touch(keys)
        if n:
            hits = keys[:n]
            prepare_load(hits)
            complete_load(hits)
        out = prepare_store(keys[n:])
        if out is not None and out.keys_to_store:
            complete_store(out.keys_to_store)
        tally.add(req, n, None if out is None else out.keys_to_store, clock() - t0)
    return tally.result(
        manager.policy_name,
        manager.admission_name if store_threshold < 2 else f"threshold{store_threshold}",
        capacity,
        _share(share, capacity, requests, unique_blocks),
        manager.stats(),
        tally.stored_tokens * bytes_per_token,
        tally.hit_tokens * bytes_per_token,
    )


def _write_through(
    disk: CPUOffloadingManager, keys: Sequence[OffloadKey], tally: _Tally
) -> list[OffloadKey]:
    """Offer ``keys`` to the disk tier; the ones its admission takes are written."""
    if not keys:
        return []
    out = disk.prepare_store(keys)
    if out is None:  # no evictable room on disk
        tally.disk_refused += 1
        return []
    if out.keys_to_store:
        disk.complete_store(out.keys_to_store)
    return out.keys_to_store


def _replay_tiers(
    requests: Sequence[Request],
    capacity: int,
    *,
    policy: str | CachePolicy,
    admission: str | AdmissionFilter | None,
    store_threshold: int,
    bytes_per_token: int,
    unique_blocks: int | None,
    share: float | None,
    progress: Progress | None,
    disk_capacity: int,
    disk_policy: str,
    disk_admission_spec: str | None,
    disk_share: float | None,
) -> ReplayResult:
    """:func:`replay` with a disk tier below the CPU tier (inclusive, write-through)."""
    threshold, disk_filter = parse_disk_admission(disk_admission_spec)
    cpu = CPUOffloadingManager(
        capacity, policy, store_threshold, enable_events=False, admission=admission
    )
    disk = CPUOffloadingManager(
        disk_capacity, disk_policy, threshold, enable_events=False, admission=disk_filter
    )
    tally = _Tally(len(requests), progress)
    cpu_get, disk_get = cpu.policy.get, disk.policy.get
    clock = time.perf_counter
    for req in requests:
        keys = req.keys
        t0 = clock()
        # The prefix walk: on while each key is ready in one tier, the CPU tier first.
        n = cpu.lookup_prefix(keys)
        from_disk: list[int] = []
        for key in keys[n:]:
            block = cpu_get(key)
            if block is None or block.ref_cnt < 0:
                block = disk_get(key)
                if block is None or block.ref_cnt < 0:
                    break
                from_disk.append(n)
            n += 1
        # The engine's touch goes to every tier.
        cpu.touch(keys)
        disk.touch(keys)
        if from_disk:
            on_disk = [keys[i] for i in from_disk]
            in_cpu = [key for key in keys[:n] if cpu_get(key) is not None]
            # As the engine's promotion: the CPU hits pinned, CPU slots reserved for the
            # disk hits (past the CPU tier's admission, evicting idle blocks), read in.
            cpu.prepare_load(in_cpu)
            promote = cpu.reserve(on_disk)
            if promote is None:
                # No idle CPU slot to bring them into: the engine fails the load, and
                # the request recomputes (and stores) its whole prompt.
                cpu.complete_load(in_cpu)
                tally.promote_failed += 1
                n, from_disk = 0, []
            else:
                disk.prepare_load(on_disk)
                cpu.complete_store(promote.keys_to_store)
                tally.promoted += len(promote.keys_to_store)
                disk.complete_load(on_disk)
                cpu.complete_load(in_cpu)
        elif n:
            hits = keys[:n]
            cpu.prepare_load(hits)
            cpu.complete_load(hits)
        rest = keys[n:]
        out = cpu.prepare_store(rest)
        written: list[OffloadKey] = []
        if out is not None:
            fresh = out.keys_to_store
            # Write-through, as the engine's: blocks of the store already in the CPU tier
            # are offered to disk at once, the ones it writes when they are written.
            if len(fresh) < len(rest):
                new = set(fresh)
                ready = [key for key in rest if key not in new and cpu_get(key) is not None]
                written += _write_through(disk, ready, tally)
            if fresh:
                cpu.complete_store(fresh)
                written += _write_through(disk, fresh, tally)
        stored = None if out is None else out.keys_to_store
        tally.add(req, n, stored, clock() - t0, from_disk, written)
    cpu_stats, disk_stats = cpu.stats(), disk.stats()
    unique = unique_blocks
    if share is None or disk_share is None:
        unique = unique if unique is not None else summarize(requests).unique_blocks
    result = tally.result(
        cpu.policy_name,
        cpu.admission_name if store_threshold < 2 else f"threshold{store_threshold}",
        capacity,
        _share(share, capacity, requests, unique),
        cpu_stats,
        tally.stored_tokens * bytes_per_token,
        tally.hit_tokens * bytes_per_token,
    )
    return dataclasses.replace(
        result,
        # The CPU tier's own: promotions are not stores from the GPU side.
        stored=cpu_stats.stored - tally.promoted,
        disk_capacity=disk_capacity,
        disk_capacity_share=_share(disk_share, disk_capacity, requests, unique),
        disk_policy=disk.policy_name,
        disk_admission=(f"frequency{threshold}" if threshold >= 2 else disk.admission_name),
        disk_hit_blocks=tally.disk_hit_blocks,
        disk_hit_tokens=tally.disk_hit_tokens,
        disk_stored=disk_stats.stored,
        disk_bytes_stored=tally.disk_stored_tokens * bytes_per_token,
        disk_evicted=disk_stats.evicted,
        disk_skipped=disk_stats.store_skipped,
        disk_refused=tally.disk_refused,
        promoted=tally.promoted,
        promote_failed=tally.promote_failed,
    )


# --- the offline bound -----------------------------------------------------------------

_NEVER = 1 << 62


class _NextUses:
    """For every request position, when each of its keys is used next."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.after: list[list[int]] = [[] for _ in requests]
        upcoming: dict[OffloadKey, int] = {}
        for i in range(len(requests) - 1, -1, -1):
            keys = requests[i].keys
            self.after[i] = [upcoming.get(key, _NEVER) for key in keys]
            for key in keys:
                upcoming[key] = i
        self.requests = requests
        #: The current request's keys: (next use, position in the prompt).
        self.current: dict[OffloadKey, tuple[int, int]] = {}

    def advance(self, i: int) -> None:
        self.current = {
            key: (nxt, pos)
            for pos, (key, nxt) in enumerate(zip(self.requests[i].keys, self.after[i]))
        }


class BeladyPolicy(CachePolicy):
    """Belady's MIN: evicts the block whose next use is furthest away (offline).

    Fed by the replay with each request's next uses before it runs. Ties (blocks used
    next by the same request) go to the deepest block, so a prefix is cut from its end.
    Honours the manager's guarantees like any policy.
    """

    name = BELADY

    def __init__(self, capacity: int, future: _NextUses) -> None:
        super().__init__(capacity)
        self._future = future
        self.clear()

    def clear(self) -> None:
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self._next: dict[OffloadKey, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, OffloadKey]] = []

    def _set(self, key: OffloadKey) -> None:
        nxt, depth = self._future.current.get(key, (_NEVER, 0))
        self._next[key] = (nxt, depth)
        heapq.heappush(self._heap, (-nxt, -depth, key))

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._blocks[key] = block
        self._set(key)

    def remove(self, key: OffloadKey) -> None:
        if self._blocks.pop(key, None) is not None:
            del self._next[key]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        blocks = self._blocks
        for key in keys:
            if key in blocks:
                self._set(key)

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        heap, nxt, blocks = self._heap, self._next, self._blocks
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        kept: list[tuple[int, int, OffloadKey]] = []
        while len(victims) < n and heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if nxt.get(key) != (-entry[0], -entry[1]):
                continue  # stale
            block = blocks[key]
            if block.ref_cnt != 0 or key in protected:
                kept.append(entry)
                continue
            victims.append((key, block))
            kept.append(entry)
        if len(victims) < n:
            for entry in kept:
                heapq.heappush(heap, entry)
            return None
        chosen = {key for key, _ in victims}
        for entry in kept:
            if entry[2] not in chosen:
                heapq.heappush(heap, entry)
        for key, _ in victims:
            del blocks[key]
            del nxt[key]
        if len(heap) > 4 * len(blocks) + 1024:
            self._heap = [(-v[0], -v[1], k) for k, v in nxt.items()]
            heapq.heapify(self._heap)
        return victims

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter(self._blocks.items())

    def __len__(self) -> int:
        return len(self._blocks)


class NeverAgainAdmission(AdmissionFilter):
    """Offline admission: does not store a block that is never used again."""

    name = "never-again"

    def __init__(self, capacity: int, future: _NextUses) -> None:
        super().__init__(capacity)
        self._future = future

    def admissible(self, keys: Sequence[OffloadKey], full: bool) -> list[OffloadKey]:
        current = self._future.current
        return [key for key in keys if current.get(key, (_NEVER, 0))[0] != _NEVER]

    def clear(self) -> None:
        pass


def belady(
    requests: Sequence[Request],
    capacity: int,
    *,
    bytes_per_token: int = LLAMA3_8B_BYTES_PER_TOKEN,
    unique_blocks: int | None = None,
    share: float | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """The offline bound: :func:`replay` with Belady's MIN and never-again admission."""
    _check_capacity(capacity)
    future = _NextUses(requests)
    result = replay(
        requests,
        capacity,
        policy=BeladyPolicy(capacity, future),
        admission=NeverAgainAdmission(capacity, future),
        bytes_per_token=bytes_per_token,
        unique_blocks=unique_blocks,
        share=share,
        progress=progress,
        before_request=future.advance,
    )
    return dataclasses.replace(result, admission=None)


# --- the full engine -------------------------------------------------------------------


async def replay_engine(
    requests: Sequence[Request],
    capacity: int,
    *,
    policy: str = "lru",
    admission: str | None = None,
    unique_blocks: int | None = None,
    share: float | None = None,
    progress: Progress | None = None,
) -> tuple[ReplayResult, int]:
    """:func:`replay` through the async engine with real bytes on the CPU backend.

    A small simulated KV cache (1 layer, 16-token blocks of 1 x 8 bf16 heads, as many
    blocks as the longest request) holds each block's deterministic content; hits are
    loaded into it and checked bit for bit. Returns the result and the number of loaded
    blocks whose bytes did not match (0 when all is well). Requests run one at a time,
    so the hits equal :func:`replay`'s: a store of more new blocks than the tier holds
    (:class:`~asyncoffload.CapacityError`) stores nothing and counts as refused, as the
    manager's ``None`` does there; ``extra["too_large"]`` counts those stores.
    """
    from asyncoffload.config import EngineConfig
    from asyncoffload.demo import SimulatedKVCache
    from asyncoffload.engine import AsyncOffloadEngine
    from asyncoffload.errors import CapacityError

    _check_capacity(capacity)
    width = max((len(req.keys) for req in requests), default=1) or 1
    cache = SimulatedKVCache(1, width, 16, 1, 8)
    config = EngineConfig(
        cpu_blocks=capacity, policy=policy, admission=admission, touch_on_load=False
    )
    tally = _Tally(len(requests), progress)
    mismatches = too_large = 0
    clock = time.perf_counter
    async with AsyncOffloadEngine(cache.kv_caches, config) as engine:
        for req in requests:
            keys = list(req.keys)
            ids = list(range(len(keys)))
            t0 = clock()
            n = engine.lookup(keys)
            engine.touch(keys)
            if n:
                load = await engine.prepare_load(keys[:n], ids[:n])
                await load
                mismatches += cache.check(keys[:n], ids[:n])
            cache.write(keys[n:], ids[n:])
            try:
                handle = await engine.prepare_store(keys[n:], ids[n:])
            except CapacityError:
                handle = None
                too_large += 1
            if handle is not None:
                await handle
            stored = None if handle is None else handle.keys_to_store
            tally.add(req, n, stored, clock() - t0)
        st = engine.manager.stats()
        block_bytes = cache.storage[:, :, :1].numel() * cache.storage.element_size()
        result = tally.result(
            policy,
            admission,
            capacity,
            _share(share, capacity, requests, unique_blocks),
            st,
            st.stored * block_bytes,
            st.loaded * block_bytes,
        )
    result.extra["too_large"] = float(too_large)
    return result, mismatches


# --- workload sources --------------------------------------------------------------------

#: How a replay source names a trace family (:func:`parse_family_source`).
FAMILY_SOURCE = "family:NAME[:N][:PARAM=VALUE]..."
#: Requests of a family source that names no count (as ``synthetic``'s).
FAMILY_REQUESTS = 20_000

Param = int | float | str


@dataclass(frozen=True)
class FamilySource:
    """A trace family (:func:`asyncoffload.workloads.families`) as a replay source names
    it: ``family:rag:50000:seed=3:zipf_s=1.2`` is the ``rag`` family's first 50,000
    requests at seed 3 with ``zipf_s=1.2``. ``str()`` gives that text back."""

    family: str
    #: Requests to generate (``None``: :data:`FAMILY_REQUESTS`).
    num_requests: int | None = None
    #: The seed (``None``: the caller's, the replay's ``--seed``).
    seed: int | None = None
    #: The generator parameters the source sets, in its order.
    params: tuple[tuple[str, Param], ...] = ()

    def __str__(self) -> str:
        parts = ["family", self.family]
        if self.num_requests is not None:
            parts.append(str(self.num_requests))
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        parts += [f"{name}={value}" for name, value in self.params]
        return ":".join(parts)

    def requests(
        self, *, seed: int = 0, block_size: int = 512, limit: int | None = None
    ) -> list[Request]:
        """The workload: the source's requests (at most ``limit``), at its seed or else
        ``seed``, with blocks of ``block_size`` tokens."""
        n = FAMILY_REQUESTS if self.num_requests is None else self.num_requests
        if limit is not None:
            n = min(n, limit)
        return trace_family(self.family).generate(
            n,
            seed=seed if self.seed is None else self.seed,
            block_size=block_size,
            **dict(self.params),
        )


def is_family_source(text: str) -> bool:
    """Whether ``text`` means a trace family (``family`` or ``family:...``), not a file."""
    return text == "family" or text.startswith("family:")


def parse_family_source(text: str) -> FamilySource:
    """``family:NAME[:N][:PARAM=VALUE]...`` as a :class:`FamilySource`.

    ``NAME`` is a trace family (``chat``, ``agent``, ``rag``, ``scan``, ``diurnal``), ``N``
    (right after it) the number of requests, each ``PARAM=VALUE`` the seed (``seed=3``)
    or one of the family's generator parameters (``zipf_s=1.2``, ``order=id``: the
    types of their defaults). The parameters are checked at once, by generating no
    requests. ``ValueError`` naming the source and the bad part otherwise; the block
    size is the caller's (the replay's ``--block-size``), never the source's.
    """
    head, _, rest = text.partition(":")
    names = ", ".join(families())
    if head != "family" or not rest:
        raise ValueError(f"{text!r}: expected {FAMILY_SOURCE} with NAME one of {names}")
    name, *parts = rest.split(":")
    try:
        family = trace_family(name)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    defaults = family.parameters()
    num_requests: int | None = None
    seed: int | None = None
    params: dict[str, Param] = {}
    for i, part in enumerate(parts):
        key, eq, value = part.partition("=")
        if not eq:
            if i == 0 and part.isdecimal() and int(part) > 0:
                num_requests = int(part)
                continue
            where = "N (a positive number of requests) or " if i == 0 else ""
            raise ValueError(f"{text!r}: expected {where}PARAM=VALUE, got {part!r}")
        if key == "seed":
            if seed is not None:
                raise ValueError(f"{text!r}: seed is given twice")
            try:
                seed = int(value)
            except ValueError:
                raise ValueError(f"{text!r}: seed takes an integer, got {value!r}") from None
            continue
        if key == "block_size":
            raise ValueError(f"{text!r}: the block size is the replay's (--block-size)")
        if key not in defaults:
            raise ValueError(
                f"{text!r}: the {name} family has no parameter {key!r} (its parameters: "
                f"{', '.join(defaults)}, and seed)"
            )
        if key in params:
            raise ValueError(f"{text!r}: {key} is given twice")
        params[key] = _param_value(text, key, value, defaults[key])
    source = FamilySource(name, num_requests, seed, tuple(params.items()))
    try:
        family.generate(0, seed=seed or 0, block_size=512, **params)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    return source


def _param_value(text: str, key: str, value: str, default: object) -> Param:
    """``value`` as the type of the parameter's ``default``."""
    if isinstance(default, str):
        return value
    kind, convert = ("an integer", int) if isinstance(default, int) else ("a number", float)
    try:
        return convert(value)
    except ValueError:
        raise ValueError(f"{text!r}: {key} takes {kind}, got {value!r}") from None


# --- many runs, and their presentation ---------------------------------------------------


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``"kv"`` -> ``("kv", None)``; ``"lru+ghost"`` -> ``("lru", "ghost")``; ``ValueError``
    naming the unknown part otherwise (``"belady"`` is the offline bound)."""
    from asyncoffload.manager.admission import get_admission_cls
    from asyncoffload.manager.policies import get_policy_cls

    name, plus, adm = spec.strip().partition("+")
    if name == BELADY:
        if plus:
            raise ValueError(f"{spec!r}: the offline bound takes no admission filter")
        return name, None
    get_policy_cls(name)
    if plus:
        get_admission_cls(adm)
        return name, adm
    return name, None


def replay_matrix(
    requests: Sequence[Request],
    shares: Sequence[float],
    specs: Sequence[str],
    *,
    bytes_per_token: int = LLAMA3_8B_BYTES_PER_TOKEN,
    progress: Callable[[str, int, int], None] | None = None,
    engine: bool = False,
    disk_shares: Sequence[float | None] | None = None,
    disk_policy: str = "lru",
    disk_admission: str | None = DISK_ADMISSION,
) -> list[ReplayResult]:
    """Replay every ``policy[+admission]`` spec (or ``"belady"``) at every capacity share.

    Specs are checked before anything runs. ``engine=True`` runs the online policies
    through the async engine with real bytes (:func:`replay_engine`); each result's
    ``extra["mismatches"]`` counts loaded blocks whose bytes were wrong.

    ``disk_shares`` (shares of the unique blocks, above 1 allowed; ``None`` in the list:
    no disk tier) runs every online spec at every CPU share x disk share, with a disk
    tier of ``disk_policy`` and ``disk_admission`` (see :func:`replay`); the offline
    bound runs once per CPU share, for the CPU tier alone. Not with ``engine``."""
    from asyncoffload.loops import run
    from asyncoffload.manager.policies import get_policy_cls

    parsed = [parse_spec(spec) for spec in specs]
    unique = summarize(requests).unique_blocks
    disks: list[float | None] = [None]
    if disk_shares is not None:
        if engine:
            raise ValueError("the engine replay models the CPU tier only: no disk_shares")
        if disk_policy == BELADY:
            raise ValueError("the disk tier takes an online policy, not the offline bound")
        get_policy_cls(disk_policy)
        parse_disk_admission(disk_admission)
        disks = list(dict.fromkeys(disk_shares))
    runs = [
        (share, name, adm, disk)
        for share in shares
        for name, adm in parsed
        for disk in ([None] if name == BELADY else disks)
    ]
    caps = {share: capacity_blocks(share, unique) for share in shares}
    disk_caps = {d: capacity_blocks(d, unique) for d in disks if d is not None}
    results: list[ReplayResult] = []
    total = len(runs) * len(requests)
    for j, (share, name, adm, disk) in enumerate(runs):
        cap = caps[share]
        label = f"{name}{'+' + adm if adm else ''} @ {_share_label(share)}"
        if disk is not None:
            label += f" + disk {_share_label(disk)}"
        base = j * len(requests)

        def step(done: int, _total: int, base: int = base, label: str = label) -> None:
            if progress is not None:
                progress(label, base + done, total)

        if name == BELADY:
            res = belady(
                requests,
                cap,
                bytes_per_token=bytes_per_token,
                unique_blocks=unique,
                share=share,
                progress=step,
            )
        elif engine:
            res, bad = run(
                replay_engine(
                    requests,
                    cap,
                    policy=name,
                    admission=adm,
                    unique_blocks=unique,
                    share=share,
                    progress=step,
                )
            )
            res.extra["mismatches"] = float(bad)
        else:
            res = replay(
                requests,
                cap,
                policy=name,
                admission=adm,
                bytes_per_token=bytes_per_token,
                unique_blocks=unique,
                share=share,
                progress=step,
                disk_capacity=None if disk is None else disk_caps[disk],
                disk_policy=disk_policy,
                disk_admission=disk_admission,
                disk_share=disk,
            )
        results.append(res)
    return results


def _share_label(share: float) -> str:
    pct = share * 100
    return f"{pct:.0f}%" if abs(pct - round(pct)) < 0.05 else f"{pct:.1f}%"


def format_table(
    results: Sequence[ReplayResult], metric: str = "block", columns: int | None = None
) -> str:
    """A text table: one row per capacity, per policy the hit rate and blocks written.
    No line is as wide as ``columns`` (default: the terminal's width): a table too wide
    is cut into blocks of policies, stacked, each repeating the capacity column."""
    if metric not in ("block", "token"):
        raise ValueError(f"metric must be 'block' or 'token', got {metric!r}")
    if any(r.has_disk for r in results):
        return _format_tiers_table(results, metric, columns)
    policies: list[str] = []
    for r in results:
        if r.label not in policies:
            policies.append(r.label)
    shares = sorted({r.capacity_share for r in results})
    by = {(r.label, r.capacity_share): r for r in results}
    head = ["capacity"] + [f"{p} hit / written" for p in policies]
    rows = [head]
    slots = {r.capacity_share: r.capacity for r in results}
    for share in shares:
        row = [f"{_share_label(share)} ({slots[share]:,})"]
        for p in policies:
            found = by.get((p, share))
            if found is None:
                row.append("-")
                continue
            rate = found.block_hit_rate if metric == "block" else found.token_hit_rate
            row.append(f"{rate:.3f} / {found.stored:,}")
        rows.append(row)
    return fitted_table(rows, columns)


def _gb(n: int) -> str:
    gb = n / 1e9
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.1f}"


def _format_tiers_table(results: Sequence[ReplayResult], metric: str, columns: int | None) -> str:
    """:func:`format_table` with a disk tier: one row per CPU capacity x disk capacity
    (``none``: the CPU tier alone), per policy the hit rates served from CPU / disk /
    both and the GB (10^9 bytes) written to disk; the offline bound is the CPU tier's."""
    policies: list[str] = []
    for r in results:
        if r.policy != BELADY and r.label not in policies:
            policies.append(r.label)
    bound = {r.capacity_share: r for r in results if r.policy == BELADY}
    slots = {r.capacity_share: r.capacity for r in results}
    disk_slots = {r.disk_capacity_share: r.disk_capacity for r in results if r.has_disk}
    by = {
        (r.label, r.capacity_share, r.disk_capacity_share): r for r in results if r.policy != BELADY
    }
    cells = sorted(
        {(share, disk) for _, share, disk in by},
        key=lambda c: (c[0], -1.0 if c[1] is None else c[1]),
    )
    head = ["cpu", "disk"] + [f"{p} cpu / disk / total, GB to disk" for p in policies]
    if bound:
        head.append(f"{BELADY} (cpu only)")
    rows = [head]
    for share, disk in cells:
        row = [
            f"{_share_label(share)} ({slots[share]:,})",
            "none" if disk is None else f"{_share_label(disk)} ({disk_slots[disk]:,})",
        ]
        for p in policies:
            found = by.get((p, share, disk))
            if found is None:
                row.append("-")
            elif not found.has_disk:
                rate = found.block_hit_rate if metric == "block" else found.token_hit_rate
                row.append(f"{rate:.3f} / - / {rate:.3f}, -")
            else:
                cpu, on_disk, total = found.hit_rates(metric)
                row.append(
                    f"{cpu:.3f} / {on_disk:.3f} / {total:.3f}, {_gb(found.disk_bytes_stored)}"
                )
        if bound:
            b = bound.get(share)
            if b is None:
                row.append("-")
            else:
                row.append(f"{b.block_hit_rate if metric == 'block' else b.token_hit_rate:.3f}")
        rows.append(row)
    return _fitted_two_key_table(rows, columns)


def _fitted_two_key_table(rows: list[list[str]], columns: int | None) -> str:
    """:func:`fitted_table` keyed by the first two columns (CPU and disk capacity): they
    are joined into one, which every stacked block repeats."""
    joined = [[f"{row[0]}  {row[1].rjust(max(len(r[1]) for r in rows))}", *row[2:]] for row in rows]
    return fitted_table(joined, columns)


def infinite_tier_hit_rate(requests: Sequence[Request], metric: str = "block") -> float:
    """The prefix hit rate of a tier that holds everything, stored at once: what the
    table's rates would reach with unlimited capacity, in the table's ``metric``."""
    if metric not in ("block", "token"):
        raise ValueError(f"metric must be 'block' or 'token', got {metric!r}")
    seen: set[OffloadKey] = set()
    hit = total = 0
    for req in requests:
        hits = 0
        for key in req.keys:
            if key not in seen:
                break
            hits += 1
        if metric == "block":
            hit += hits
            total += len(req.keys)
        else:
            hit += sum(req.block_tokens()[:hits])
            total += req.input_tokens
        seen.update(req.keys)
    return hit / total if total else 0.0


def figure(results: Sequence[ReplayResult], title: str = "", metric: str = "block") -> Figure:
    """A figure of two panels against capacity, one line per policy (matplotlib): the
    prefix hit rate (``metric``: ``"block"`` or ``"token"``) and the blocks written to
    the tier. The legend sits below the panels, where it covers no point."""
    if metric not in ("block", "token"):
        raise ValueError(f"metric must be 'block' or 'token', got {metric!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("plotting needs matplotlib: pip install 'asyncoffload[replay]'") from exc
    fig, (hits, written) = plt.subplots(1, 2, figsize=(11, 4.8), dpi=120)
    policies: list[str] = []
    for r in results:
        if r.label not in policies:
            policies.append(r.label)
    markers = "os^vDP*Xh<>"
    shares = sorted({r.capacity_share for r in results})
    for i, p in enumerate(policies):
        mine = sorted((r for r in results if r.label == p), key=lambda r: r.capacity_share)
        xs = [r.capacity_share * 100 for r in mine]
        rates = [r.block_hit_rate if metric == "block" else r.token_hit_rate for r in mine]
        style = "k--" if p == BELADY else "-"
        marker = "o" if p == BELADY else markers[i % len(markers)]
        hits.plot(xs, rates, style, marker=marker, label=p)
        written.plot(xs, [r.stored for r in mine], style, marker=marker, label=p)
    for ax in (hits, written):
        ax.set_xscale("log")
        ax.set_xticks([x * 100 for x in shares], [_share_label(x) for x in shares])
        ax.minorticks_off()
        ax.set_xlabel("capacity (share of the workload's unique blocks)")
        ax.grid(True, which="both", alpha=0.3)
    hits.set_ylabel(f"prefix hit rate ({metric}s)")
    written.set_ylabel("blocks written to the tier")
    if title:
        fig.suptitle(title)
    handles, labels = hits.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False)
    rows = -(-len(labels) // 6)
    fig.tight_layout(rect=(0, 0.06 * rows + 0.02, 1, 1))
    return fig


def plot(
    results: Sequence[ReplayResult], path: str, title: str = "", metric: str = "block"
) -> None:
    """Write :func:`figure` to ``path`` (any format matplotlib saves: .png, .svg, .pdf)."""
    import matplotlib.pyplot as plt

    fig = figure(results, title, metric)
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)
