"""A tier's read time, fitted to its reads: the cost rule's model (``cost.py``) and the
read guard's idle reference (``backpressure.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ALPHA", "FLOOR_S", "ReadModel"]

#: Weight of the newest measurement in the models' exponential averages.
ALPHA = 0.25
#: The least a tier read is expected to take (and its fitted latency's floor).
FLOOR_S = 0.0002


@dataclass
class ReadModel:
    """A tier's read time: ``latency_s + bytes / bytes_per_s``, an exponentially weighted
    least-squares fit of each read's (bytes, seconds) (an EMA of the fit's sums, weight
    ``alpha``), the latency at least ``floor_s``. Reads of one size only cannot tell
    latency from bandwidth: the last slope fitted stays (none at first: all latency)."""

    alpha: float = ALPHA
    floor_s: float = FLOOR_S
    samples: int = 0
    _b: float = 0.0
    _bb: float = 0.0
    _d: float = 0.0
    _bd: float = 0.0
    #: Seconds per byte (1 / bandwidth), and the latency.
    _slope: float = 0.0
    latency_s: float = FLOOR_S

    def observe(self, seconds: float, nbytes: int, *, alone: bool = False) -> None:
        """A read of ``nbytes`` took ``seconds`` (bad values are ignored); ``alone``: it
        replaces what was measured before (a read that overran its deadline: the tier
        changed, and it is at least this slow now)."""
        if not (seconds >= 0 and math.isfinite(seconds) and nbytes >= 0):
            return
        a = 1.0 if self.samples == 0 or alone else self.alpha
        b = float(nbytes)
        self._b += a * (b - self._b)
        self._bb += a * (b * b - self._bb)
        self._d += a * (seconds - self._d)
        self._bd += a * (b * seconds - self._bd)
        self.samples += 1
        var = self._bb - self._b * self._b
        if var > 1e-6 * self._b * self._b and var > 0:  # sizes vary: latency and bandwidth
            self._slope = max(0.0, (self._bd - self._b * self._d) / var)
        self.latency_s = max(self.floor_s, self._d - self._slope * self._b)

    @property
    def bytes_per_s(self) -> float:
        """The fitted bandwidth (``inf``: none measured apart from the latency)."""
        return 1.0 / self._slope if self._slope > 0 else math.inf

    def expect(self, nbytes: int) -> float:
        """Seconds a read of ``nbytes`` is expected to take (``floor_s`` before any)."""
        return max(self.floor_s, self.latency_s + self._slope * nbytes)
