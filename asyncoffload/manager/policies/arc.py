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

_Entries = Iterator[tuple[OffloadKey, BlockStatus]]


def _next_idle(entries: _Entries, protected: Collection[OffloadKey]) -> OffloadKey | None:
    for key, block in entries:
        if block.ref_cnt == 0 and key not in protected:
            return key
    return None


@register_policy("arc")
class ARCPolicy(CachePolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1: float = 0.0
        self.t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        block = self.t1.get(key)
        return block if block is not None else self.t2.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            block = self.t1.get(key)
            if block is not None:
                if block.is_ready:
                    del self.t1[key]
                    self.t2[key] = block
                else:
                    # Offered again while its store is in flight: not a second use.
                    self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
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
        t1_entries, t2_entries = iter(self.t1.items()), iter(self.t2.items())
        t1_exhausted = t2_exhausted = False
        chosen: list[tuple[OffloadKey, bool]] = []  # (key, from_t1)
        virtual_t1 = len(self.t1)
        while len(chosen) < n:
            prefer_t1 = virtual_t1 >= int(self.target_t1)
            key: OffloadKey | None = None
            for from_t1 in (prefer_t1, not prefer_t1):
                if from_t1 and not t1_exhausted:
                    key = _next_idle(t1_entries, protected)
                    t1_exhausted = key is None
                elif not from_t1 and not t2_exhausted:
                    key = _next_idle(t2_entries, protected)
                    t2_exhausted = key is None
                if key is not None:
                    chosen.append((key, from_t1))
                    virtual_t1 -= from_t1
                    break
            if key is None:
                return None
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        for key, from_t1 in chosen:
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
