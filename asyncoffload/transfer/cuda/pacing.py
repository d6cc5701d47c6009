"""When a transfer is expected to end, and what to do about it: :class:`Pacer` keeps per
direction the bandwidth measured on the device (an EWMA of finished jobs) and the jobs
not yet seen ended, and from them gives each new job its expected end. From that come
the spinner's window (poll the job's event around its end, so that its wake-up comes
sooner than the host function's) and the inline wait (a job expected to end within
``inline_wait_ns`` with nothing ahead of it is waited for on the submitting thread).
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from asyncoffload.transfer.cuda.jobs import CudaJob

__all__ = ["SPIN_LEAD_NS", "SPIN_WINDOW_NS", "Expected", "Pacer"]

#: The spinner starts polling this long before a job's expected end ...
SPIN_LEAD_NS = 60_000
#: ... and gives up this long after it (its CPU cost is bounded by the window; a wrong
#: estimate only loses the speed-up).
SPIN_WINDOW_NS = 150_000
#: Jobs remembered per direction for the bandwidth measurement.
_RECENT_MAX = 64
#: Weight of the newest sample in the bandwidth's EWMA.
_RATE_WEIGHT = 0.3


class Expected(NamedTuple):
    """A job's expectation: ``now``, its expected ``end`` (``time.perf_counter_ns``) and
    whether every earlier job of its direction had ended (``idle``)."""

    now: int
    end: int
    idle: bool


class Pacer:
    """Expected ends per direction (``directions`` of them); ``inline_wait_ns`` 0: never
    wait on the submitting thread."""

    def __init__(self, directions: int, inline_wait_ns: int) -> None:
        self.inline_wait_ns = inline_wait_ns
        self.rate: list[float | None] = [None] * directions  # bytes per ns, EWMA
        self._lane_end_ns = [0] * directions
        # Per direction, the jobs not yet seen ended, in submission order.
        self._recent: list[deque[CudaJob]] = [deque() for _ in range(directions)]

    def expect(self, job: CudaJob, direction: int) -> Expected | None:
        """``job``'s expected end, from the bandwidth measured in ``direction`` and the
        transfers queued before it; ``None`` before a measurement. Counts ``job`` as
        queued."""
        recent = self._recent[direction]
        while recent and recent[0].query():  # a stream's jobs end in order
            done = recent.popleft()
            seconds = done.duration_s
            if done.error is None and done.nbytes and seconds > 0:
                sample = done.nbytes / (seconds * 1e9)
                old = self.rate[direction]
                self.rate[direction] = (
                    sample if old is None else (1 - _RATE_WEIGHT) * old + _RATE_WEIGHT * sample
                )
        idle = not recent
        if len(recent) < _RECENT_MAX:
            recent.append(job)
        rate = self.rate[direction]
        if not (rate and job.nbytes):
            return None
        now = time.perf_counter_ns()
        end = max(now, self._lane_end_ns[direction]) + int(job.nbytes / rate)
        self._lane_end_ns[direction] = end
        return Expected(now, end, idle)

    @staticmethod
    def spin_window(expected: Expected | None) -> tuple[int, int] | None:
        """When the spinner should poll a job's event: around its ``expected`` end."""
        if expected is None:
            return None
        return (max(expected.now, expected.end - SPIN_LEAD_NS), expected.end + SPIN_WINDOW_NS)

    def wait_here(self, expected: Expected | None) -> int:
        """Nanoseconds to wait on this thread for a job ``expected`` to end within
        ``inline_wait_ns`` with nothing of its direction ahead of it (twice that: past it
        the wait gives up); 0: don't wait."""
        limit = self.inline_wait_ns
        if expected is None or not limit:
            return 0
        if expected.idle and expected.end - expected.now <= limit:
            return 2 * limit
        return 0
