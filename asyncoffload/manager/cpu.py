"""The CPU-tier manager: a fixed pool of slots, reference counts, a cache policy, events.

Slot allocation is deterministic: never-used slots in ascending order first, then freed
slots, the most recently freed first. Every method validates its whole input before it
changes anything, so a rejected call leaves the manager as it was.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from asyncoffload.errors import DuplicateKeyError, KeyNotReadyError, UnknownKeyError
from asyncoffload.keys import BlockTokens, OffloadKey
from asyncoffload.manager.admission import AdmissionFilter, get_admission_cls
from asyncoffload.manager.base import (
    BlockStatus,
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from asyncoffload.manager.policies import CachePolicy, get_policy_cls

__all__ = ["CPUOffloadingManager", "ManagerStats"]

_EMPTY_SPEC = CPULoadStoreSpec(())


class ManagerStats(NamedTuple):
    """State and counters of a manager; the counters run from its creation."""

    #: Slots in the tier.
    num_blocks: int
    #: Ready blocks (loadable).
    ready: int
    #: Blocks whose store is in flight.
    write_pending: int
    #: Ready blocks pinned by at least one load.
    pinned: int
    #: Free slots.
    free: int
    #: Blocks made ready by successful stores.
    stored: int
    #: Blocks dropped by failed stores.
    store_failed: int
    #: Blocks handed to loads.
    loaded: int
    #: Blocks evicted.
    evicted: int
    #: Keys offered and held back: by ``store_threshold``, the admission filter or the
    #: policy's own admission.
    store_skipped: int
    #: ``lookup`` calls, and those that found the key (ready or pending).
    lookups: int
    hits: int


def _reject_duplicates(keys: Sequence[OffloadKey], what: str) -> None:
    if len(set(keys)) != len(keys):
        seen: set[OffloadKey] = set()
        for key in keys:
            if key in seen:
                raise DuplicateKeyError(f"{what}: key {key.hex()} appears more than once")
            seen.add(key)


class CPUOffloadingManager(OffloadingManager):
    """vLLM-compatible manager of ``num_blocks`` CPU slots.

    ``policy`` names a registered :class:`CachePolicy` (``"lru"``, ``"arc"``, ``"kv"``,
    ...) or is one, built for ``num_blocks``. ``store_threshold >= 2`` stores a key only
    from the ``store_threshold``-th time it is offered to ``prepare_store`` (offers are
    counted per key in a bounded LRU tracker of ``max_tracker_size`` keys); 0 or 1 stores
    on first offer. ``admission`` names a registered
    :class:`~asyncoffload.manager.admission.AdmissionFilter` (``"ghost"``,
    ``"adaptive"``) or is one; it cannot be combined with ``store_threshold``.
    """

    medium = Medium.CPU

    def __init__(
        self,
        num_blocks: int,
        policy: str | CachePolicy = "lru",
        store_threshold: int = 0,
        enable_events: bool = True,
        *,
        max_tracker_size: int = 64_000,
        admission: str | AdmissionFilter | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if store_threshold < 0:
            raise ValueError(f"store_threshold must be >= 0, got {store_threshold}")
        if max_tracker_size <= 0:
            raise ValueError(f"max_tracker_size must be positive, got {max_tracker_size}")
        if admission is not None and store_threshold >= 2:
            raise ValueError("use either store_threshold or an admission filter, not both")
        if isinstance(policy, CachePolicy):
            if policy.capacity != num_blocks:
                raise ValueError(
                    f"policy capacity {policy.capacity} differs from num_blocks {num_blocks}"
                )
            if len(policy):
                raise ValueError("the policy instance already tracks blocks")
            self._policy: CachePolicy = policy
        else:
            self._policy = get_policy_cls(policy)(num_blocks)
        if isinstance(admission, str):
            admission = get_admission_cls(admission)(num_blocks)
        elif admission is not None and not isinstance(admission, AdmissionFilter):
            raise TypeError(f"admission must be a name or an AdmissionFilter, got {admission!r}")
        self._admission: AdmissionFilter | None = admission
        self.num_blocks = num_blocks
        self.policy_name = self._policy.name or type(self._policy).__name__
        self.admission_name = admission.name if admission is not None else None
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._offers: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._seq = 0
        self._reset_slots()
        self._stored = self._store_failed = self._loaded = self._evicted = 0
        self._store_skipped = self._lookups = self._hits = 0

    def _reset_slots(self) -> None:
        self._num_allocated = 0
        self._free_list: list[int] = []
        self._num_ready = 0
        self._num_idle = 0  # ready with ref_cnt 0: the evictable ones
        self._num_pending = 0

    # --- introspection ---------------------------------------------------------------

    @property
    def policy(self) -> CachePolicy:
        return self._policy

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._num_allocated + len(self._free_list)

    def resident_keys(self) -> Iterator[OffloadKey]:
        """Keys of the ready (loadable) blocks, in policy order."""
        return (key for key, block in self._policy.items() if block.ref_cnt >= 0)

    def block_of(self, key: OffloadKey) -> BlockStatus | None:
        """The slot record of ``key``, or ``None``; for inspection, never mutate it."""
        return self._policy.get(key)

    def stats(self) -> ManagerStats:
        return ManagerStats(
            num_blocks=self.num_blocks,
            ready=self._num_ready,
            write_pending=self._num_pending,
            pinned=self._num_ready - self._num_idle,
            free=self.num_free,
            stored=self._stored,
            store_failed=self._store_failed,
            loaded=self._loaded,
            evicted=self._evicted,
            store_skipped=self._store_skipped,
            lookups=self._lookups,
            hits=self._hits,
        )

    def __repr__(self) -> str:
        return (
            f"<CPUOffloadingManager policy={self.policy_name} [{self._num_ready} ready, "
            f"{self._num_ready - self._num_idle} pinned, {self._num_pending} writing, "
            f"{self.num_free} free of {self.num_blocks}]>"
        )

    # --- slots and events --------------------------------------------------------------

    def _allocate(self, n: int) -> list[int]:
        fresh = min(n, self.num_blocks - self._num_allocated)
        ids = list(range(self._num_allocated, self._num_allocated + fresh))
        self._num_allocated += fresh
        free_list = self._free_list
        for _ in range(n - fresh):
            ids.append(free_list.pop())
        return ids

    def _emit(
        self, keys: list[OffloadKey], removed: bool, tokens: BlockTokens | None = None
    ) -> None:
        if self._events is not None and keys:
            self._seq += 1
            self._events.append(
                OffloadingEvent(
                    tuple(keys), self.medium, removed, self._seq, time.time(), tokens=tokens
                )
            )

    @property
    def last_seq(self) -> int:
        """``seq`` of the last event made (0 before the first)."""
        return self._seq

    # --- OffloadingManager -------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext | None = None) -> LookupResult:
        self._lookups += 1
        block = self._policy.get(key)
        if block is None:
            return LookupResult.MISS
        self._hits += 1
        return LookupResult.HIT if block.ref_cnt >= 0 else LookupResult.HIT_PENDING

    def lookup_prefix(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> int:
        """How many leading ``keys`` are ready to load. Does not change recency."""
        get = self._policy.get
        n = 0
        for key in keys:
            block = get(key)
            if block is None or block.ref_cnt < 0:
                break
            n += 1
        return n

    def prepare_load(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        """Pin ready blocks for reading; their slots, in the order of ``keys``.

        Raises :class:`UnknownKeyError` / :class:`KeyNotReadyError` /
        :class:`DuplicateKeyError` and pins nothing if any key cannot be loaded.
        """
        _reject_duplicates(keys, "prepare_load")
        get = self._policy.get
        blocks: list[BlockStatus] = []
        for key in keys:
            block = get(key)
            if block is None:
                raise UnknownKeyError(f"prepare_load: key {key.hex()} is not stored")
            if block.ref_cnt < 0:
                raise KeyNotReadyError(f"prepare_load: key {key.hex()} is still being stored")
            blocks.append(block)
        for block in blocks:
            if block.ref_cnt == 0:
                self._num_idle -= 1
            block.ref_cnt += 1
        self._loaded += len(blocks)
        return CPULoadStoreSpec(tuple(block.block_id for block in blocks))

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        self._policy.touch(keys)
        if self._admission is not None:
            self._admission.on_touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Unpin blocks pinned by ``prepare_load``. ``ValueError`` if one is not pinned."""
        need: dict[OffloadKey, int] = {}
        for key in keys:
            need[key] = need.get(key, 0) + 1
        get = self._policy.get
        blocks: list[BlockStatus] = []
        for key, count in need.items():
            block = get(key)
            if block is None or block.ref_cnt < count:
                raise ValueError(f"complete_load: key {key.hex()} is not being loaded")
            blocks.append(block)
        for block, count in zip(blocks, need.values()):
            block.ref_cnt -= count
            if block.ref_cnt == 0:
                self._num_idle += 1

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not yet present; ``None`` when there is no room.

        Keys already present (ready or in flight) are skipped without an event. Every key
        of ``keys`` is protected from eviction in this call. Evicted blocks are reported
        in one removed event.
        """
        _reject_duplicates(keys, "prepare_store")
        get = self._policy.get
        offered = [key for key in keys if get(key) is None]
        to_store = offered
        admission = self._admission
        if offered:
            full = len(offered) > self.num_free
            to_store = self._policy.admissible(offered, full)
            if self._offers is not None:
                to_store = self._admissible(to_store)
            elif admission is not None:
                to_store = admission.admissible(to_store, full)
        if not to_store:
            self._record_offers(offered, to_store)
            return PrepareStoreOutput([], _EMPTY_SPEC, [])

        evicted: list[OffloadKey] = []
        shortfall = len(to_store) - self.num_free
        if shortfall > 0:
            # A refused call (``None``) changes nothing, offer counts included.
            if shortfall > self._num_idle:
                return None
            victims = self._policy.evict(shortfall, set(keys))
            if victims is None:
                return None
            free_list = self._free_list
            for key, block in victims:
                free_list.append(block.block_id)
                evicted.append(key)
            self._num_idle -= len(victims)
            self._num_ready -= len(victims)
            self._evicted += len(victims)
            self._emit(evicted, removed=True)

        self._record_offers(offered, to_store)
        if admission is not None and evicted:
            admission.on_evict(evicted)  # after record(): admitted keys leave the ghost first
        ids = self._allocate(len(to_store))
        self._policy.insert_many(
            [(key, BlockStatus(block_id)) for key, block_id in zip(to_store, ids)]
        )
        self._num_pending += len(to_store)
        return PrepareStoreOutput(to_store, CPULoadStoreSpec(tuple(ids)), evicted)

    def _admissible(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The ``keys`` whose offer in this call reaches ``store_threshold``; changes nothing."""
        offers = self._offers
        assert offers is not None
        threshold = self.store_threshold
        return [key for key in keys if offers.get(key, 0) + 1 >= threshold]

    def _record_offers(self, offered: list[OffloadKey], admitted: list[OffloadKey]) -> None:
        """Count this call's offers (held back: by the policy, the threshold or the
        filter): admitted keys leave the tracker, the others go up by one; or tell the
        admission filter."""
        self._store_skipped += len(offered) - len(admitted)
        offers = self._offers
        if offers is None:
            if self._admission is not None and offered:
                self._admission.record(offered, admitted)
            return
        admitted_set = set(admitted)
        for key in offered:
            count = offers.pop(key, 0) + 1
            if key not in admitted_set:
                if len(offers) >= self.max_tracker_size:
                    offers.popitem(last=False)
                offers[key] = count

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, success: bool = True
    ) -> None:
        """Finish stores: on success the blocks become loadable and one stored event goes
        out; on failure their slots are freed and nothing is published. Keys that are not
        pending (already ready, or unknown) are ignored."""
        get = self._policy.get
        done: list[OffloadKey] = []
        for key in keys:
            block = get(key)
            if block is None or block.ref_cnt >= 0:
                continue
            if success:
                block.ref_cnt = 0
            else:
                self._policy.remove(key)
                self._free_list.append(block.block_id)
            done.append(key)
        self._num_pending -= len(done)
        if success:
            self._num_ready += len(done)
            self._num_idle += len(done)
            self._stored += len(done)
            self._emit(done, removed=False, tokens=ctx.tokens if ctx is not None else None)
        else:
            self._store_failed += len(done)

    def take_events(self) -> list[OffloadingEvent]:
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Drop every block; ready blocks are reported in one removed event.

        Refused (``RuntimeError``, nothing changed) while a store or a load is in flight:
        a later ``complete_store`` could not tell the old store from a new one of the same
        key, and a load would read a slot that may be handed out again. Wait for the
        transfers first. Counters (:meth:`stats`) are kept.
        """
        pinned = self._num_ready - self._num_idle
        if self._num_pending or pinned:
            raise RuntimeError(
                f"reset_cache with transfers in flight ({self._num_pending} blocks being "
                f"stored, {pinned} being loaded): wait for them first"
            )
        removed = list(self.resident_keys())
        self._policy.clear()
        if self._offers is not None:
            self._offers.clear()
        if self._admission is not None:
            self._admission.clear()
        self._reset_slots()
        self._emit(removed, removed=True)
