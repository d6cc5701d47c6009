"""The tier core's plain types: what an index must offer it, what a tier did (its
counters and stats), and how a block's result reads (bytes moved, or ``-errno``).

Nothing here performs I/O or reads a clock; import-linter holds it to that (see
pyproject.toml, "the tier core is sans-I/O").
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import (
    BlockStatus,
    CPULoadStoreSpec,
    ManagerStats,
    Medium,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)
from asyncoffload.manager.pins import PinStats, PinTable
from asyncoffload.manager.retention import DEFAULT_PIN_BUDGET

__all__ = [
    "MAX_KEY_BYTES",
    "CpuIndex",
    "IndexSpec",
    "Outcome",
    "TierCounters",
    "TierIndex",
    "TierStats",
    "count_failures",
    "failure_cause",
    "results_of",
]

log = logging.getLogger("asyncoffload.tiers")

#: The longest key a block in a lower tier may carry (its header's key field).
MAX_KEY_BYTES = 256


class CpuIndex(Protocol):
    """What the core asks of the CPU tier's index (a ``CPUOffloadingManager``)."""

    #: Its slots (0: not counted here), and the stores and promotions it refused for want
    #: of one: backpressure reads them.
    num_blocks: int
    no_room: int

    def block_of(self, key: OffloadKey) -> BlockStatus | None: ...

    def reserve(
        self, keys: Sequence[OffloadKey], protect: Sequence[OffloadKey] = (), ctx: object = None
    ) -> PrepareStoreOutput | None: ...

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, success: bool = True
    ) -> None: ...

    def pin(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec: ...

    def prepare_load(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> CPULoadStoreSpec: ...

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None: ...


class TierIndex(CpuIndex, Protocol):
    """What the core asks of a lower tier's index (a ``TierManager``): the CPU tier's
    calls, plus readiness, admission (``prepare_store``), drops, events and stats; and
    what a driver's event stream reads of it (``medium``, ``last_seq``,
    ``resident_keys``)."""

    #: The tier's retention pins and classes.
    pins: PinTable

    @property
    def medium(self) -> Medium: ...

    @property
    def dropped(self) -> int: ...

    @property
    def last_seq(self) -> int: ...

    def resident_keys(self) -> Iterator[OffloadKey]: ...

    def ready(self, key: OffloadKey) -> bool: ...

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> PrepareStoreOutput | None: ...

    def drop(self, keys: Sequence[OffloadKey], pinned: bool = True) -> None: ...

    def count_offers(self, keys: Sequence[OffloadKey]) -> None: ...

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None: ...

    def take_events(self) -> list[OffloadingEvent]: ...

    def stats(self) -> ManagerStats: ...


@dataclass(frozen=True)
class IndexSpec:
    """How a tier's index is built (a backend says it; the index is the core's):
    ``num_blocks`` slots of ``medium``, its ``policy``, ``store_threshold`` (the
    ``min_offers``-th offer is written) and ``admission`` filter, and the keys a tier
    found at open (``recovered``: a files-mode disk tier's blocks, oldest first), and
    its ``pin_budget``."""

    num_blocks: int
    medium: Medium
    policy: str = "lru"
    store_threshold: int = 0
    admission: str | None = None
    recovered: tuple[OffloadKey, ...] = ()
    #: The most of the tier that retention pins may hold, in (0, 1].
    pin_budget: float = DEFAULT_PIN_BUDGET


class Outcome(NamedTuple):
    """How an I/O request ended, as the driver hands it back: per block, bytes moved
    (``0``: a write found the block there already) or ``-errno``; ``late``: the tier
    gave up on the job while an op of it may still run (stuck in a system call: its
    host slots are held until the driver says it ended, see ``TierHierarchy.reap``)."""

    results: list[int]
    late: bool = False

    @property
    def ok(self) -> bool:
        """Every block moved, in time."""
        return not self.late and all(r >= 0 for r in self.results)


@dataclass
class TierCounters:
    """What a tier did, for stats: offers written and refused, reads and their failures
    by cause."""

    writes: int = 0
    blocks_written: int = 0
    #: Offered blocks the tier found there already (a shared tier's put-if-absent that
    #: wrote nothing): ready in the index, not counted written.
    blocks_present: int = 0
    bytes_written: int = 0
    write_failures: int = 0
    reads: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    read_failures: int = 0
    #: Keys whose release failed (a files-mode block file left behind).
    delete_failures: int = 0
    lookup_hits: int = 0
    #: Blocks of CPU stores that the CPU tier's admission declined: never offered here.
    declined_above: int = 0
    #: Blocks of write-through shed while the tier's writes lagged (``core.backpressure``).
    write_shed: int = 0
    #: Blocks whose write waited (the tier's writes lagged) and that the CPU tier evicted
    #: before it went: not written (``core.backpressure``), or still waiting at close.
    write_yielded: int = 0
    #: Failures by cause ("corrupt", "stale", "missing", "short", "timeout", "ENOSPC", ...).
    failures: dict[str, int] = field(default_factory=dict)
    #: Load or recompute (``core.cost``): blocks promoted, and blocks recomputed instead,
    #: by choice or after a read overran its deadline.
    loaded: int = 0
    recomputed_by_choice: int = 0
    recomputed_after_deadline: int = 0


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
    #: or the errno name ("ENOSPC", "EIO", ...), "after_failure" (writes that waited
    #: behind one that found the tier stuck: not tried); skips: "full", "no_slot",
    #: "no_pool".
    failures: dict[str, int]
    #: Offered blocks found there already, nothing written (a shared tier's put-if-absent
    #: over another engine's copy): ready in the index, not in ``blocks_written``.
    blocks_present: int = 0
    #: Keys the index let go whose release failed (a files-mode block file that could
    #: not be removed: it stays on disk until the directory's next recovery).
    delete_failures: int = 0
    #: Blocks offered to the CPU tier that its admission declined (the policy's own, as
    #: ``kv``'s and ``auto``'s once the tier is full, the filter or ``store_threshold``):
    #: the hierarchy is inclusive, a lower tier is written from the CPU tier's slots, so
    #: they were never offered here. Not failures; the CPU tier counts them too
    #: (``ManagerStats.store_skipped``).
    declined_above: int = 0
    #: Blocks of write-through shed, never offered to the tier's admission, while its
    #: writes lagged (``asyncoffload.tiers.core.backpressure``): the CPU tier keeps them.
    write_shed: int = 0
    #: Blocks whose write waited while the tier's writes lagged and that the CPU tier
    #: evicted before it went, or that still waited at close: not written.
    write_yielded: int = 0
    #: The EMA of a write's time in flight (seconds), and the blocks whose write pins
    #: their CPU slots now (being written, or waiting for the tier's lagging writes).
    write_lag_s: float = 0.0
    write_queued: int = 0
    #: The tier's retention pins (``asyncoffload.manager.pins``).
    pins: PinStats | None = None
    #: Load or recompute (``asyncoffload.tiers.core.cost``), in blocks: promoted
    #: (promotions that ended well), recomputed because reading them was expected to be
    #: slower (the lookup stopped before them), and recomputed because their read
    #: overran its deadline (the promotion failed, the request did not).
    loaded: int = 0
    recomputed_by_choice: int = 0
    recomputed_after_deadline: int = 0
    #: The tier's read model as measured (None before its first read): the per-read
    #: latency (s) and the bandwidth (B/s; ``inf``: no size dependence measured).
    read_latency_s: float | None = None
    read_bytes_per_s: float | None = None


_CAUSES = {
    errno.EBADMSG: "corrupt",
    errno.ESTALE: "stale",
    errno.EKEYREJECTED: "wrong_key",
    errno.ENOKEY: "unauthenticated",
    errno.ENODATA: "short",
    errno.EMSGSIZE: "oversize",
    errno.EPROTO: "protocol",
    errno.ENOENT: "missing",
    errno.ETIMEDOUT: "timeout",
    errno.EHOSTDOWN: "unavailable",
}


def failure_cause(code: int) -> str:
    """The name of a failed block's ``-errno``: a cause of tiers' stats."""
    code = -code
    return _CAUSES.get(code) or errno.errorcode.get(code, f"errno {code}")


def results_of(results: Sequence[int] | None, error: BaseException | None, n: int) -> list[int]:
    """Per block of an I/O job of ``n`` blocks: bytes moved, or ``-errno``. A job that
    failed whole (``error``, or no ``results``) fails every block with its errno (EIO
    if it has none); one that ended with another number of results than ``n`` (a
    defect) fails them all with ``-EPROTO``: pairing results with the wrong blocks, or
    leaving some unsettled, would be worse."""
    if results is None or error is not None:
        code = error.errno if isinstance(error, OSError) and error.errno else errno.EIO
        return [-code] * n
    out = list(results)
    if len(out) != n:
        log.error("an I/O job of %d blocks ended with %d results: all fail", n, len(out))
        return [-errno.EPROTO] * n
    return out


def count_failures(counters: TierCounters, results: Sequence[int]) -> dict[str, int]:
    """Count the failed blocks of ``results`` by cause, into ``counters.failures`` too;
    the causes of this job."""
    causes: dict[str, int] = {}
    for r in results:
        if r < 0:
            cause = failure_cause(r)
            causes[cause] = causes.get(cause, 0) + 1
            counters.failures[cause] = counters.failures.get(cause, 0) + 1
    return causes
