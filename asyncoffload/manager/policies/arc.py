"""Adaptive Replacement Cache (Megiddo & Modha), as vLLM's ARC decides.

T1 holds blocks used once since they were stored, T2 blocks used again; B1 / B2 remember
keys recently evicted from each (ghosts, no data). A use of a ghost (a touch, or under
vLLM's call pattern an offer to a store) shifts the target size of T1 towards the list
that would have kept it. Eviction takes from T1 while it is at or above its target, else
from T2, falling back to the other list when the preferred one has no idle block, so it
fails only when the tier has too few idle blocks.

Under a request-scoped manager (vLLM's call pattern), a request that ends moves the
ready blocks it reused from T1 to T2 (or to T2's recent end), and the blocks it only
stored to the recent end of their list: a store is not a second use.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from itertools import repeat

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, order_request_keys, register_policy

__all__ = ["ARCPolicy"]


@register_policy("arc")
class ARCPolicy(CachePolicy):
    observes_store_misses = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1: float = 0.0
        self.t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        #: T1 and T2 together, for one-lookup ``get`` (the manager's hottest call).
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self.get = self._blocks.get  # type: ignore[method-assign,assignment]

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.t1[key] = block
        self._blocks[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def insert_many(self, items: Iterable[tuple[OffloadKey, BlockStatus]]) -> None:
        batch = items if isinstance(items, list) else list(items)
        self.t1.update(batch)
        self._blocks.update(batch)
        for ghosts in (self.b1, self.b2):
            if ghosts:
                deque(map(ghosts.pop, [key for key, _ in batch], repeat(None)), 0)

    def remove(self, key: OffloadKey) -> None:
        if self._blocks.pop(key, None) is None:
            return
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, b1, b2, blocks = self.t1, self.t2, self.b1, self.b2, self._blocks
        for key in reversed(keys):
            block = blocks.get(key)
            if block is not None:
                if key in t1:
                    if block.ref_cnt >= 0:
                        del t1[key]
                        t2[key] = block
                    else:
                        # Offered again while its store is in flight: not a second use.
                        t1.move_to_end(key)
                else:
                    t2.move_to_end(key)
            elif b1 or b2:
                self._ghost_hit(key)

    def _ghost_hit(self, key: OffloadKey) -> None:
        """Shift T1's target towards the list whose ghost ``key`` is."""
        b1, b2 = self.b1, self.b2
        if key in b1:
            step = max(1.0, len(b2) / len(b1))
            self.target_t1 = min(self.target_t1 + step, float(self.capacity))
            b1.move_to_end(key)
        elif key in b2:
            step = max(1.0, len(b1) / len(b2))
            self.target_t1 = max(self.target_t1 - step, 0.0)
            b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        b1, b2 = self.b1, self.b2
        if not b1 and not b2:
            return
        in_b1 = list(filter(b1.__contains__, reversed(keys)))
        in_b2 = list(filter(b2.__contains__, reversed(keys)))
        if in_b1 and in_b2:  # interleaved: one key at a time, tail first
            for key in reversed(keys):
                self._ghost_hit(key)
            return
        # One list only: its size, and so the step, stay fixed; adding the step once per
        # hit keeps the float arithmetic of the key-by-key loop.
        if in_b1:
            step = max(1.0, len(b2) / len(b1))
            target, cap = self.target_t1, float(self.capacity)
            for _ in in_b1:
                target = min(target + step, cap)
            self.target_t1 = target
            deque(map(b1.move_to_end, in_b1), 0)
        elif in_b2:
            step = max(1.0, len(b1) / len(b2))
            target = self.target_t1
            for _ in in_b2:
                target = max(target - step, 0.0)
            self.target_t1 = target
            deque(map(b2.move_to_end, in_b2), 0)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only: Collection[OffloadKey],
        reused: Collection[OffloadKey],
        positions: Mapping[OffloadKey, int] | None = None,
    ) -> None:
        """Tail to head: a block only stored moves to the recent end of its list; a
        ready block reused moves to T2's recent end."""
        order = order_request_keys(key_groups, positions)
        order.reverse()
        # A request reuses a prefix and stores what follows: tail to head, its
        # insertion-only keys come first, then the rest. Handle those two runs a list
        # at a time; any other mix, key by key.
        is_inserted = list(map(insertion_only.__contains__, order))
        split = is_inserted.index(False) if False in is_inserted else len(order)
        if True in is_inserted[split:]:
            self._finish_by_key(order, insertion_only, reused)
            return
        t1, t2 = self.t1, self.t2
        if split:
            stored = order[:split]
            deque(map(t1.move_to_end, filter(t1.__contains__, stored)), 0)
            deque(map(t2.move_to_end, filter(t2.__contains__, stored)), 0)
        if split < len(order) and reused:
            used = list(filter(reused.__contains__, order[split:]))
            promoted = list(filter(t1.__contains__, used))
            if promoted:
                t2.update(zip(promoted, map(t1.pop, promoted)))
            # Each reused block joins T2's recent end in this order, from T1 or within T2.
            deque(map(t2.move_to_end, filter(t2.__contains__, used)), 0)

    def _finish_by_key(
        self,
        order: list[OffloadKey],
        insertion_only: Collection[OffloadKey],
        reused: Collection[OffloadKey],
    ) -> None:
        t1, t2 = self.t1, self.t2
        for key in order:
            if key in insertion_only:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused:
                block = t1.pop(key, None)
                if block is not None:
                    t2[key] = block
                elif key in t2:
                    t2.move_to_end(key)

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        # Choose first, commit after: a failed eviction must leave every list untouched.
        # Victims come in runs: from T1 while it is at or above its target (or T2 has no
        # idle block left), else from T2 (which leaves T1's size, so the preference).
        t1_entries, t2_entries = iter(self.t1.items()), iter(self.t2.items())
        t1_exhausted = t2_exhausted = False
        chosen: list[tuple[OffloadKey, bool]] = []  # (key, from_t1)
        virtual_t1 = len(self.t1)
        target = int(self.target_t1)
        while len(chosen) < n:
            want = n - len(chosen)
            if not t1_exhausted and (t2_exhausted or virtual_t1 >= target):
                if not t2_exhausted:
                    want = min(want, virtual_t1 - target + 1)
                taken = 0
                for key, block in t1_entries:
                    if block.ref_cnt == 0 and key not in protected:
                        chosen.append((key, True))
                        taken += 1
                        if taken == want:
                            break
                else:
                    t1_exhausted = True
                virtual_t1 -= taken
            elif not t2_exhausted:
                taken = 0
                for key, block in t2_entries:
                    if block.ref_cnt == 0 and key not in protected:
                        chosen.append((key, False))
                        taken += 1
                        if taken == want:
                            break
                else:
                    t2_exhausted = True
            else:
                return None
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        blocks = self._blocks
        for key, from_t1 in chosen:
            del blocks[key]
            if from_t1:
                victims.append((key, self.t1.pop(key)))
                self.b1[key] = None
            else:
                victims.append((key, self.t2.pop(key)))
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        return victims

    def clear(self) -> None:
        self._blocks.clear()
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1 = 0.0

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        yield from self.t1.items()
        yield from self.t2.items()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
