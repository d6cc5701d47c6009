"""Our tiers under a framework that owns the host memory above them.

vLLM 0.34's tiering keeps its own CPU primary tier and lends its chunks to a secondary
tier's jobs (``integrations/vllm/secondary.py``); SGLang's HiCache keeps its own host
pool and lends its pages to a storage backend's calls (``integrations/sglang``). In both,
the framework decides what is in host memory; our tiers only store blocks from slots
the framework lends and load blocks into slots it lends.

:class:`LentTiers` drives the tier core (:class:`~asyncoffload.tiers.core.TierHierarchy`)
for them, with the framework's slots as the core's CPU index (:class:`LentSlots`): a
store is the core's write-through of the lent slots, a load is the core's promotion
into them. Every rule (which tier holds a key, admission, eviction, checks, drops,
failure causes, stalls, the shared tiers' questions and their negative answers, events)
stays the core's; the carrying is :class:`~asyncoffload.tiers.polled.PolledTiers`'.

Each store and load is a :class:`LentJob`. A framework that polls (vLLM) takes the
jobs that ended from :meth:`LentTiers.poll`; one whose calls block (SGLang's I/O
threads) waits for them (:meth:`LentTiers.wait`). Every method may be called from any
thread: one lock guards the core. A caller that waits runs the wait itself, on its own
thread: the lanes signal an eventfd that it sleeps on, and a shared tier's client runs
on the private event loop that the waiting caller runs; no thread of ours completes I/O.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncoffload.keys import OffloadKey
from asyncoffload.manager.base import (
    BlockStatus,
    CPULoadStoreSpec,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.core import MAX_KEY_BYTES, Promotion, TierIo, TierState, TierStats
from asyncoffload.tiers.polled import PolledTiers

__all__ = ["LentJob", "LentSlots", "LentTiers"]

log = logging.getLogger("asyncoffload.tiers")

#: A waiting caller sleeps at most this long before it looks again (an I/O end wakes it
#: sooner); followers of the caller that sleeps on the lanes wake at least this often.
_SLICE_S = 0.02


def _ready_block() -> BlockStatus:
    block = BlockStatus(-1)
    block.ref_cnt = 0
    return block


#: What :meth:`LentSlots.block_of` answers for a lent key: ready, idle.
_READY = _ready_block()


class LentSlots:
    """The framework's host slots as the core's CPU index.

    The framework owns the slots; during one core call, :meth:`lending` says which slot
    each key of the job has. The core reserves (a load) or pins (a store) exactly those;
    it never evicts, and what it releases goes back to the framework through the job
    (:class:`LentJob`), not through this index."""

    #: The framework's slots are not counted here: only a tier's write lag sheds its
    #: write-through (``core.backpressure``), not the share of slots it pins.
    num_blocks = no_room = 0

    def __init__(self) -> None:
        self._lent: dict[OffloadKey, int] = {}

    @contextlib.contextmanager
    def lending(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> Iterator[None]:
        self._lent = dict(zip(keys, slots))
        try:
            yield
        finally:
            self._lent = {}

    def block_of(self, key: OffloadKey) -> BlockStatus | None:
        return _READY if key in self._lent else None

    def _slots(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        return CPULoadStoreSpec(tuple(self._lent[key] for key in keys))

    def reserve(
        self, keys: Sequence[OffloadKey], protect: Sequence[OffloadKey] = (), ctx: object = None
    ) -> PrepareStoreOutput | None:
        return PrepareStoreOutput(list(keys), self._slots(keys), [])

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, success: bool = True
    ) -> None:
        """The framework's slots are the framework's: nothing to record."""

    def pin(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        return self._slots(keys)

    def prepare_load(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        return self._slots(keys)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """As :meth:`complete_store`."""


@dataclass(eq=False)
class LentJob:
    """One store (``write``) or load of ``keys`` from or into the framework's
    ``slots``; ``owner``: the framework's handle of it.

    Once ``done``, ``ok`` says per key whether it succeeded: a load's bytes are in the
    slot and passed their checks; a store failed nowhere (a key no tier's admission
    took, or that a tier held already, is ok). ``written``: a store's keys that a tier
    holds now. ``released`` is set once no operation of ours can touch the slots any
    more: at ``done``, or later for an operation given up on while it still ran (a read
    stuck in a system call past its deadline). ``causes``: why keys failed. ``moved``:
    the blocks it read, or wrote (a store's keys that a tier held already are not);
    ``submitted`` and ``finished``: when it began and ended (``time.monotonic()``)."""

    keys: list[OffloadKey]
    slots: list[int]
    write: bool
    owner: Any = None
    done: bool = False
    ok: list[bool] = field(default_factory=list)
    written: list[bool] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)
    moved: int = 0
    submitted: float = field(default_factory=time.monotonic)
    finished: float = 0.0
    #: A store's keys that a tier held before it.
    _held_before: frozenset[OffloadKey] = frozenset()
    #: Its I/O requests not ended, and those whose slots are still held.
    _open: int = 0
    _held: int = 0

    def _fail(self, keys: Sequence[OffloadKey]) -> None:
        bad = set(keys)
        self.ok = [ok and key not in bad for key, ok in zip(self.keys, self.ok)]


class LentTiers(PolledTiers):
    """The tiers ``stores`` (opened ports, highest first) under a framework whose slot
    ``slot`` starts at host address ``address(slot)`` and holds one block of the tiers'
    ``block_bytes``. ``tenant``: the deployment's, whose quota in each tier (its
    settings' ``quotas``) every store counts in."""

    def __init__(
        self, stores: Sequence[LowerTier], address: Callable[[int], int], tenant: str = ""
    ) -> None:
        sizes = {store.block_bytes for store in stores}
        if len(sizes) > 1:
            raise ValueError(f"the tiers hold blocks of different sizes: {sorted(sizes)} B")
        self.slots = LentSlots()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        #: Whether a waiting caller sleeps on the lanes or runs the private loop now.
        self._leader = False
        self._looping = False
        #: Each request in flight's job.
        self._jobs_of: dict[int, LentJob] = {}
        self._ended: list[LentJob] = []
        try:
            super().__init__(self.slots, stores, address, wake_fd=self._wake)
            self.connect()
        except BaseException:
            os.close(self._wake)
            raise
        self.block_bytes = sizes.pop() if sizes else 0
        self._ctx = ReqContext("", tenant=tenant) if tenant else None

    # --- entering ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _entered(self) -> Iterator[None]:
        """The lock, after waking a caller that runs the private loop under it."""
        if self._looping:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake, 1)
        with self._lock:
            yield

    # --- which tier holds a key -------------------------------------------------------

    def source(self, key: OffloadKey) -> str | None:
        """The name of the highest tier holding ``key`` ready, or None."""
        with self._entered():
            tier = self._readable(key)
            return None if tier is None else tier.name

    def _readable(self, key: OffloadKey) -> TierState | None:
        """The highest tier ``key`` may be read from now: None while a read of it that
        ended failed past its deadline still runs (its index drops it once that read
        ends; asked meanwhile, a framework whose slots are lent would read it again,
        into other slots, behind the same stuck read: vLLM 0.34's did, in a CI run)."""
        core = self.core
        return None if core.stalled(key) else core.source(key)

    def lookup(self, key: OffloadKey, run: int = 0) -> Literal["hit", "miss", "pending"]:
        """``hit``: a tier holds ``key`` ready; ``pending``: the shared tiers are asked
        about it (ask again once :meth:`flush` or :meth:`poll` took the answer);
        ``miss`` otherwise. Non-blocking.

        ``run`` (for a framework that looks keys up one at a time): the blocks a read
        from ``key``'s tier would bring, ``key`` the last of the request's run from it.
        A held key is then a ``miss`` when reading them is expected to lose to
        recomputing them (load or recompute, ``tiers.core.cost``), counted
        ``recomputed_by_choice``: the framework recomputes from there."""
        with self._entered():
            core = self.core
            if core.stalled(key):
                return "miss"
            tier = core.source(key)
            if tier is not None:
                if run <= 0 or core.cost.worth({tier: run}, time.monotonic(), count=False):
                    return "hit"
                tier.counters.recomputed_by_choice += 1
                return "miss"
            if not self._shared or self._closed:
                return "miss"
            now = time.monotonic()
            if not core.questions.want(key, now, core.known(key), self._blocked()):
                return "miss"
            if core.io_due:
                self.flush()
            return "pending"

    def exists(self, keys: Sequence[OffloadKey], timeout_s: float) -> list[bool]:
        """Per key, whether a tier holds it ready; keys no tier knows are asked of the
        shared tiers first, waiting for their answers at most ``timeout_s`` (blocking
        the caller). An unanswered question is a miss (the core counts it)."""
        with self._entered():
            if self._shared and not self._closed:
                now = time.monotonic()
                unknown = [k for k in keys if self.core.source(k) is None]
                asked = self.core.ask(unknown, now) if unknown else []
                self._carry(asked)
            else:
                asked = []
        if asked:
            self._wait_until(lambda: all(q.settled for q in asked), timeout_s)
        with self._entered():
            return [self._readable(k) is not None for k in keys]

    # --- stores and loads --------------------------------------------------------------

    def store(self, keys: Sequence[OffloadKey], slots: Sequence[int], owner: Any = None) -> LentJob:
        """Write the lent ``slots`` (one per key, untouched by the framework until the
        job's ``released``) to every tier whose admission takes their keys."""
        job = self._job(keys, slots, owner, write=True)
        with self._entered():
            if self._closed:
                return self._refused(job, "closed")
            core = self.core
            job._held_before = frozenset(k for k in job.keys if core.source(k) is not None)
            fit = [key for key in dict.fromkeys(job.keys) if len(key) <= MAX_KEY_BYTES]
            if len(fit) < len(set(job.keys)):
                job._fail([key for key in job.keys if len(key) > MAX_KEY_BYTES])
                job.causes.append(f"a key over {MAX_KEY_BYTES} bytes")
            with self.slots.lending(job.keys, job.slots):
                core.write_through(fit, self._ctx, blocked=self._blocked())
                requests = core.take_io(time.monotonic(), batched=False)
            writes = [r for r in requests if isinstance(r, TierIo) and r.write]
            self._own(job, writes)
            self._carry(requests)
            if not writes:
                self._end(job)
            return job

    def load(self, keys: Sequence[OffloadKey], slots: Sequence[int], owner: Any = None) -> LentJob:
        """Read ``keys`` into the lent ``slots`` (one per key); a key ready in no tier
        fails at once. Each key's bytes pass their tier's checks before it is ok."""
        job = self._job(keys, slots, owner, write=False)
        if len(set(job.keys)) < len(job.keys):
            raise ValueError("load: a key is listed twice (each needs its own slot)")
        with self._entered():
            if self._closed:
                return self._refused(job, "closed")
            core = self.core
            sources: dict[OffloadKey, TierState] = {}
            for key in job.keys:
                tier = self._readable(key)
                if tier is not None:
                    sources[key] = tier
            missing = [key for key in job.keys if key not in sources]
            if missing:
                job._fail(missing)
                job.causes.append(f"{len(missing)} keys in no tier")
            blocked = self._blocked()
            if blocked and sources:
                for tier in dict.fromkeys(sources.values()):
                    core.skip(tier, blocked, 1)
                job._fail(list(sources))
                sources = {}
            if not sources:
                self._end(job)
                return job
            with self.slots.lending(job.keys, job.slots):
                promotion = core.promote(sources, None)
            assert promotion is not None  # lent slots are never short
            promotion.owner = job
            requests = core.take_io(time.monotonic())
            reads = [r for r in requests if isinstance(r, TierIo) and not r.write]
            self._own(job, reads)
            self._carry(requests)
            return job

    def _job(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], owner: Any, *, write: bool
    ) -> LentJob:
        what = "store" if write else "load"
        keys, slots = list(keys), list(slots)
        if len(keys) != len(slots):
            raise ValueError(f"{what}: {len(keys)} keys but {len(slots)} slots")
        for slot in slots:
            if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
                raise ValueError(f"{what}: slot {slot!r} is not an int >= 0")
        for key in keys:
            if not isinstance(key, bytes):
                raise TypeError(f"{what}: key {key!r} is not bytes")
        return LentJob(keys, slots, write, owner, ok=[True] * len(keys))

    def _refused(self, job: LentJob, cause: str) -> LentJob:
        job._fail(job.keys)
        job.causes.append(cause)
        self._end(job)
        return job

    def _own(self, job: LentJob, requests: Sequence[TierIo]) -> None:
        job._open = job._held = len(requests)
        for io in requests:
            self._jobs_of[id(io)] = job

    def _end(self, job: LentJob) -> None:
        if job.done:
            return
        job.done = True
        job.finished = time.monotonic()
        if job.write:
            job.written = [self.core.source(key) is not None for key in job.keys]
            before = job._held_before
            job.moved = sum(1 for k, w in zip(job.keys, job.written) if w and k not in before)
        else:
            job.moved = sum(job.ok)
        if job._held <= 0:
            job.released.set()
        self._ended.append(job)
        self._cond.notify_all()

    def _let_go(self, job: LentJob) -> None:
        job._held -= 1
        if job._held <= 0 and job.done:
            job.released.set()

    # --- what ends (the polled driver's hooks) ----------------------------------------

    def _held_late(self, io: TierIo) -> bool:
        return any(late is io for late in self.core.late)

    def _on_read(self, io: TierIo, finished: list[Promotion]) -> None:
        job = self._jobs_of.get(id(io))
        if job is None:
            return
        if io.bad:
            job._fail(io.bad)
            job.causes.append(f"{io.tier.name}: {len(io.bad)} blocks failed their read")
        job._open -= 1
        if not self._held_late(io):
            self._jobs_of.pop(id(io), None)
            self._let_go(job)
        for promotion in finished:
            if promotion.owner is job:
                if promotion.error is not None:
                    job._fail(job.keys)
                    job.causes.append(repr(promotion.error))
                self._end(job)

    def _on_write(self, io: TierIo) -> None:
        job = self._jobs_of.get(id(io))
        if job is None:
            return
        index = io.tier.index
        bad = [key for key in io.keys if not index.ready(key)]
        if bad:
            job._fail(bad)
            job.causes.append(f"{io.tier.name}: {len(bad)} blocks could not be written")
        job._open -= 1
        if not self._held_late(io):
            self._jobs_of.pop(id(io), None)
            self._let_go(job)
        if job._open <= 0:
            self._end(job)

    def _on_stalled(self, promotions: list[Promotion]) -> None:
        for promotion in promotions:
            job = promotion.owner
            if isinstance(job, LentJob) and not job.done:
                job._fail(job.keys)
                job.causes.append("the read outlived its tier's deadline")
                self._end(job)

    def _on_reaped(self, ended: list[TierIo]) -> None:
        for io in ended:
            job = self._jobs_of.pop(id(io), None)
            if job is not None:
                self._let_go(job)

    # --- polling and waiting ----------------------------------------------------------

    def poll(self) -> None:
        with self._entered():
            super().poll()

    def flush(self) -> None:
        with self._entered():
            super().flush()

    def ended(self) -> list[LentJob]:
        """The jobs that ended since the last call (after taking what ended now)."""
        with self._entered():
            self._progress()
            out, self._ended = self._ended, []
            return out

    def _progress(self) -> None:
        """Hand out what is queued, step the private loop, take what ended."""
        super().flush()
        super().poll()

    def wait(self, jobs: Sequence[LentJob], timeout_s: float) -> bool:
        """Block until every job of ``jobs`` ended, at most ``timeout_s``; whether they
        did. (A job that did not is still in flight: take it later.)"""
        return self._wait_until(lambda: all(job.done for job in jobs), timeout_s)

    def _wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Make progress until ``done()``, at most ``timeout_s``. One waiting caller at a
        time sleeps on the lanes' eventfd (or runs the private loop, holding the lock:
        callers that only enter wake it first); the others wait on the condition, which
        every end of a job notifies."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._progress()
                if done():
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return done()
                if self._leader:
                    self._cond.wait(min(left, _SLICE_S))
                    continue
                self._leader = True
                try:
                    if self._loop is not None:
                        self._looping = True
                        try:
                            self._loop.wait(min(left, _SLICE_S), self._wake)
                        finally:
                            self._looping = False
                        continue
                finally:
                    if self._loop is not None:
                        self._leader = False
            try:
                with contextlib.suppress(OSError, ValueError):  # closed meanwhile
                    select.select([self._wake], [], [], min(left, _SLICE_S))
                with contextlib.suppress(BlockingIOError, OSError):
                    os.eventfd_read(self._wake)
            finally:
                with self._lock:
                    self._leader = False
                    self._cond.notify_all()

    def pending(self) -> bool:
        with self._entered():
            return super().pending()

    # --- events, stats, closing ---------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        """Each tier's stored and removed events since the last call, tier order."""
        with self._entered():
            return self.core.take_events()

    def stats(self) -> tuple[TierStats, ...]:
        with self._entered():
            return super().stats()

    def drain(self, timeout_s: float | None = None) -> bool:
        with self._entered():
            return super().drain(timeout_s)

    def close(self) -> None:
        """Drain, close every tier, then end every job still open as failed (its slots
        are released once its operations end). Idempotent."""
        with self._entered():
            if self._closed:
                return
            self._close_ports()
            for job in {id(j): j for j in self._jobs_of.values()}.values():
                if not job.done:
                    job._fail(job.keys)
                    job.causes.append("closed")
                    self._end(job)
            wake, self._wake = self._wake, -1
            os.close(wake)  # the lanes hold their own copies
