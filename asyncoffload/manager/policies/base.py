"""The CachePolicy interface and its registry.

A policy orders the blocks of one tier and picks eviction victims. The manager owns
reference counts and slots; a policy must honour two guarantees:

- it never evicts a block whose ``ref_cnt`` is not 0 (being written or being read) nor a
  key in ``protected``;
- eviction is all or nothing: ``evict(n, ...)`` either removes exactly ``n`` blocks or
  returns ``None`` and changes nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import ClassVar, TypeVar

from asyncoffload._registry import Registry
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus

__all__ = ["CachePolicy", "available_policies", "get_policy_cls", "register_policy"]


class CachePolicy(ABC):
    """Block ordering and victim selection for one tier of ``capacity`` slots."""

    name: ClassVar[str] = ""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> BlockStatus | None:
        """The block stored under ``key``, ready or not; never changes recency."""

    @abstractmethod
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        """Track a new block (its store is in flight)."""

    def insert_many(self, items: Iterable[tuple[OffloadKey, BlockStatus]]) -> None:
        """Track the blocks of one store, given parent first (a prefix's order).

        The default inserts them one by one in that order; a prefix-aware policy may
        order them otherwise."""
        for key, block in items:
            self.insert(key, block)

    def admissible(self, keys: list[OffloadKey], full: bool) -> list[OffloadKey]:
        """Which of ``keys`` (offered to a store, not tracked) the policy would keep.

        ``full`` says whether storing them all would evict. The default keeps all; a
        policy that can tell a block is worth less than what it would push out may
        decline it. Must not change anything."""
        return keys

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget ``key`` (a failed store); no ghost entry is kept."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark ``keys`` used; ``keys[0]`` ends up the most recently used."""

    @abstractmethod
    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Remove ``n`` idle ready blocks not in ``protected``, or nothing and ``None``."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything, history included."""

    @abstractmethod
    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Every tracked block, ready or not, in the policy's own order."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None  # type: ignore[arg-type]


_REGISTRY: Registry[CachePolicy] = Registry(CachePolicy, "cache policy", "policies")
_P = TypeVar("_P", bound=type[CachePolicy])


def register_policy(name: str) -> Callable[[_P], _P]:
    """Class decorator: make a :class:`CachePolicy` available under ``name``."""
    return _REGISTRY.register(name)


def get_policy_cls(name: str) -> type[CachePolicy]:
    """The policy class registered as ``name``; ``ValueError`` naming the known ones if none."""
    return _REGISTRY.get(name)


def available_policies() -> list[str]:
    """Names of the registered policies, sorted."""
    return _REGISTRY.names()
