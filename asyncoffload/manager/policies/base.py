"""The CachePolicy interface and its registry.

A policy orders the blocks of one tier and picks eviction victims. The manager owns
reference counts and slots; a policy must honour two guarantees:

- it never evicts a block whose ``ref_cnt`` is not 0 (being written or being read) nor a
  key in ``protected``;
- eviction is all or nothing: ``evict(n, ...)`` either removes exactly ``n`` blocks or
  returns ``None`` and changes nothing.

Recency comes from one of two call patterns. The engine and the replay call
:meth:`~CachePolicy.touch` with the blocks a request loads, then with those it stores.
vLLM's connector (0.32 and later) never calls ``touch``: a manager that tracks requests
(``CPUOffloadingManager(request_scoped=True)``) reports what a request did instead,
through :meth:`~CachePolicy.on_store_miss` while it stores and
:meth:`~CachePolicy.on_request_finished` when it ends. A policy whose learning needs a
request's touch before its stores (``touch_before_store``) gets that touch at the
request's first store.

A policy that learns from whole requests (``observes_requests``: ``auto``'s full-size
ghosts) gets each request's prompt keys once through :meth:`~CachePolicy.on_request`: from
``lookup_prefix`` under a manager that does not track requests (the engine's and the
replay's pattern: one lookup a request), else with the request's touch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import ClassVar, TypeVar

from asyncoffload._registry import Registry
from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import BlockStatus, ReqContext

__all__ = [
    "CachePolicy",
    "RequestScope",
    "available_policies",
    "get_policy_cls",
    "order_request_keys",
    "register_policy",
]


class RequestScope:
    """What a request-scoped manager tells a ``request_ranked`` policy of one request:
    the end token of each of its keys, where known (vLLM's ``_offload_key_positions``),
    and room for the policy's own per-request state (keyed by ``id(policy)``)."""

    __slots__ = ("positions", "state")

    def __init__(self, positions: Mapping[OffloadKey, int] | None = None) -> None:
        self.positions = positions
        self.state: dict[int, tuple[int, int]] = {}


class CachePolicy(ABC):
    """Block ordering and victim selection for one tier of ``capacity`` slots."""

    name: ClassVar[str] = ""
    #: Under a request-scoped manager, touch a request's blocks (those it loaded and
    #: those it offers) at its first store, as the engine's call pattern does, instead
    #: of reporting the request when it ends.
    touch_before_store: ClassVar[bool] = False
    #: Whether :meth:`on_store_miss` can change anything; when not, a request-scoped
    #: manager skips finding a request's new store misses.
    observes_store_misses: ClassVar[bool] = False
    #: Whether :meth:`on_request` can change anything; when not, the manager skips it.
    observes_requests: ClassVar[bool] = False
    #: Whether the policy learns its decisions from the workload as it goes (``kv``'s
    #: table starts empty): ``auto`` leaves such a leader early only on a clear lead.
    learns_online: ClassVar[bool] = False
    #: Whether a request-scoped manager tells the policy which request inserts a block
    #: (:meth:`insert_ranked`) and which blocks a request first uses
    #: (:meth:`on_request_access`), as vLLM 0.34's manager tells its LRU.
    request_ranked: ClassVar[bool] = False

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

    def insert_ranked(
        self, items: Iterable[tuple[OffloadKey, BlockStatus]], request: RequestScope | None
    ) -> None:
        """Track the blocks one request stores (``request_ranked`` policies, under a
        request-scoped manager; ``None``: no request). The default is
        :meth:`insert_many`."""
        self.insert_many(items)

    def on_request_access(self, keys: Sequence[OffloadKey], request: RequestScope) -> None:
        """A running request uses ``keys`` for the first time (it loads them, or offers
        them to a store), before any of them is inserted (``request_ranked`` policies,
        under a request-scoped manager). Must not evict. The default does nothing."""
        return None

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget ``key`` (a failed store); no ghost entry is kept."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark ``keys`` used; ``keys[0]`` ends up the most recently used."""

    def on_request(self, keys: Sequence[OffloadKey]) -> None:
        """A request arrives with prompt ``keys``, head first (see the module docstring
        for when). It must not evict or drop a tracked block. The default does nothing."""
        return None

    def on_context(self, ctx: ReqContext | None) -> None:
        """The request context of the manager call that follows (``lookup_prefix``,
        ``touch``, ``prepare_store``; ``None``: none given), before the policy hears of
        the call. The default does nothing."""
        return None

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Read the time (seconds) from ``clock`` from now on: the replays pass the
        trace's arrival times. The default ignores it (no built-in policy but
        ``session`` weighs time)."""
        return None

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """A request offers ``keys`` (not tracked) to a store, before they are inserted;
        each key is reported once per request. The default does nothing."""
        return None

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only: Collection[OffloadKey],
        reused: Collection[OffloadKey],
        positions: Mapping[OffloadKey, int] | None = None,
    ) -> None:
        """A request ended. ``key_groups`` holds, per KV-cache group, the blocks it
        loaded or stored, head to tail; ``insertion_only`` those it only stored,
        ``reused`` the ready blocks it used again; ``positions`` the end token of each
        key, where known. The default touches each group (vLLM's default for policies
        that do not distinguish); a ``touch_before_store`` policy has had its touch."""
        if self.touch_before_store:
            return
        for keys in key_groups:
            self.touch(keys)

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


def order_request_keys(
    key_groups: Sequence[Sequence[OffloadKey]], positions: Mapping[OffloadKey, int] | None
) -> list[OffloadKey]:
    """A request's keys across groups, head to tail: the groups one after the other, then
    sorted by end token when ``positions`` knows every key (as vLLM orders them)."""
    keys = [key for group in key_groups for key in group]
    if positions is not None and len(key_groups) > 1:
        get = positions.get
        if all(get(key) is not None for key in keys):
            keys.sort(key=positions.__getitem__)
    return keys
