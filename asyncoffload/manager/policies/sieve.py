"""SIEVE eviction (Zhang et al., NSDI'24).

One FIFO queue, oldest (tail) to newest (head), with a visited bit per block and a hand.
New blocks enter at the head and a touch only sets the visited bit: nothing ever moves
on a hit. To evict, the hand walks from where it stopped towards the head, wrapping to
the tail: a visited block has its bit cleared and is kept, an unvisited one is evicted,
and the hand stops just past the last victim.

The queue is stored in two halves split at the hand, ``behind`` (blocks the hand has
passed in this sweep) and ``ahead`` (the hand's block first), so the queue is
``behind + ahead`` and every step of the hand is O(1). Wrapping swaps the two. Whenever
``ahead`` runs empty the hand wraps at once, so it always rests on a block if any exists.

Blocks that may not be evicted (``ref_cnt != 0``: being stored or loaded, or a key in
``protected``) are passed over by the hand unchanged: they stay where they are in the
queue and keep their visited bit. A touch of a block whose store is still in flight is
not a use (as in ARC): it sets no bit, since the request storing a block touches it.
Touch order is irrelevant here, as a hit never reorders the queue (a FIFO policy has no
"most recently used").

All or nothing: ``evict`` first checks, reading only, that ``n`` blocks are evictable;
given that, the hand finds ``n`` victims within two sweeps (the first clears every bit).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator, Sequence
from itertools import chain

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, register_policy

__all__ = ["SIEVEPolicy"]


@register_policy("sieve")
class SIEVEPolicy(CachePolicy):
    """SIEVE; ``items()`` yields the queue oldest first.

    The two halves of the queue are deques of keys (O(1) at both ends); ``blocks`` maps
    every tracked key to its block. ``remove`` (a failed store) scans a deque.
    """

    touch_before_store = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        #: Passed by the hand in this sweep, oldest first.
        self.behind: deque[OffloadKey] = deque()
        #: From the hand's block to the newest; empty only when ``behind`` is too.
        self.ahead: deque[OffloadKey] = deque()
        self.blocks: dict[OffloadKey, BlockStatus] = {}
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]
        #: Keys of the tracked blocks whose visited bit is set.
        self.visited: set[OffloadKey] = set()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.blocks[key] = block
        self.ahead.append(key)  # the head: ``ahead`` is nonempty whenever anything is

    def remove(self, key: OffloadKey) -> None:
        if self.blocks.pop(key, None) is None:
            return
        self.visited.discard(key)
        try:
            self.ahead.remove(key)
        except ValueError:
            self.behind.remove(key)
        if not self.ahead:
            self.ahead, self.behind = self.behind, self.ahead

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        visited, blocks = self.visited, self.blocks
        for key in keys:
            if key not in visited:
                block = blocks.get(key)
                if block is not None and block.ref_cnt >= 0:
                    visited.add(key)

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        ahead, behind, blocks, visited = self.ahead, self.behind, self.blocks, self.visited
        # All or nothing: first make sure n blocks may be evicted, without moving the hand.
        idle = 0
        for key in chain(ahead, behind):
            if not blocks[key].ref_cnt and key not in protected:
                idle += 1
                if idle == n:
                    break
        else:
            return None
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        while True:
            key = ahead.popleft()
            block = blocks[key]
            if block.ref_cnt or key in protected:
                behind.append(key)  # passed over, bit kept
            elif key in visited:
                visited.remove(key)
                behind.append(key)
            else:
                del blocks[key]
                victims.append((key, block))
                if len(victims) == n:
                    break
            if not ahead:  # past the head: wrap to the tail
                ahead, behind = behind, ahead
        if not ahead:
            ahead, behind = behind, ahead
        self.ahead, self.behind = ahead, behind
        return victims

    def clear(self) -> None:
        self.behind.clear()
        self.ahead.clear()
        self.blocks.clear()
        self.visited.clear()

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Oldest (tail) to newest (head); the hand rests on the first block of ``ahead``."""
        blocks = self.blocks
        for key in self.behind:
            yield key, blocks[key]
        for key in self.ahead:
            yield key, blocks[key]

    def __len__(self) -> int:
        return len(self.blocks)
