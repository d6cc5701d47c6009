"""What every tier below the CPU tier shares: its bookkeeping (index, policy, admission,
events) and the runtime protocol the engine drives.

The pinned host pool is the hub: a lower tier reads into host slots and writes out of
them, and never touches KV tensors. Each tier keeps its own index on the loop thread, with
the CPU tier's rules: a slot is pinned while it is read or written, evicted only when
idle, and every change is an event of the tier's medium. I/O lanes (and servers) only
move bytes and signal the completion bridge.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.admission import AdmissionFilter
from asyncoffload.manager.base import Medium
from asyncoffload.manager.cpu import CPUOffloadingManager
from asyncoffload.manager.policies import CachePolicy
from asyncoffload.manager.retention import DEFAULT_PIN_BUDGET
from asyncoffload.tiers.core.types import (
    IndexSpec,
    TierCounters,
    count_failures,
    failure_cause,
    results_of,
)
from asyncoffload.transfer.base import CopyJob, HostRegion

log = logging.getLogger("asyncoffload.tiers")

__all__ = [
    "IndexSpec",
    "LowerTier",
    "SharedSettings",
    "TierCounters",
    "TierManager",
    "count_failures",
    "failure_cause",
    "new_index",
    "outcomes",
    "shared_index_spec",
]


class TierManager(CPUOffloadingManager):
    """The index of one lower tier: :class:`CPUOffloadingManager`'s slots, policy,
    admission and events, with the tier's medium, plus :meth:`drop` for blocks that
    turned out unreadable (a failed check, a vanished file): they leave the index in the
    same step and one removed event says so, so a retry never finds them again."""

    def __init__(
        self,
        num_blocks: int,
        medium: Medium,
        policy: str | CachePolicy = "lru",
        store_threshold: int = 0,
        *,
        admission: str | AdmissionFilter | None = None,
        max_tracker_size: int = 64_000,
        pin_budget: float = DEFAULT_PIN_BUDGET,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(
            num_blocks,
            policy,
            store_threshold,
            enable_events=True,
            max_tracker_size=max_tracker_size,
            admission=admission,
            pin_budget=pin_budget,
            clock=clock,
        )
        self.medium = medium
        self.tenants.tier = medium.value
        #: Keys found bad while other reads still pin them: gone for lookups, freed when
        #: the last pin goes.
        self._bad: set[OffloadKey] = set()
        self.dropped = 0

    def count_offers(self, keys: Sequence[OffloadKey]) -> None:
        """Blocks offered to the engine that a tier above declined (the CPU tier's
        admission): none is written here, but the tier's admission counts the offer of
        each one not here, as its ``prepare_store`` would (``min_offers``; a filter's
        ghost). So a block the tiers above take at its next offer is written here then,
        if that offer is its ``min_offers``-th, instead of that offer being its first
        here. Changes no slot."""
        offers, admission = self._offers, self._admission
        if offers is None and admission is None:
            return
        absent = [key for key in dict.fromkeys(keys) if self._policy.get(key) is None]
        if not absent:
            return
        if offers is not None:
            offers.record(absent, [])
        elif admission is not None:
            admission.record(absent, [])

    def ready(self, key: OffloadKey) -> bool:
        """Whether ``key`` is stored here and readable now (does not change recency)."""
        block = self._policy.get(key)
        return block is not None and block.ref_cnt >= 0 and not (self._bad and key in self._bad)

    def lookup_prefix(
        self, keys: Sequence[OffloadKey], ctx: object = None, *, observe: bool = True
    ) -> int:
        n = 0
        for key in keys:
            if not self.ready(key):
                break
            n += 1
        if observe and keys and self._policy.observes_requests:
            self._policy.on_request(keys)
        return n

    def complete_load(self, keys: Sequence[OffloadKey], ctx: object = None) -> None:
        super().complete_load(keys)
        if self._bad:
            self._free_bad(keys)

    def drop(self, keys: Sequence[OffloadKey], pinned: bool = True) -> None:
        """Remove ``keys`` found unreadable. ``pinned``: each is pinned once by the read
        that failed (that pin goes too). A key other reads still pin stops being
        readable now and leaves when they end. One removed event for those present."""
        gone: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            block = self._policy.get(key)
            if block is None or block.ref_cnt < 0:
                continue
            if pinned and block.ref_cnt > 0:
                block.ref_cnt -= 1
                idle = False  # counted pinned until now
            else:
                idle = block.ref_cnt == 0
            if key in self._bad:  # already dropped, with its event
                if block.ref_cnt == 0:
                    self._bad.discard(key)
                    self._remove(key, idle)
                continue
            gone.append(key)
            if block.ref_cnt:
                self._bad.add(key)  # other readers: freed with their last pin
            else:
                self._remove(key, idle)
        self.dropped += len(gone)
        self._emit(gone, removed=True)

    def _free_bad(self, keys: Sequence[OffloadKey]) -> None:
        """After ``complete_load``: dropped keys whose last pin just went leave."""
        for key in keys:
            if key in self._bad:
                block = self._policy.get(key)
                if block is not None and block.ref_cnt == 0:
                    self._bad.discard(key)
                    self._remove(key, idle=True)

    def _remove(self, key: OffloadKey, idle: bool) -> None:
        """Free a ready block with no pins, with no event (the caller emits one).
        ``idle``: whether it was counted idle."""
        block = self._policy.get(key)
        assert block is not None and block.ref_cnt == 0
        self._policy.remove(key)
        self.pins.forget((key,))
        self._free_list.append(block.block_id)
        self.tenants.removed((key,))
        self._num_ready -= 1
        if idle:
            self._num_idle -= 1

    def resident_keys(self) -> Iterator[OffloadKey]:
        bad = self._bad
        return (key for key, block in self._policy.items() if block.ref_cnt >= 0 and key not in bad)


class SharedSettings(Protocol):
    """What a shared tier's settings (Redis / Valkey, Mooncake) give its index."""

    @property
    def index_blocks(self) -> int: ...
    @property
    def policy(self) -> str: ...
    @property
    def admission(self) -> str | None: ...
    @property
    def min_offers(self) -> int: ...
    @property
    def pin_budget(self) -> float: ...


def shared_index_spec(config: SharedSettings) -> IndexSpec:
    """A shared tier's index: ``index_blocks`` of blocks it knows the store holds, its
    policy, and its admission (``"frequency"``: the ``min_offers``-th offer; another
    name: that filter; None: every block)."""
    threshold = config.min_offers if config.admission == "frequency" else 0
    admission = config.admission if config.admission not in (None, "frequency") else None
    return IndexSpec(
        config.index_blocks,
        Medium.REMOTE,
        config.policy,
        threshold,
        admission,
        pin_budget=config.pin_budget,
    )


def new_index(spec: IndexSpec) -> TierManager:
    """The index a tier's ``spec`` describes, holding the blocks it found at open (ready,
    oldest first; no event: a subscriber's snapshot shows them)."""
    index = TierManager(
        spec.num_blocks,
        spec.medium,
        spec.policy,
        spec.store_threshold,
        admission=spec.admission,
        pin_budget=spec.pin_budget,
    )
    if spec.recovered:
        keys = list(spec.recovered)
        out = index.reserve(keys)
        assert out is not None
        index.complete_store(keys)
        index.take_events()
    return index


class LowerTier(ABC):
    """A tier below the CPU tier, opened by the engine for one namespace and host pool."""

    name: str
    medium: Medium
    #: How the tier's index is built (the index itself is the tier core's).
    index_spec: IndexSpec
    block_bytes: int
    #: Seconds an operation may wait to start; a read still running well past it fails
    #: its load (the engine does not wait on a stalled disk).
    deadline_s: float

    @abstractmethod
    def bind(self, wake_fd: int | None) -> None:
        """Signal ``wake_fd`` (the completion bridge's) when a job ends."""

    @abstractmethod
    def submit_read(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        """Read the blocks of ``keys`` (in tier slots ``slots``) into host addresses
        ``host``; the job's ``results`` say, per block, ``block_bytes`` or ``-errno``."""

    @abstractmethod
    def submit_write(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], host: Sequence[int]
    ) -> CopyJob:
        """Write host addresses ``host`` as the blocks of ``keys`` (tier slots ``slots``);
        the job's ``results`` say, per block, ``block_bytes``, ``0`` (the block was there
        already: nothing written) or ``-errno``."""

    def attach_host(self, regions: Sequence[HostRegion]) -> None:
        """The host slots' memory as another process can map it (the backend's
        :meth:`~asyncoffload.transfer.base.TransferBackend.host_regions`), given once
        before any I/O. Tiers whose I/O runs in this process ignore it."""
        return None

    def set_segments(self, deltas: Sequence[int]) -> None:
        """Each block's payload is in ``len(deltas)`` equal slices from now on, slice
        ``r`` at the host address given to :meth:`submit_read` / :meth:`submit_write`
        plus ``deltas[r]``: one slice per tensor-parallel rank, the same slot of each
        rank's host pool. A block stays one value, checked whole before any slice is
        written."""
        raise NotImplementedError(f"{type(self).__name__} cannot read or write slices")

    @abstractmethod
    def forget(self, keys: Sequence[OffloadKey]) -> CopyJob | None:
        """The index let ``keys`` go (evicted, dropped): release what they hold. Where
        that is I/O, it runs on the tier's lanes and this returns its job, whose
        ``results`` say per key ``0`` (released) or ``-errno``, ending like a write's
        (it signals the bound wake fd); ``None``: nothing to do (released already)."""

    def describe(self) -> dict[str, object]:
        return {}

    async def aclose(self) -> None:
        """Close on the event loop (a network client's connections); by default
        :meth:`close`."""
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Finish queued I/O, stop the lanes, close files. Idempotent."""


def outcomes(job: CopyJob, n: int) -> list[int]:
    """Per block of an ended I/O job of ``n`` blocks: bytes moved, or ``-errno`` (see
    :func:`~asyncoffload.tiers.core.types.results_of`)."""
    return results_of(getattr(job, "results", None), job.error, n)
