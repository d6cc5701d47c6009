"""What the tier core keeps per tier, per promotion, and the I/O requests it hands out.

Every request is plain data: a driver carries it to its tier's port (a lane, a server)
and hands its result back to the core with the time (``TierHierarchy.read_done``,
``write_done``, ``delete_done``, ``answered``). The core never holds a job, a task or a
port; a driver may keep its own handle of a running request in its ``job`` field, which
the core never reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import Medium, ReqContext
from asyncoffload.tiers.core.backpressure import WritePressure
from asyncoffload.tiers.core.types import TierCounters, TierIndex

__all__ = ["Delete", "Exists", "Promotion", "Request", "TierIo", "TierState"]

#: A time no rule has reached (an unset deadline, a tier never down).
NEVER = float("inf")


@dataclass(eq=False)
class TierState:
    """One tier below the CPU tier, as the core sees it: what it is (from its port's
    description), its index, and what the core counts and remembers of it."""

    name: str
    medium: Medium
    block_bytes: int
    #: Seconds a tier operation may wait to start.
    deadline_s: float
    index: TierIndex
    #: Whether the tier answers ``Exists`` (a shared server that other engines write).
    shared: bool = False
    counters: TierCounters = field(default_factory=TierCounters)
    #: Promotions reserved and not handed out yet: (key, tier slot, CPU slot, promotion).
    batch: list[tuple[OffloadKey, int, int, Promotion]] = field(default_factory=list)
    #: Keys a shared tier was asked about, and those it held.
    asked: int = 0
    found: int = 0
    #: When the last write failure was logged (the driver's clock), or None.
    warned_at: float | None = None
    #: When the last failed release (a file left behind) was logged, or None.
    delete_warned_at: float | None = None
    #: A shared tier whose last question failed is not asked again before this time.
    down_until: float = -NEVER
    #: Its write lag and the rule that sheds its write-through (``core.backpressure``).
    pressure: WritePressure = field(default_factory=WritePressure)


@dataclass(eq=False)
class Promotion:
    """Keys of one request brought up from lower tiers into reserved CPU slots.

    ``left``: keys whose read has not ended. ``bad``: keys that could not be read (by
    cause, per tier, in ``causes``); ``error``: a defect met while settling. ``stalled``:
    a read outlived its tier's deadline plus the grace (the promotion failed then; its
    slots stay held until the read really ends). A driver keeps what its world needs of
    the promotion in ``owner``."""

    keys: list[OffloadKey]
    ctx: ReqContext | None
    left: int
    bad: int = 0
    causes: list[str] = field(default_factory=list)
    error: BaseException | None = None
    owner: Any = None
    #: When it stalls (set when its reads are handed out), and whether it did.
    deadline: float = NEVER
    stalled: bool = False

    @property
    def done(self) -> bool:
        return self.left == 0

    @property
    def failed(self) -> bool:
        return bool(self.bad) or self.error is not None or self.stalled


@dataclass(eq=False)
class TierIo:
    """Read ``keys`` from ``tier``'s slots ``tier_slots`` into CPU slots ``cpu_slots``,
    or (``write``) write those CPU slots there."""

    tier: TierState
    write: bool
    keys: list[OffloadKey]
    tier_slots: list[int]
    cpu_slots: list[int]
    ctx: ReqContext | None = None
    #: Reads: the promotion of each key.
    promotions: list[Promotion] = field(default_factory=list)
    #: Its number among the reads and writes handed out (oldest first), and when.
    seq: int = 0
    sent: float = 0.0
    #: Set once its result was taken: a second hand-back (a completion rerun after an
    #: interrupt) changes nothing.
    settled: bool = False
    #: Reads, once settled: the keys that could not be read (misses now).
    bad: list[OffloadKey] = field(default_factory=list)
    #: The driver's handle of the running job (never read by the core).
    job: Any = None


@dataclass(eq=False)
class Delete:
    """The index let ``keys`` go (evicted, dropped): the port releases what they hold
    (a files-mode disk tier's files, removed on its lanes; a shared tier keeps its
    blocks for others). Where that is a job, its result goes back through
    ``TierHierarchy.delete_done``."""

    tier: TierState
    keys: list[OffloadKey]
    #: The driver's handle of the running job, if the port made one (never read by
    #: the core).
    job: Any = None


@dataclass(eq=False)
class Exists:
    """Ask the shared ``tier`` which of ``keys`` it holds; the answer goes back through
    ``TierHierarchy.answered`` (a failure too). Unanswered by ``deadline``, it counts as
    failed (``settled``: the driver drops its task)."""

    tier: TierState
    keys: list[OffloadKey]
    deadline: float = NEVER
    settled: bool = False
    #: The driver's handle of the running question (never read by the core).
    job: Any = None


Request = TierIo | Delete | Exists
