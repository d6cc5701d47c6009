"""Adaptive Replacement Cache (Megiddo & Modha), with vLLM's touch-driven adaptation.

T1 holds blocks used once since they were stored, T2 blocks used again; B1 / B2 remember
keys recently evicted from each (ghosts, no data). A touch of a ghost shifts the target
size of T1 towards the list that would have kept it. Eviction takes from T1 while it is
at or above its target, else from T2, falling back to the other list when the preferred
one has no idle block, so it fails only when the tier has too few idle blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, register_policy

__all__ = ["ARCPolicy"]


@register_policy("arc")
class ARCPolicy(CachePolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1: float = 0.0
        self.t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        #: T1 and T2 together, for one-lookup ``get`` (the manager's hottest call).
        self._blocks: dict[OffloadKey, BlockStatus] = {}

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.t1[key] = block
        self._blocks[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

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
            elif not b1 and not b2:
                continue
            elif key in b1:
                step = max(1.0, len(self.b2) / len(self.b1))
                self.target_t1 = min(self.target_t1 + step, float(self.capacity))
                self.b1.move_to_end(key)
            elif key in self.b2:
                step = max(1.0, len(self.b1) / len(self.b2))
                self.target_t1 = max(self.target_t1 - step, 0.0)
                self.b2.move_to_end(key)

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
