"""A driver of the tier core for callers that poll: no event loop of their own.

vLLM's scheduler (``integrations/vllm/tiers.py``) and the frameworks whose own host
memory sits above our tiers (``tiers/lent.py``: vLLM 0.34's secondary tiers, SGLang's
HiCache storage) call in from threads that run no event loop. :class:`PolledTiers`
carries the core's requests for them, and nothing else:

- reads, writes and deletes go to the tiers' native lanes, whose ends :meth:`poll`
  takes (each tier's heads only: a tier's jobs end about in order);
- a shared tier's client runs on a private event loop
  (:class:`~asyncoffload.tiers.private_loop.PrivateLoop`) that :meth:`flush` steps
  while something of ours is in flight on it: submissions and questions are made there;
- each result goes back to the core with the time, and the core's deadlines are checked
  when due.

Every rule (which tier holds a key, promotions and their slots, write-through,
questions, drops, counters, events) is the core's,
:class:`~asyncoffload.tiers.core.TierHierarchy`. A subclass says where a CPU slot lives
(``address``), whether I/O is blocked now (:meth:`PolledTiers._blocked`), and what its
world does when a read, a write or a stall ends (the ``_on_*`` hooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from asyncoffload.keys import OffloadKey
from asyncoffload.tiers import ports
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.core import (
    CostedHierarchy,
    CpuIndex,
    Delete,
    Exists,
    Promotion,
    Request,
    TierIo,
    TierState,
    TierStats,
)
from asyncoffload.tiers.private_loop import PrivateLoop
from asyncoffload.transfer.base import CopyJob, FailedJob

__all__ = ["CLOSE_TIMEOUT_S", "PolledTiers"]

log = logging.getLogger("asyncoffload.tiers")

#: Seconds the shutdown waits for a shared tier's client to close.
CLOSE_TIMEOUT_S = 5.0


class PolledTiers:
    """The tiers ``stores`` (highest first) below the CPU index ``cpu``, driven by a
    caller that polls. ``address(slot)``: where CPU slot ``slot``'s bytes start in this
    process. ``wake_fd``: an eventfd the lanes write when a job ends (``None``: nothing
    is signalled; the caller polls)."""

    def __init__(
        self,
        cpu: CpuIndex,
        stores: Sequence[LowerTier],
        address: Callable[[int], int],
        *,
        wake_fd: int | None = None,
    ) -> None:
        self.core = CostedHierarchy(cpu, ports.tier_states(stores))
        self.tiers = self.core.tiers
        self._ports = dict(zip(self.tiers, stores))
        self._stores = list(stores)
        self._shared = self.core.shared_tiers
        self._address = address
        #: Each tier's reads, writes and deletes in flight, in submission order (they end
        #: about in order); each request's job is in its ``job``.
        self._reads: dict[TierState, deque[TierIo]] = {t: deque() for t in self.tiers}
        self._writes: dict[TierState, deque[TierIo]] = {t: deque() for t in self.tiers}
        self._deletes: dict[TierState, deque[Delete]] = {t: deque() for t in self.tiers}
        self._closed = False
        # The shared tiers' private loop, stepped from the caller (see the module docstring).
        self._loop = PrivateLoop() if self._shared else None
        #: Questions out on the private loop (each one's task in its ``job``).
        self._queries: list[Exists] = []
        self.deadline_s = self.core.deadline_s
        for store in stores:
            store.bind(wake_fd)

    def configure_cost(
        self,
        enabled: bool,
        tokens_per_block: int,
        tokens_per_s: float | None,
        deadline_factor: float = 1.0,
        deadline_floor_s: float = 0.05,
        probe_every_s: float = 5.0,
    ) -> None:
        """The load-or-recompute rule (``tiers.core.cost``): on or off, the tokens of one
        block, the framework's prefill throughput if configured (None: unknown, or
        measured from its steps by the driver), the deadline's factor and floor, and how
        often a tier judged slow is probed."""
        cost = self.core.cost
        cost.enabled = enabled
        cost.deadline_factor, cost.min_deadline_s = deadline_factor, deadline_floor_s
        cost.probe_every_s = probe_every_s
        cost.recompute.tokens_per_block = tokens_per_block
        if tokens_per_s is not None:
            cost.recompute.tokens_per_s = tokens_per_s
            cost.recompute.configured = True

    def connect(self) -> None:
        """Open the shared tiers' connections now, once, at start-up: the private loop
        runs only while the caller calls in, and a handshake of several round trips made
        in the middle of a request would outlive the request's deadline. A server down
        now is not an error: the tier then connects when first used."""
        for tier in self._shared:
            connect = getattr(self._ports[tier], "connect", None)
            if connect is None:
                continue
            try:
                assert self._loop is not None
                self._loop.run(connect())
            except Exception as exc:
                log.warning(
                    "shared tier %s: no connection at start-up (%r): it connects when first used",
                    tier.name,
                    exc,
                )

    @property
    def stores(self) -> tuple[LowerTier, ...]:
        """The running tiers' ports, highest first."""
        return tuple(self._ports.values())

    @property
    def miss_ttl_s(self) -> float:
        """How long a shared tier's "not there" is remembered (the core's rule)."""
        return self.core.questions.miss_ttl_s

    @miss_ttl_s.setter
    def miss_ttl_s(self, seconds: float) -> None:
        self.core.questions.miss_ttl_s = seconds

    def _blocked(self) -> str:
        """Why no tier I/O can run now (a cause the core counts), or ""."""
        return ""

    # --- what a subclass's world does when I/O ends ---------------------------------

    def _on_read(self, io: TierIo, finished: list[Promotion]) -> None:
        """A read ended (``io.bad``: its keys that failed); ``finished``: the
        promotions it was the last read of."""

    def _on_write(self, io: TierIo) -> None:
        """A write ended."""

    def _on_stalled(self, promotions: list[Promotion]) -> None:
        """Promotions whose read outlived their tier's deadline failed (their slots stay
        held until the read ends)."""

    def _on_reaped(self, ended: list[TierIo]) -> None:
        """Jobs given up on really ended: their slots are released now."""

    # --- carrying the core's requests -------------------------------------------------

    def _carry(self, requests: Sequence[Request]) -> None:
        """Hand each request to its port: reads, writes and deletes to the lanes (polled;
        a delete with no job is done), questions to a task on the private loop."""
        for req in requests:
            if isinstance(req, TierIo):
                self._submit(req)
                (self._writes if req.write else self._reads)[req.tier].append(req)
            elif isinstance(req, Delete):
                if ports.delete(self._ports[req.tier], req) is not None:
                    self._deletes[req.tier].append(req)
            else:
                loop = self._loop
                assert loop is not None and loop.loop is not None
                task = loop.loop.create_task(ports.shared(self._ports[req.tier]).exists(req.keys))
                loop.track(task)
                req.job = task
                self._queries.append(req)

    def _submit(self, io: TierIo) -> CopyJob:
        """Hand ``io`` to its tier: a shared tier's job is a task on the private loop,
        submitted from inside it."""
        host = [self._address(slot) for slot in io.cpu_slots]
        store = self._ports[io.tier]
        loop = self._loop
        if not io.tier.shared or loop is None:
            return ports.submit(store, io, host)
        try:
            job = loop.call(ports.submit, store, io, host)
        except Exception as exc:
            log.warning("a tier I/O submission failed: %r", exc)
            job = io.job = FailedJob(len(io.keys), exc.with_traceback(None))
            return job
        task = getattr(job, "task", None)
        if isinstance(task, asyncio.Future):
            loop.track(task)
        return job

    # --- polling --------------------------------------------------------------------

    def pending(self) -> bool:
        """Whether a read, a write or a shared tier's question is in flight (deletes are
        not waited for: the next poll takes their ends), promotions or questions
        wait to be submitted, or a task of ours runs on the private loop (a shared tier's
        removal of a damaged value: the caller steps the loop only while this says so)."""
        core = self.core
        on_loop = self._loop is not None and bool(self._loop.on_loop)
        return bool(core.batched or core.questions.asking or self._io_in_flight() or on_loop)

    def _io_in_flight(self) -> bool:
        """Whether reads or writes are in flight."""
        return any(self._reads.values()) or any(self._writes.values())

    def _jobs(self) -> int:
        """How many reads, writes and deletes are in flight."""
        reads, writes = self._reads.values(), self._writes.values()
        return sum(map(len, reads)) + sum(map(len, writes)) + sum(map(len, self._deletes.values()))

    def poll(self) -> None:
        """Finish the I/O jobs that ended (only each tier's heads: a tier's jobs end
        about in order), take the shared tiers' answers that arrived, and let the core
        decide what is due. It does not step the private loop (cheap enough for every
        lookup)."""
        core = self.core
        now = time.monotonic()
        for reads in self._reads.values():
            while reads and reads[0].job.query():
                io = reads.popleft()
                finished = core.read_done(io, ports.outcome(io.job, len(io.keys)), now)
                if io.tier.shared:
                    self._track_background(self._ports[io.tier])
                self._on_read(io, finished)
        for writes in self._writes.values():
            while writes and writes[0].job.query():
                io = writes.popleft()
                core.write_done(io, ports.outcome(io.job, len(io.keys)), now)
                self._on_write(io)
        for deletes in self._deletes.values():
            while deletes and deletes[0].job.query():
                req = deletes.popleft()
                core.delete_done(req, ports.outcome(req.job, len(req.keys)), now)
        self._reap(now)
        due = core.next_deadline()
        if due is not None and due <= now:
            stalled = core.check(now)  # stalled promotions (misses), silent servers
            if stalled:
                self._on_stalled(stalled)
        if self._queries:
            self._answers(now)
        self._carry(core.take_io(now, batched=False))  # the deletes of dropped blocks

    def _reap(self, now: float) -> None:
        """Jobs given up on (stuck disk ops) that ended: their slots go."""
        late = self.core.late
        if not late:
            return
        ports.reap(self.core, now)
        still = {id(io) for io in self.core.late}
        ended = [io for io in late if id(io) not in still]
        if ended:
            self._on_reaped(ended)

    def _track_background(self, port: object) -> None:
        """Step the private loop while ``port``'s own tasks run (see ``pending``)."""
        loop = self._loop
        for task in getattr(port, "background", ()):
            if loop is not None:
                loop.track(task)

    def flush(self) -> None:
        """Submit the promotions found since the last flush, one read job per tier, and
        the shared tiers' questions; then step the private loop and take what ended."""
        self._carry(self.core.take_io(time.monotonic()))
        loop = self._loop
        if loop is not None and loop.on_loop:
            loop.step()
            self.poll()

    def _answers(self, now: float) -> None:
        """Take the answers of the questions that ended; drop those the core gave up on."""
        left: list[Exists] = []
        for q in self._queries:
            task: asyncio.Task[list[bool]] = q.job
            if q.settled:  # unanswered by its deadline: failed already
                task.cancel()
            elif not task.done():
                left.append(q)
            elif task.cancelled():
                self.core.answered(q, None, asyncio.CancelledError(), now)
            elif (error := task.exception()) is not None:
                self.core.answered(q, None, error, now)
            else:
                self.core.answered(q, task.result(), None, now)
        self._queries = left

    # --- write-through --------------------------------------------------------------

    def write_through(self, keys: Sequence[OffloadKey]) -> None:
        """Offer CPU-ready ``keys`` to each tier; those its admission takes are written
        from their CPU slots, which stay pinned until the write ends."""
        if self._closed or not keys:
            return
        self.core.write_through(keys, None, blocked=self._blocked())
        self._carry(self.core.take_io(time.monotonic(), batched=False))

    # --- events, stats --------------------------------------------------------------

    def stats(self) -> tuple[TierStats, ...]:
        return self.core.stats(self._info)

    def _info(self, tier: TierState) -> dict[str, object]:
        return self._ports[tier].describe()

    # --- lifecycle ------------------------------------------------------------------

    def drain(self, timeout_s: float | None = None) -> bool:
        """Finish every I/O job (promotions not submitted are released; questions to the
        shared tiers go on, they touch no slot): wait at most ``timeout_s``, by default
        the tiers' deadline plus the core's grace. False if a job still runs then (a
        stalled disk or server: its slots may still be read or written)."""
        core = self.core
        released = core.cancel_reads()
        if released:
            self._on_stalled(released)
        start = time.monotonic()
        limit = core.drain_deadline(start) if timeout_s is None else start + timeout_s
        while True:
            if self._loop is not None:
                self._loop.step()
            self.poll()
            # Writes a read guard paused wait in the core with no job: poll hands them out.
            if not self._jobs() and not any(t.pressure.waiting for t in core.tiers):
                return True
            if time.monotonic() > limit:
                log.error(
                    "%d tier I/O jobs still run %.1fs after the drain began (a stalled "
                    "disk or server?): going on without them",
                    self._jobs(),
                    limit - start,
                )
                return False
            time.sleep(0.001)

    def _close_ports(self) -> None:
        """Drain, close every tier (its lanes joined; a shared tier's client closed on
        the private loop, for at most ``CLOSE_TIMEOUT_S``), close the loop."""
        self.drain()
        self._closed = True
        for q in self.core.close():
            if isinstance(q.job, asyncio.Future):
                q.job.cancel()
        self._queries.clear()
        for tier, store in self._ports.items():
            try:
                if tier.shared and self._loop is not None:
                    closing = asyncio.wait_for(_aclose_shared(store), CLOSE_TIMEOUT_S)
                    self._loop.run(closing)
                else:
                    store.close()
            except Exception:
                log.exception("closing tier %s failed", tier.name)
                if tier.shared:
                    with contextlib.suppress(Exception):
                        store.close()
            self._reads[tier].clear()
            self._writes[tier].clear()
            self._deletes[tier].clear()
        if self._loop is not None:
            self._loop.close()
        self._reap(time.monotonic())


async def _aclose_shared(store: LowerTier) -> None:
    """``store.aclose()`` (which closes its client's connections too)."""
    await store.aclose()
