"""Fault injection for transfer backends: failed copies, failing and interrupted
submissions, interrupted completion callbacks, slow lanes. For tests.

A :class:`FaultPlan` lists :class:`Fault` rules; ``backend.inject_faults(plan)`` makes
the backend consult it at every submission (``inject_faults(None)`` stops). Without a
plan nothing is consulted and nothing wraps the submission (the Python copy lanes read
one attribute): no measurable cost.

Kinds of fault, each by ``rate`` (a probability per eligible submission, drawn from the
plan's seeded generator) and/or ``nth`` (the n-th eligible submissions, from 1):

- ``copy_error``: the job ends failed, as a device error would: the backend reports it
  through ``job.error`` and the engine's failure path runs (``TransferError``). On the
  ``threads`` copy engine the lane raises instead of copying; elsewhere (native lanes,
  CUDA) the copy runs and its job reports the failure.
- ``submit_error``: ``submit_*`` raises (an :class:`InjectedFault`) before anything is
  queued.
- ``interrupt_before_queue`` / ``interrupt_after_queue``: ``submit_*`` raises a
  ``BaseException`` (``KeyboardInterrupt`` unless told otherwise) before the copy is
  queued, or after it was queued (the copy runs, but its job never reaches the caller):
  a signal landing on either side of the hand-off.
- ``interrupt_in_callback``: once the job has ended, the first read of ``job.error``
  (the completion callback's first look at the outcome) raises a ``BaseException``
  (``KeyboardInterrupt`` unless told otherwise); later reads return the outcome.
- ``slot_error`` (a :class:`~asyncoffload.transfer.paged_worker.PagedTransferWorker`
  only): host slots that fail every copy touching them, on every path, as a damaged
  host page would; the job's other slots copy.
- ``slow_lane``: the copy ends ``delay_s`` late. On the ``threads`` engine the lane
  sleeps before copying, so the jobs behind it wait too; elsewhere the job's end becomes
  visible ``delay_s`` after the copy ended (a helper thread wakes the loop then; it runs
  only while such jobs are pending).

When several rules hit one submission, the first to act hides the others: an error
or interrupt before queueing leaves nothing else to happen; an interrupt after queueing
hides a callback interrupt (the engine never sees the job); otherwise a callback
interrupt masks a copy error (the callback never reads it). Only what acts is counted.
A submission of zero blocks (the engine's fence) is never faulted unless
``include_empty=True``. The plan is deterministic: the same seed and the same sequence
of submissions inject the same faults. It counts what it injected (``fired``) and keeps
a ``history`` of the faulted submissions.

Example::

    plan = FaultPlan(Fault.copy_error(rate=0.1), Fault.slow_lane(0.002, rate=0.5), seed=7)
    engine.backend.inject_faults(plan)
"""

from __future__ import annotations

import contextlib
import heapq
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from asyncoffload.transfer.jobs import CopyJob

__all__ = [
    "Fault",
    "FaultDecision",
    "FaultKind",
    "FaultPlan",
    "FaultRecord",
    "InjectedFault",
    "InjectedJob",
]

FaultKind = Literal[
    "copy_error",
    "submit_error",
    "interrupt_before_queue",
    "interrupt_after_queue",
    "interrupt_in_callback",
    "slow_lane",
    "slot_error",
]
Direction = Literal["store", "load"]
#: Makes the exception a fault raises, from a message (an exception class will do).
ExceptionFactory = Callable[[str], BaseException]
Submit = Callable[[Sequence[int], Sequence[int]], CopyJob]

_KINDS: frozenset[str] = frozenset(get_args(FaultKind))
_INTERRUPTS = ("interrupt_before_queue", "interrupt_after_queue", "interrupt_in_callback")


class InjectedFault(RuntimeError):
    """What a :class:`FaultPlan` raises, or fails a copy with, unless told otherwise."""


@dataclass(frozen=True)
class Fault:
    """One rule of a :class:`FaultPlan`: which submissions get a fault of ``kind``.

    A submission of ``direction`` (``None``: either) is eligible; the rule fires on the
    ``nth`` eligible ones (counted from 1) and, independently, with probability ``rate``
    on each, at most ``times`` times in all (``None``: no limit). ``error`` makes the
    exception raised or reported (default: :class:`InjectedFault` for errors,
    ``KeyboardInterrupt`` for interrupts). ``delay_s`` is a slow lane's delay.
    The classmethods build each kind."""

    kind: FaultKind
    rate: float = 0.0
    nth: frozenset[int] = frozenset()
    direction: Direction | None = None
    times: int | None = None
    delay_s: float = 0.0
    error: ExceptionFactory | None = None
    #: A ``slot_error``'s damaged host slots.
    slots: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}: one of {sorted(_KINDS)}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must lie in [0, 1], got {self.rate}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.nth):
            raise ValueError(f"nth counts submissions from 1, got {sorted(self.nth)}")
        if not self.rate and not self.nth:
            raise ValueError(f"a {self.kind} fault needs a rate or an nth")
        if self.direction not in (None, "store", "load"):
            raise ValueError(f"direction must be 'store', 'load' or None, got {self.direction!r}")
        if self.times is not None and self.times < 0:
            raise ValueError(f"times must be >= 0, got {self.times}")
        if self.delay_s < 0 or (self.kind == "slow_lane") != (self.delay_s > 0):
            raise ValueError("delay_s: positive for a slow_lane fault, 0 for any other")
        if (self.kind == "slot_error") != bool(self.slots):
            raise ValueError("slots: some for a slot_error fault, none for any other")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.slots):
            raise ValueError(f"slots are host slot ids (ints >= 0), got {sorted(self.slots)}")

    def make_error(self, what: str) -> BaseException:
        factory = self.error
        if factory is None:
            factory = KeyboardInterrupt if self.kind in _INTERRUPTS else InjectedFault
        return factory(f"injected {self.kind.replace('_', ' ')} ({what})")

    # --- one builder per kind --------------------------------------------------------

    @classmethod
    def copy_error(
        cls,
        rate: float = 0.0,
        *,
        nth: int | Iterable[int] = (),
        direction: Direction | None = None,
        times: int | None = None,
        error: ExceptionFactory | None = None,
    ) -> Fault:
        """The copy ends failed (``job.error``), as after a device error."""
        return cls("copy_error", rate, _counts(nth), direction, times, 0.0, error)

    @classmethod
    def submit_error(
        cls,
        rate: float = 0.0,
        *,
        nth: int | Iterable[int] = (),
        direction: Direction | None = None,
        times: int | None = None,
        error: ExceptionFactory | None = None,
    ) -> Fault:
        """``submit_*`` raises an ``Exception`` before queueing anything."""
        return cls("submit_error", rate, _counts(nth), direction, times, 0.0, error)

    @classmethod
    def interrupt_at_submit(
        cls,
        rate: float = 0.0,
        *,
        queued: bool = False,
        nth: int | Iterable[int] = (),
        direction: Direction | None = None,
        times: int | None = None,
        error: ExceptionFactory | None = None,
    ) -> Fault:
        """``submit_*`` raises a ``BaseException`` before the copy is queued, or with
        ``queued=True`` just after (the copy runs; the caller never gets its job)."""
        kind: FaultKind = "interrupt_after_queue" if queued else "interrupt_before_queue"
        return cls(kind, rate, _counts(nth), direction, times, 0.0, error)

    @classmethod
    def interrupt_in_callback(
        cls,
        rate: float = 0.0,
        *,
        nth: int | Iterable[int] = (),
        direction: Direction | None = None,
        times: int | None = None,
        error: ExceptionFactory | None = None,
    ) -> Fault:
        """The completion callback's first read of ``job.error`` raises a
        ``BaseException``."""
        return cls("interrupt_in_callback", rate, _counts(nth), direction, times, 0.0, error)

    @classmethod
    def slow_lane(
        cls,
        delay_s: float,
        rate: float = 0.0,
        *,
        nth: int | Iterable[int] = (),
        direction: Direction | None = None,
        times: int | None = None,
    ) -> Fault:
        """The copy ends ``delay_s`` late."""
        return cls("slow_lane", rate, _counts(nth), direction, times, delay_s)

    @classmethod
    def slot_error(
        cls,
        slots: Iterable[int],
        rate: float = 1.0,
        *,
        nth: int | Iterable[int] = (),
        direction: Direction | None = None,
        times: int | None = None,
        error: ExceptionFactory | None = None,
    ) -> Fault:
        """Every copy of a faulted job that touches one of ``slots`` fails, on every
        path; its other slots copy (a damaged host page). Every eligible job by default."""
        return cls("slot_error", rate, _counts(nth), direction, times, 0.0, error, frozenset(slots))


def _counts(nth: int | Iterable[int]) -> frozenset[int]:
    return frozenset((nth,) if isinstance(nth, int) else nth)


@dataclass
class FaultDecision:
    """What one submission gets. The backend applies it (see the module docstring)."""

    submission: int
    direction: Direction
    kinds: list[FaultKind]
    raise_before: BaseException | None = None
    raise_after: BaseException | None = None
    copy_error: BaseException | None = None
    delay_s: float = 0.0
    callback_interrupt: BaseException | None = None
    #: Damaged host slots (``slot_error``), and the error a copy touching one gets.
    bad_slots: frozenset[int] = frozenset()
    slot_error: BaseException | None = None

    def lane_copy(self, copy: Callable[..., None]) -> Callable[..., None]:
        """``copy`` as a copy lane should run it under this decision: after ``delay_s``,
        and failing with ``copy_error`` instead of copying."""
        delay, error = self.delay_s, self.copy_error

        def faulty(*args: object) -> None:
            if delay:
                time.sleep(delay)
            if error is not None:
                raise error
            copy(*args)

        return faulty


@dataclass(frozen=True)
class FaultRecord:
    """One faulted submission: its number (from 1, among all consulted), direction,
    blocks, and the kinds of fault it got."""

    submission: int
    direction: Direction
    num_blocks: int
    kinds: tuple[FaultKind, ...]


class FaultPlan:
    """Which submissions get which faults. See the module docstring.

    Every rule is evaluated at every eligible submission (a rate rule draws each time,
    fired or not), so a rule's choices depend only on the seed and on the sequence of
    submissions, not on the other rules. Used from the thread that submits (the event
    loop's)."""

    def __init__(self, *faults: Fault, seed: int = 0, include_empty: bool = False) -> None:
        for fault in faults:
            if not isinstance(fault, Fault):
                raise TypeError(f"a FaultPlan takes Fault rules, got {type(fault).__name__}")
        self.faults: tuple[Fault, ...] = faults
        self.seed = seed
        self.include_empty = include_empty
        self.reset()

    def reset(self) -> None:
        """Start over: reseed, forget counts and history."""
        self._rng = random.Random(self.seed)
        self._eligible = [0] * len(self.faults)
        self._fired = [0] * len(self.faults)
        #: Submissions consulted (all directions).
        self.submissions = 0
        #: Faults injected, per kind.
        self.fired: Counter[FaultKind] = Counter()
        #: The faulted submissions, oldest first.
        self.history: list[FaultRecord] = []

    def draw(self, direction: Direction, num_blocks: int) -> FaultDecision | None:
        """Consult the plan for one submission; ``None`` when it gets no fault."""
        self.submissions += 1
        if not num_blocks and not self.include_empty:
            return None
        hits: list[int] = []
        for i, fault in enumerate(self.faults):
            if fault.direction is not None and fault.direction != direction:
                continue
            self._eligible[i] += 1
            hit = self._eligible[i] in fault.nth
            if fault.rate and self._rng.random() < fault.rate:
                hit = True
            if hit and (fault.times is None or self._fired[i] < fault.times):
                hits.append(i)
        if not hits:
            return None
        decision = FaultDecision(self.submissions, direction, [])
        what = f"{direction} #{self.submissions}"
        for i in _effective(self.faults, hits):
            fault = self.faults[i]
            _apply(decision, fault, what)
            decision.kinds.append(fault.kind)
            self._fired[i] += 1
            self.fired[fault.kind] += 1
        self.history.append(
            FaultRecord(self.submissions, direction, num_blocks, tuple(decision.kinds))
        )
        return decision

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}={n}" for k, n in sorted(self.fired.items()))
        return (
            f"<FaultPlan seed={self.seed} {len(self.faults)} rules, "
            f"{self.submissions} submissions [{kinds}]>"
        )


def _effective(faults: tuple[Fault, ...], hits: list[int]) -> list[int]:
    """The rules among ``hits`` that act on the submission: one that raises before
    queueing hides all others (there is no copy); one that raises after queueing hides
    a callback interrupt (the engine never sees the job). One exception per place (the
    first rule's), every delay (the longest counts)."""
    kinds = [faults[i].kind for i in hits]
    for i, kind in zip(hits, kinds):
        if kind in ("submit_error", "interrupt_before_queue"):
            return [i]
    taken: set[str] = set()
    if "interrupt_after_queue" in kinds:
        taken.add("interrupt_in_callback")
    out = []
    for i, kind in zip(hits, kinds):
        if kind != "slow_lane":
            if kind in taken:
                continue
            taken.add(kind)
        out.append(i)
    return out


def _apply(decision: FaultDecision, fault: Fault, what: str) -> None:
    kind = fault.kind
    if kind == "slow_lane":
        decision.delay_s = max(decision.delay_s, fault.delay_s)
    elif kind in ("submit_error", "interrupt_before_queue"):
        decision.raise_before = fault.make_error(what)
    elif kind == "interrupt_after_queue":
        decision.raise_after = fault.make_error(what)
    elif kind == "copy_error":
        decision.copy_error = fault.make_error(what)
    elif kind == "slot_error":
        decision.bad_slots |= fault.slots
        decision.slot_error = fault.make_error(f"{what}, host slots {sorted(fault.slots)}")
    else:
        decision.callback_interrupt = fault.make_error(what)


# --- jobs under a plan ---------------------------------------------------------------------


class InjectedJob(CopyJob):
    """A job under a :class:`FaultDecision`: ends when ``inner`` does (``delay_s`` later,
    failed with ``copy_error`` if given), and once ended, the first read of ``error``
    raises ``interrupt`` (if given)."""

    __slots__ = ("_delay_ns", "_err", "_interrupt", "_scheduled", "_wake", "copy_error", "inner")

    def __init__(
        self,
        inner: CopyJob,
        *,
        copy_error: BaseException | None,
        delay_s: float,
        interrupt: BaseException | None,
        wake: Callable[[], None],
    ) -> None:
        self._interrupt: BaseException | None = None
        super().__init__(inner.num_blocks, inner.nbytes)
        self.started_ns = inner.started_ns
        self.inner = inner
        self.copy_error = copy_error
        self._delay_ns = int(delay_s * 1e9)
        self._interrupt = interrupt
        self._scheduled = False
        self._wake = wake

    @property
    def error(self) -> BaseException | None:
        interrupt = self._interrupt
        if interrupt is not None and self._done:
            self._interrupt = None
            raise interrupt
        return self._err

    @error.setter
    def error(self, value: BaseException | None) -> None:
        self._err = value

    def query(self) -> bool:
        if self._done:
            return True
        inner = self.inner
        if not inner.query():
            return False
        end = inner.finished_ns
        if self._delay_ns:
            end += self._delay_ns
            if time.perf_counter_ns() < end:
                if not self._scheduled:
                    self._scheduled = True
                    _DELAYER.wake_at(end, self._wake)
                return False
        self._err = inner.error if inner.error is not None else self.copy_error
        self.finished_ns = end
        self.stamped = inner.stamped
        self._done = True
        return True

    def check_failed(self) -> bool:
        self.inner.check_failed()
        return self.query()

    def __repr__(self) -> str:
        state = "done" if self._done else "running"
        return f"<InjectedJob {self.num_blocks} blocks {self.nbytes} B {state} of {self.inner!r}>"


def wrap_job(
    job: CopyJob, decision: FaultDecision, wake: Callable[[], None], *, in_lane: bool = False
) -> CopyJob:
    """``job`` under ``decision``: itself when nothing is left to apply. ``in_lane``: the
    lane already applied the delay and the copy error (see ``lane_copy``)."""
    copy_error = None if in_lane else decision.copy_error
    delay_s = 0.0 if in_lane else decision.delay_s
    if copy_error is None and not delay_s and decision.callback_interrupt is None:
        return job
    return InjectedJob(
        job,
        copy_error=copy_error,
        delay_s=delay_s,
        interrupt=decision.callback_interrupt,
        wake=wake,
    )


class _Delayer:
    """A thread that calls wake-ups at their times, for slow-lane jobs whose end is only
    a deadline (no lane signals it). It runs while deadlines are pending and exits once
    idle, so an idle process holds no thread for it.

    The submitting side only puts into a ``SimpleQueue`` (one C call) and starts a
    thread when none runs: it holds no Python-level lock, which an interrupt landing in
    its ``__enter__`` would leave held for good. Should an interrupt cut a start short,
    the next submission starts one (two may serve the queue a while; both exit)."""

    #: How long an idle thread waits for more before it exits.
    IDLE_S = 0.01

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, Callable[[], None]]] = queue.SimpleQueue()
        #: One entry per running thread (list appends and pops are atomic).
        self._alive: list[int] = []

    def wake_at(self, when_ns: int, wake: Callable[[], None]) -> None:
        self._queue.put((when_ns, wake))
        if not self._alive:
            threading.Thread(target=self._run, name="asyncoffload-faults", daemon=True).start()

    @property
    def idle(self) -> bool:
        return not self._alive

    def _run(self) -> None:
        self._alive.append(1)
        heap: list[tuple[int, int, Callable[[], None]]] = []
        count = 0
        while True:
            timeout = self.IDLE_S
            if heap:
                timeout = max(0.0, (heap[0][0] - time.perf_counter_ns()) / 1e9)
            try:
                when, wake = self._queue.get(timeout=timeout)
            except queue.Empty:
                pass
            else:
                count += 1
                heapq.heappush(heap, (when, count, wake))
                continue
            now = time.perf_counter_ns()
            while heap and heap[0][0] <= now:
                with contextlib.suppress(Exception):  # a closed loop: nobody waits any more
                    heapq.heappop(heap)[2]()
            if not heap:
                self._alive.pop()
                try:  # one more look: a wake-up put just as this thread was leaving
                    when, wake = self._queue.get_nowait()
                except queue.Empty:
                    return
                self._alive.append(1)
                count += 1
                heapq.heappush(heap, (when, count, wake))


_DELAYER = _Delayer()


def delayer_idle() -> bool:
    """Whether no thread serves slow-lane wake-ups (the last one has exited)."""
    return _DELAYER.idle


# --- installing a plan ----------------------------------------------------------------------


class _Backend(Protocol):
    """What a plan is installed on: a :class:`~asyncoffload.transfer.base.TransferBackend`
    (which imports this module, so it is named here by what is used of it)."""

    faults: FaultPlan | None

    def _submit_faulted(
        self, submit: Submit, first: Sequence[int], second: Sequence[int], decision: FaultDecision
    ) -> CopyJob: ...


class _FaultySubmit:
    """Stands in for a backend's ``submit_store`` / ``submit_load`` under a plan."""

    __slots__ = ("backend", "direction", "plan", "real")

    def __init__(
        self, backend: _Backend, direction: Direction, plan: FaultPlan, real: Submit
    ) -> None:
        self.backend = backend
        self.direction = direction
        self.plan = plan
        self.real = real

    def __call__(self, first: Sequence[int], second: Sequence[int]) -> CopyJob:
        decision = self.plan.draw(self.direction, len(first))
        if decision is None:
            return self.real(first, second)
        if decision.raise_before is not None:
            raise decision.raise_before
        job = self.backend._submit_faulted(self.real, first, second, decision)
        if decision.raise_after is not None:
            raise decision.raise_after
        return job


def install(backend: _Backend, plan: FaultPlan | None) -> None:
    """Make ``backend`` consult ``plan`` (``None``: stop); see
    :meth:`TransferBackend.inject_faults`."""
    if plan is not None and not isinstance(plan, FaultPlan):
        raise TypeError(f"inject_faults takes a FaultPlan or None, got {type(plan).__name__}")
    if plan is not None and any(f.kind == "slot_error" for f in plan.faults):
        raise ValueError("slot_error faults apply to a PagedTransferWorker only")
    attrs = vars(backend)
    directions: tuple[tuple[str, Direction], ...] = (
        ("submit_store", "store"),
        ("submit_load", "load"),
    )
    for name, direction in directions:
        current = attrs.get(name)
        if isinstance(current, _FaultySubmit):  # a plan is installed: unwrap it first
            del attrs[name]
            if current.real != getattr(backend, name):  # it wrapped an instance override
                attrs[name] = current.real
        if plan is not None:
            real: Submit = getattr(backend, name)
            attrs[name] = _FaultySubmit(backend, direction, plan, real)
    backend.faults = plan
