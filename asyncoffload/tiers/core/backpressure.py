"""Backpressure on write-through, per tier: a lagging tier sheds new writes, by value.

Write-through pins the CPU slots it writes from until the lower write ends. A tier whose
writes lag (a busy disk, a slow server, lanes short of CPU) therefore holds CPU slots
for longer and longer, and the CPU tier, full of pinned blocks, refuses stores and
promotions: a lower tier made serving worse than none (issue 41; the demo with a disk
tier on a busy machine: 41 % hit rate against 64 % without the tier). So each tier
measures its write lag, and past a bound new write-through to it is shed and counted,
never the CPU tier's own stores.

What a tier measures (:class:`WritePressure`): the blocks taken to write and not
finished (``queued``: handed out, their CPU slots pinned, ``flying``; or waiting in the
core, see below), and how long a write takes (:attr:`~WritePressure.lag`): the EMA of
a write's time in flight, handed out to ended (``lag_s``), or the age of the oldest
write still in flight, or waiting, if that is longer (a stalled disk has no write that
ends). What
it decides, per offer (:meth:`WritePressure.admit`), in three levels:

- **calm**: every block offered goes to the tier's admission, as without backpressure;
- **lagging**: the lag passed ``write_lag_s`` (the EMA is calm again below half of
  it); or the CPU tier refused a store or a promotion for want of a slot in the last
  ``MISSED_S``, the tier's queued writes reach ``write_pin_share`` of its slots and the
  lag passed ``PINNING_LAG`` of ``write_lag_s`` (5 ms at the default): only blocks
  offered before (a block stored, or asked for, again) are written; first offers are
  shed. The value is the offer count, as a frequency admission's: a block that comes
  back is worth more than one seen once, whatever order they came in;
- **full**: as the second case of lagging, with twice ``write_pin_share`` of the CPU
  slots queued: every new block is shed until writes end.

**A lagging tier's writes wait, unpinned.** A write pins its blocks' CPU slots only
once it is handed out (:meth:`WritePressure.due`). While the tier's writes lag
``PINNING_LAG`` of ``write_lag_s``, the blocks in flight stay within a window of
``write_pin_share`` of the CPU tier's slots, whole writes (with none in flight, one
larger than the window is cut where it ends); the rest waits in the core, in order,
pinning nothing. The oldest waiting write's age counts in the lag (``write_lag_s``
bounds the wait), and while the CPU tier missed slots lately at most twice the window
is queued in all: an offer's excess is shed, the blocks offered most kept, then in
offer order. The CPU tier evicts meanwhile as it would with no tier
below: a waiting block it evicted is not written (``write_yielded``; its slot below is
freed), the others are pinned where they are when their write is handed out. A fast
tier's writes never wait: all are handed out, and pinned, at once. (Issue 41: pinned
while they waited, a slow disk's writes cost the demo's CPU tier 0.03-0.05 of its hit
rate, shedding notwithstanding; a frequency-aware policy could not evict the blocks
being written, seen once, and evicted blocks worth more.)

**Reads come first: the read guard.** A read handed out while writes are in flight waits
behind them: in the tier's queue, at a shared server, for the CPU that packs them (issue
41: on two vCPUs a Valkey read took 5 times its idle time behind a window of 51 blocks
of writes). So each tier compares its reads with its idle reads: a read with no write in
flight beside it feeds an idle model (:class:`~.readtime.ReadModel`); a read beside
writes that took more than :data:`READ_SLOWDOWN` times the idle model's time for its
bytes (before any idle read: the least time seen of reads of its size), or more than the
idle reads' own spread if that is larger (the :data:`IDLE_QUANTILE` of the last
:data:`IDLE_RATIOS` idle reads' ratios to the model: jitter alone halves nothing),
halves the blocks writes may have in flight (``read_window``, from those in flight
during the read, at least one block); each read within it adds a block, and the bound
goes once it reaches the CPU tier's slots. The bound holds while reads come (one in
flight, or handed out in the last :data:`READS_ACTIVE_S`); the writes it holds back wait
in the core like a lagging tier's, unpinned, and are shed by the same rule if they wait
too long. Below one block the bound is a duty cycle: one block at a time, and after each
a pause of ``1 / bound - 1`` times its time in flight (the core's next deadline names
its end; ``engine.flush`` waits for the paused writes), halved to at most
:data:`READ_LEAST` (1/16: writes still progress), grown back by a tenth per read within
the ratio (:data:`READ_REGROW`). The guard is learned only while the tier's writes lag
``PINNING_LAG`` of ``write_lag_s`` (:attr:`WritePressure.saturated`); once learned it
holds, and halves and grows, while reads come, whatever the lag: its own pacing keeps
the writes short (1 MiB blocks on Valkey: one alone in 1.4-2 ms, under the 5 ms), and
holding only while saturated let the next offer out whole beside the reads (32 MiB: a
load took 111 ms, issue 41). It buys read
latency with write rate, and where the tier would have absorbed the writes, with hit
rate (the demo's fast disk: 0.625 against 0.662 without it; docs/benchmarks.md): the
tiers' settings turn it on by default for the shared tiers, whose loads took 2-7 times
their idle p99 without it, and off for a disk (here ``read_guard=False`` is the
default). ``backpressure=False`` turns it off too.

A tier with no write in flight is calm (the next offer probes it: a lag EMA can only
fall by writes that end). Shed blocks count in ``TierStats.write_shed`` (and the
Prometheus family ``asyncoffload_tier_write_shed_blocks``), their offer counts for the
tier's own admission (``count_offers``), and one warning per tier at most every
``WARN_EVERY_S`` says how many were shed and why, and how many waited in vain.

Sans-I/O like the rest of the core: the driver's ``now`` comes in through
``TierHierarchy.take_io`` (:meth:`sent`) and ``write_done`` (:meth:`ended`).
"""

from __future__ import annotations

import copy
import errno
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus, CPULoadStoreSpec, ReqContext
from asyncoffload.tiers.core.readtime import ReadModel
from asyncoffload.tiers.core.types import Outcome, TierCounters, TierIndex

__all__ = [
    "CALM",
    "FULL",
    "LAGGING",
    "MISSED_S",
    "OFFER_KEYS",
    "PINNING_LAG",
    "READS_ACTIVE_S",
    "READ_SLOWDOWN",
    "WARN_EVERY_S",
    "Backpressure",
    "CpuRoom",
    "WritePressure",
    "drop_waiting",
    "stuck",
]

log = logging.getLogger("asyncoffload")

#: Levels of :meth:`WritePressure.level`.
CALM, LAGGING, FULL = 0, 1, 2
#: Keys at most whose offers a tier counts (the least recently offered leave first).
OFFER_KEYS = 65_536
#: A warning about shed writes at most this often per tier.
WARN_EVERY_S = 10.0
#: Weight of a write's newest time in flight in the EMA.
ALPHA = 0.2
#: While its queued writes pin ``write_pin_share`` of the CPU tier's slots, a tier lags
#: from this share of ``write_lag_s`` (5 ms at the default): a slot pinned that long is
#: missed by the stores and promotions that come meanwhile (issue 41: the demo's CPU
#: tier refused them, its writes 13-39 ms in flight on a busy disk).
PINNING_LAG = 0.005
#: ... for this long after the CPU tier last refused a store or a promotion for want of
#: a slot (until then, the slots its writes pin are missed by no one).
MISSED_S = 1.0
#: The read guard: a read slower than this many times the tier's idle reads halves the
#: blocks that writes may have in flight while reads come (each read within it: one more).
READ_SLOWDOWN = 1.25
#: ...for as long as reads come: the last handed out at most this long ago.
READS_ACTIVE_S = 1.0
#: The read guard's least bound: below one block, writes go one block at a time, with
#: pauses (a bound of 1/4: the tier is written a quarter of the time).
READ_LEAST = 1 / 16
#: ...grown back by this factor per read within the ratio (a block more above one).
READ_REGROW = 1.1
#: The idle reads' own spread: a read is slow beside writes only past the
#: ``IDLE_QUANTILE`` of the last ``IDLE_RATIOS`` idle reads' ratios to the idle model (once
#: ``IDLE_SPREAD_MIN`` were seen), if that is more than ``READ_SLOWDOWN``.
IDLE_RATIOS = 64
IDLE_QUANTILE = 0.9
IDLE_SPREAD_MIN = 8
#: Sizes of read whose least time a tier keeps (the idle reference before an idle read).
LEAST_SIZES = 64


@dataclass(frozen=True)
class Backpressure:
    """A tier's backpressure settings (``DiskTier(write_lag_s=..., ...)``, and the same
    fields of every tier's settings); ``ValueError`` naming the setting for a bad one.

    ``write_lag_s``: the EMA of a write's time in flight past which the tier lags
    (calm again below half). ``write_pin_share``: the share of the CPU tier's slots, in
    (0, 1], that the tier's writes may pin in flight once they lag ``PINNING_LAG`` of
    ``write_lag_s`` (the rest waits, unpinned), and that its
    queued writes may reach while the CPU tier misses slots before first offers are
    shed (twice it: every block). ``backpressure=False``: nothing is shed and nothing
    waits, every offer goes to the tier's admission and is written at once.
    ``read_guard``: the read guard (module docstring) bounds the writes in flight while
    reads come and the writes lag; ``False`` (the default): only the window above does."""

    write_lag_s: float = 1.0
    write_pin_share: float = 0.1
    backpressure: bool = True
    read_guard: bool = False

    def __post_init__(self) -> None:
        lag = self.write_lag_s
        if isinstance(lag, bool) or not isinstance(lag, (int, float)):
            raise ValueError(f"write_lag_s must be a number of seconds, got {lag!r}")
        if not (math.isfinite(lag) and 0 < lag <= 3600):
            raise ValueError(f"write_lag_s must be in (0, 3600] seconds, got {lag!r}")
        share = self.write_pin_share
        if isinstance(share, bool) or not isinstance(share, (int, float)):
            raise ValueError(f"write_pin_share must be a number in (0, 1], got {share!r}")
        if not (math.isfinite(share) and 0 < share <= 1):
            raise ValueError(f"write_pin_share must be in (0, 1], got {share!r}")
        if not isinstance(self.backpressure, bool):
            raise ValueError(f"backpressure must be True or False, got {self.backpressure!r}")
        if not isinstance(self.read_guard, bool):
            raise ValueError(f"read_guard must be True or False, got {self.read_guard!r}")

    @classmethod
    def of(cls, settings: object) -> Backpressure:
        """The backpressure fields of a tier's settings (the defaults for those it
        lacks)."""
        fields = ("write_lag_s", "write_pin_share", "backpressure", "read_guard")
        return cls(**{f: getattr(settings, f) for f in fields if hasattr(settings, f)})


class CpuRoom(Protocol):
    """What backpressure reads of the CPU tier's index: its slots (0: not counted), and
    how many stores and promotions it refused for want of one; and where the blocks of
    a write handed out are (pinned then)."""

    num_blocks: int
    no_room: int

    def block_of(self, key: OffloadKey) -> BlockStatus | None: ...

    def pin(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec: ...


class TierState(Protocol):
    """What backpressure reads of a tier (a ``requests.TierState``, which holds it)."""

    name: str
    block_bytes: int
    index: TierIndex
    counters: TierCounters
    pressure: WritePressure


class TierIo(Protocol):
    """What backpressure reads of a request handed out (a ``requests.TierIo``)."""

    write: bool
    keys: list[OffloadKey]
    tier_slots: list[int]
    cpu_slots: list[int]
    ctx: ReqContext | None
    seq: int
    sent: float

    @property
    def tier(self) -> TierState: ...


class WritePressure:
    """One tier's write lag, and the rule that sheds its write-through (see the module
    docstring)."""

    def __init__(self, settings: Backpressure | None = None) -> None:
        self.settings = settings or Backpressure()
        #: Blocks taken to write and not ended: handed out (``flying``: their CPU slots
        #: pinned) or waiting (``waiting``, oldest first: see the module docstring).
        self.queued = 0
        self.flying = 0
        self.waiting: deque[TierIo] = deque()
        #: EMA of a write's time in flight (seconds); 0 before the first ended.
        self.lag_s = 0.0
        self.lagging = False
        #: Blocks shed, all told, and since the last warning (by level).
        self.shed = 0
        self._unwarned = [0, 0, 0]
        #: Waiting blocks not written (the CPU tier evicted them) since the last warning.
        self.unwarned_given = 0
        self._warned_at: float | None = None
        self._offers: OrderedDict[OffloadKey, int] = OrderedDict()
        #: When each write in flight was handed out, oldest first; the latest time seen.
        self._writes: OrderedDict[int, float] = OrderedDict()
        self._now = 0.0
        #: The CPU tier's refusals for want of a slot seen, and when they last grew.
        self._no_room = 0
        self._missed_at = -math.inf
        #: The read guard (see the module docstring): the blocks writes may have in
        #: flight while reads come (None: no bound learned), the reads in flight (by
        #: seq: handed out when, with how many write blocks flying and handed out so far),
        #: the write blocks handed out all told, when the last read was handed out, the
        #: tier's reads with no write beside them, and the least time per read size.
        self.read_window: float | None = None
        self._reads: dict[int, tuple[float, int, int, bool]] = {}
        self._handed = 0
        self._read_at = -math.inf
        self.idle = ReadModel()
        self._least: OrderedDict[int, float] = OrderedDict()
        #: No write goes before this (the read guard's pause below one block).
        self._resume = -math.inf
        #: Idle reads' times over what the idle model expected (before each fed it).
        self._idle_ratios: deque[float] = deque(maxlen=IDLE_RATIOS)

    # --- what the tier does -----------------------------------------------------------

    def wait(self, io: TierIo) -> None:
        """A write was taken (nothing pinned yet): it waits for :meth:`due`."""
        self.waiting.append(io)
        self.queued += len(io.keys)

    def _window(self, cpu: CpuRoom) -> float | None:
        """The blocks that may be in flight now (``write_pin_share`` of the CPU tier's
        slots while the writes lag ``PINNING_LAG``), or None: no bound."""
        settings = self.settings
        window = settings.write_pin_share * cpu.num_blocks
        if not settings.backpressure or window <= 0:
            return None
        out = None if self.lag < settings.write_lag_s * PINNING_LAG else window
        guard = self.guarded()
        if guard is not None:
            guard = max(1.0, guard)
            out = guard if out is None else min(out, guard)
        return out

    def guarded(self) -> float | None:
        """The read guard's bound now (None: none): one was learned, and reads come
        (saturated or not: the writes it paces are short, module docstring)."""
        settings = self.settings
        guard = self.read_window
        if guard is None or not (settings.read_guard and settings.backpressure):
            return None
        if self._reads or self._now - self._read_at <= READS_ACTIVE_S:
            return guard
        return None

    @property
    def saturated(self) -> bool:
        """Whether write-through saturates the tier: its writes lag ``PINNING_LAG`` of
        ``write_lag_s`` (5 ms at the default), the lagging tier's window's condition.
        The read guard is learned only then: a tier whose writes keep up is never held
        back for reads (beside them a read is slowed by the engine's other work as much
        as by the writes, and holding writes back then costs the tier its hits)."""
        return self.lag >= self.settings.write_lag_s * PINNING_LAG

    def resume_at(self) -> float | None:
        """When writes that wait for the read guard's pause may go (None: none waits)."""
        if self.waiting and self.flying == 0 and self._resume > self._now:
            return self._resume
        return None

    def due(self, cpu: CpuRoom, now: float) -> list[TierIo]:
        """The waiting writes to hand out at ``now``, their blocks pinned where they are
        in the CPU tier (those it evicted meanwhile are not written): all of them, or,
        while the tier's writes lag, as many whole writes as keep the blocks in flight
        within the window (:meth:`_window`); with none in flight, a write larger than
        the window is cut where it ends (at least one block), the rest staying first."""
        self._now = max(self._now, now)
        waiting = self.waiting
        for io in reversed(waiting):  # the writes taken since: waiting from now on
            if io.sent:
                break
            io.sent = now
        out: list[TierIo] = []
        if waiting and self.flying == 0 and now < self._resume and self.guarded() is not None:
            return out
        window = self._window(cpu) if waiting else None
        flying = self.flying
        while waiting:
            io = waiting[0]
            take = len(io.keys)
            if window is not None:  # whole writes; one alone larger than it is cut
                if flying == 0:
                    take = min(take, max(1, int(window)))
                elif flying + take > window:
                    break
            if take < len(io.keys):  # the rest stays at the head
                io = copy.copy(io)
                io.keys, io.tier_slots = io.keys[:take], io.tier_slots[:take]
                rest = waiting[0]
                rest.keys, rest.tier_slots = rest.keys[take:], rest.tier_slots[take:]
            else:
                waiting.popleft()
            if self._pin(io, cpu):
                out.append(io)
                flying += len(io.keys)
        return out

    def _pin(self, io: TierIo, cpu: CpuRoom) -> bool:
        """Pin ``io``'s blocks that the CPU tier still has ready (in their slots now); the
        others leave it, their tier slots freed. False if none is left."""
        get = cpu.block_of
        kept = [(k, s) for k, s in zip(io.keys, io.tier_slots) if (b := get(k)) and b.ref_cnt >= 0]
        if len(kept) < len(io.keys):
            left = {k for k, _ in kept}
            gone = [k for k in io.keys if k not in left]
            self.queued = max(0, self.queued - len(gone))
            self.unwarned_given += len(gone)
            tier = io.tier
            tier.counters.write_yielded += len(gone)
            tier.index.complete_store(gone, io.ctx, success=False)
            if not kept:
                return False
            io.keys, io.tier_slots = [k for k, _ in kept], [s for _, s in kept]
        io.cpu_slots = list(cpu.pin(io.keys).block_ids)
        return True

    def sent(self, io: TierIo, now: float) -> None:
        """``io`` was handed out at ``now``."""
        io.sent = self._now = now
        if io.write:
            self.flying += len(io.keys)
            self._handed += len(io.keys)
            self._writes[io.seq] = now
        elif self.settings.read_guard:  # only the read guard looks at reads
            self._reads[io.seq] = (now, self.flying, self._handed, self.saturated)
            self._read_at = now

    def read_ended(self, io: TierIo, now: float, ok: bool, cpu_blocks: int) -> None:
        """A read handed out ended at ``now`` (``ok``: every block read, in time): the
        read guard learns from it. A read with no write in flight beside it feeds the
        tier's idle reference; one beside writes is compared with that reference (before
        any idle read: the least time seen of reads of its size): slower than
        :data:`READ_SLOWDOWN` times it, the writes' window while reads come is halved
        (from the blocks that were in flight, at least one); within it, the window grows
        by a block, unbounded again once it reaches the CPU tier's slots. A bound is
        first learned only from a read handed out while the writes saturated the tier
        (:attr:`saturated`); once there, any read beside writes moves it. A CPU tier that
        does not count its slots (0: the framework's, lent: its writes are never held)
        has no guard."""
        start = self._reads.pop(io.seq, None)
        self._now = max(self._now, now)
        if start is None or not ok or not self.settings.read_guard:
            return
        if cpu_blocks <= 0:  # lent slots (the framework's): never held back
            return
        at, flying, handed, saturated = start
        took = now - at
        n = len(io.keys)
        nbytes = n * io.tier.block_bytes
        least = self._least
        best = least.pop(n, None)
        least[n] = took if best is None else min(best, took)
        while len(least) > LEAST_SIZES:
            least.popitem(last=False)
        if flying == 0 and self.flying == 0 and self._handed == handed:  # alone
            if self.idle.samples:
                self._idle_ratios.append(took / self.idle.expect(nbytes))
            self.idle.observe(took, nbytes)
            return
        ref = self.idle.expect(nbytes) if self.idle.samples else best
        guard = self.read_window
        if ref is None or (guard is None and not saturated):
            return
        limit = READ_SLOWDOWN
        if len(self._idle_ratios) >= IDLE_SPREAD_MIN:  # jitter idle reads have too
            ratios = sorted(self._idle_ratios)
            limit = max(limit, ratios[int(IDLE_QUANTILE * (len(ratios) - 1))])
        if took > limit * ref:
            seen = max(flying, self.flying, self._handed - handed)
            bound = seen if guard is None else min(guard, seen)
            self.read_window = max(READ_LEAST, bound / 2)
        elif guard is not None:
            guard = guard + 1 if guard >= 1 else min(1.0, guard * READ_REGROW)
            self.read_window = None if 0 < cpu_blocks <= guard else guard

    def ended(self, io: TierIo, now: float, failed: bool = False) -> None:
        """A write handed out ended at ``now``: its time in flight feeds the EMA.
        ``failed``: it says the tier is stuck or gone (:func:`stuck`): the writes
        waiting behind it fail too (``write_failures``, cause ``after_failure``), not
        each handed out to wait a deadline of its own, one after the other."""
        if failed:
            drop_waiting([io.tier], "after_failure")
        self.queued = max(0, self.queued - len(io.keys))
        self.flying = max(0, self.flying - len(io.keys))
        self._writes.pop(io.seq, None)
        self._now = max(self._now, now)
        took = max(0.0, now - io.sent)
        guard = self.guarded()
        if guard is not None and guard < 1:
            self._resume = now + took * (1 / guard - 1)
        self.lag_s = took if self.lag_s == 0.0 else ALPHA * took + (1 - ALPHA) * self.lag_s
        lag = self.settings.write_lag_s
        if self.lag_s > lag:
            self.lagging = True
        elif self.lag_s < lag / 2:
            self.lagging = False
        if any(self._unwarned) or self.unwarned_given:
            self._warn(io.tier, now)

    # --- the rule ---------------------------------------------------------------------

    @property
    def lag(self) -> float:
        """How long the tier's writes take: the EMA of those that ended, or the age of
        the oldest still in flight, or of the oldest waiting (since it was first seen
        waiting), at the latest time seen, if that is longer."""
        oldest = next(iter(self._writes.values()), self._now)
        if self.waiting and self.waiting[0].sent:
            oldest = min(oldest, self.waiting[0].sent)
        return max(self.lag_s, self._now - oldest)

    def level(self, cpu: CpuRoom) -> int:
        """:data:`CALM`, :data:`LAGGING` or :data:`FULL` (see the module docstring)."""
        settings = self.settings
        if not settings.backpressure or self.queued == 0:
            return CALM
        lag = self.lag
        cap = settings.write_pin_share * cpu.num_blocks
        if cpu.no_room != self._no_room:  # the CPU tier refused something: slots missed
            self._no_room, self._missed_at = cpu.no_room, self._now
        # Writes pinning a share of the CPU tier's slots while it misses slots lag from a
        # far shorter time.
        pinning = (
            cap > 0
            and self._now - self._missed_at <= MISSED_S
            and self.queued >= cap
            and lag >= settings.write_lag_s * PINNING_LAG
        )
        if pinning and self.queued >= 2 * cap:
            return FULL
        if pinning or self.lagging or lag > settings.write_lag_s:
            return LAGGING
        return CALM

    def _room(self, cpu: CpuRoom) -> int | None:
        """While the CPU tier missed slots lately and the writes lag ``PINNING_LAG``: how
        many more blocks may be queued (twice ``write_pin_share`` of the CPU tier's
        slots, less those queued); ``None``: no bound now."""
        window = self._window(cpu)
        if window is None or self.queued == 0 or self._now - self._missed_at > MISSED_S:
            return None
        return max(0, int(2 * window) - self.queued)

    def admit(self, tier: TierState, keys: Sequence[OffloadKey], cpu: CpuRoom) -> list[OffloadKey]:
        """The keys of an offer to ``tier`` that go on to its admission; the others are
        shed (counted, and their offer counted by the tier's admission). Keys the tier
        holds already pass (its admission skips them)."""
        keys = list(keys)
        if not self.settings.backpressure:
            return keys
        get = tier.index.block_of
        counts = self._offers
        new = [key for key in keys if get(key) is None]
        for key in new:
            counts[key] = counts.pop(key, 0) + 1
        while len(counts) > OFFER_KEYS:
            counts.popitem(last=False)
        level = self.level(cpu)
        if not new:
            return keys
        # FULL: every new block; LAGGING: first offers go first.
        if level == CALM:
            shed: set[OffloadKey] = set()
        else:
            shed = set(new) if level == FULL else {key for key in new if counts.get(key, 0) < 2}
        room = self._room(cpu)
        if room is not None:
            # One offer never takes the writes past twice the share while the CPU tier
            # misses slots: the most offered go, then in offer order (a prefix first).
            kept = [key for key in new if key not in shed]
            if len(kept) > room:
                shed.update(sorted(kept, key=lambda k: -counts.get(k, 0))[room:])
        if not shed:
            return keys
        self.shed += len(shed)
        self._unwarned[level] += len(shed)
        tier.counters.write_shed += len(shed)
        tier.index.count_offers([key for key in new if key in shed])
        return [key for key in keys if key not in shed]

    def _warn(self, tier: TierState, now: float) -> None:
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY_S:
            return
        self._warned_at = now
        calm, lagging, full = self._unwarned
        given, self.unwarned_given = self.unwarned_given, 0
        self._unwarned = [0, 0, 0]
        log.warning(
            "tier %s: write-through lags (a write takes %.3fs on average, %d blocks queued): "
            "%d first-offered blocks shed, %d blocks shed with %d%%+ of the CPU tier's slots "
            "queued to it, %d waiting blocks not written (the CPU tier evicted them first); "
            "the CPU tier's stores are unaffected",
            tier.name,
            self.lag_s,
            self.queued,
            calm + lagging,
            full,
            round(200 * self.settings.write_pin_share),
            given,
        )


#: Write failures that say the tier is stuck or gone: a timeout, the tier down.
_STUCK = frozenset((-errno.ETIMEDOUT, -errno.EHOSTDOWN))


def stuck(outcome: Outcome) -> bool:
    """Whether a write's end says its tier is stuck or gone: it was given up on (an op
    stuck in a system call), or every block of it timed out or found the tier down (not
    a full disk or a store out of space: the writes behind it may still fit)."""
    return outcome.late or all(r in _STUCK for r in outcome.results)


def drop_waiting(tiers: Sequence[TierState], cause: str = "") -> None:
    """The writes still waiting are not written, their tier slots freed (they pin
    nothing in the CPU tier): at close (counted in ``write_yielded``), or behind a write
    that found the tier stuck (failed writes, for ``cause``)."""
    for tier in tiers:
        pressure = tier.pressure
        while pressure.waiting:
            io = pressure.waiting.popleft()
            n = len(io.keys)
            pressure.queued = max(0, pressure.queued - n)
            if cause:  # failed writes, for their cause
                failures = tier.counters.failures
                failures[cause] = failures.get(cause, 0) + n
                tier.counters.write_failures += n
            else:
                tier.counters.write_yielded += n
            tier.index.complete_store(io.keys, io.ctx, success=False)
