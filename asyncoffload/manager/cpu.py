"""The CPU-tier manager: a fixed pool of slots, reference counts, a cache policy, events.

Slot allocation is deterministic: never-used slots in ascending order first, then freed
slots, the most recently freed first. Every method validates its whole input before it
changes anything, so a rejected call leaves the manager as it was.

Two call patterns feed the policy its recency. The engine's: ``touch`` the keys a request
loads, then the keys it stores (``touch_on_load``, ``touch_on_store``), after one
``lookup_prefix`` of the prompt (where a policy that ``observes_requests`` hears of it),
or after a ``lookup`` of each key (the policy then hears of the request at the store's
touch).
vLLM's connector (0.32 and later), which never calls ``touch``:
with ``request_scoped=True`` the manager remembers what each request (by
``ctx.req_id``) loaded and stored, and tells the policy when ``on_request_finished``
comes, as vLLM's own manager does (see :mod:`asyncoffload.manager.policies.base`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import compress, repeat
from operator import attrgetter, is_, itemgetter
from typing import cast

from asyncoffload.errors import KeyNotReadyError, UnknownKeyError
from asyncoffload.keys import GROUP_IDX_BYTES, BlockTokens, OffloadKey
from asyncoffload.manager.admission import AdmissionFilter, get_admission_cls
from asyncoffload.manager.base import (
    BlockStatus,
    CPULoadStoreSpec,
    LookupResult,
    ManagerStats,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    reject_duplicates,
)
from asyncoffload.manager.offers import OfferCounts
from asyncoffload.manager.pins import PinTable
from asyncoffload.manager.policies import CachePolicy, RequestScope, get_policy_cls
from asyncoffload.manager.quotas import Tenants, tenancy
from asyncoffload.manager.retention import DEFAULT_PIN_BUDGET
from asyncoffload.manager.walks import Walks

__all__ = ["CPUOffloadingManager", "ManagerStats", "reject_duplicates"]

_EMPTY_SPEC = CPULoadStoreSpec(())
_ref_cnt = attrgetter("ref_cnt")
_block_id = attrgetter("block_id")

#: Blocks a policy evicts.
_Victims = list[tuple[OffloadKey, BlockStatus]]

#: Called with (keys, removed) for each event, instead of keeping OffloadingEvents.
EventSink = Callable[[list[OffloadKey], bool], None]


class _RequestLog:
    """What one request did, for request-scoped recency: per prepare call the keys it
    used (in the order given), the ready keys among them it used again, and the keys
    it inserted. Folded into sets only when the request ends."""

    __slots__ = ("calls", "counted", "missed", "positions", "scope", "seen", "touched")

    def __init__(
        self,
        scope: RequestScope | None = None,
        positions: Mapping[OffloadKey, int] | None = None,
    ) -> None:
        self.calls: list[tuple[Sequence[OffloadKey], Sequence[OffloadKey], Sequence[OffloadKey]]]
        self.calls = []
        #: Keys already reported to the policy as store misses.
        self.missed: set[OffloadKey] | None = None
        #: Whether a ``touch_before_store`` policy has been touched for this request.
        self.touched = False
        #: For a ``request_ranked`` policy: the request's scope, and the keys it has used
        #: (reported to ``on_request_access``).
        self.scope = scope
        self.seen: set[OffloadKey] | None = None if scope is None else set()
        #: With ``count_once_per_request``: the keys this request's offers counted.
        self.counted: set[OffloadKey] | None = None
        #: The end token of each of the request's keys, where the caller knows them
        #: (vLLM's ``_offload_key_positions``: every full block of the request).
        self.positions = positions


_group_of = itemgetter(slice(-GROUP_IDX_BYTES, None))


def _whole_request(log: _RequestLog, used: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
    """The request a policy that observes requests hears once: every key the request
    has, head first, where the caller named their positions (vLLM names each full block
    of the request: it stores a long prompt chunk by chunk, over several steps, so the
    first store alone holds only the first chunk), else the keys it used so far."""
    positions = log.positions
    if not positions or len(positions) <= len(used):
        return used
    return sorted(positions, key=lambda key: (positions[key], key))


def _group_keys(
    keys: list[OffloadKey], positions: Mapping[OffloadKey, int] | None
) -> list[list[OffloadKey]]:
    """``keys`` split by KV-cache group (ascending group index), each group in first-use
    order, or by end token where ``positions`` knows all of the group's keys."""
    tails = list(map(_group_of, keys))
    groups: dict[bytes, list[OffloadKey]]
    if tails.count(tails[0]) == len(tails):
        groups = {tails[0]: keys}
    else:
        groups = {}
        for key, tail in zip(keys, tails):
            groups.setdefault(tail, []).append(key)
    out: list[list[OffloadKey]] = []
    for tail in sorted(groups):
        group = groups[tail]
        if positions is not None:
            ends = list(map(positions.get, group))
            if None not in ends:
                known = cast(list[int], ends)
                if known != sorted(known):
                    group = [group[i] for i in sorted(range(len(group)), key=known.__getitem__)]
        out.append(group)
    return out


def _unpin_counted(
    get: Callable[[OffloadKey], BlockStatus | None], keys: Sequence[OffloadKey]
) -> int:
    """``complete_load`` of keys listed more than once, or unknown ones: count, then
    check (``ValueError``, changing nothing, for one not pinned that often), then unpin;
    how many blocks became idle."""
    need: dict[OffloadKey, int] = {}
    for key in keys:
        need[key] = need.get(key, 0) + 1
    pinned: list[BlockStatus] = []
    for key, count in need.items():
        maybe = get(key)
        if maybe is None or maybe.ref_cnt < count:
            raise ValueError(f"complete_load: key {key.hex()} is not being loaded")
        pinned.append(maybe)
    idle = 0
    for block, count in zip(pinned, need.values()):
        block.ref_cnt -= count
        if block.ref_cnt == 0:
            idle += 1
    return idle


def _checked_parts(
    num_blocks: int,
    policy: str | CachePolicy,
    store_threshold: int,
    max_tracker_size: int,
    admission: str | AdmissionFilter | None,
    clock: Callable[[], float] | None = None,
) -> tuple[CachePolicy, AdmissionFilter | None]:
    """A manager's arguments checked (``ValueError`` / ``TypeError`` naming the one that
    is wrong), and its policy and admission filter built from them; a ``clock`` given is
    the policy's too (:meth:`CachePolicy.use_clock`)."""
    if clock is not None and not callable(clock):
        raise TypeError(f"clock must be callable, got {clock!r}")
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
    else:
        policy = get_policy_cls(policy)(num_blocks)
    if isinstance(admission, str):
        admission = get_admission_cls(admission)(num_blocks)
    elif admission is not None and not isinstance(admission, AdmissionFilter):
        raise TypeError(f"admission must be a name or an AdmissionFilter, got {admission!r}")
    if clock is not None:
        policy.use_clock(clock)
    return policy, admission


def _partition(
    get: Callable[[OffloadKey], BlockStatus | None], keys: Sequence[OffloadKey]
) -> tuple[list[OffloadKey], list[OffloadKey], bool]:
    """The absent keys, the ready ones, and whether any is being stored (``get``: the
    policy's block of a key)."""
    blocks = list(map(get, keys))
    absent = blocks.count(None)
    if absent == len(blocks):
        return list(keys), [], False
    offered = list(compress(keys, map(is_, blocks, repeat(None))))
    ready: list[OffloadKey] = []
    for key, block in zip(keys, blocks):
        if block is not None and block.ref_cnt >= 0:
            ready.append(key)
    return offered, ready, absent + len(ready) != len(keys)


class CPUOffloadingManager(OffloadingManager):
    """vLLM-compatible manager of ``num_blocks`` CPU slots.

    ``policy`` names a registered :class:`CachePolicy` (``"lru"``, ``"arc"``, ``"kv"``,
    ...) or is one, built for ``num_blocks``. ``store_threshold >= 2`` stores a key only
    from the ``store_threshold``-th time it is offered to ``prepare_store`` (offers are
    counted per key in a bounded LRU tracker of ``max_tracker_size`` keys); 0 or 1 stores
    on first offer. ``admission`` names a registered
    :class:`~asyncoffload.manager.admission.AdmissionFilter` (``"ghost"``,
    ``"adaptive"``) or is one; it cannot be combined with ``store_threshold``.
    ``quotas`` caps tenants at that many blocks each (:mod:`~asyncoffload.manager.quotas`).
    ``clock`` (seconds; ``time.monotonic`` if None) times the pins, and the policy if given.
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
        request_scoped: bool = False,
        count_once_per_request: bool = False,
        event_sink: EventSink | None = None,
        pin_budget: float = DEFAULT_PIN_BUDGET,
        clock: Callable[[], float] | None = None,
        quotas: Mapping[str, int] | None = None,
    ) -> None:
        self._policy, self._admission = _checked_parts(
            num_blocks, policy, store_threshold, max_tracker_size, admission, clock
        )
        self.num_blocks = num_blocks
        self.policy_name = self._policy.name or type(self._policy).__name__
        self.admission_name = self._admission.name if self._admission is not None else None
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._offers: OfferCounts | None = None
        if store_threshold >= 2:
            self._offers = OfferCounts(store_threshold, max_tracker_size)
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._event_sink = event_sink if enable_events else None
        self._seq = 0
        self._requests: dict[str, _RequestLog] | None = {} if request_scoped else None
        #: Request-scoped: a ``request_ranked`` policy hears each request's first uses and
        #: inserts, ``store_threshold`` counts a key once per request (vLLM 0.34's rules).
        self._ranked = request_scoped and self._policy.request_ranked
        self._count_once = request_scoped and count_once_per_request
        #: Slots the last ``prepare_store`` asked for, whether it got them or not.
        self.last_store_size = 0
        self._touch_before_store = self._policy.touch_before_store
        self._observe_misses = self._policy.observes_store_misses
        #: Whether ``lookup_prefix`` tells the policy of a request (see ``on_request``).
        self._observe_lookups = self._policy.observes_requests and not request_scoped
        #: Requests looked up key by key that the policy has not heard of yet (``lookup``).
        self._walks = Walks(self._policy.on_request if self._observe_lookups else None)
        #: Retention pins and classes (asyncoffload.manager.pins), ``pin_budget`` of the tier.
        # Through the policy as it is at each call: `auto` rebinds its methods to the
        # leader at each switch (a bound method kept here would look in the old one).
        self.pins = PinTable(num_blocks, self.block_of, pin_budget, clock=clock or time.monotonic)
        self.pins.emit = functools.partial(_pin_event, self)
        #: Tenant quotas (asyncoffload.manager.quotas): own evictions honour the pins.
        self.tenants = Tenants(self._policy, self._evict, self.pins)
        self.tenants.set_caps(quotas or {}, num_blocks)
        self._reset_slots()
        self._stored = self._store_failed = self._loaded = self._evicted = 0
        self._store_skipped = self._lookups = self._hits = 0
        #: Stores and promotions refused for want of a slot (read by tier backpressure).
        self.no_room = 0

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
            **self.tenants.totals(),
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
        reused = n - fresh
        if reused:
            free_list = self._free_list
            ids += reversed(free_list[-reused:])  # popped one by one: last freed first
            del free_list[-reused:]
        return ids

    def _emit(
        self, keys: list[OffloadKey], removed: bool, tokens: BlockTokens | None = None
    ) -> None:
        if self._event_sink is not None:
            if keys:
                self._event_sink(keys, removed)
            return
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
        """Whether ``key`` is stored (``HIT``), being stored (``HIT_PENDING``) or not
        (``MISS``); never changes recency (a policy hears of the walk at a later ``touch``)."""
        self._lookups += 1
        block = self._policy.get(key)
        self._walks.look(key, block is not None and block.ref_cnt >= 0)
        if block is None:
            return LookupResult.MISS
        self._hits += 1
        return LookupResult.HIT if block.ref_cnt >= 0 else LookupResult.HIT_PENDING

    def lookup_prefix(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, *, observe: bool = True
    ) -> int:
        """How many leading ``keys`` are ready to load. Does not change recency.

        Under a manager that does not track requests, a policy that ``observes_requests``
        learns of the request here (its ``on_request``), unless ``observe`` is false: a
        caller that looks a request up more than once passes it on all but one lookup."""
        self._policy.on_context(ctx)
        get = self._policy.get
        n = 0
        for key in keys:
            block = get(key)
            if block is None or block.ref_cnt < 0:
                break
            n += 1
        self.pins.hit(keys[:n], ctx)
        if self._observe_lookups and observe and keys:
            self._walks.prefix_lookup()  # walks not heard yet first
            self._policy.on_request(keys)
        return n

    def prepare_load(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        """Pin ready blocks for reading; their slots, in the order of ``keys``.

        Raises :class:`UnknownKeyError` / :class:`KeyNotReadyError` /
        :class:`DuplicateKeyError` and pins nothing if any key cannot be loaded.
        """
        reject_duplicates(keys, "prepare_load")
        found = list(map(self._policy.get, keys))
        if None in found or (found and min(map(_ref_cnt, found)) < 0):
            for key, block in zip(keys, found):
                if block is None:
                    raise UnknownKeyError(f"prepare_load: key {key.hex()} is not stored")
                if block.ref_cnt < 0:
                    raise KeyNotReadyError(f"prepare_load: key {key.hex()} is still being stored")
        blocks = cast(list[BlockStatus], found)
        self._pin_blocks(blocks)
        self._loaded += len(blocks)
        self.pins.hit(keys, ctx)
        self._walks.end()
        if self._requests is not None and ctx is not None and keys:
            loaded = tuple(keys)
            log = self._request(ctx)
            log.calls.append((loaded, loaded, ()))
            if self._ranked:
                self._accessed(log, loaded)
        return CPULoadStoreSpec(tuple(map(_block_id, blocks)))

    def _accessed(self, log: _RequestLog, keys: Sequence[OffloadKey]) -> None:
        """A ``request_ranked`` policy hears the keys the request uses for the first time."""
        seen, scope = log.seen, log.scope
        assert seen is not None and scope is not None
        new = [key for key in keys if key not in seen]
        if new:
            seen.update(new)
            self._policy.on_request_access(new, scope)

    def _pin_blocks(self, blocks: list[BlockStatus]) -> None:
        idle = 0
        for block in blocks:
            if not block.ref_cnt:
                idle += 1
            block.ref_cnt += 1
        self._num_idle -= idle

    def pin(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        """Pin ready blocks that something other than a load reads (a write to a lower
        tier): like :meth:`prepare_load` without counting a load; unpin them with
        :meth:`complete_load`. ``KeyNotReadyError`` / ``UnknownKeyError``, pinning
        nothing, if one is not ready."""
        found = list(map(self._policy.get, keys))
        for key, block in zip(keys, found):
            if block is None:
                raise UnknownKeyError(f"pin: key {key.hex()} is not stored")
            if block.ref_cnt < 0:
                raise KeyNotReadyError(f"pin: key {key.hex()} is still being stored")
        blocks = cast(list[BlockStatus], found)
        self._pin_blocks(blocks)
        return CPULoadStoreSpec(tuple(map(_block_id, blocks)))

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used (``keys[0]`` the most recently), after telling a
        policy that observes requests of those looked up key by key (:meth:`lookup`)."""
        self._policy.on_context(ctx)
        self._walks.touched(keys)
        self.pins.hit(keys, ctx)
        self._policy.touch(keys)
        if self._admission is not None:
            self._admission.on_touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Unpin blocks pinned by ``prepare_load``. ``ValueError`` if one is not pinned."""
        found = list(map(self._policy.get, keys))
        if len(set(keys)) == len(keys) and None not in found:
            blocks = cast(list[BlockStatus], found)
            if blocks and min(map(_ref_cnt, blocks)) < 1:
                for key, block in zip(keys, blocks):
                    if block.ref_cnt < 1:
                        raise ValueError(f"complete_load: key {key.hex()} is not being loaded")
            idle = 0
            for block in blocks:
                block.ref_cnt -= 1
                if not block.ref_cnt:
                    idle += 1
            self._num_idle += idle
            return
        self._num_idle += _unpin_counted(self._policy.get, keys)

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not yet present; ``None`` when there is no room.

        Keys already present (ready or in flight) are skipped without an event. Every key
        of ``keys`` is protected from eviction in this call. Evicted blocks are reported
        in one removed event. A refused call (``None``) changes no slot; a
        request-scoped manager still records the request's offer (as vLLM's does).
        """
        reject_duplicates(keys, "prepare_store")
        who = tenancy(ctx)
        self._walks.end()
        self._policy.on_context(ctx)
        get = self._policy.get
        requests = self._requests
        log: _RequestLog | None = None
        if requests is None or ctx is None:
            offered = list(compress(keys, map(is_, map(get, keys), repeat(None))))
            ready: list[OffloadKey] = []
            pending = False
        else:
            log = self._request(ctx)
            offered, ready, pending = _partition(self._policy.get, keys)
        counted = None
        offers = self._offers
        if self._count_once and log is not None and offers is not None:
            # vLLM 0.34's tracker: every key of the offer counts, once per request,
            # before anything is decided (a refused call has counted too).
            counted = log.counted
            if counted is None:
                counted = log.counted = set()
            offers.count(keys, counted)
        to_store = offered
        admission = self._admission
        if offered:
            full = len(offered) > self.num_free
            to_store = self._policy.admissible(offered, full)
            if counted is not None and offers is not None:
                self._store_skipped += len(offered) - len(to_store)  # the policy's own
                to_store, skipped = offers.counted_admissible(to_store, counted)
                self._store_skipped += skipped
            elif offers is not None:
                to_store = offers.admissible(to_store)
            elif admission is not None:
                to_store = admission.admissible(to_store, full)
        own: list[OffloadKey] = []  # a tenant's blocks evicted for its quota
        if who.no_store or (to_store and self.tenants.caps):
            to_store, own = self.tenants.admit(who, to_store, keys)
        if counted is not None:
            counted.update(keys)
        if log is not None:
            self._log_store(log, keys, offered, to_store, ready, pending)
        self.last_store_size = len(to_store)
        if not to_store:
            if counted is None:
                self._record_offers(offered, to_store)
            self.pins.offer(keys, (), ctx)
            return PrepareStoreOutput([], _EMPTY_SPEC, [])

        # A refused call (``None``) changes no slot, offer counts included.
        evicted = self._make_room(len(to_store), keys)
        if evicted is None:
            if not own:
                return None
            to_store = to_store[: self.num_free]  # what the tenant's own room holds
            evicted = []
        evicted = own + evicted if own else evicted

        if counted is None:
            self._record_offers(offered, to_store)
        if admission is not None and evicted:
            admission.on_evict(evicted)  # after record(): admitted keys leave the ghost first
        ids = self._allocate(len(to_store))
        items = list(zip(to_store, map(BlockStatus, ids)))
        if self._ranked and log is not None:
            self._policy.insert_ranked(items, log.scope)
        else:
            self._policy.insert_many(items)
        self.tenants.added(to_store, who)
        self._num_pending += len(to_store)
        self.pins.offer(keys, to_store, ctx)
        if log is not None:
            calls = log.calls
            seen, reused, _ = calls[-1]
            calls[-1] = (seen, reused, to_store)
        return PrepareStoreOutput(to_store, CPULoadStoreSpec(tuple(ids)), evicted)

    def reserve(
        self, keys: Sequence[OffloadKey], protect: Sequence[OffloadKey] = (), ctx: object = None
    ) -> PrepareStoreOutput | None:
        """Take slots for ``keys``, none of which may be present, evicting idle blocks as
        needed (one removed event), never one of ``protect`` (the rest of the request's
        prefix): the way a promotion from a lower tier comes in. It skips admission and
        offer counting (the block earned its place when it was stored), not ``ctx``'s
        tenant's quota. ``None``, changing nothing, when too few idle blocks can be
        evicted. Finish it with :meth:`complete_store` like a store."""
        reject_duplicates(keys, "reserve")
        get = self._policy.get
        for key in keys:
            if get(key) is not None:
                raise ValueError(f"reserve: key {key.hex()} is already present")
        to_store = list(keys)
        if not to_store:
            return PrepareStoreOutput([], _EMPTY_SPEC, [])
        kept = [*keys, *protect] if protect else keys
        who, own = self.tenants.promotion(ctx, len(to_store), kept)  # own: for its quota
        evicted = None if own is None else self._make_room(len(to_store), kept)
        if evicted is None:
            return None
        evicted = own + evicted if own else evicted
        if self._admission is not None and evicted:
            self._admission.on_evict(evicted)
        ids = self._allocate(len(to_store))
        self._policy.insert_many(list(zip(to_store, map(BlockStatus, ids))))
        self.tenants.added(to_store, who)
        self._num_pending += len(to_store)
        return PrepareStoreOutput(to_store, CPULoadStoreSpec(tuple(ids)), evicted)

    def _make_room(self, n: int, protect: Sequence[OffloadKey]) -> list[OffloadKey] | None:
        """Evict idle blocks (never one of ``protect``) until ``n`` slots are free; the
        evicted keys (one removed event), or ``None``, changing nothing, if it can't."""
        shortfall = n - self.num_free
        if shortfall <= 0:
            return []
        idle = self._num_idle
        victims = (
            None if shortfall > idle else self.pins.evict(self._policy, shortfall, protect, idle)
        )
        if victims is None:
            self.no_room += 1
        return None if victims is None else self._evict(victims)

    def _evict(self, victims: _Victims) -> list[OffloadKey]:
        """Free the slots of the idle ``victims``, with one removed event."""
        evicted = [key for key, _ in victims]
        self._free_list.extend(block.block_id for _, block in victims)
        self._num_idle -= len(victims)
        self._num_ready -= len(victims)
        self._evicted += len(victims)
        self.tenants.removed(evicted)
        self._emit(evicted, removed=True)
        return evicted

    def _log_store(
        self,
        log: _RequestLog,
        keys: Sequence[OffloadKey],
        offered: list[OffloadKey],
        to_store: list[OffloadKey],
        ready: list[OffloadKey],
        pending: bool,
    ) -> None:
        """Record a request's offer: new store misses go to the policy, a
        ``touch_before_store`` policy gets the request's touch, and the keys used (the
        ones to store and the ready ones, in the order offered) join the request's log."""
        if self._observe_misses and to_store:
            missed = log.missed
            if missed is None:
                missed = log.missed = set()
            new = [key for key in to_store if key not in missed]
            if new:
                self._policy.on_store_miss(new)
                missed.update(new)
        if self._touch_before_store and not log.touched:
            log.touched = True
            loaded = [key for seen, reused, _ in log.calls for key in reused]
            touched = loaded + list(keys) if loaded else keys
            if self._policy.observes_requests:
                self._policy.on_request(_whole_request(log, touched))
            self._policy.touch(touched)
        if pending or len(to_store) != len(offered):
            used = set(to_store)
            used.update(ready)
            seen = tuple(key for key in keys if key in used)
        else:
            seen = tuple(keys)
        log.calls.append((seen, ready, ()))
        if self._ranked:
            self._accessed(log, seen)

    def _record_offers(self, offered: list[OffloadKey], admitted: list[OffloadKey]) -> None:
        """Count this call's offers (held back: by the policy, the threshold or the
        filter) in the tracker, or tell the admission filter."""
        self._store_skipped += len(offered) - len(admitted)
        if self._offers is not None:
            self._offers.record(offered, admitted)
        elif self._admission is not None and offered:
            self._admission.record(offered, admitted)

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, success: bool = True
    ) -> None:
        """Finish stores: on success the blocks become loadable and one stored event goes
        out; on failure their slots are freed and nothing is published. Keys that are not
        pending (already ready, or unknown) are ignored."""
        found = list(map(self._policy.get, keys))
        blocks: list[BlockStatus]
        if (
            None in found
            or (found and max(map(_ref_cnt, found)) >= 0)
            or len(set(keys)) != len(keys)
        ):
            # Some keys are not pending (unknown, already ready, listed twice): one by one.
            done = []
            blocks = []
            taken: set[OffloadKey] = set()
            for key, block in zip(keys, found):
                if block is not None and block.ref_cnt < 0 and key not in taken:
                    taken.add(key)
                    done.append(key)
                    blocks.append(block)
        else:
            done = keys if isinstance(keys, list) else list(keys)
            blocks = cast(list[BlockStatus], found)
        if success:
            for block in blocks:
                block.ref_cnt = 0
        else:
            remove, free_list = self._policy.remove, self._free_list
            for key, block in zip(done, blocks):
                remove(key)
                free_list.append(block.block_id)
            self.tenants.removed(done)
        self._num_pending -= len(done)
        if success:
            self._num_ready += len(done)
            self._num_idle += len(done)
            self._stored += len(done)
            self._emit(done, removed=False, tokens=ctx.tokens if ctx is not None else None)
        else:
            self._store_failed += len(done)
        self.pins.stored(done, success)

    # --- requests (request_scoped) --------------------------------------------------------

    def _new_log(self, ctx: ReqContext) -> _RequestLog:
        positions = getattr(ctx, "_offload_key_positions", None)
        return _RequestLog(RequestScope(positions) if self._ranked else None, positions)

    def _request(self, ctx: ReqContext) -> _RequestLog:
        requests = self._requests
        assert requests is not None
        log = requests.get(ctx.req_id)
        if log is None:
            log = requests[ctx.req_id] = self._new_log(ctx)
        return log

    def on_new_request(self, ctx: ReqContext) -> None:
        """A request starts (request-scoped managers; otherwise nothing to do)."""
        if self._requests is not None:
            self._requests[ctx.req_id] = self._new_log(ctx)

    def on_request_finished(
        self, ctx: ReqContext, positions: Mapping[OffloadKey, int] | None = None
    ) -> None:
        """A request ended: the policy learns which blocks it used (request-scoped
        managers; otherwise nothing to do). ``positions`` maps keys to their end token
        in the request, where known, to order its blocks as vLLM does. Completions of
        its transfers may still follow. Unknown or already finished requests are
        ignored."""
        requests = self._requests
        if requests is None:
            return
        log = requests.pop(ctx.req_id, None)
        if log is None or not log.calls:
            return
        policy = self._policy
        if self._touch_before_store:
            if not log.touched:
                touched = [key for seen, _, _ in log.calls for key in seen]
                if policy.observes_requests:
                    policy.on_request(_whole_request(log, touched))
                policy.touch(touched)
            return
        seen_order, inserted, reused = _fold(log)
        if not seen_order:
            return
        key_groups = _group_keys(list(seen_order), positions)
        policy.on_request_finished(
            key_groups, inserted - reused if reused else inserted, reused, positions
        )

    def take_events(self) -> list[OffloadingEvent]:
        self.pins.expire()
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def reset_cache(self, force: bool = False) -> None:
        """Drop every block; ready blocks are reported in one removed event.

        Refused (``RuntimeError``, nothing changed) while a store or a load is in flight:
        a later ``complete_store`` could not tell the old store from a new one of the same
        key, and a load would read a slot that may be handed out again. Wait for the
        transfers first, or pass ``force=True`` when the caller guarantees that no
        completion of an earlier transfer will reach this manager and that its copies
        are fenced before the slots are written again (vLLM's scheduler does both).
        Counters (:meth:`stats`) are kept; requests in progress start afresh.
        """
        pinned = self._num_ready - self._num_idle
        if (self._num_pending or pinned) and not force:
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
        if self._requests is not None:
            self._requests.clear()
        self._walks.clear()
        self.pins.clear()
        self.tenants.clear()
        self._reset_slots()
        self._emit(removed, removed=True)


def _pin_event(manager: CPUOffloadingManager, keys: list[OffloadKey], change: str) -> None:
    """Publish a pin change of ``manager``'s blocks (``retention``: ``change``); an
    ``event_sink`` takes stores and removals only, so none goes there."""
    events = manager._events
    if events is not None and manager._event_sink is None and keys:
        manager._seq += 1
        events.append(
            OffloadingEvent(
                tuple(keys), manager.medium, False, manager._seq, time.time(), retention=change
            )
        )


def _fold(
    log: _RequestLog,
) -> tuple[dict[OffloadKey, None], set[OffloadKey], set[OffloadKey]]:
    """What a finished request did: the keys it used (first use first), those it
    inserted, and those it found ready (before inserting them itself)."""
    seen_order: dict[OffloadKey, None] = {}
    inserted: set[OffloadKey] = set()
    reused: set[OffloadKey] = set()
    for seen, ready, stored in log.calls:
        seen_order.update(dict.fromkeys(seen))
        if ready:
            if inserted:
                reused.update(key for key in ready if key not in inserted)
            else:
                reused.update(ready)
        if stored:
            inserted.update(stored)
    return seen_order, inserted, reused
