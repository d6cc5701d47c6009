"""vLLM's prefill throughput, measured from its scheduler's own steps: the recompute side
of load or recompute (``asyncoffload.tiers.core.cost``).

vLLM's scheduler ends each step's scheduling with ``on_schedule_end`` and then prepares
the stores of the chunks that step computes (prompt chunks only, and only those not
loaded: what a prefill computes). So the time from one ``on_schedule_end`` to the next
is a step's run, and the chunks offered between them what it computed. A step that
computed less than a block (decode steps, whose cost per token says nothing of a
prefill's) is left out, and so is a gap far longer than the estimate says the step
took (vLLM idle between requests).
"""

from __future__ import annotations

import math

__all__ = ["PrefillClock"]

#: A gap this many times longer than the estimate of its step is idle time, not a step.
IDLE_FACTOR = 4.0


class PrefillClock:
    """Times the scheduler's steps: :meth:`step` returns the (tokens, seconds) of the
    step that ran since the last call, or None when it tells nothing."""

    def __init__(self) -> None:
        self._last: float | None = None

    def step(self, now: float, tokens: int, rate: float | None) -> tuple[int, float] | None:
        """A step ends at ``now`` (the next is scheduled) after computing ``tokens`` of
        prompts; ``rate``: the current estimate (tokens per second, or None)."""
        last, self._last = self._last, now
        if last is None or tokens <= 0:
            return None
        seconds = now - last
        if not (seconds > 0 and math.isfinite(seconds)):
            return None
        if rate is not None and seconds > IDLE_FACTOR * tokens / rate:
            return None
        return tokens, seconds
