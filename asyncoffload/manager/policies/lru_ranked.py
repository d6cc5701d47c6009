"""LRU with a running request's blocks ranked together: vLLM 0.34's LRU, decision for decision.

vLLM 0.34 removed ``touch``. Its LRU gives each running request one *provisional rank*,
drawn from the policy's rank counter when the request first inserts a block or first
accesses one, and ranks the request's blocks by that rank and then by position, tail
before head: ``(request rank, -end token)``. A block the request only finds (a load, or
a block it offers that is already there) moves up to the request's rank; a block it
inserts enters at it, however long after the request began. When the request ends,
every block it used gets a fresh rank, tail first, so its head is the most recent, as
under 0.32. Blocks with no known position (promotions from a lower tier, callers that
name no positions) get a fresh rank each.

Victims are the idle blocks (``ref_cnt == 0``) outside ``protected`` with the smallest
``(rank, key)``; ties within one rank and position (two KV-cache groups' blocks of one
token span) break by the key's bytes, as vLLM's heap does. A lazily pruned heap holds
every tracked block; a pinned one is passed over and kept. ``clear`` starts the ranks
again and forgets every request's rank (vLLM's cache generation).

:class:`~asyncoffload.manager.CPUOffloadingManager` drives it in request-scoped mode
(``request_ranked``): :meth:`on_request_access` with a request's first accesses, and
:meth:`insert_ranked` with the blocks it stores, each call carrying the request's
:class:`~asyncoffload.manager.policies.base.RequestScope`.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies.base import CachePolicy, RequestScope, order_request_keys

__all__ = ["RankedLRUPolicy"]

Rank = tuple[int, int]


class RankedLRUPolicy(CachePolicy):
    """vLLM 0.34's LRU (see the module docstring). Not registered under a name of its
    own: the vLLM adapter gives it to the manager as ``lru`` where vLLM 0.34 runs."""

    name = "lru"
    request_ranked = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self._ranks: dict[OffloadKey, Rank] = {}
        self._heap: list[tuple[Rank, OffloadKey]] = []
        self._next_rank = 0
        self._generation = 0
        self.get = self._blocks.get  # type: ignore[method-assign,assignment]

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    # --- ranks -----------------------------------------------------------------------------

    def _fresh(self) -> Rank:
        self._next_rank += 1
        return (self._next_rank, 0)

    def _request_rank(self, request: RequestScope) -> int:
        """The request's provisional rank, drawn at its first use here."""
        held = request.state.get(id(self))
        if held is None or held[0] != self._generation:
            self._next_rank += 1
            held = request.state[id(self)] = (self._generation, self._next_rank)
        return held[1]

    def _set(self, key: OffloadKey, rank: Rank) -> None:
        self._ranks[key] = rank
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > max(64, 4 * len(self._ranks)):
            self._heap = [(r, k) for k, r in self._ranks.items()]
            heapq.heapify(self._heap)

    # --- CachePolicy ----------------------------------------------------------------------

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._blocks[key] = block
        self._set(key, self._fresh())

    def insert_ranked(
        self, items: Iterable[tuple[OffloadKey, BlockStatus]], request: RequestScope | None
    ) -> None:
        positions: Mapping[OffloadKey, int] | None = None if request is None else request.positions
        for key, block in items:
            self._blocks[key] = block
            position = None if positions is None else positions.get(key)
            if position is None or request is None:
                self._set(key, self._fresh())
            else:
                self._set(key, (self._request_rank(request), -position))

    def on_request_access(self, keys: Sequence[OffloadKey], request: RequestScope) -> None:
        rank = self._request_rank(request)
        positions = request.positions
        if positions is None:
            return
        ranks = self._ranks
        for key in keys:
            position = positions.get(key)
            if position is None or key not in self._blocks:
                continue
            new = (rank, -position)
            if ranks[key] >= new:
                continue
            self._set(key, new)

    def remove(self, key: OffloadKey) -> None:
        self._blocks.pop(key, None)
        self._ranks.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """``keys[0]`` most recent: a fresh rank each, tail first (the engine's call)."""
        for key in reversed(keys):
            if key in self._blocks:
                self._set(key, self._fresh())

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only: Collection[OffloadKey],
        reused: Collection[OffloadKey],
        positions: Mapping[OffloadKey, int] | None = None,
    ) -> None:
        self.touch(order_request_keys(key_groups, positions))

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        heap, ranks, blocks = self._heap, self._ranks, self._blocks
        chosen: list[tuple[Rank, OffloadKey]] = []
        passed: list[tuple[Rank, OffloadKey]] = []
        taken: set[OffloadKey] = set()
        while heap and len(chosen) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if ranks.get(key) != rank or key in taken:
                continue  # stale: the block moved or left
            if blocks[key].ref_cnt != 0 or key in protected:
                passed.append(entry)
                continue
            chosen.append(entry)
            taken.add(key)
        for entry in passed:
            heapq.heappush(heap, entry)
        if len(chosen) < n:
            for entry in chosen:
                heapq.heappush(heap, entry)
            return None
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        for _, key in chosen:
            del ranks[key]
            victims.append((key, blocks.pop(key)))
        return victims

    def clear(self) -> None:
        self._blocks.clear()
        self._ranks.clear()
        self._heap.clear()
        self._next_rank = 0
        self._generation += 1

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Tracked blocks, least recent first."""
        order = sorted(self._ranks.items(), key=lambda item: (item[1], item[0]))
        blocks = self._blocks
        return iter([(key, blocks[key]) for key, _ in order])

    def __len__(self) -> int:
        return len(self._blocks)
