"""Copy jobs: the completion tokens a :class:`~asyncoffload.transfer.base.TransferBackend`
hands out for its copies (and lower tiers for their reads and writes).

Below both the backends (:mod:`asyncoffload.transfer.base`) and the fault injection
(:mod:`asyncoffload.transfer.faults`, whose jobs wrap a backend's), which import it;
``asyncoffload.transfer.base`` re-exports both classes.
"""

from __future__ import annotations

import time

__all__ = ["CopyJob", "FailedJob"]


class CopyJob:
    """One submitted copy. ``query()`` is True once the copy has ended, well or not;
    then ``error`` is ``None`` or the exception that ended it, and ``finished_ns``
    (``time.perf_counter_ns``) says when it ended."""

    __slots__ = (
        "_done",
        "error",
        "finished_ns",
        "inline",
        "nbytes",
        "num_blocks",
        "stamped",
        "started_ns",
    )

    def __init__(self, num_blocks: int, nbytes: int) -> None:
        self.num_blocks = num_blocks
        self.nbytes = nbytes
        self.started_ns = time.perf_counter_ns()
        self.finished_ns = 0
        self.error: BaseException | None = None
        #: Whether ``finished_ns`` is when the copy really ended (stamped by whoever ran
        #: it), rather than when someone noticed; only stamped jobs feed latency figures.
        self.stamped = True
        #: Whether the job ended on the submitting thread before ``submit_*`` returned
        #: (:meth:`finish_inline`): the engine then completes it at once, on that thread,
        #: with no wake-up round trip.
        self.inline = False
        self._done = False

    def query(self) -> bool:
        return self._done

    def check_failed(self) -> bool:
        """Look for a failure that would stop the job from ever completing (a device
        error); the bridge calls it now and then on a job that seems stuck. True if the
        job has ended."""
        return self._done

    def finish(self, error: BaseException | None = None) -> None:
        """Mark the job ended. Called once, by whoever ran the copy."""
        self.error = error
        self.finished_ns = time.perf_counter_ns()
        self._done = True  # last: a reader that sees _done sees error and finished_ns

    def finish_inline(self, error: BaseException | None = None) -> None:
        """:meth:`finish`, called by ``submit_*`` itself: the copy ran on the submitting
        (the event loop's) thread. No wake-up is needed."""
        self.error = error
        self.finished_ns = time.perf_counter_ns()
        self.inline = True
        self._done = True

    @property
    def duration_s(self) -> float:
        return (self.finished_ns - self.started_ns) / 1e9 if self._done else 0.0

    def __repr__(self) -> str:
        state = "failed" if self.error is not None else ("done" if self._done else "running")
        return f"<CopyJob {self.num_blocks} blocks {self.nbytes} B {state}>"


class FailedJob(CopyJob):
    """A job that failed at submission: already ended, with ``error`` set."""

    def __init__(self, num_blocks: int, error: BaseException) -> None:
        super().__init__(num_blocks, 0)
        self.finish(error)
