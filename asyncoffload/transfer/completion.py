"""The completion bridge: finished copies -> callbacks and futures, on the loop thread.

Each copy direction has a :class:`CopyLane`, a FIFO of (job, callback). A direction's
jobs complete in submission order, so only a lane's head needs checking. The loop thread
does all the Python-side work: it checks the heads and runs the callbacks of every
finished job, in order. Other threads only *signal* that something may have finished.
A helper thread that had to take the GIL to hand a result back would starve on a busy
loop (see docs/architecture.md), so no design here needs one.

Two ways to learn that a head may be done:

- ``eventfd``: the backend writes 1 to an eventfd (a pipe where eventfd is missing) when
  a job ends; the loop watches it with ``add_reader``. Wake-ups cost nothing while idle.
- ``poll``: a loop timer checks the heads every ``poll_interval`` while jobs are pending.
  The portable baseline, for loops without ``add_reader`` (Windows' proactor).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable

from asyncoffload.histogram import LATENCY_BUCKETS_S, Histogram
from asyncoffload.transfer.base import CopyJob

__all__ = ["CompletionBridge", "CopyLane", "LatencyWindow", "run_completion"]

log = logging.getLogger("asyncoffload.completion")

JobCallback = Callable[[CopyJob], None]


class CopyLane:
    """Jobs of one copy queue, oldest first."""

    __slots__ = ("jobs", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs: deque[tuple[CopyJob, JobCallback]] = deque()

    def __len__(self) -> int:
        return len(self.jobs)

    def __repr__(self) -> str:
        return f"<CopyLane {self.name} [{len(self.jobs)} pending]>"


#: Sub-buckets per power of two of the latency window: a percentile is known to within
#: half a sub-bucket, about 1.6% of its value.
_SUB_BITS = 5
_SUB = 1 << _SUB_BITS
#: Largest octave kept (2**46 ns is 19 hours); anything longer counts there.
_TOP = 46


def _bucket(value_ns: int) -> int:
    """Log-linear bucket of a non-negative nanosecond count: exact below ``_SUB``, then
    ``_SUB`` buckets per power of two."""
    if value_ns < _SUB:
        return max(value_ns, 0)
    shift = min(value_ns.bit_length(), _TOP) - _SUB_BITS - 1
    return (shift + 1) * _SUB + (min(value_ns >> shift, 2 * _SUB - 1) - _SUB)


def _bucket_mid_ns(index: int) -> float:
    """The middle of bucket ``index``, in nanoseconds."""
    if index < _SUB:
        return float(index)
    shift = index // _SUB - 1
    low = (_SUB + index % _SUB) << shift
    return low + ((1 << shift) - 1) / 2


_NUM_BUCKETS = _bucket((1 << _TOP) - 1) + 1


class LatencyWindow:
    """Percentiles of the last ``size`` samples (integers, nanoseconds), and a histogram
    (in seconds) of every sample since the start.

    Both are kept incrementally: adding a sample is O(1) and a percentile costs a walk
    over a fixed number of log-linear buckets, whatever the history, so reading stats on
    the loop never stalls it. Percentiles are bucket middles, within about 1.6% of the
    exact order statistic."""

    def __init__(self, size: int = 65_536) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self._ring = array("H", bytes(2 * size))  # bucket of each sample in the window
        self._counts = [0] * _NUM_BUCKETS  # samples of the window per bucket
        self._size = size
        self._count = 0
        self.histogram = Histogram(LATENCY_BUCKETS_S)

    def add(self, value_ns: int) -> None:
        index = _bucket(value_ns)
        pos = self._count % self._size
        counts = self._counts
        if self._count >= self._size:
            counts[self._ring[pos]] -= 1
        self._ring[pos] = index
        counts[index] += 1
        self._count += 1
        self.histogram.observe(value_ns * 1e-9)

    @property
    def count(self) -> int:
        """Samples added since the start."""
        return self._count

    def percentile_us(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the window in microseconds; NaN with no
        sample."""
        n = min(self._count, self._size)
        if n == 0:
            return float("nan")
        rank = min(n - 1, max(0, round(q / 100 * (n - 1))))
        seen = 0
        for index, c in enumerate(self._counts):
            seen += c
            if seen > rank:
                return _bucket_mid_ns(index) / 1e3
        raise AssertionError("window counts are inconsistent")  # pragma: no cover


class _Waker:
    """An fd the loop can watch, and a thread-safe way to make it readable."""

    def __init__(self) -> None:
        self.kind: str
        self.closed = False
        # The fds are closed by close() or, should that never come (an interrupt while
        # the bridge was being built left it to nobody), when the waker goes. Each is
        # filed by the C call that makes it (extend over a map), so an interrupt cannot
        # come between making it and owning it.
        fds: list[int] = []
        self._finalizer = weakref.finalize(self, _close_fds, fds)
        if hasattr(os, "eventfd"):
            self.kind = "eventfd"
            fds.extend(map(os.eventfd, (0,), (os.EFD_NONBLOCK | os.EFD_CLOEXEC,)))
            self.read_fd = self.write_fd = fds[0]
        else:
            self.kind = "pipe"
            fds.extend(itertools.chain.from_iterable(itertools.starmap(os.pipe, ((),))))
            self.read_fd, self.write_fd = fds
            os.set_blocking(self.read_fd, False)
            os.set_blocking(self.write_fd, False)

    def wake(self) -> None:
        if self.closed:
            return
        # A full pipe already wakes the loop; a closed fd means the bridge is gone.
        with contextlib.suppress(BlockingIOError, OSError):
            if self.kind == "eventfd":
                os.eventfd_write(self.write_fd, 1)
            else:
                os.write(self.write_fd, b"\x01")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            if self.kind == "eventfd":
                os.eventfd_read(self.read_fd)
            else:
                while os.read(self.read_fd, 4096):
                    pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._finalizer()


def _close_fds(fds: list[int]) -> None:
    while fds:
        fd = fds.pop()
        with contextlib.suppress(OSError):
            os.close(fd)


def run_completion(
    jobs: deque[tuple[CopyJob, JobCallback]], job: CopyJob, callback: JobCallback
) -> None:
    """Run ``callback(job)``, then take ``job``, the head of ``jobs``, off its lane. A
    callback that raises an ``Exception`` is logged (a broken callback must not stall
    the lane); one cut short by anything else runs once more, then that propagates."""
    try:
        callback(job)
    except Exception:
        log.exception("completion callback failed for %r", job)
    except BaseException:
        try:
            callback(job)
        except Exception:
            log.exception("completion callback failed for %r", job)
        jobs.popleft()
        raise
    jobs.popleft()


class CompletionBridge:
    """Resolves finished jobs on ``loop``'s thread, lane by lane, in submission order.

    ``mechanism`` is ``"eventfd"``, ``"pipe"`` or ``"poll"``: what is active, which
    ``mode="auto"`` chooses as eventfd (or pipe) where the loop supports ``add_reader``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        mode: str = "auto",
        poll_interval: float = 0.001,
        watchdog_interval: float = 0.05,
    ) -> None:
        if mode not in ("auto", "eventfd", "poll"):
            raise ValueError(f"completion mode must be 'auto', 'eventfd' or 'poll', got {mode!r}")
        self.loop = loop
        self.poll_interval = poll_interval
        self.watchdog_interval = watchdog_interval
        self.lanes: list[CopyLane] = []
        self.latency = LatencyWindow()
        self._waker: _Waker | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.mechanism = "poll"
        if mode != "poll":
            waker = _Waker()
            try:
                loop.add_reader(waker.read_fd, self._on_wake)
            except (NotImplementedError, RuntimeError):
                waker.close()
                if mode == "eventfd":
                    raise RuntimeError(
                        "completion='eventfd' needs a loop with add_reader; use 'poll'"
                    ) from None
            else:
                self._waker = waker
                self.mechanism = waker.kind
        log.debug("completion bridge active: %s", self.mechanism)

    @property
    def wake_fd(self) -> int | None:
        """The fd native code writes 1 (8 bytes) to instead of calling :meth:`notify`;
        ``None`` in poll mode."""
        return self._waker.write_fd if self._waker is not None else None

    def lane(self, name: str) -> CopyLane:
        lane = CopyLane(name)
        self.lanes.append(lane)
        return lane

    def notify(self) -> None:
        """Thread-safe: a job may have finished; check the lanes soon."""
        waker = self._waker
        if waker is not None:
            waker.wake()
        # In poll mode the armed timer will find it.

    def watch(self, lane: CopyLane, job: CopyJob, callback: JobCallback) -> None:
        """Loop thread only: run ``callback(job)`` on the loop once ``job`` and every job
        queued before it on ``lane`` have ended."""
        if self._closed:
            raise RuntimeError("completion bridge is closed")
        jobs = lane.jobs
        jobs.append((job, callback))
        if job.inline and len(jobs) == 1:
            # Copied by submit_* itself, on this thread (the loop's), with nothing ahead
            # of it: its callback runs now. A wake-up would cost an fd write and read and
            # two passes of the loop. (A job a lane thread ended meanwhile is left to
            # the wake-up, so that when a callback runs never hangs on a race.) The job
            # stays in its lane while the callback runs, so a job the callback queues
            # there waits its turn; see drain() for the rest.
            try:
                run_completion(jobs, job, callback)
                if jobs:  # queued by the callback
                    self._drain_lane(lane)
            except Exception:
                raise
            except BaseException:
                self._rearm()
                raise
            return
        if self._timer is None:
            # Poll mode: the timer is the mechanism. Wake-up mode: a slow watchdog, for
            # jobs that end without signalling (a device error stops the stream before
            # its host function runs).
            delay = self.poll_interval if self._waker is None else self.watchdog_interval
            self._timer = self.loop.call_later(delay, self._on_timer)
        if self._waker is not None and job.query():
            # Ended before we watched it (a failed submission): its wake-up may be gone.
            self._waker.wake()

    @property
    def pending(self) -> int:
        return sum(len(lane) for lane in self.lanes)

    def _on_wake(self) -> None:
        assert self._waker is not None
        self._waker.drain()
        self.drain()

    def _on_timer(self) -> None:
        self._timer = None
        if self._waker is not None:
            for lane in self.lanes:
                if lane.jobs:
                    lane.jobs[0][0].check_failed()
        self.drain()
        if self.pending and not self._closed:
            delay = self.poll_interval if self._waker is None else self.watchdog_interval
            self._timer = self.loop.call_later(delay, self._on_timer)

    def drain(self) -> int:
        """Run the callbacks of every finished head job; how many ran.

        A callback that raises an ``Exception`` is logged and the lane goes on. One cut
        short by anything else (``KeyboardInterrupt``, ``SystemExit``: a signal can land
        anywhere) is run once more at once, so that its job's completion is never lost,
        then the interrupt propagates and ends the drain; callbacks must allow that
        second run (the engine's do). A job leaves its lane only once its callback has
        run: an interrupt anywhere in here loses none, and the bridge asks for another
        drain first, so the jobs still finished are drained at the loop's next turn."""
        ran = 0
        try:
            for lane in self.lanes:
                ran += self._drain_lane(lane)
        except Exception:
            raise
        except BaseException:
            self._rearm()
            raise
        return ran

    def _drain_lane(self, lane: CopyLane) -> int:
        ran = 0
        jobs = lane.jobs
        while jobs and jobs[0][0].query():
            job, callback = jobs[0]
            woke = time.perf_counter_ns()
            run_completion(jobs, job, callback)
            # An inline job's callback runs as it ends: no wake-up latency to record.
            if job.stamped and job.finished_ns and not job.inline:
                self.latency.add(woke - job.finished_ns)
            ran += 1
        return ran

    def _rearm(self) -> None:
        """Make sure the lanes are looked at again soon (after an interrupted drain)."""
        if self._closed:
            return
        if self._waker is not None:
            self._waker.wake()
        elif self._timer is None:
            self._timer = self.loop.call_later(self.poll_interval, self._on_timer)

    def close(self) -> None:
        """Stop watching and close the wake-up fd. Refuses while jobs are pending: native
        code may still write the fd (wait for the jobs, and for the device, first)."""
        if self._closed:
            return
        if self.pending:
            raise RuntimeError(f"completion bridge closed with {self.pending} jobs pending")
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._waker is not None:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self._waker.read_fd)
            self._waker.close()

    def __repr__(self) -> str:
        return f"<CompletionBridge {self.mechanism} [{self.pending} pending]>"
