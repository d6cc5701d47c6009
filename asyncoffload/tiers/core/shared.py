"""The shared tiers' questions: which keys to ask a server about, what its answers (and
its silences) mean, and how long a "not there" is remembered.

Rules, for every driver:

- a key is asked about only if the tier's index does not know it, it is no longer than
  ``MAX_KEY_BYTES``, no "not there" of it is younger than ``miss_ttl_s`` and the tier is
  not down;
- a key every question of which ended without a tier holding it is remembered as a
  miss for ``miss_ttl_s`` (at most ``MISS_KEYS`` keys, the oldest forgotten first); so
  is a key whose read failed, gone from every index;
- a question that fails, or is not answered by its tier's deadline plus the grace,
  counts its keys ``lookup_failed`` and puts the tier down for ``miss_ttl_s``: it is
  not asked again until then, and the failure is logged at most once a ``LOG_EVERY_S``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from asyncoffload.keys import OffloadKey
from asyncoffload.tiers.core.requests import Exists, TierState
from asyncoffload.tiers.core.types import MAX_KEY_BYTES

__all__ = ["LOG_EVERY_S", "MISS_KEYS", "MISS_TTL_S", "Questions"]

log = logging.getLogger("asyncoffload")

#: Seconds a shared tier's "not there" (or a failed question) is remembered, and how
#: many such keys at most.
MISS_TTL_S = 2.0
MISS_KEYS = 65_536
#: A failed question is logged at most once this often (the others are counted).
LOG_EVERY_S = 60.0


class Questions:
    """What the shared ``tiers`` are asked and what their answers left behind.
    ``join(tier, keys, found)`` adds a tier's finds to its index (the hierarchy's);
    ``grace_s``: how long past its tier's deadline a question may stay unanswered."""

    def __init__(
        self,
        tiers: Sequence[TierState],
        join: Callable[[TierState, Sequence[OffloadKey], Sequence[bool]], list[OffloadKey]],
        skip: Callable[[TierState, str, int], None],
        grace_s: float,
    ) -> None:
        self.tiers = list(tiers)
        self._join = join
        self._skip = skip
        self.grace_s = grace_s
        self.miss_ttl_s = MISS_TTL_S
        #: Keys no shared tier holds, until when, oldest first.
        self.misses: OrderedDict[OffloadKey, float] = OrderedDict()
        #: Keys to ask about at the next ``take`` (a driver that batches: ``want``).
        self.queue: dict[OffloadKey, None] = {}
        #: Keys asked about (or queued): how many questions of them are still out.
        self.asking: dict[OffloadKey, int] = {}
        #: Keys of ``asking`` that some shared tier holds.
        self.found: set[OffloadKey] = set()
        #: Questions handed out and not answered.
        self.out: list[Exists] = []
        self._logged_at: float | None = None
        self._unlogged = 0
        self.closed = False

    # --- asking --------------------------------------------------------------------------

    def missed(self, key: OffloadKey, now: float) -> bool:
        """Whether a "not there" of ``key`` is younger than ``miss_ttl_s``."""
        misses = self.misses
        if not misses:
            return False
        until = misses.get(key)
        if until is None:
            return False
        if until > now:
            return True
        del misses[key]
        return False

    def want(self, key: OffloadKey, now: float, known: bool, blocked: str = "") -> bool:
        """``key`` is in no tier's CPU slot: queue it for the next questions. True (the
        key is pending) while it is asked about; False (a miss) if a tier knows it but
        cannot read it yet (``known``), if it is remembered as a miss, too long, if every
        shared tier is down, or if the driver cannot read anything now (``blocked``: that
        cause, counted once)."""
        if key in self.asking:
            return True
        if known or self.missed(key, now) or len(key) > MAX_KEY_BYTES or self.closed:
            return False
        if all(tier.down_until > now for tier in self.tiers):
            return False
        if blocked:
            self._skip(self.tiers[0], blocked, 1)
            return False
        self.queue[key] = None
        self.asking[key] = 0
        return True

    def take(self, now: float) -> list[Exists]:
        """The questions of the keys queued by :meth:`want`."""
        if not self.queue:
            return []
        keys = list(self.queue)
        self.queue.clear()
        return self._ask(keys, now, queued=True)

    def ask(self, keys: Sequence[OffloadKey], now: float) -> list[Exists]:
        """Questions about ``keys`` now, one per shared tier that is up, each of the keys
        its index does not know (and that are not remembered as misses)."""
        fresh = [k for k in dict.fromkeys(keys) if k not in self.asking and not self.missed(k, now)]
        for key in fresh:
            self.asking[key] = 0
        return self._ask(fresh, now, queued=False)

    def _ask(self, keys: list[OffloadKey], now: float, queued: bool) -> list[Exists]:
        asking = self.asking
        out: list[Exists] = []
        for tier in self.tiers:
            if tier.down_until > now or self.closed:
                continue
            block_of = tier.index.block_of
            unknown = [k for k in keys if block_of(k) is None and len(k) <= MAX_KEY_BYTES]
            tier.asked += len(unknown)
            if not unknown:
                continue
            q = Exists(tier, unknown, now + tier.deadline_s + self.grace_s)
            out.append(q)
            for key in unknown:
                asking[key] += 1
        for key in keys:
            if asking.get(key) == 0:  # no tier was asked
                del asking[key]
                # Known to a tier's index: not a miss (a lookup finds it there).
                if queued or not any(t.index.block_of(key) is not None for t in self.tiers):
                    self._settled(key, now)
        self.out += out
        return out

    # --- answers -------------------------------------------------------------------------

    def answered(
        self,
        q: Exists,
        found: Sequence[bool] | None,
        error: BaseException | None,
        now: float,
    ) -> list[OffloadKey]:
        """``q`` ended: ``found`` per key, or ``None`` with the ``error`` it failed with
        (a malformed answer counts as failed). Those found join the tier's index; the
        keys held are returned. A second hand-back changes nothing."""
        if q.settled:
            return []
        q.settled = True
        if q in self.out:
            self.out.remove(q)
        tier, keys = q.tier, q.keys
        hits: list[OffloadKey] = []
        if found is None or len(found) != len(keys):
            tier.down_until = now + self.miss_ttl_s
            self._skip(tier, "lookup_failed", len(keys))
            self._log_failure(tier, error, now)
        else:
            hits = self._join(tier, keys, found)
            self.found.update(hits)
        asking = self.asking
        for key in keys:
            left = asking.get(key, 0) - 1
            if left > 0:
                asking[key] = left
                continue
            asking.pop(key, None)
            self._settled(key, now)
        return hits

    def expire(self, now: float) -> list[Exists]:
        """Questions unanswered past their deadline: failed now (the driver drops them)."""
        late = [q for q in self.out if q.deadline <= now]
        for q in late:
            self.answered(q, None, TimeoutError("no answer within the tier's deadline"), now)
        return late

    def next_deadline(self) -> float | None:
        return min((q.deadline for q in self.out), default=None)

    def _settled(self, key: OffloadKey, now: float) -> None:
        """Every question of ``key`` ended: a miss to remember unless a tier had it."""
        if key in self.found:
            self.found.discard(key)
        else:
            self.remember_miss(key, now)

    def remember_miss(self, key: OffloadKey, now: float) -> None:
        misses = self.misses
        misses[key] = now + self.miss_ttl_s
        misses.move_to_end(key)
        if len(misses) > MISS_KEYS:
            misses.popitem(last=False)

    def _log_failure(self, tier: TierState, error: BaseException | None, now: float) -> None:
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f"; {self._unlogged} more failed since the last report" if self._unlogged else ""
        self._logged_at = now
        self._unlogged = 0
        log.warning(
            "shared tier %s did not answer a lookup (%s): its keys are misses, and it is "
            "not asked again for %.1fs%s",
            tier.name,
            repr(error) if error is not None else "a malformed answer",
            self.miss_ttl_s,
            more,
        )

    def close(self) -> list[Exists]:
        """Nothing more is asked; the questions still out (to drop) are returned."""
        self.closed = True
        out, self.out = self.out, []
        for q in out:
            q.settled = True
        self.queue.clear()
        self.asking.clear()
        self.found.clear()
        return out
