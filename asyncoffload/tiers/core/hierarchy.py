"""The tier hierarchy below the CPU tier, as one sans-I/O core.

:class:`TierHierarchy` owns the indices of the tiers below the CPU tier and every rule
of them, once, for every driver: the engine on its event loop
(``asyncoffload.engine_tiers``) and vLLM's scheduler side, polled from each manager call
(``integrations/vllm/tiers.py``). It decides:

- which tier holds a key (:meth:`~TierHierarchy.source`, :meth:`~TierHierarchy.lookup`);
- how a promotion reserves CPU slots, reads, settles, stalls or fails
  (:meth:`~TierHierarchy.promote`, :meth:`~TierHierarchy.promote_key`,
  :meth:`~TierHierarchy.read_done`, :meth:`~TierHierarchy.check`,
  :meth:`~TierHierarchy.cancel_reads`), and how long a key waits for a CPU slot that
  tier I/O holds (:meth:`~TierHierarchy.wait_for_slot`);
- write-through, its admission and the re-offer of stored keys
  (:meth:`~TierHierarchy.write_through`, :meth:`~TierHierarchy.reoffer`,
  :meth:`~TierHierarchy.write_done`), and its backpressure: a tier whose writes lag
  sheds new write-through (``core.backpressure``, each tier's ``TierState.pressure``);
- what the shared tiers are asked and what their answers mean, negative answers and
  down windows included (:attr:`~TierHierarchy.questions`, ``core.shared``);
- drops, failure causes, counters, throttled logs, stats and per-tier events.

It performs no I/O, owns no thread, awaits nothing and reads no clock, in the manner of
h11's ``Connection``: plain calls go in, plain requests come out
(:meth:`~TierHierarchy.take_io`: :class:`TierIo` reads and writes, :class:`Delete`,
:class:`Exists`), and a driver carries each to its tier's port and hands the result
back with the time (``now``, on the driver's one monotonic clock). Its next deadline
(:meth:`~TierHierarchy.next_deadline`) tells the driver when to call
:meth:`~TierHierarchy.check`. Every call is made on one thread.

A job a tier gave up on while its ops may still run (``late``: an op stuck in a system
call past its deadline, see ``tiers._io``) settles at once, every block failed (a read's
are misses, a write's are not indexed), but the host slots its ops read or write are
held: a read's CPU slots stay reserved, a write's stay pinned and its tier slots
reserved, until the driver says the job really ended (:meth:`~TierHierarchy.reap`).
Reused sooner, they would take another block's bytes, or give this one's to it.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from asyncoffload.errors import KeyNotReadyError, UnknownKeyError
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import OffloadingEvent, ReqContext, reject_duplicates
from asyncoffload.manager.pins import carry_pins, expire_pins, hold_below
from asyncoffload.tiers.core.backpressure import drop_waiting, stuck
from asyncoffload.tiers.core.requests import (
    NEVER,
    Delete,
    Exists,
    Promotion,
    Request,
    TierIo,
    TierState,
)
from asyncoffload.tiers.core.shared import Questions
from asyncoffload.tiers.core.tenants import by_tenant, opted_out, track_tenants
from asyncoffload.tiers.core.types import (
    MAX_KEY_BYTES,
    CpuIndex,
    Outcome,
    TierStats,
    count_failures,
    failure_cause,
)

__all__ = ["MAX_BATCH", "REAP_S", "STALL_GRACE_S", "TierHierarchy"]

log = logging.getLogger("asyncoffload")

#: A promotion whose read still runs this long after its tier's deadline fails (its
#: slots stay held until the read ends); a drain waits at most as long.
STALL_GRACE_S = 1.0
#: While a job given up on holds slots, the driver is asked this often whether it ended.
REAP_S = 0.25
#: A warning about failed writes at most this often per tier (a full disk fails every one).
WARN_EVERY_S = 10.0
#: Reads (and questions) found one at a time are handed out at the latest once this many
#: are queued (:attr:`TierHierarchy.io_due`).
MAX_BATCH = 256
#: Keys at most that wait for a CPU slot held by tier I/O (see ``wait_for_slot``).
SLOT_WAIT_KEYS = 65_536

_STILL_RUNNING = (
    "; the job was given up on while an operation still runs (stuck in a system call): "
    "its host slots are held until it ends"
)


class TierHierarchy:
    """The rules of every tier below the CPU tier ``cpu`` (``tiers``: highest first)."""

    def __init__(self, cpu: CpuIndex, tiers: Sequence[TierState]) -> None:
        self.cpu = cpu
        self.tiers = list(tiers)
        track_tenants(cpu, self.tiers)
        self.shared_tiers = [tier for tier in self.tiers if tier.shared]
        #: Seconds a tier operation may wait to start (the slowest tier's).
        self.deadline_s = max((t.deadline_s for t in self.tiers), default=0.0)
        self.questions = Questions(self.shared_tiers, self.join, self.skip, STALL_GRACE_S)
        #: Promotions reserved and not yet handed out by :meth:`take_io`.
        self.batched = 0
        self._outbox: list[Request] = []
        #: Reads and writes handed out and not settled, by number (oldest first).
        self._flight: dict[int, TierIo] = {}
        self._seq = 0
        #: Promotions handed out and not done, by stall deadline.
        self._stalls: list[tuple[float, int, Promotion]] = []
        #: Keys of stalled promotions whose read has not ended.
        self._stalled: set[OffloadKey] = set()
        #: Keys that wait for a CPU slot: the number of the last I/O handed out then,
        #: and the time the wait ends at the latest.
        self._slot_waits: OrderedDict[OffloadKey, tuple[int, float]] = OrderedDict()
        #: Jobs given up on whose ops may still run, each with what lets its slots go.
        self._late: list[tuple[TierIo, Callable[[], None]]] = []
        self._reap_at = NEVER
        self.closed = False
        hold_below(cpu, [tier.index for tier in self.tiers])  # a CPU pin holds them too

    # --- which tier holds a key ------------------------------------------------------

    def source(
        self, key: OffloadKey, allow: Callable[[TierState], bool] | None = None
    ) -> TierState | None:
        """The highest tier that has ``key`` ready (of those ``allow`` accepts: a
        request's tier filter)."""
        for tier in self.tiers:
            if tier.index.ready(key) and (allow is None or allow(tier)):
                return tier
        return None

    def known(self, key: OffloadKey) -> bool:
        """Whether a tier's index holds ``key`` (ready, or being written there)."""
        return any(tier.index.block_of(key) is not None for tier in self.tiers)

    def lookup(self, keys: Sequence[OffloadKey], n: int, *, count: bool = True) -> int:
        """Extend a CPU prefix of ``n`` keys through the tiers: a key counts if it is
        ready in the CPU tier, or absent there and ready in a lower tier (counted as
        that tier's lookup hit, unless ``count`` is False: a first pass that asks the
        shared tiers before the lookup that counts)."""
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
                tier.counters.lookup_hits += count
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
            tier.index.touch(keys, ctx)

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
        tier; their reads wait for :meth:`take_io`. ``None``, changing nothing but a
        ``no_slot`` count, when the CPU tier has too few idle slots. ``lookup``: each
        key counts as a lookup hit of its tier (a driver whose lookups promote);
        ``count_no_slot=False``: the caller counts the skip itself, once it gives up."""
        keys = list(sources)
        out = self.cpu.reserve(keys, protect, ctx)
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
            tier_slots = tier.index.prepare_load(held := [k for k, _ in pairs], ctx).block_ids
            carry_pins(tier.index, self.cpu, held)  # a pin below holds the copy above too
            if lookup:
                tier.counters.lookup_hits += len(pairs)
            tier.batch.extend(
                (key, slot, cpu_slot, promotion) for (key, cpu_slot), slot in zip(pairs, tier_slots)
            )
        self.batched += len(keys)
        if self._slot_waits:
            for key in keys:
                self._slot_waits.pop(key, None)
        return promotion

    def promote_key(
        self,
        key: OffloadKey,
        now: float,
        protect: Sequence[OffloadKey] = (),
        allow: Callable[[TierState], bool] | None = None,
        *,
        ask: bool = True,
        blocked: str = "",
        ctx: ReqContext | None = None,
    ) -> bool:
        """``key`` is absent from the CPU tier (a driver whose lookups promote, one key
        at a time): True if it is pending now. If a lower tier (of those ``allow``
        accepts) has it ready, a CPU slot is reserved (never evicting one of
        ``protect``) and its read queued. Else, with ``ask``, the shared tiers are asked
        about it (:meth:`Questions.want`). A key that finds no idle CPU slot waits for
        one (:meth:`wait_for_slot`) with ``ask``, and is a ``no_slot`` miss otherwise or
        once the wait is over. ``blocked``: the driver cannot read now, for this cause
        (counted once, a miss)."""
        tier = self.source(key, allow)
        if tier is None:
            shared = self.shared_tiers
            if not (ask and shared):
                return False
            if allow is not None and not any(allow(t) for t in shared):
                return False
            return self.questions.want(key, now, self.known(key), blocked)
        if blocked:
            self.skip(tier, blocked, 1)
            return False
        if self.promote({key: tier}, ctx, protect, lookup=True, count_no_slot=False) is None:
            if not ask:
                return False  # a lookahead: the walk reaches the key itself, waits or counts
            if self.wait_for_slot(key, now):
                return True
            self.skip(tier, "no_slot", 1)
            return False
        return True

    @property
    def io_due(self) -> bool:
        """Whether enough reads or questions are queued to hand them out now."""
        return self.batched >= MAX_BATCH or len(self.questions.queue) >= MAX_BATCH

    def wait_for_slot(self, key: OffloadKey, now: float) -> bool:
        """``key``'s promotion found no idle CPU slot: whether it waits for one (pending,
        nothing reserved). Tier I/O holds CPU slots until it ends (a write-through pins
        the blocks it writes, a read fills the slots it reserved), and every completed
        store is written through at once: a request looked up then would find no slot
        for the rest of its prefix. So the key waits until every read and write handed
        out when it first found none has ended, and at most the tiers' deadline plus the
        grace; then it is a miss."""
        waits = self._slot_waits
        oldest = next(iter(self._flight), None)
        if oldest is None or self.closed:
            waits.clear()  # every wait is over: the next lookups take a slot or miss
            return False
        mark = waits.get(key)
        if mark is None:
            waits[key] = (self._seq, now + self.deadline_s + STALL_GRACE_S)
            if len(waits) > SLOT_WAIT_KEYS:
                waits.popitem(last=False)
            return True
        if oldest <= mark[0] and now < mark[1]:
            return True
        del waits[key]
        return False

    def waits_for_slot(self, key: OffloadKey) -> bool:
        """Whether ``key`` waits for a CPU slot (see :meth:`wait_for_slot`)."""
        return key in self._slot_waits

    def stalled(self, key: OffloadKey) -> bool:
        """Whether ``key``'s promotion stalled (failed) while its read still runs: its
        CPU slot stays reserved, and the key is a miss for the driver meanwhile."""
        return key in self._stalled

    def take_io(self, now: float, *, batched: bool = True) -> list[Request]:
        """Every request to carry now: one read per tier of the promotions reserved since
        the last call (each promotion stalls at its slowest tier's deadline plus the
        grace from ``now``), then the writes, deletes and questions queued since.
        ``batched=False``: the writes and deletes only (a driver that hands reads and
        questions out once a step, between two steps' ends)."""
        out: list[Request] = []
        if self.batched and batched:
            self.batched = 0
            due: dict[Promotion, float] = {}
            for tier in self.tiers:
                if not tier.batch:
                    continue
                read = self._read(tier)
                out.append(read)
                at = now + tier.deadline_s + STALL_GRACE_S
                for promotion in read.promotions:
                    due[promotion] = max(due.get(promotion, at), at)
            for promotion, at in due.items():
                promotion.deadline = at
                heapq.heappush(self._stalls, (at, id(promotion), promotion))
        if self._outbox:
            out += self._outbox
            self._outbox = []
        for tier in self.tiers:  # writes: all, or those a lagging tier's window lets go
            out += cast("list[TierIo]", tier.pressure.due(self.cpu, now))
        if self.questions.queue and batched:
            out += self.questions.take(now)
        for req in out:
            if isinstance(req, TierIo) and not req.seq:
                self._seq = req.seq = self._seq + 1
                self._flight[req.seq] = req
                req.tier.pressure.sent(req, now)
        return out

    def _read(self, tier: TierState) -> TierIo:
        batch, tier.batch = tier.batch, []
        tier.counters.reads += 1
        return TierIo(
            tier,
            False,
            [key for key, _, _, _ in batch],
            [slot for _, slot, _, _ in batch],
            [cpu_slot for _, _, cpu_slot, _ in batch],
            promotions=[promotion for _, _, _, promotion in batch],
        )

    def read_done(self, io: TierIo, outcome: Outcome, now: float) -> list[Promotion]:
        """A read ended: the blocks that passed their checks become ready in the CPU tier;
        the others are misses, dropped from their tier in this step (a removed event),
        their CPU slots freed, remembered as misses of the shared tiers. Returns the
        promotions this read finished."""
        if io.settled:
            return []
        io.settled = True
        self._flight.pop(io.seq, None)
        tier, keys = io.tier, io.keys
        tier.pressure.read_ended(io, now, outcome.ok, self.cpu.num_blocks)
        if self._stalled:
            self._stalled.difference_update(keys)
        bad: list[OffloadKey] = []
        try:
            bad = self._settle_read(io, outcome, now)
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

    def _settle_read(self, io: TierIo, outcome: Outcome, now: float) -> list[OffloadKey]:
        tier, keys = io.tier, io.keys
        results = outcome.results
        bad = [key for key, r in zip(keys, results) if r < 0]
        good = [key for key, r in zip(keys, results) if r >= 0]
        index = tier.index
        index.complete_load(good)
        tier.counters.blocks_read += len(good)
        tier.counters.bytes_read += len(good) * tier.block_bytes
        if good:
            self.cpu.complete_store(good, None, success=True)
        if not bad:
            return bad
        causes = count_failures(tier.counters, results)
        tier.counters.read_failures += len(bad)
        index.drop(bad)
        self._outbox.append(Delete(tier, bad))
        if outcome.late:  # its ops may still write into these CPU slots: held until they end
            free = functools.partial(self.cpu.complete_store, bad, None, success=False)
            self._hold(io, free, now)
        else:
            self.cpu.complete_store(bad, None, success=False)
        if self.shared_tiers:  # gone from every index: not asked about at once
            for key in bad:
                self.questions.remember_miss(key, now)
        log.warning(
            "%d of %d blocks read from %s failed (%s): misses, dropped from its index%s",
            len(bad),
            len(keys),
            tier.name,
            ", ".join(f"{k} {v}" for k, v in causes.items()),
            _STILL_RUNNING if outcome.late else "",
        )
        failed = set(bad)
        hit: dict[Promotion, None] = {}
        for key, promotion in zip(keys, io.promotions):
            if key in failed:
                promotion.bad += 1
                hit[promotion] = None
        for promotion in hit:
            promotion.causes.append(f"{tier.name}: {causes}")
        return bad

    def cancel_reads(self) -> list[Promotion]:
        """Release the promotions reserved and not handed out (nothing was read): their
        tier pins and CPU slots go. Returns those it ended."""
        finished: list[Promotion] = []
        for tier in self.tiers:
            if not tier.batch:
                continue
            batch, tier.batch = tier.batch, []
            keys = [key for key, _, _, _ in batch]
            tier.index.complete_load(keys)
            self.cpu.complete_store(keys, None, success=False)
            for _, _, _, promotion in batch:
                promotion.error = promotion.error or RuntimeError("the read was cancelled")
                promotion.left -= 1
                if promotion.left == 0:
                    finished.append(promotion)
        self.batched = 0
        return finished

    # --- deadlines -------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`check` has something to decide (a promotion that
        stalls, a question unanswered, late jobs to look at), or None."""
        stalls = self._stalls
        while stalls and (stalls[0][2].done or stalls[0][2].stalled):
            heapq.heappop(stalls)
        times = [stalls[0][0]] if stalls else []
        if self._late:
            times.append(self._reap_at)
        asked = self.questions.next_deadline()
        if asked is not None:
            times.append(asked)
        times += [at for t in self.tiers if (at := t.pressure.resume_at()) is not None]
        return min(times, default=None)

    def check(self, now: float) -> list[Promotion]:
        """Decide what is due at ``now``: promotions whose read outlived its tier's
        deadline plus the grace fail (returned; their slots stay held until the read
        ends, and their keys are misses meanwhile: :meth:`stalled`), and questions
        unanswered by their deadline count as failed; the lower tiers' pins due expire."""
        expire_pins([tier.index for tier in self.tiers], now)  # else lazily, at evictions
        stalls = self._stalls
        out: list[Promotion] = []
        while stalls and stalls[0][0] <= now:
            _, _, promotion = heapq.heappop(stalls)
            if promotion.done or promotion.stalled:
                continue
            promotion.stalled = True
            out.append(promotion)
            self._stalled.update(promotion.keys)
        if self.questions.out:
            self.questions.expire(now)
        return out

    def drain_deadline(self, now: float) -> float:
        """When a driver that waits for every job to end gives up (a stalled disk or
        server): the tiers' deadline plus the grace from ``now``."""
        return now + self.deadline_s + STALL_GRACE_S

    # --- write-through ---------------------------------------------------------------

    def write_through(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, *, blocked: str = ""
    ) -> None:
        """Offer the CPU-ready ``keys`` to each tier; those its admission takes are to be
        written from their CPU slots (queued for :meth:`take_io`), pinned until
        :meth:`write_done`. ``blocked``: no tier can be written now, for this cause
        (counted per tier, nothing offered)."""
        ready = _writable(self.cpu, keys)
        if not ready or self.closed:
            return
        if blocked:
            for tier in self.tiers:
                self.skip(tier, blocked, len(ready))
            return
        for tier, (who, group) in itertools.product(self.tiers, by_tenant(self.cpu, ready, ctx)):
            if not (group := tier.pressure.admit(tier, group, self.cpu)):
                continue  # shed: the tier's writes lag (core.backpressure)
            out = tier.index.prepare_store(group, who)
            if out is None:  # the tier is full of blocks being read or written
                self.skip(tier, "full", 1)
                continue
            if out.evicted_keys:
                self._outbox.append(Delete(tier, list(out.evicted_keys)))
            chosen = list(out.keys_to_store)
            if not chosen:
                continue
            carry_pins(self.cpu, tier.index, chosen)  # the CPU tier's pins hold below too
            tier.counters.writes += 1  # (its CPU slots are pinned once it is handed out)
            slots = list(out.store_spec.block_ids)
            tier.pressure.wait(TierIo(tier, True, chosen, slots, [], who))

    def reoffer(
        self,
        keys: Sequence[OffloadKey],
        stored: Sequence[OffloadKey],
        ctx: ReqContext | None = None,
        *,
        blocked: str = "",
    ) -> None:
        """A CPU store of ``keys`` took only ``stored``: the others, already in the CPU
        tier, are offered to the lower tiers again (their admission counts offers). Those
        absent from it, which its admission declined, cannot be written (a tier is
        written from the CPU tier's slots): each tier counts them (``declined_above``),
        and its admission counts their offer (``TierManager.count_offers``)."""
        if len(stored) >= len(keys) or opted_out(ctx):  # an opted-out request: nothing below
            return
        fresh = set(stored)
        rest = [k for k in dict.fromkeys(keys) if k not in fresh]
        get = self.cpu.block_of
        declined = [key for key in rest if get(key) is None]
        if declined and not self.closed:
            for tier in self.tiers:
                tier.counters.declined_above += len(declined)
                tier.index.count_offers(declined)
        self.write_through(rest, ctx, blocked=blocked)

    def write_done(self, io: TierIo, outcome: Outcome, now: float) -> None:
        """A write ended: the blocks written become ready in the tier (a stored event),
        the others are dropped and counted by cause (a warning at most once a
        ``WARN_EVERY_S`` per tier); the CPU slots are unpinned."""
        if io.settled:
            return
        io.settled = True
        self._flight.pop(io.seq, None)
        late = outcome.late
        io.tier.pressure.ended(io, now, stuck(outcome))
        tier, keys = io.tier, io.keys
        try:
            results = outcome.results
            good = [key for key, r in zip(keys, results) if r >= 0]
            bad = [key for key, r in zip(keys, results) if r < 0]
            index = tier.index
            counters = tier.counters
            if good:
                index.complete_store(good, io.ctx, success=True)
                # 0 bytes: the block was there already (a put-if-absent that wrote nothing).
                written = sum(1 for r in results if r > 0)
                counters.blocks_written += written
                counters.bytes_written += written * tier.block_bytes
                counters.blocks_present += len(good) - written
            if bad:
                if not late:
                    index.complete_store(bad, io.ctx, success=False)
                counters.write_failures += len(bad)
                causes = count_failures(counters, results)
                if late or tier.warned_at is None or now - tier.warned_at >= WARN_EVERY_S:
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
                self._hold(io, functools.partial(self._write_ended, io), now)
            else:
                self.cpu.complete_load(keys)  # unpin

    def _write_ended(self, io: TierIo) -> None:
        """A write given up on really ended: its tier slots are freed (nothing indexed)
        and its CPU slots unpinned."""
        try:
            io.tier.index.complete_store(io.keys, io.ctx, success=False)
        finally:
            self.cpu.complete_load(io.keys)

    def delete_done(self, req: Delete, outcome: Outcome, now: float) -> None:
        """A release of keys the index let go ended: the keys it failed for are counted
        (``delete_failures``) and logged at most once a ``WARN_EVERY_S`` per tier."""
        if any(r < 0 for r in outcome.results):
            _delete_failed(req, outcome, now)

    # --- jobs given up on ------------------------------------------------------------

    def _hold(self, io: TierIo, release: Callable[[], None], now: float) -> None:
        self._late.append((io, release))
        self._reap_at = min(self._reap_at, now + REAP_S)

    @property
    def late(self) -> list[TierIo]:
        """Requests given up on whose slots are still held (see the module docstring);
        the driver says which really ended (:meth:`reap`)."""
        return [io for io, _ in self._late]

    def reap(self, ended: Sequence[TierIo], now: float) -> int:
        """Let go of the slots of the late requests ``ended`` (their ops really ended);
        how many."""
        gone = {id(io) for io in ended}
        keep: list[tuple[TierIo, Callable[[], None]]] = []
        released = 0
        for io, release in self._late:
            if id(io) not in gone:
                keep.append((io, release))
                continue
            released += 1
            try:
                release()
            except Exception:  # a defect: the other jobs' slots still go
                log.exception("releasing the slots of a late tier job failed")
        self._late = keep
        self._reap_at = now + REAP_S if keep else NEVER
        return released

    # --- shared tiers ----------------------------------------------------------------

    def ask(self, keys: Sequence[OffloadKey], now: float) -> list[Exists]:
        """Questions to carry now about ``keys`` (see :class:`Questions`)."""
        return self.questions.ask(keys, now)

    def answered(
        self,
        q: Exists,
        found: Sequence[bool] | None,
        error: BaseException | None,
        now: float,
    ) -> list[OffloadKey]:
        """A question ended (``found`` per key, or None and the ``error``)."""
        return self.questions.answered(q, found, error, now)

    def join(
        self, tier: TierState, keys: Sequence[OffloadKey], found: Sequence[bool]
    ) -> list[OffloadKey]:
        """A shared tier answered that it holds ``found`` of ``keys``: those its index
        does not know join it, ready (a stored event), as if written here. Returns the
        keys it holds now (not those its full index could not take: ``full``)."""
        index = tier.index
        hits = [key for key, hit in zip(keys, found) if hit]
        new = [key for key in hits if index.block_of(key) is None]
        if new:
            out = index.reserve(new)
            if out is None:  # the index is full of blocks in flight
                self.skip(tier, "full", len(new))
                gone = set(new)
                hits = [key for key in hits if key not in gone]
            else:
                index.complete_store(new)
                if out.evicted_keys:
                    self._outbox.append(Delete(tier, list(out.evicted_keys)))
        tier.found += len(hits)
        return hits

    # --- counters, events, stats, closing ----------------------------------------------

    def skip(self, tier: TierState, cause: str, n: int) -> None:
        """Count ``n`` blocks a tier could not take or give for ``cause``."""
        failures = tier.counters.failures
        failures[cause] = failures.get(cause, 0) + n

    def take_events(self) -> list[OffloadingEvent]:
        """Every tier's stored and removed events since the last call, tier order."""
        events: list[OffloadingEvent] = []
        for tier in self.tiers:
            events += tier.index.take_events()
        return events

    def close(self) -> list[Exists]:
        """Nothing more is written, asked or waited for; the questions still out are
        returned (the driver drops them)."""
        self.closed = True
        self._slot_waits.clear()
        drop_waiting(self.tiers)  # writes never handed out: unwritten
        return self.questions.close()

    def stats(
        self, info: Callable[[TierState], dict[str, object]] | None = None
    ) -> tuple[TierStats, ...]:
        """Each tier's contents and counters, highest first; ``info`` gives a driver's
        details of a tier (its port's description, ...)."""
        return tuple(_stats(tier, info) for tier in self.tiers)


def _stats(tier: TierState, info: Callable[[TierState], dict[str, object]] | None) -> TierStats:
    c = tier.counters
    details: dict[str, object] = dict(info(tier)) if info is not None else {}
    if tier.shared:
        details["keys_asked"] = tier.asked
        details["keys_found"] = tier.found
    m = tier.index
    return TierStats(
        name=tier.name,
        medium=tier.medium.value,
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
        delete_failures=c.delete_failures,
        declined_above=c.declined_above,
        write_shed=c.write_shed,
        write_yielded=c.write_yielded,
        write_lag_s=tier.pressure.lag_s,
        write_queued=tier.pressure.queued,
        pins=m.pins.stats(),
        loaded=c.loaded,
        recomputed_by_choice=c.recomputed_by_choice,
        recomputed_after_deadline=c.recomputed_after_deadline,
    )


def _writable(cpu: CpuIndex, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    """The keys of ``keys`` a lower tier can take: ready in the CPU tier, and short
    enough for every tier's key format (``MAX_KEY_BYTES``); once each, in order."""
    get = cpu.block_of
    return [
        key
        for key in dict.fromkeys(keys)
        if len(key) <= MAX_KEY_BYTES and (b := get(key)) is not None and b.ref_cnt >= 0
    ]


def _delete_failed(req: Delete, outcome: Outcome, now: float) -> None:
    tier = req.tier
    bad = [r for r in outcome.results if r < 0]
    tier.counters.delete_failures += len(bad)
    at = tier.delete_warned_at
    if outcome.late or at is None or now - at >= WARN_EVERY_S:
        tier.delete_warned_at = now
        causes: dict[str, int] = {}
        for cause in map(failure_cause, bad):
            causes[cause] = causes.get(cause, 0) + 1
        log.warning(
            "%d of %d blocks that tier %s let go could not be removed (%s): their files "
            "stay on disk%s",
            len(bad),
            len(req.keys),
            tier.name,
            ", ".join(f"{k} {v}" for k, v in causes.items()),
            "; the removal was given up on while it still runs" if outcome.late else "",
        )
