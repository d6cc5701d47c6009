"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, register_policy

__all__ = ["LRUPolicy"]


@register_policy("lru")
class LRUPolicy(CachePolicy):
    """One ordered dict, least recently used first. New blocks enter as most recent."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        self._blocks.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        blocks = self._blocks
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        for key, block in self._blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                victims.append((key, block))
                if len(victims) == n:
                    break
        else:
            return None
        for key, _ in victims:
            del self._blocks[key]
        return victims

    def clear(self) -> None:
        self._blocks.clear()

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter(self._blocks.items())

    def __len__(self) -> int:
        return len(self._blocks)
