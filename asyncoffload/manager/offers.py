"""``store_threshold``: how many times each key was offered to a store.

:class:`OfferCounts` is the CPU tier's tracker of offers (a key is stored from its
``threshold``-th offer on): a bounded LRU of ``max_keys`` keys, the least recently offered
leaving first. Two counting rules exist, both vLLM's: every call counts each key it
offers (:meth:`~OfferCounts.admissible`, then :meth:`~OfferCounts.record`), or, vLLM
0.34's ``count_once_per_request``, each key counts once per request, present or not
(:meth:`~OfferCounts.count`, then :meth:`~OfferCounts.counted_admissible`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from asyncoffload.keys import OffloadKey

__all__ = ["OfferCounts"]


class OfferCounts:
    """Offers per key, for a ``threshold`` of at least 2, at most ``max_keys`` keys."""

    def __init__(self, threshold: int, max_keys: int) -> None:
        self.threshold = threshold
        self.max_keys = max_keys
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    @property
    def counts(self) -> Mapping[OffloadKey, int]:
        """The count of each tracked key (read-only), least recently offered first."""
        return MappingProxyType(self._counts)

    def clear(self) -> None:
        self._counts.clear()

    def admissible(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The ``keys`` whose offer in this call reaches the threshold; changes nothing."""
        counts, threshold = self._counts, self.threshold
        return [key for key in keys if counts.get(key, 0) + 1 >= threshold]

    def record(self, offered: list[OffloadKey], admitted: list[OffloadKey]) -> None:
        """Count this call's offers: admitted keys leave the tracker, the others (held
        back by the policy or the threshold) go up by one."""
        counts = self._counts
        admitted_set = set(admitted)
        for key in offered:
            count = counts.pop(key, 0) + 1
            if key not in admitted_set:
                if len(counts) >= self.max_keys:
                    counts.popitem(last=False)
                counts[key] = count

    def count(self, keys: Sequence[OffloadKey], counted: set[OffloadKey]) -> None:
        """vLLM 0.34's offer count (``count_once_per_request``): every key of the offer,
        present or not, goes up by one unless this request counted it already
        (``counted``); keys new to the tracker enter at one, the least recently offered
        keys not in this offer leaving it when it is full (a key of this offer never
        does: with no other room it stays out)."""
        counts = self._counts
        offered = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                if key not in counted:
                    counts[key] += 1
                offered.add(key)
        room = len(counts) - len(offered)  # entries that may leave for a new key
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_keys:
                if not room:
                    continue
                counts.popitem(last=False)
                room -= 1
            counts[key] = 1

    def counted_admissible(
        self, keys: list[OffloadKey], counted: set[OffloadKey]
    ) -> tuple[list[OffloadKey], int]:
        """The ``keys`` (absent, counted already by :meth:`count`) that reached the
        threshold, and how many of the others this request had not counted before (each
        held-back key is a skip once per request)."""
        counts, threshold = self._counts, self.threshold
        admitted = [key for key in keys if counts.get(key, 0) >= threshold]
        skipped = 0
        if len(admitted) != len(keys):
            held = set(keys).difference(admitted)
            skipped = sum(1 for key in held if key not in counted)
        return admitted, skipped
