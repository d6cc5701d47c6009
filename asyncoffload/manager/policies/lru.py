"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, order_request_keys, register_policy

__all__ = ["LRUPolicy"]


@register_policy("lru")
class LRUPolicy(CachePolicy):
    """One ordered dict, least recently used first. New blocks enter as most recent."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        # The manager's hottest call, straight to the dict.
        self.get = self._blocks.get  # type: ignore[method-assign,assignment]

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._blocks[key] = block

    def insert_many(self, items: Iterable[tuple[OffloadKey, BlockStatus]]) -> None:
        self._blocks.update(items)

    def remove(self, key: OffloadKey) -> None:
        self._blocks.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        blocks = self._blocks
        # for key in reversed(keys): if key in blocks: blocks.move_to_end(key), in C.
        deque(map(blocks.move_to_end, filter(blocks.__contains__, reversed(keys))), 0)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only: Collection[OffloadKey],
        reused: Collection[OffloadKey],
        positions: Mapping[OffloadKey, int] | None = None,
    ) -> None:
        """Every block the request used becomes recent, its head the most recent, as
        vLLM's LRU does when a request ends."""
        self.touch(order_request_keys(key_groups, positions))

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
