"""The OffloadingManager contract (vLLM ``kv_offload`` semantics) and the records it exchanges.

A manager runs on one thread (the event loop's), never blocks and never touches a device.
Its primitives:

- ``lookup(key)``: is the block stored (``HIT``), being stored (``HIT_PENDING``) or not (``MISS``)?
  Lookups never change recency.
- ``prepare_load(keys)``: pin ready blocks for reading (they cannot be evicted until
  ``complete_load``) and say where they are.
- ``touch(keys)``: mark blocks recently used; the first key becomes the most recently used.
- ``complete_load(keys)``: unpin blocks pinned by ``prepare_load``.
- ``prepare_store(keys)``: choose slots for the keys not yet present, evicting idle ready
  blocks when needed (all or nothing), and say where to write them. ``None`` when there
  is no room.
- ``complete_store(keys, success)``: the copy finished; the blocks become loadable, or
  on failure are dropped.
- ``take_events()``: the blocks stored / removed since the last call.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from asyncoffload.errors import DuplicateKeyError
from asyncoffload.keys import BlockTokens, OffloadKey
from asyncoffload.manager.retention import Retention

__all__ = [
    "NO_STORE_KEY",
    "BlockStatus",
    "CPULoadStoreSpec",
    "LookupResult",
    "ManagerStats",
    "Medium",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "TenantStats",
    "reject_duplicates",
]


class Medium(str, enum.Enum):
    """The tier a block lives in: the pinned host pool, a local disk, a shared server."""

    CPU = "CPU"
    DISK = "DISK"
    REMOTE = "REMOTE"


class LookupResult(enum.Enum):
    """Result of :meth:`OffloadingManager.lookup` for one key."""

    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()


#: The ``kv_transfer_params`` key that opts a request out of caching (a bool).
NO_STORE_KEY = "asyncoffload_no_store"


@dataclass(slots=True)
class ReqContext:
    """Per-request context handed to every manager call.

    ``kv_transfer_params`` carries connector parameters as vLLM does; ``tokens``
    describes the request's blocks (token ids, parent hash, block size) so that the
    stored events of its keys describe them too; ``extra`` is free for policies and
    integrations. ``tenant`` (a cache salt) keeps the request's blocks apart from other
    tenants' in every tier: the engine files them under :func:`~asyncoffload.tenant_key`
    of each key, and a tier's quota (``quotas``) counts them as the tenant's. ``no_store``
    opts the request out of caching: it stores nothing in any tier (counted as
    ``ManagerStats.opted_out``); ``kv_transfer_params={"asyncoffload_no_store": True}``
    says the same. ``retention`` pins the blocks the request stores or hits, in every
    tier, and ranks them (:class:`~asyncoffload.Retention`, docs/policies.md).
    ``session`` names the conversation or agent run the request continues (the
    ``session`` policy keeps a session due back soon; others ignore it).
    """

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    tokens: BlockTokens | None = None
    tenant: str | None = None
    retention: Retention | None = None
    no_store: bool = False
    session: str | None = None


class BlockStatus:
    """One slot of a tier: its id and reference count.

    ``ref_cnt`` is -1 while the block is being written, 0 when ready and idle
    (evictable), and ``n > 0`` while ``n`` loads read it.
    """

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


@dataclass(frozen=True, slots=True)
class CPULoadStoreSpec:
    """Where blocks live in the CPU tier: slot ids, in the order of the keys asked for."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided: which keys to write where, and what it evicted."""

    keys_to_store: list[OffloadKey]
    store_spec: CPULoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Blocks stored in, or removed from, one tier.

    ``seq`` grows by one per event published by a manager, so consumers can detect gaps;
    ``ts`` is ``time.time()`` when the event was made. Snapshot events (see
    ``AsyncOffloadEngine.events``) carry ``snapshot=True`` and the ``seq`` of the last
    live event they include. A stored event carries the :class:`~asyncoffload.BlockTokens`
    of the store's request context, when it had one (keys it does not describe have none).
    A pin change (``retention``: ``"pinned"``, ``"expired"`` or ``"unpinned"``, see
    :mod:`asyncoffload.manager.pins`) is not a store: ``removed`` is False and the blocks
    were, and stay, stored; a consumer that indexes blocks skips it.
    """

    keys: tuple[OffloadKey, ...]
    medium: Medium
    removed: bool
    seq: int
    ts: float
    snapshot: bool = False
    tokens: BlockTokens | None = None
    retention: str | None = None


class TenantStats(NamedTuple):
    """One tenant with a quota in one tier; the counters run from the tier's creation."""

    tenant: str
    #: The tenant's cap, in blocks of this tier.
    quota: int
    #: Blocks the tenant holds here (ready or being stored).
    held: int
    #: Blocks refused: its stores (and promotions) that did not fit its quota even after
    #: its own idle, unpinned blocks were evicted.
    refused: int
    #: Its own blocks evicted to make room under its quota.
    evicted: int
    #: Blocks its opted-out requests (``ReqContext.no_store``) did not store here.
    opted_out: int


class ManagerStats(NamedTuple):
    """State and counters of a manager; the counters run from its creation."""

    #: Slots in the tier.
    num_blocks: int
    #: Ready blocks (loadable).
    ready: int
    #: Blocks whose store is in flight.
    write_pending: int
    #: Ready blocks pinned by at least one load.
    pinned: int
    #: Free slots.
    free: int
    #: Blocks made ready by successful stores.
    stored: int
    #: Blocks dropped by failed stores.
    store_failed: int
    #: Blocks handed to loads.
    loaded: int
    #: Blocks evicted.
    evicted: int
    #: Keys offered and held back: by ``store_threshold``, the admission filter or the
    #: policy's own admission.
    store_skipped: int
    #: ``lookup`` calls, and those that found the key (ready or pending).
    lookups: int
    hits: int
    #: Blocks refused by a tenant's quota, all tenants together (see ``tenants``).
    quota_refused: int = 0
    #: Blocks not stored because their request opted out (``ReqContext.no_store``).
    opted_out: int = 0
    #: Each tenant with a quota here, by name.
    tenants: tuple[TenantStats, ...] = ()


def reject_duplicates(keys: Sequence[OffloadKey], what: str) -> None:
    """``DuplicateKeyError`` (naming the call ``what``) for a key listed twice."""
    if len(set(keys)) != len(keys):
        seen: set[OffloadKey] = set()
        for key in keys:
            if key in seen:
                raise DuplicateKeyError(f"{what}: key {key.hex()} appears more than once")
            seen.add(key)


class OffloadingManager(ABC):
    """The scheduler-side contract. See the module docstring for the semantics."""

    medium: Medium

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext | None = None) -> LookupResult: ...

    @abstractmethod
    def prepare_load(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> CPULoadStoreSpec: ...

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None: ...

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None: ...

    @abstractmethod
    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> PrepareStoreOutput | None: ...

    @abstractmethod
    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, success: bool = True
    ) -> None: ...

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]: ...

    @abstractmethod
    def reset_cache(self) -> None: ...
