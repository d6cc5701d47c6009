"""S3-FIFO eviction (Yang et al., SOSP'23).

Three FIFO queues, oldest first: a small queue S (target: 10% of the capacity, at least
one block), a main queue M, and a ghost queue G of keys recently evicted from S (no data;
as many keys as M's share of the capacity, at least one). Every block has a saturating
access count (0 to 3). New blocks enter S, or M when their key is in G (leaving G). A
touch only bumps the counts: nothing moves on a hit, so touch order is irrelevant (a
FIFO policy has no "most recently used").

Each victim comes from S while ``|S|`` is at its target, else from M:

- S, from its oldest block: a block accessed since insertion (count > 0) moves to M,
  keeping its count; the first one not accessed is evicted, its key entering G.
- M, a CLOCK: the oldest block, if its count is > 0, goes back as the newest with the
  count decremented; the first one found at 0 is evicted (no ghost).

M has no bound of its own: the tier's slot count bounds ``|S| + |M|``. If the queue
picked has no evictable block, the other one gives the victim (S may first have to
promote its accessed blocks to M, which then gives it).

Skip rule: a block that may not be evicted (``ref_cnt != 0``: being stored or loaded,
or a key in ``protected``) is passed over unchanged when a scan reaches it: it moves
from the oldest to the newest end of its own queue, keeping its count; it is neither
promoted, decremented nor evicted. A scan over a queue with no evictable block is thus a
full rotation, which leaves the queue as it was. A touch of a block whose store is in
flight is not a use (as in ARC): the request that stores a block also touches it.

All or nothing: ``evict`` first checks, reading only, that ``n`` blocks are evictable;
given that, the scans above always find ``n`` victims.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Sequence
from itertools import chain

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, register_policy

__all__ = ["S3FIFOPolicy"]

MAX_FREQ = 3

_Victim = tuple[OffloadKey, BlockStatus]


@register_policy("s3fifo")
class S3FIFOPolicy(CachePolicy):
    """S3-FIFO; ``items()`` yields S then M, each oldest first.

    The queues hold keys (deques: O(1) at both ends); ``blocks`` maps every tracked key
    to its block and ``freq`` holds the counts above 0. ``remove`` (a failed store) scans
    a deque, S first, where blocks in flight usually are.
    """

    touch_before_store = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small_capacity = max(1, capacity // 10)
        self.ghost_capacity = max(1, capacity - self.small_capacity)
        self.small: deque[OffloadKey] = deque()
        self.main: deque[OffloadKey] = deque()
        self.ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self.blocks: dict[OffloadKey, BlockStatus] = {}
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]
        #: Access counts; a tracked key absent here counts 0.
        self.freq: dict[OffloadKey, int] = {}

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        ghost = self.ghost
        if key in ghost:
            del ghost[key]
            self.main.append(key)
        else:
            self.small.append(key)
        self.blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        if self.blocks.pop(key, None) is None:
            return
        try:
            self.small.remove(key)
        except ValueError:
            self.main.remove(key)
        self.freq.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Count one use of each tracked ready key; order-free. A key listed twice
        counts twice, as in two calls (callers list a request's keys once each)."""
        freq, blocks = self.freq, self.blocks
        for key in keys:
            count = freq.get(key, 0)
            if count == 0:
                block = blocks.get(key)
                # Untracked, or its store is in flight. (A count > 0 implies neither.)
                if block is None or block.ref_cnt < 0:
                    continue
                freq[key] = 1
            elif count < MAX_FREQ:
                freq[key] = count + 1

    def _from_small(
        self, need: int, protected: Collection[OffloadKey], victims: list[_Victim], to_target: bool
    ) -> bool:
        """Victims from S until there are ``need`` (with ``to_target``, only while ``|S|``
        is at its target when a victim is sought), each found within one pass over S.
        ``False`` when a pass finds none: S holds no evictable block any more."""
        small, blocks, freq, ghost = self.small, self.blocks, self.freq, self.ghost
        popleft, pass_over, promote = small.popleft, small.append, self.main.append
        target = self.small_capacity if to_target else 0
        found, size = len(victims), len(small)
        while found < need and size >= target:
            skipped = 0  # blocks passed over in this pass: all of S once it equals ``size``
            while True:
                if skipped == size:
                    return False
                key = popleft()
                block = blocks[key]
                if block.ref_cnt or key in protected:
                    pass_over(key)
                    skipped += 1
                elif key in freq:
                    promote(key)  # accessed in S: to M, with its count
                    size -= 1
                else:
                    del blocks[key]
                    ghost[key] = None
                    victims.append((key, block))
                    found += 1
                    size -= 1
                    break
        return True

    def _from_main(
        self, need: int, protected: Collection[OffloadKey], victims: list[_Victim]
    ) -> bool:
        """Victims from M's CLOCK until there are ``need``. ``False`` when M holds no
        evictable block: a full round passed over every block, leaving M as it was."""
        main, blocks, freq = self.main, self.blocks, self.freq
        popleft, reinsert = main.popleft, main.append
        found, size = len(victims), len(main)
        skipped = 0  # consecutive blocks passed over; all of M once it equals ``size``
        while found < need:
            if skipped == size:
                return False
            key = popleft()
            block = blocks[key]
            if block.ref_cnt or key in protected:
                reinsert(key)
                skipped += 1
                continue
            skipped = 0
            count = freq.pop(key, 0)
            if count:
                if count > 1:
                    freq[key] = count - 1
                reinsert(key)
            else:
                del blocks[key]
                victims.append((key, block))
                found += 1
                size -= 1
        return True

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """``n`` victims, or ``None`` and nothing changed when fewer are evictable."""
        if n <= 0:
            return []
        small, blocks, freq = self.small, self.blocks, self.freq
        # One read-only scan, oldest first. All or nothing: n blocks must be evictable
        # before anything moves. And if S stays at its target for all n victims and its n
        # oldest blocks are evictable and unaccessed, they are the victims.
        simple = len(small) - n >= self.small_capacity - 1
        idle = 0
        for key in chain(small, self.main):
            if blocks[key].ref_cnt or key in protected:
                simple = False
            else:
                if simple and key in freq:
                    simple = False
                idle += 1
                if idle == n:
                    break
        else:
            return None
        victims: list[_Victim] = []
        if simple:
            popleft, ghost = small.popleft, self.ghost
            for _ in range(n):
                key = popleft()
                victims.append((key, blocks.pop(key)))
                ghost[key] = None
        else:
            self._evict_any(n, protected, victims)
        ghost = self.ghost
        for _ in range(len(ghost) - self.ghost_capacity):
            ghost.popitem(last=False)
        return victims

    def _evict_any(self, n: int, protected: Collection[OffloadKey], victims: list[_Victim]) -> None:
        """Append victims up to ``n``, knowing there are enough evictable blocks.

        Each one comes from the first of S (only while ``|S|`` is at its target), M, S,
        M to give one. A queue found without an evictable block is not scanned again in
        this call (the scan would be a full rotation, changing nothing), unless S has
        promoted blocks to M since."""
        main = self.main
        small_dry = main_dry = False
        while len(victims) < n:
            if not small_dry and len(self.small) >= self.small_capacity:
                if self._from_small(n, protected, victims, to_target=True):
                    continue  # n victims, or S is below its target now
                small_dry = True
            if not main_dry:
                if self._from_main(n, protected, victims):
                    continue
                main_dry = True
            if not small_dry:
                promoted_from = len(main)
                found = self._from_small(len(victims) + 1, protected, victims, to_target=False)
                if len(main) != promoted_from:
                    main_dry = False
                if found:
                    continue
                small_dry = True
            # S had no victim but promoted its accessed blocks: M has one now.
            found = self._from_main(len(victims) + 1, protected, victims)
            assert found, "at least n evictable blocks"

    def clear(self) -> None:
        self.small.clear()
        self.main.clear()
        self.ghost.clear()
        self.blocks.clear()
        self.freq.clear()

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """S then M, each from its oldest block (the next one its scan reaches)."""
        blocks = self.blocks
        for key in self.small:
            yield key, blocks[key]
        for key in self.main:
            yield key, blocks[key]

    def __len__(self) -> int:
        return len(self.blocks)
