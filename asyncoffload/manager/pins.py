"""Retention pins and classes of one tier's blocks, within a budget.

Every tier's index (:class:`~asyncoffload.manager.CPUOffloadingManager`, and each lower
tier's ``TierManager``) keeps a :class:`PinTable`. A request whose context carries a
:class:`~asyncoffload.manager.retention.Retention` with a ``ttl_s``:

- pins the blocks it stores, from the end of their store (``complete_store``), for
  ``ttl_s`` seconds;
- pins, or refreshes the pin of, the blocks it hits (``lookup_prefix``'s ready prefix,
  ``prepare_load``, ``touch``, and the keys of a store that are there already).

A hit of any request refreshes a pinned block for its own ``ttl_s``: a pin lasts
``ttl_s`` from the block's last use. A pinned block is never evicted; once its pin
expires it is an ordinary block again (an ``"expired"`` event). Expiry is lazy but
never late for an eviction: each eviction, hit, ``take_events`` and ``stats`` first
expires what is due on the table's clock (``time.monotonic`` unless given; the tier
core gives its lower tiers' tables the time its drivers hand it, and expires them at
its deadlines). The module reads no clock itself: the tier core imports it.

**The budget.** At most ``floor(pin_budget * num_blocks)`` blocks are pinned at once
(``pin_budget`` in (0, 1]). A pin past it is refused, block by block in the order
given (a prompt's head first), and counted (``refused``); the block is stored all the
same, unpinned. Refreshes never count against it.

**Classes.** A hint's ``retention_class`` ranks the blocks it stores (blocks of no
hinted request are ``"normal"``), and raises the class of those it hits (a hit never
lowers one). Among the idle, unpinned blocks an eviction may take, ``"low"`` ones go
first (oldest ranked first), then ``"normal"`` ones in the policy's own order, then
``"high"`` ones in the policy's order: the policy's ``evict`` with the higher classes
protected, and ``remove`` for the low ones, so every registered policy honours it.
A tenant over its quota (:mod:`~asyncoffload.manager.quotas`) evicts among its own
blocks by the same rules (:meth:`PinTable.evict_among`).

**Tiers.** The tier core gives each lower tier's table the CPU tier's as ``upstream``:
a block pinned above stays pinned below until its pin above ends (the engine's loads
hit the CPU tier alone), and a promotion refreshes the pin where it reads.

**Events.** New pins publish a ``"pinned"`` event, expiry an ``"expired"`` one and
:meth:`PinTable.release` an ``"unpinned"`` one (an ``OffloadingEvent`` whose
``retention`` names the change; ``removed`` is False and the blocks stay stored). A
pinned block that leaves its tier otherwise (a failed read's drop, ``reset_cache``)
is said by its removed event.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus, ReqContext
from asyncoffload.manager.retention import (
    DEFAULT_PIN_BUDGET,
    NORMAL,
    RETENTION_CLASSES,
    Retention,
    check_pin_budget,
)

__all__ = ["PinStats", "PinTable", "carry_pins", "expire_pins", "hold_below"]

#: Called with (keys, change) for each pin event: "pinned", "expired" or "unpinned".
PinSink = Callable[[list[OffloadKey], str], None]
_Victims = list[tuple[OffloadKey, BlockStatus]]


class _Policy(Protocol):
    """What eviction asks of a tier's ``CachePolicy`` (not imported: the tier core
    imports this module, and the policies reach native code)."""

    def get(self, key: OffloadKey) -> BlockStatus | None: ...

    def remove(self, key: OffloadKey) -> None: ...

    def insert_many(self, items: _Victims) -> None: ...

    def evict(self, n: int, protected: Collection[OffloadKey]) -> _Victims | None: ...


class _Either(Collection[OffloadKey]):
    """Keys in ``first`` or in ``second``, for membership tests (what a policy's
    ``evict`` asks of its ``protected``)."""

    __slots__ = ("first", "second")

    def __init__(self, first: Collection[OffloadKey], second: Collection[OffloadKey]) -> None:
        self.first, self.second = first, second

    def __contains__(self, key: object) -> bool:
        return key in self.first or key in self.second

    def __iter__(self) -> Iterator[OffloadKey]:  # pragma: no cover - policies test membership
        return iter({*self.first, *self.second})

    def __len__(self) -> int:  # pragma: no cover
        return len({*self.first, *self.second})


class PinStats(NamedTuple):
    """A tier's pins now and what they did since its creation (blocks)."""

    #: Blocks pinned now, and the most the budget allows at once.
    pinned: int
    limit: int
    #: New pins, refreshes of held ones, pins refused by the budget, pins that
    #: expired, and pins let go before their expiry (:meth:`PinTable.release`, or the
    #: block left its tier).
    pins: int
    refreshed: int
    refused: int
    expired: int
    released: int
    #: Blocks ranked above and below ``"normal"`` now.
    high: int
    low: int


class PinTable:
    """The pins and classes of one tier of ``num_blocks`` slots (module docstring).

    ``get`` is the tier policy's ``get``; ``emit`` publishes pin events; ``clock`` gives
    the time (seconds, monotonic). ``pin_budget`` outside (0, 1] is a ``ValueError``
    naming ``setting``."""

    def __init__(
        self,
        num_blocks: int,
        get: Callable[[OffloadKey], BlockStatus | None],
        pin_budget: float = DEFAULT_PIN_BUDGET,
        *,
        clock: Callable[[], float],
        emit: PinSink | None = None,
        setting: str = "pin_budget",
    ) -> None:
        self.budget = check_pin_budget(pin_budget, setting)
        #: The most blocks pinned at once.
        self.limit = int(self.budget * num_blocks)
        self.clock = clock
        self._get = get
        self.emit = emit
        #: Pinned keys: (expiry, ttl).
        self._pins: dict[OffloadKey, tuple[float, float]] = {}
        #: (expiry, key) of every pin set or refreshed; stale ones are skipped.
        self._heap: list[tuple[float, OffloadKey]] = []
        #: Keys being stored for a hinted request: pinned once their store ends.
        self._pending: dict[OffloadKey, Retention] = {}
        #: Ranks of the keys whose class is not "normal", oldest first.
        self._rank: dict[OffloadKey, int] = {}
        #: Hints of requests that cannot carry one on their context (vLLM's).
        self._requests: dict[str, Retention] = {}
        self._counts = [0, 0, 0, 0, 0]  # pins, refreshed, refused, expired, released
        #: The table of the tier above (the CPU tier's, for a lower tier's): a block it
        #: still pins keeps its pin here too (hits there refresh only that tier's).
        self.upstream: PinTable | None = None
        #: The request (its context's or hint's id) whose refusals were counted last,
        #: and those keys: a block is refused once per request, not once per call.
        self._refusals: tuple[int, set[OffloadKey]] = (0, set())

    def __bool__(self) -> bool:
        """Whether anything is pinned, ranked or waiting to be."""
        return bool(self._pins or self._rank or self._pending)

    def __contains__(self, key: object) -> bool:
        return key in self._pins

    # --- hints ---------------------------------------------------------------------

    def hint(self, req_id: str, retention: Retention | None) -> None:
        """Hold ``retention`` for request ``req_id`` until :meth:`forget_request` (for a
        caller whose contexts cannot carry it); ``None`` forgets it."""
        if retention is None:
            self._requests.pop(req_id, None)
        else:
            self._requests[req_id] = retention

    def forget_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def retention_of(self, ctx: ReqContext | None) -> Retention | None:
        """The hint of ``ctx``: its ``retention``, else one held for its request."""
        if ctx is None:
            return None
        hint: Retention | None = getattr(ctx, "retention", None)
        if hint is None and self._requests:
            hint = self._requests.get(getattr(ctx, "req_id", ""))
        return hint

    def retention_of_key(self, key: OffloadKey) -> Retention | None:
        """What holds ``key`` here, as a hint for another tier (its pin's ttl and its
        class), or ``None``."""
        pin = self._pins.get(key)
        rank = self._rank.get(key, NORMAL)
        if pin is None and rank == NORMAL:
            return None
        return Retention(None if pin is None else pin[1], RETENTION_CLASSES[rank])

    def expect(self, keys: Iterable[OffloadKey], retention: Retention) -> None:
        """``keys`` are being stored for a hinted request: :meth:`stored` pins them."""
        pending = self._pending
        for key in keys:
            pending.setdefault(key, retention)

    # --- the manager's hooks -------------------------------------------------------

    def offer(
        self, keys: Sequence[OffloadKey], to_store: Sequence[OffloadKey], ctx: ReqContext | None
    ) -> None:
        """``prepare_store(keys, ctx)`` took slots for ``to_store``: a hinted request's
        are pinned when stored, and the keys there already count as hits."""
        hint = self.retention_of(ctx)
        if hint is None:
            return
        self.expect(to_store, hint)
        if len(to_store) < len(keys):
            taken = set(to_store)
            self.hit([key for key in keys if key not in taken], retention=hint)

    def stored(self, keys: Sequence[OffloadKey], success: bool) -> None:
        """``complete_store(keys)`` ended: the hinted keys among them are pinned and
        ranked (on success), and no longer pending."""
        pending = self._pending
        if not pending:
            return
        done: dict[Retention, list[OffloadKey]] = {}
        for key in keys:
            hint = pending.pop(key, None)
            if hint is not None:
                done.setdefault(hint, []).append(key)
        if success:
            for hint, group in done.items():
                self.hit(group, retention=hint, fresh=True)

    def hit(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext | None = None,
        *,
        retention: Retention | None = None,
        fresh: bool = False,
    ) -> None:
        """``keys`` were used (by ``ctx``'s request, or one hinted ``retention``):
        pinned ones are refreshed; with a hint, ready ones are pinned (within the
        budget) and ranked (``fresh``: just stored, the hint's class; else the higher of
        theirs and the hint's)."""
        hint = retention if retention is not None else self.retention_of(ctx)
        pins = self._pins
        if hint is None and not pins:
            return
        now = self.clock()
        if self._heap:
            self.expire(now)
        refreshed = 0
        ttl = hint.ttl_s if hint is not None else None
        new: list[OffloadKey] = []
        get = self._get
        for key in keys:
            pin = pins.get(key)
            if pin is not None:
                span = pin[1] if ttl is None or ttl < pin[1] else ttl
                until = now + span
                pins[key] = (until, span)
                heapq.heappush(self._heap, (until, key))
                refreshed += 1
            if hint is None:
                continue
            block = get(key)
            if block is None or block.ref_cnt < 0:
                continue
            if pin is None and ttl is not None:
                new.append(key)
            self._set_rank(key, hint.rank, fresh)
        self._counts[1] += refreshed
        if new and ttl is not None:
            self._pin(new, ttl, now, id(ctx) if ctx is not None else id(hint))
        if len(self._heap) > 2 * len(pins) + 1024:
            self._compact()

    def _set_rank(self, key: OffloadKey, rank: int, fresh: bool) -> None:
        """A block's class: its storer's (``fresh``), raised by hinted hits."""
        ranks = self._rank
        if not fresh:
            rank = max(rank, ranks.get(key, NORMAL))
        if rank == NORMAL:
            ranks.pop(key, None)
        else:
            ranks[key] = rank

    def _pin(self, keys: list[OffloadKey], ttl: float, now: float, request: int) -> None:
        room = self.limit - len(self._pins)
        take = keys if room >= len(keys) else keys[: max(room, 0)]
        if len(take) < len(keys):
            token, counted = self._refusals
            if token != request:
                counted = set()
                self._refusals = (request, counted)
            refused = [key for key in keys[len(take) :] if key not in counted]
            counted.update(refused)
            self._counts[2] += len(refused)
        if not take:
            return
        until = now + ttl
        pins, heap = self._pins, self._heap
        for key in take:
            pins[key] = (until, ttl)
            heapq.heappush(heap, (until, key))
        self._counts[0] += len(take)
        self._publish(take, "pinned")

    def expire(self, now: float | None = None) -> list[OffloadKey]:
        """Let go of the pins due at ``now`` (the clock's time if ``None``): one
        ``"expired"`` event; the keys."""
        heap = self._heap
        if not heap:
            return []
        if now is None:
            now = self.clock()
        if heap[0][0] > now:
            return []
        pins = self._pins
        above = self.upstream._pins if self.upstream is not None else {}
        gone: list[OffloadKey] = []
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            pin = pins.get(key)
            if pin is not None and pin[0] == until:
                held = above.get(key)
                if held is not None and held[0] > now:  # pinned above: held here too
                    pins[key] = (held[0], pin[1])
                    heapq.heappush(heap, (held[0], key))
                    continue
                del pins[key]
                gone.append(key)
        if gone:
            self._counts[3] += len(gone)
            self._publish(gone, "expired")
        return gone

    def next_expiry(self) -> float | None:
        """When the next pin expires (None: none is held)."""
        heap, pins = self._heap, self._pins
        while heap:
            until, key = heap[0]
            pin = pins.get(key)
            if pin is not None and pin[0] == until:
                return until
            heapq.heappop(heap)
        return None

    def release(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Unpin ``keys`` now (those not pinned are ignored): one ``"unpinned"`` event;
        the keys unpinned. They stay stored, ordinary blocks again."""
        pins = self._pins
        gone = [key for key in dict.fromkeys(keys) if pins.pop(key, None) is not None]
        if gone:
            self._counts[4] += len(gone)
            self._publish(gone, "unpinned")
        return gone

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """``keys`` left the tier (a removed event says so): no pin, class or pending
        pin of theirs remains."""
        pins, ranks, pending = self._pins, self._rank, self._pending
        released = 0
        for key in keys:
            if pins.pop(key, None) is not None:
                released += 1
            ranks.pop(key, None)
            pending.pop(key, None)
        self._counts[4] += released

    def clear(self) -> None:
        """Every block left (``reset_cache``); hints of requests are kept."""
        self._counts[4] += len(self._pins)
        self._pins.clear()
        self._heap.clear()
        self._rank.clear()
        self._pending.clear()

    def _compact(self) -> None:
        self._heap = [(until, key) for key, (until, _) in self._pins.items()]
        heapq.heapify(self._heap)

    def _publish(self, keys: list[OffloadKey], change: str) -> None:
        if self.emit is not None:
            self.emit(keys, change)

    # --- eviction ------------------------------------------------------------------

    def evict(
        self, policy: _Policy, n: int, protect: Collection[OffloadKey], num_idle: int
    ) -> _Victims | None:
        """``n`` victims for the manager (``num_idle``: its idle ready blocks), never a
        pinned one nor one of ``protect``: low-class ones first, then normal ones,
        then high ones, each class in its own order; ``None``, changing nothing, when
        too few idle blocks are free to go."""
        if self._heap:
            self.expire()
        pins, ranks = self._pins, self._rank
        if not pins and not ranks:
            return policy.evict(n, set(protect))
        base = set(protect)
        base.update(pins)
        get = policy.get

        def idle(key: OffloadKey) -> bool:
            block = get(key)
            return block is not None and block.ref_cnt == 0

        free = num_idle - sum(map(idle, base))
        if free < n:
            return None
        if not ranks:
            return policy.evict(n, base)
        lows = [k for k, r in ranks.items() if r < NORMAL and k not in base and idle(k)]
        highs = {k for k, r in ranks.items() if r > NORMAL and k not in base and idle(k)}
        victims: _Victims = []
        for key in lows[:n]:
            block = get(key)
            assert block is not None
            policy.remove(key)
            victims.append((key, block))
        rest = n - len(victims)
        normal = min(rest, free - len(lows) - len(highs))
        for count, guard in ((normal, base | highs), (rest - normal, base)):
            if count <= 0:
                continue
            got = policy.evict(count, guard)
            if got is None:  # a policy that broke its contract: put the others back
                policy.insert_many(victims)
                return None
            victims += got
        for key, _ in victims:
            ranks.pop(key, None)
        return victims

    def evict_among(
        self,
        policy: _Policy,
        n: int,
        guard: Collection[OffloadKey],
        among: Callable[[], Iterable[OffloadKey]],
        partial: bool,
    ) -> _Victims | None:
        """``n`` victims for a tenant's quota: idle blocks outside ``guard`` (tested for
        membership only: every block but the tenant's own, and the call's), never a
        pinned one; low-class ones first, then normal ones, then high ones, each class
        in its own order. ``among`` lists the tenant's keys, scanned only when the
        policy's pick falls short. ``partial``: as many as there are (maybe none), else
        all ``n`` or ``None``; ``None`` changes nothing."""
        if self._heap:
            self.expire()
        pins, ranks = self._pins, self._rank
        skip: Collection[OffloadKey] = _Either(guard, pins) if pins else guard
        get = policy.get

        def idle(key: OffloadKey) -> bool:
            block = get(key)
            return block is not None and block.ref_cnt == 0

        lows = [k for k, r in ranks.items() if r < NORMAL and k not in skip and idle(k)]
        highs = {k for k, r in ranks.items() if r > NORMAL and k not in skip and idle(k)}
        take = lows[:n]
        rest = n - len(take)
        normal = _Either(skip, highs.union(lows)) if lows or highs else skip
        got = policy.evict(rest, normal) if rest > 0 else []
        if got is None:  # fewer normal blocks than ``rest``: count them
            normals = min(rest, sum(1 for key in among() if key not in normal and idle(key)))
            if not partial and len(take) + normals + len(highs) < n:
                return None
            got = policy.evict(normals, normal) if normals else []
            more = min(rest - normals, len(highs))
            if got is not None and more:  # the rest from the high ones (lows: in take)
                high = policy.evict(more, _Either(skip, set(lows)))
                if high is None:  # a policy that broke its contract: put the others back
                    policy.insert_many(got)
                    return None
                got += high
            if got is None:
                return None
        victims: _Victims = []
        for key in take:
            block = get(key)
            assert block is not None
            policy.remove(key)
            victims.append((key, block))
        victims += got
        for key, _ in victims:
            ranks.pop(key, None)
        return victims

    def stats(self) -> PinStats:
        if self._heap:
            self.expire()
        ranks = list(self._rank.values())
        high = sum(1 for r in ranks if r > NORMAL)
        pins, refreshed, refused, expired, released = self._counts
        return PinStats(
            len(self._pins),
            self.limit,
            pins,
            refreshed,
            refused,
            expired,
            released,
            high,
            len(ranks) - high,
        )


def carry_pins(src: object, dst: object, keys: Iterable[OffloadKey]) -> None:
    """The pins and classes ``src``'s tier holds for ``keys`` also hold them in ``dst``'s
    tier once their store there ends (a write-through, a promotion): each index's
    ``pins``, where it has one."""
    source: PinTable | None = getattr(src, "pins", None)
    target: PinTable | None = getattr(dst, "pins", None)
    if source is None or target is None or not source:
        return
    of = source.retention_of_key
    pending = target._pending
    for key in keys:
        if key not in pending:
            hint = of(key)
            if hint is not None:
                pending[key] = hint


def hold_below(cpu: object, indices: Iterable[object]) -> None:
    """The tables of ``indices`` (lower tiers) keep a pin while ``cpu``'s table (the
    CPU tier's, where it has one) still pins the block (:attr:`PinTable.upstream`)."""
    above: PinTable | None = getattr(cpu, "pins", None)
    for index in indices:
        table: PinTable | None = getattr(index, "pins", None)
        if table is not None:
            table.upstream = above


def expire_pins(indices: Iterable[object], now: float) -> None:
    """Let go of the pins due at ``now`` in each of ``indices``' tables."""
    for index in indices:
        table: PinTable | None = getattr(index, "pins", None)
        if table is not None:
            table.expire(now)
