"""Fixed-bucket histograms the engine keeps for its own counters.

Cheap enough for the completion path (a bisect and two additions per sample), owned by
the loop thread, and read as a :class:`HistogramSnapshot` that exporters turn into their
own format (``asyncoffload.integrations.prometheus`` makes Prometheus histograms of them).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

__all__ = [
    "BYTES_PER_SECOND_BUCKETS",
    "LATENCY_BUCKETS_S",
    "TRANSFER_BUCKETS_S",
    "Histogram",
    "HistogramSnapshot",
]

#: Completion-callback latency: 10 us to 100 ms.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3,
)  # fmt: skip
#: Transfer durations, submission to end of copy: 100 us to 10 s.
TRANSFER_BUCKETS_S: tuple[float, ...] = (
    100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    500e-3, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Transfer throughput: 100 MB/s to 100 GB/s.
BYTES_PER_SECOND_BUCKETS: tuple[float, ...] = (
    0.1e9, 0.25e9, 0.5e9, 1e9, 2.5e9, 5e9, 10e9, 15e9, 20e9, 25e9, 30e9, 40e9, 50e9, 60e9,
    100e9,
)  # fmt: skip


class HistogramSnapshot(NamedTuple):
    """Counts per bucket: ``counts[i]`` samples were ``<= bounds[i]`` and above the bound
    before; ``counts[-1]`` (one more than ``bounds``) counts those above the last bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    samples: int

    def cumulative(self) -> list[int]:
        """Samples ``<= bounds[i]`` for each bound, then all of them (Prometheus' form)."""
        out: list[int] = []
        running = 0
        for c in self.counts:
            running += c
            out.append(running)
        return out


class Histogram:
    """Samples counted into fixed buckets (upper bounds, inclusive), with their sum."""

    __slots__ = ("_bounds", "_counts", "_total")

    def __init__(self, bounds: Sequence[float]) -> None:
        b = tuple(float(x) for x in bounds)
        if not b or any(lo >= hi for lo, hi in pairwise(b)):
            raise ValueError(f"bucket bounds must be non-empty and increasing, got {bounds!r}")
        self._bounds = b
        self._counts = [0] * (len(b) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._total += value

    def snapshot(self) -> HistogramSnapshot:
        counts = tuple(self._counts)
        return HistogramSnapshot(self._bounds, counts, self._total, sum(counts))
