"""Admission filters: which offered blocks a store actually writes.

Most blocks of real workloads are never read again, yet every stored block costs a PCIe
copy and pushes out a block that might have been. An admission filter sees the keys a
``prepare_store`` offers that are not stored yet and returns those worth writing. It
must not change anything while deciding (:meth:`AdmissionFilter.admissible`): the store
may still be refused for lack of room, and a refused call changes nothing. The manager
then reports what happened (:meth:`~AdmissionFilter.record`), and tells the filter about
touches and evictions, so filters can learn.

vLLM's ``store_threshold`` (store a key from its N-th offer on) is built into the
manager (``CPUOffloadingManager(store_threshold=N)``); the filters here add:

- ``"ghost"``: store a block on its second offer. Keys offered and not stored, and keys
  evicted, are remembered in a ghost list of ``ghost_factor`` times the tier's capacity;
  a key found there is admitted. One-off blocks never cost a write; a block that is
  reused, or was stored and pushed out, gets in when it comes back.
- ``"adaptive"``: the ghost rule, switched on only while it pays. It measures, over one
  lifetime of the cache (the time it takes to write as many blocks as it holds), how
  often a block offered for the first time is asked for again, and how often an
  evicted block is asked for again. While newcomers return less often than the blocks
  evicted to make room for them, first offers are held back; otherwise everything is
  admitted. On a tier large enough for the workload's reuse distances nothing is held
  back; on a small one, only blocks seen twice get in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

from asyncoffload._registry import Registry
from asyncoffload.keys import OffloadKey

__all__ = [
    "AdaptiveAdmission",
    "AdmissionFilter",
    "GhostAdmission",
    "available_admissions",
    "get_admission_cls",
    "register_admission",
]


class AdmissionFilter(ABC):
    """Chooses the keys a store writes, for a tier of ``capacity`` blocks."""

    name: ClassVar[str] = ""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def admissible(self, keys: Sequence[OffloadKey], full: bool) -> list[OffloadKey]:
        """The keys to write among ``keys`` (offered, not stored; in prefix order).

        ``full`` says whether writing all of them would evict. Changes nothing."""

    def record(self, offered: Sequence[OffloadKey], admitted: Sequence[OffloadKey]) -> None:
        """A store wrote ``admitted`` out of ``offered`` (not called for refused stores)."""
        return None

    def on_touch(self, keys: Sequence[OffloadKey]) -> None:
        """A request touched ``keys`` (stored or not)."""
        return None

    def on_evict(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` were evicted."""
        return None

    @abstractmethod
    def clear(self) -> None:
        """Forget everything learned."""


_REGISTRY: Registry[AdmissionFilter] = Registry(
    AdmissionFilter, "admission filter", "filters", article="an"
)
_A = TypeVar("_A", bound=type[AdmissionFilter])


def register_admission(name: str) -> Callable[[_A], _A]:
    """Class decorator: make an :class:`AdmissionFilter` available under ``name``."""
    return _REGISTRY.register(name)


def get_admission_cls(name: str) -> type[AdmissionFilter]:
    """The filter class registered as ``name``; ``ValueError`` naming the known ones if none."""
    return _REGISTRY.get(name)


def available_admissions() -> list[str]:
    """Names of the registered admission filters, sorted."""
    return _REGISTRY.names()


@register_admission("ghost")
class GhostAdmission(AdmissionFilter):
    """Admit a key on its second offer, or when it was evicted before."""

    def __init__(self, capacity: int, *, ghost_factor: float = 8.0) -> None:
        super().__init__(capacity)
        if not ghost_factor > 0:
            raise ValueError(f"ghost_factor must be positive, got {ghost_factor}")
        self.ghost_factor = ghost_factor
        self._ghost_cap = max(1, int(capacity * ghost_factor))
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()

    def admissible(self, keys: Sequence[OffloadKey], full: bool) -> list[OffloadKey]:
        ghost = self._ghost
        return [key for key in keys if key in ghost]

    def _remember(self, keys: Sequence[OffloadKey]) -> None:
        ghost = self._ghost
        for key in keys:
            ghost[key] = None
            ghost.move_to_end(key)
        for _ in range(len(ghost) - self._ghost_cap):
            ghost.popitem(last=False)

    def record(self, offered: Sequence[OffloadKey], admitted: Sequence[OffloadKey]) -> None:
        ghost = self._ghost
        if admitted:
            for key in admitted:
                ghost.pop(key, None)
        if len(admitted) < len(offered):
            chosen = set(admitted)
            self._remember([key for key in offered if key not in chosen])

    def on_evict(self, keys: Sequence[OffloadKey]) -> None:
        self._remember(keys)

    def clear(self) -> None:
        self._ghost.clear()


@register_admission("adaptive")
class AdaptiveAdmission(GhostAdmission):
    """The ghost rule while newcomers return less often than evicted blocks do."""

    def __init__(self, capacity: int, *, ghost_factor: float = 8.0) -> None:
        super().__init__(capacity, ghost_factor=ghost_factor)
        self.clear()

    def clear(self) -> None:
        super().clear()
        self._tick = 0
        # Blocks written per touch, smoothed: a cache lifetime is capacity / this.
        self._write_rate = 0.0
        self._written = 0
        # When first offers and evictions happened, to tell whether they come back
        # within one cache lifetime.
        self._first_offers: OrderedDict[OffloadKey, int] = OrderedDict()
        self._evictions: OrderedDict[OffloadKey, int] = OrderedDict()
        # Decayed counts: first offers / those back in time; evictions / those back.
        self._new_n = self._new_back = 0.0
        self._evicted_n = self._evicted_back = 0.0
        self._decay = 0.5 ** (1.0 / (4.0 * self.capacity))

    @property
    def lifetime(self) -> float:
        """Touches it takes to write as many blocks as the tier holds (inf before any)."""
        return self.capacity / self._write_rate if self._write_rate > 0 else float("inf")

    @property
    def holding_back(self) -> bool:
        """Whether first offers are held back now."""
        if self._evicted_n < 1.0 or self._new_n < 1.0:
            return False
        return self._new_back / self._new_n < self._evicted_back / self._evicted_n

    def admissible(self, keys: Sequence[OffloadKey], full: bool) -> list[OffloadKey]:
        if not full or not self.holding_back:
            return list(keys)
        return super().admissible(keys, full)

    def on_touch(self, keys: Sequence[OffloadKey]) -> None:
        self._tick += 1
        self._write_rate += (self._written - self._write_rate) / 64.0
        self._written = 0
        horizon = self._tick - self.lifetime
        first, evictions = self._first_offers, self._evictions
        for key in keys:
            if first:
                t = first.pop(key, None)
                if t is not None and t >= horizon:
                    self._new_back += 1.0
            if evictions:
                t = evictions.pop(key, None)
                if t is not None and t >= horizon:
                    self._evicted_back += 1.0

    def record(self, offered: Sequence[OffloadKey], admitted: Sequence[OffloadKey]) -> None:
        ghost = self._ghost
        first = self._first_offers
        fresh = 0
        for key in offered:
            if key not in ghost:
                first[key] = self._tick
                fresh += 1
        for _ in range(len(first) - self._ghost_cap):
            first.popitem(last=False)
        if fresh:
            f = self._decay**fresh
            self._new_n = self._new_n * f + fresh
            self._new_back *= f
        self._written += len(admitted)
        super().record(offered, admitted)

    def on_evict(self, keys: Sequence[OffloadKey]) -> None:
        evictions = self._evictions
        for key in keys:
            evictions[key] = self._tick
        for _ in range(len(evictions) - self._ghost_cap):
            evictions.popitem(last=False)
        f = self._decay ** len(keys)
        self._evicted_n = self._evicted_n * f + len(keys)
        self._evicted_back *= f
        super().on_evict(keys)
