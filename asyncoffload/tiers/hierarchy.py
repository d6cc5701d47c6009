"""The tier hierarchy below the CPU tier, as one sans-I/O core.

:class:`TierHierarchy` owns every rule of the tiers below the CPU tier, once, for both
drivers: the engine on its event loop (``asyncoffload.engine_tiers``) and vLLM's
scheduler side, polled from each manager call (``integrations/vllm/tiers.py``). It
decides:

- which tier holds a key (:meth:`~TierHierarchy.source`, :meth:`~TierHierarchy.lookup`);
- how a promotion reserves CPU slots, reads, settles or fails
  (:meth:`~TierHierarchy.promote`, :meth:`~TierHierarchy.take_reads`,
  :meth:`~TierHierarchy.read_done`, :meth:`~TierHierarchy.cancel_reads`);
- write-through and its admission (:meth:`~TierHierarchy.write_through`,
  :meth:`~TierHierarchy.write_done`);
- what a shared tier's answer adds to its index (:meth:`~TierHierarchy.join`);
- drops, failure causes, counters (:meth:`~TierHierarchy.stats`) and per-tier events
  (:meth:`~TierHierarchy.take_events`).

It performs no I/O, owns no thread and awaits nothing, in the manner of h11 or
aioquic's QUIC connection: plain calls go in, :class:`TierIo` requests come out, and a
driver carries each to its tier (:func:`submit`, then its own way of learning that the
job ended: the completion bridge, or polling) and hands the ended job back. Every call
is made on one thread (the event loop's, or vLLM's scheduler thread); the managers it
updates are plain Python.

A promotion is a :class:`Promotion`: the keys of one request that must come up from
lower tiers. It ends (``done``) when every read that carries one of its keys has ended;
``failed`` then says whether any key could not be read, which makes the blocks misses
(dropped from their tier's index, their CPU slots freed) and nothing reaches the KV.

A job a tier gave up on while its ops may still run (``late``: an op stuck in a system
call past its deadline, see ``tiers._io``) settles at once, every block failed (a read's
are misses, a write's are not indexed), but the host slots its ops read or write are
held: a read's CPU slots stay reserved, a write's stay pinned and its tier slots
reserved, until the job really ``ended`` and :meth:`~TierHierarchy.reap` lets them go.
Reused sooner, they would take another block's bytes, or give this one's to it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from asyncoffload.errors import KeyNotReadyError, UnknownKeyError
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import CPUOffloadingManager, ManagerStats, OffloadingEvent, ReqContext
from asyncoffload.manager.cpu import reject_duplicates
from asyncoffload.tiers.base import LowerTier, TierCounters, count_failures, outcomes
from asyncoffload.tiers.format import MAX_KEY_BYTES
from asyncoffload.transfer.base import CopyJob, FailedJob

__all__ = [
    "Promotion",
    "SharedTier",
    "TierHierarchy",
    "TierIo",
    "TierState",
    "TierStats",
    "submit",
]

log = logging.getLogger("asyncoffload")

#: A warning about failed writes at most this often per tier (a full disk fails every one).
_WARN_EVERY_S = 10.0


@dataclass(frozen=True)
class TierStats:
    """A tier below the CPU tier: what it holds and what it did."""

    name: str
    medium: str
    #: Tier details: mode, path, O_DIRECT, capacity, ...
    info: dict[str, object]
    manager: ManagerStats
    #: Leading keys of ``lookup`` calls found only here.
    lookup_hits: int
    #: Blocks written (write-through) and bytes; writes that failed, per block.
    blocks_written: int
    bytes_written: int
    write_failures: int
    #: Blocks read back (promotions) and bytes; reads that failed, per block (each a miss).
    blocks_read: int
    bytes_read: int
    read_failures: int
    #: Blocks dropped from the index because a read failed its checks.
    dropped: int
    #: Failures by cause: "corrupt", "stale", "wrong_key", "short", "missing", "timeout",
    #: or the errno name ("ENOSPC", "EIO", ...); skips: "full", "no_slot", "no_pool".
    failures: dict[str, int]
    #: Offered blocks found there already, nothing written (a shared tier's put-if-absent
    #: over another engine's copy): ready in the index, not in ``blocks_written``.
    blocks_present: int = 0


class SharedTier(Protocol):
    """A tier that can be asked which blocks it holds (a shared server)."""

    async def exists(self, keys: Sequence[OffloadKey]) -> list[bool]: ...


@dataclass(eq=False)
class TierState:
    """One tier below the CPU tier, as the core sees it."""

    store: LowerTier
    counters: TierCounters = field(default_factory=TierCounters)
    #: Promotions reserved and not handed out yet: (key, tier slot, CPU slot, promotion).
    batch: list[tuple[OffloadKey, int, int, Promotion]] = field(default_factory=list)
    #: The tier as a shared one (it answers ``exists``), or None.
    shared: SharedTier | None = None
    #: Keys a shared tier was asked about, and those it held.
    asked: int = 0
    found: int = 0
    #: When the last write failure was logged (monotonic).
    warned_at: float = -1e18

    @property
    def name(self) -> str:
        return self.store.name


@dataclass(eq=False)
class Promotion:
    """Keys of one request brought up from lower tiers into reserved CPU slots.

    ``left``: keys whose read has not ended. ``bad``: keys that could not be read (by
    cause, per tier, in ``causes``); ``error``: a defect met while settling. A driver
    keeps what its world needs of the promotion in ``owner``."""

    keys: list[OffloadKey]
    ctx: ReqContext | None
    left: int
    bad: int = 0
    causes: list[str] = field(default_factory=list)
    error: BaseException | None = None
    owner: Any = None

    @property
    def done(self) -> bool:
        return self.left == 0

    @property
    def failed(self) -> bool:
        return bool(self.bad) or self.error is not None


@dataclass(eq=False)
class TierIo:
    """An I/O request: read ``keys`` from ``tier``'s slots ``tier_slots`` into CPU slots
    ``cpu_slots``, or (``write``) write those CPU slots there. The driver submits it
    (:func:`submit`) and hands the job back when it ended."""

    tier: TierState
    write: bool
    keys: list[OffloadKey]
    tier_slots: list[int]
    cpu_slots: list[int]
    ctx: ReqContext | None = None
    #: Reads: the promotion of each key.
    promotions: list[Promotion] = field(default_factory=list)
    #: Set once its result was taken: a second hand-back (a completion rerun after an
    #: interrupt) changes nothing.
    settled: bool = False
    #: Reads, once settled: the keys that could not be read (misses now).
    bad: list[OffloadKey] = field(default_factory=list)


def submit(io: TierIo, host: Sequence[int]) -> CopyJob:
    """Hand ``io`` to its tier, its CPU slots at host addresses ``host``. A submission
    that raises becomes a failed job, so the failure takes the job's normal way back."""
    store = io.tier.store
    fn = store.submit_write if io.write else store.submit_read
    try:
        return fn(io.keys, io.tier_slots, host)
    except Exception as exc:
        log.warning("a tier I/O submission to %s failed: %r", store.name, exc)
        return FailedJob(len(io.keys), exc.with_traceback(None))


class TierHierarchy:
    """The rules of every tier below the CPU tier ``cpu`` (``stores``: highest first)."""

    def __init__(self, cpu: CPUOffloadingManager, stores: Sequence[LowerTier]) -> None:
        self.cpu = cpu
        self.tiers = [TierState(store, shared=_shared(store)) for store in stores]
        self.shared_tiers = [tier for tier in self.tiers if tier.shared is not None]
        #: Seconds a tier operation may wait to start (the slowest tier's).
        self.deadline_s = max((s.deadline_s for s in stores), default=0.0)
        #: Promotions reserved and not yet handed out by :meth:`take_reads`.
        self.batched = 0
        #: Jobs given up on whose ops may still run, each with what lets its slots go.
        self._late: list[tuple[CopyJob, Callable[[], None]]] = []

    # --- which tier holds a key ------------------------------------------------------

    def source(
        self, key: OffloadKey, allow: Callable[[TierState], bool] | None = None
    ) -> TierState | None:
        """The highest tier that has ``key`` ready (of those ``allow`` accepts: a
        request's tier filter)."""
        for tier in self.tiers:
            if tier.store.manager.ready(key) and (allow is None or allow(tier)):
                return tier
        return None

    def lookup(self, keys: Sequence[OffloadKey], n: int) -> int:
        """Extend a CPU prefix of ``n`` keys through the tiers: a key counts if it is
        ready in the CPU tier, or absent there and ready in a lower tier (counted as
        that tier's lookup hit)."""
        get = self.cpu.block_of
        for key in keys[n:]:
            block = get(key)
            if block is not None:
                if block.ref_cnt < 0:
                    break
            else:
                tier = self.source(key)
                if tier is None:
                    break
                tier.counters.lookup_hits += 1
            n += 1
        return n

    def sources(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, TierState]:
        """The keys of a load that are absent from the CPU tier, with the tier that
        gives each; raises (changing nothing) for a key listed twice, still being
        stored, or in no tier."""
        reject_duplicates(keys, "prepare_load")
        get = self.cpu.block_of
        out: dict[OffloadKey, TierState] = {}
        for key in keys:
            block = get(key)
            if block is not None:
                if block.ref_cnt < 0:
                    raise KeyNotReadyError(f"prepare_load: key {key.hex()} is still being stored")
                continue
            tier = self.source(key)
            if tier is None:
                raise UnknownKeyError(f"prepare_load: key {key.hex()} is not stored in any tier")
            out[key] = tier
        return out

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        for tier in self.tiers:
            tier.store.manager.touch(keys, ctx)

    # --- promotion -------------------------------------------------------------------

    def promote(
        self,
        sources: Mapping[OffloadKey, TierState],
        ctx: ReqContext | None = None,
        protect: Sequence[OffloadKey] = (),
        *,
        lookup: bool = False,
        count_no_slot: bool = True,
    ) -> Promotion | None:
        """Reserve CPU slots for the keys of ``sources`` (each absent from the CPU tier
        and ready in its tier), never evicting one of ``protect``, and pin each in its
        tier; their reads wait for :meth:`take_reads`. ``None``, changing nothing but a
        ``no_slot`` count, when the CPU tier has too few idle slots. ``lookup``: each
        key counts as a lookup hit of its tier (a driver whose lookups promote);
        ``count_no_slot=False``: a driver that may try again later counts the skip
        itself, once it gives up (:meth:`skip`)."""
        keys = list(sources)
        out = self.cpu.reserve(keys, protect)
        if out is None:
            if count_no_slot:
                for tier in dict.fromkeys(sources.values()):
                    self.skip(tier, "no_slot", 1)
            return None
        promotion = Promotion(keys, ctx, len(keys))
        by_tier: dict[TierState, list[tuple[OffloadKey, int]]] = {}
        for key, cpu_slot in zip(keys, out.store_spec.block_ids):
            by_tier.setdefault(sources[key], []).append((key, cpu_slot))
        for tier, pairs in by_tier.items():
            tier_slots = tier.store.manager.prepare_load([key for key, _ in pairs]).block_ids
            if lookup:
                tier.counters.lookup_hits += len(pairs)
            tier.batch.extend(
                (key, slot, cpu_slot, promotion) for (key, cpu_slot), slot in zip(pairs, tier_slots)
            )
        self.batched += len(keys)
        return promotion

    def take_reads(self) -> list[TierIo]:
        """The reads of every promotion reserved since the last call: one per tier."""
        reads: list[TierIo] = []
        if not self.batched:
            return reads
        self.batched = 0
        for tier in self.tiers:
            batch = tier.batch
            if not batch:
                continue
            tier.batch = []
            tier.counters.reads += 1
            reads.append(
                TierIo(
                    tier,
                    False,
                    [key for key, _, _, _ in batch],
                    [slot for _, slot, _, _ in batch],
                    [cpu_slot for _, _, cpu_slot, _ in batch],
                    promotions=[promotion for _, _, _, promotion in batch],
                )
            )
        return reads

    def read_done(self, io: TierIo, job: CopyJob) -> list[Promotion]:
        """A read ended: the blocks that passed their checks become ready in the CPU tier;
        the others are misses, dropped from their tier in this step (a removed event)
        and their CPU slots freed. Returns the promotions this read finished."""
        if io.settled:
            return []
        io.settled = True
        tier, keys = io.tier, io.keys
        bad: list[OffloadKey] = []
        try:
            results = outcomes(job, len(keys))
            bad = [key for key, r in zip(keys, results) if r < 0]
            good = [key for key, r in zip(keys, results) if r >= 0]
            manager = tier.store.manager
            manager.complete_load(good)
            tier.counters.blocks_read += len(good)
            tier.counters.bytes_read += len(good) * tier.store.block_bytes
            if good:
                self.cpu.complete_store(good, None, success=True)
            if bad:
                causes = count_failures(tier.counters, results)
                tier.counters.read_failures += len(bad)
                manager.drop(bad)
                tier.store.forget(bad)
                late = _late(job)
                if late:  # its ops may still write into these CPU slots: held until they end
                    free = functools.partial(self.cpu.complete_store, bad, None, success=False)
                    self._late.append((job, free))
                else:
                    self.cpu.complete_store(bad, None, success=False)
                log.warning(
                    "%d of %d blocks read from %s failed (%s): misses, dropped from its index%s",
                    len(bad),
                    len(keys),
                    tier.name,
                    ", ".join(f"{k} {v}" for k, v in causes.items()),
                    _STILL_RUNNING if late else "",
                )
                failed = set(bad)
                hit: dict[Promotion, None] = {}
                for key, promotion in zip(keys, io.promotions):
                    if key in failed:
                        promotion.bad += 1
                        hit[promotion] = None
                for promotion in hit:
                    promotion.causes.append(f"{tier.name}: {causes}")
        except Exception as exc:  # a defect: fail the promotions, never leave them open
            log.exception("settling a read from %s failed", tier.name)
            for promotion in io.promotions:
                promotion.error = promotion.error or exc
        finished: list[Promotion] = []
        for promotion in io.promotions:
            promotion.left -= 1
            if promotion.left == 0:
                finished.append(promotion)
        io.bad = bad
        return finished

    def cancel_reads(self) -> list[Promotion]:
        """Release the promotions reserved and not handed out (nothing was read): their
        tier pins and CPU slots go. Returns those it ended."""
        finished: list[Promotion] = []
        for tier in self.tiers:
            if not tier.batch:
                continue
            batch, tier.batch = tier.batch, []
            keys = [key for key, _, _, _ in batch]
            tier.store.manager.complete_load(keys)
            self.cpu.complete_store(keys, None, success=False)
            for _, _, _, promotion in batch:
                promotion.error = promotion.error or RuntimeError("the read was cancelled")
                promotion.left -= 1
                if promotion.left == 0:
                    finished.append(promotion)
        self.batched = 0
        return finished

    # --- write-through ---------------------------------------------------------------

    def write_through(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, *, blocked: str = ""
    ) -> list[TierIo]:
        """Offer the CPU-ready ``keys`` to each tier; those its admission takes are to be
        written from their CPU slots, pinned until :meth:`write_done`. ``blocked``: no
        tier can be written now, for this cause (counted per tier, nothing offered)."""
        get = self.cpu.block_of
        ready = [
            key
            for key in dict.fromkeys(keys)
            if len(key) <= MAX_KEY_BYTES and (b := get(key)) is not None and b.ref_cnt >= 0
        ]
        writes: list[TierIo] = []
        if not ready:
            return writes
        if blocked:
            for tier in self.tiers:
                self.skip(tier, blocked, len(ready))
            return writes
        for tier in self.tiers:
            manager = tier.store.manager
            out = manager.prepare_store(ready, ctx)
            if out is None:  # the tier is full of blocks being read or written
                self.skip(tier, "full", 1)
                continue
            if out.evicted_keys:
                tier.store.forget(out.evicted_keys)
            chosen = list(out.keys_to_store)
            if not chosen:
                continue
            spec = self.cpu.pin(chosen)
            tier.counters.writes += 1
            writes.append(
                TierIo(
                    tier,
                    True,
                    chosen,
                    list(out.store_spec.block_ids),
                    list(spec.block_ids),
                    ctx,
                )
            )
        return writes

    def write_done(self, io: TierIo, job: CopyJob) -> None:
        """A write ended: the blocks written become ready in the tier (a stored event),
        the others are dropped and counted by cause; the CPU slots are unpinned."""
        if io.settled:
            return
        io.settled = True
        tier, keys = io.tier, io.keys
        late = _late(job)
        try:
            results = outcomes(job, len(keys))
            good = [key for key, r in zip(keys, results) if r >= 0]
            bad = [key for key, r in zip(keys, results) if r < 0]
            manager = tier.store.manager
            counters = tier.counters
            if good:
                manager.complete_store(good, io.ctx, success=True)
                # 0 bytes: the block was there already (a put-if-absent that wrote nothing).
                written = sum(1 for r in results if r > 0)
                counters.blocks_written += written
                counters.bytes_written += written * tier.store.block_bytes
                counters.blocks_present += len(good) - written
            if bad:
                if not late:
                    manager.complete_store(bad, io.ctx, success=False)
                counters.write_failures += len(bad)
                causes = count_failures(counters, results)
                now = time.monotonic()
                if late or now - tier.warned_at >= _WARN_EVERY_S:
                    tier.warned_at = now
                    log.warning(
                        "%d of %d blocks could not be written to %s (%s): skipped%s",
                        len(bad),
                        len(keys),
                        tier.name,
                        ", ".join(f"{k} {v}" for k, v in causes.items()),
                        _STILL_RUNNING if late else "",
                    )
        finally:
            if late:  # its ops may still read these CPU slots and write these tier slots
                self._late.append((job, functools.partial(self._write_ended, io)))
            else:
                self.cpu.complete_load(keys)  # unpin

    def _write_ended(self, io: TierIo) -> None:
        """A write given up on really ended: its tier slots are freed (nothing indexed)
        and its CPU slots unpinned."""
        try:
            io.tier.store.manager.complete_store(io.keys, io.ctx, success=False)
        finally:
            self.cpu.complete_load(io.keys)

    # --- jobs given up on ------------------------------------------------------------

    @property
    def late(self) -> int:
        """Jobs given up on whose slots are still held (see the module docstring)."""
        return len(self._late)

    @property
    def running(self) -> bool:
        """Whether an op of a job given up on may still run (touch host memory)."""
        return any(not _ended(job) for job, _ in self._late)

    def reap(self) -> int:
        """Let go of the slots of the jobs given up on that really ended; how many."""
        if not self._late:
            return 0
        ended = [entry for entry in self._late if _ended(entry[0])]
        for entry in ended:
            self._late.remove(entry)
            try:
                entry[1]()
            except Exception:  # a defect: the other jobs' slots still go
                log.exception("releasing the slots of a late tier job failed")
        return len(ended)

    # --- shared tiers ----------------------------------------------------------------

    def ask(self, tier: TierState, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """The keys of ``keys`` to ask the shared ``tier`` about: those its index does
        not hold (counted as asked)."""
        block_of = tier.store.manager.block_of
        unknown = [key for key in keys if block_of(key) is None and len(key) <= MAX_KEY_BYTES]
        tier.asked += len(unknown)
        return unknown

    def join(
        self, tier: TierState, keys: Sequence[OffloadKey], found: Sequence[bool]
    ) -> list[OffloadKey]:
        """A shared tier answered that it holds ``found`` of ``keys``: those its index
        does not know join it, ready (a stored event), as if written here. Returns the
        keys it holds now (not those its full index could not take: ``full``)."""
        manager = tier.store.manager
        hits = [key for key, hit in zip(keys, found) if hit]
        new = [key for key in hits if manager.block_of(key) is None]
        if new:
            out = manager.reserve(new)
            if out is None:  # the index is full of blocks in flight
                self.skip(tier, "full", len(new))
                gone = set(new)
                hits = [key for key in hits if key not in gone]
            else:
                manager.complete_store(new)
                if out.evicted_keys:
                    tier.store.forget(out.evicted_keys)
        tier.found += len(hits)
        return hits

    # --- counters, events, stats -----------------------------------------------------

    def skip(self, tier: TierState, cause: str, n: int) -> None:
        """Count ``n`` blocks a tier could not take or give for ``cause``."""
        failures = tier.counters.failures
        failures[cause] = failures.get(cause, 0) + n

    def take_events(self) -> list[OffloadingEvent]:
        """Every tier's stored and removed events since the last call, tier order."""
        events: list[OffloadingEvent] = []
        for tier in self.tiers:
            events += tier.store.manager.take_events()
        return events

    def stats(
        self, info: Callable[[TierState], dict[str, object]] | None = None
    ) -> tuple[TierStats, ...]:
        """Each tier's contents and counters, highest first; ``info`` adds a driver's
        details to a tier's ``info``."""
        out = []
        for tier in self.tiers:
            c = tier.counters
            details = dict(tier.store.describe())
            if tier.shared is not None:
                details["keys_asked"] = tier.asked
                details["keys_found"] = tier.found
            if info is not None:
                details.update(info(tier))
            m = tier.store.manager
            out.append(
                TierStats(
                    name=tier.name,
                    medium=tier.store.medium.value,
                    info=details,
                    manager=m.stats(),
                    lookup_hits=c.lookup_hits,
                    blocks_written=c.blocks_written,
                    bytes_written=c.bytes_written,
                    write_failures=c.write_failures,
                    blocks_read=c.blocks_read,
                    bytes_read=c.bytes_read,
                    read_failures=c.read_failures,
                    dropped=m.dropped,
                    failures=dict(c.failures),
                    blocks_present=c.blocks_present,
                )
            )
        return tuple(out)


_STILL_RUNNING = (
    "; the job was given up on while an operation still runs (stuck in a system call): "
    "its host slots are held until it ends"
)


def _late(job: CopyJob) -> bool:
    """Whether ``job`` was given up on while its ops may still run (``tiers._io``)."""
    return getattr(job, "late", False) is True


def _ended(job: CopyJob) -> bool:
    """Whether every op of a job given up on really ended."""
    return bool(getattr(job, "ended", True))


def _shared(store: LowerTier) -> SharedTier | None:
    """``store`` as a shared tier (one that answers ``exists``), or None."""
    return cast(SharedTier, store) if callable(getattr(store, "exists", None)) else None
