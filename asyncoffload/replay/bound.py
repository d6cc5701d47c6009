"""The offline bound: Belady's MIN (evict the block whose next use is furthest away) with
an admission that declines a block never used again (:func:`belady`). It needs the
future, so it is not a registered policy."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Collection, Iterator, Sequence

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.admission import AdmissionFilter
from asyncoffload.manager.base import BlockStatus
from asyncoffload.manager.policies import CachePolicy
from asyncoffload.replay.manager import replay
from asyncoffload.replay.result import (
    LLAMA3_8B_BYTES_PER_TOKEN,
    Progress,
    ReplayResult,
    _check_capacity,
)
from asyncoffload.workloads import Request

__all__ = ["BELADY", "BeladyPolicy", "NeverAgainAdmission", "belady"]

#: Name under which :func:`replay_matrix` reports the offline bound.
BELADY = "belady"

_NEVER = 1 << 62


class _NextUses:
    """For every request position, when each of its keys is used next."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.after: list[list[int]] = [[] for _ in requests]
        upcoming: dict[OffloadKey, int] = {}
        for i in range(len(requests) - 1, -1, -1):
            keys = requests[i].keys
            self.after[i] = [upcoming.get(key, _NEVER) for key in keys]
            for key in keys:
                upcoming[key] = i
        self.requests = requests
        #: The current request's keys: (next use, position in the prompt).
        self.current: dict[OffloadKey, tuple[int, int]] = {}

    def advance(self, i: int) -> None:
        self.current = {
            key: (nxt, pos)
            for pos, (key, nxt) in enumerate(zip(self.requests[i].keys, self.after[i]))
        }


class BeladyPolicy(CachePolicy):
    """Belady's MIN: evicts the block whose next use is furthest away (offline).

    Fed by the replay with each request's next uses before it runs. Ties (blocks used
    next by the same request) go to the deepest block, so a prefix is cut from its end.
    Honours the manager's guarantees like any policy.
    """

    name = BELADY

    def __init__(self, capacity: int, future: _NextUses) -> None:
        super().__init__(capacity)
        self._future = future
        self.clear()

    def clear(self) -> None:
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self._next: dict[OffloadKey, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, OffloadKey]] = []

    def _set(self, key: OffloadKey) -> None:
        nxt, depth = self._future.current.get(key, (_NEVER, 0))
        self._next[key] = (nxt, depth)
        heapq.heappush(self._heap, (-nxt, -depth, key))

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self._blocks[key] = block
        self._set(key)

    def remove(self, key: OffloadKey) -> None:
        if self._blocks.pop(key, None) is not None:
            del self._next[key]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        blocks = self._blocks
        for key in keys:
            if key in blocks:
                self._set(key)

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        heap, nxt, blocks = self._heap, self._next, self._blocks
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        kept: list[tuple[int, int, OffloadKey]] = []
        while len(victims) < n and heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if nxt.get(key) != (-entry[0], -entry[1]):
                continue  # stale
            block = blocks[key]
            if block.ref_cnt != 0 or key in protected:
                kept.append(entry)
                continue
            victims.append((key, block))
            kept.append(entry)
        if len(victims) < n:
            for entry in kept:
                heapq.heappush(heap, entry)
            return None
        chosen = {key for key, _ in victims}
        for entry in kept:
            if entry[2] not in chosen:
                heapq.heappush(heap, entry)
        for key, _ in victims:
            del blocks[key]
            del nxt[key]
        if len(heap) > 4 * len(blocks) + 1024:
            self._heap = [(-v[0], -v[1], k) for k, v in nxt.items()]
            heapq.heapify(self._heap)
        return victims

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter(self._blocks.items())

    def __len__(self) -> int:
        return len(self._blocks)


class NeverAgainAdmission(AdmissionFilter):
    """Offline admission: does not store a block that is never used again."""

    name = "never-again"

    def __init__(self, capacity: int, future: _NextUses) -> None:
        super().__init__(capacity)
        self._future = future

    def admissible(self, keys: Sequence[OffloadKey], full: bool) -> list[OffloadKey]:
        current = self._future.current
        return [key for key in keys if current.get(key, (_NEVER, 0))[0] != _NEVER]

    def clear(self) -> None:
        pass


def belady(
    requests: Sequence[Request],
    capacity: int,
    *,
    bytes_per_token: int = LLAMA3_8B_BYTES_PER_TOKEN,
    unique_blocks: int | None = None,
    share: float | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """The offline bound: :func:`replay` with Belady's MIN and never-again admission."""
    _check_capacity(capacity)
    future = _NextUses(requests)
    result = replay(
        requests,
        capacity,
        policy=BeladyPolicy(capacity, future),
        admission=NeverAgainAdmission(capacity, future),
        bytes_per_token=bytes_per_token,
        unique_blocks=unique_blocks,
        share=share,
        progress=progress,
        before_request=future.advance,
    )
    return dataclasses.replace(result, admission=None)
