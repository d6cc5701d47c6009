"""Lower tiers under vLLM: the scheduler side of the disk and shared (Redis / Valkey)
tiers below the CPU tier.

vLLM splits the offloading backend in two: the manager (every index) in the scheduler
process, the host slots and their copies in each worker process. With ``tiers`` set,
the scheduler maps every worker's host pool file (``host_pools.HostPools``) so that the
tiers' lanes move blocks straight between the slots and the tier, driven from here.

Nothing here blocks or runs a Python thread: I/O jobs are submitted to the native
lanes and polled (:meth:`SchedulerTiers.poll`) at the start of every manager call,
which vLLM makes every step. A shared tier's client runs on a private event loop
(``private_loop.PrivateLoop``) that :meth:`SchedulerTiers.flush` (every manager call
but ``lookup``) steps while something of ours is in flight on it. It does not import vLLM.

- A lookup of a key absent from the CPU tier and ready in a lower tier starts a
  *promotion*: a CPU slot is reserved (the CPU tier's ``reserve``), the key answers
  ``HIT_PENDING`` and the read is submitted, with the others of that step, when the
  step's scheduling ends. When the read has ended and passed its checks, the CPU tier's
  ``complete_store`` makes the key ready (``HIT`` from then on); a failed read drops the
  key from the tier and frees the slot (``MISS`` from then on: it is never offered
  again). No free or idle CPU slot: ``MISS`` (counted as ``no_slot``), unless tier I/O
  of ours holds CPU slots (a write-through pins its slots until it ends, a read holds
  those it fills): then the key answers ``HIT_PENDING`` with no slot, and its next
  lookups try again until the I/O that was in flight then has ended (each job ends
  within its tier's deadline); a key still without a slot then is a ``MISS``. vLLM
  loads a request's prefix up to its first ``MISS``: without the wait, a request
  looked up while the write-through of the blocks just stored still ran loaded only
  the blocks that found a slot (3 of 9 in real vLLM at TP 2, issue 37).
- Stores the CPU tier completed are written through to each tier its admission lets in,
  from their CPU slots, pinned until the write ends, as the engine does.
- Every rule of the tiers (which tier holds a key, how a promotion reserves, reads,
  settles or fails, write-through, drops, counters, events) is the sans-I/O core's,
  :class:`~asyncoffload.tiers.core.TierHierarchy`, which the engine drives too;
  this module only carries its requests to the lanes and the private loop, polls for
  their ends and hands them back with the time, and keeps the scheduler's world: the
  host pool file and the private loop. The core also bounds every ``HIT_PENDING``: a
  promotion whose read outlives its tier's deadline plus a second fails (its key is a
  ``MISS`` while the read still runs; its slot is freed when it ends), as in the engine.
- A shared tier knows only the blocks this engine wrote or found there. A key absent
  from the CPU tier and unknown to every lower tier is asked about (``EXISTS``, once per
  key, the step's keys in one pipelined query per shared tier, sent at the step's end)
  and answers ``HIT_PENDING`` until the answer arrives. A key found joins the tier's
  index (a stored event), and its next lookup promotes it as from disk; a key not found
  answers ``MISS``, and so does every lookup of it for ``miss_ttl_s`` seconds (a
  bounded memory of negative answers). A query that fails (the server down, no answer
  within the tier's ``timeout_s``) is a ``MISS``, logged at most once a minute, and
  the tier is not asked again for ``miss_ttl_s``.
- Failures are counted by cause and skipped; nothing reaches vLLM's worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from asyncoffload.integrations.vllm.host_pools import HostPools, host_pool_path
from asyncoffload.integrations.vllm.private_loop import PrivateLoop
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.tiers import ports
from asyncoffload.tiers._io import keep_until_ended
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.core import (
    Delete,
    Exists,
    Request,
    TierHierarchy,
    TierIo,
    TierState,
    TierStats,
)
from asyncoffload.transfer.base import CopyJob, FailedJob

__all__ = ["SchedulerTiers", "host_pool_path"]

log = logging.getLogger("asyncoffload.vllm")

#: Seconds the shutdown waits for a shared tier's client to close.
_CLOSE_TIMEOUT_S = 5.0


class SchedulerTiers:
    """The lower tiers of one vLLM engine, driven from its scheduler thread.

    ``cpu``: the CPU tier's manager (its slots are the worker's host slots, ``num_slots``
    of ``slot_bytes`` in the file at ``pool_path``); ``stores``: the running tiers,
    highest first. The caller polls (:meth:`poll`) at the start of each call and flushes
    (:meth:`flush`) once its step's lookups are done.
    """

    def __init__(
        self,
        cpu: CPUOffloadingManager,
        stores: Sequence[LowerTier],
        pool_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        num_slots: int,
        slot_bytes: int,
        *,
        unlink_pools: bool = True,
    ) -> None:
        self.cpu = cpu
        self.core = TierHierarchy(cpu, ports.tier_states(stores))
        self.tiers = self.core.tiers
        self._ports = dict(zip(self.tiers, stores))
        self._stores = list(stores)
        self._shared = self.core.shared_tiers
        #: Each tier's reads, writes and deletes in flight, in submission order (they end
        #: about in order); each request's job is in its ``job``.
        self._reads: dict[TierState, deque[TierIo]] = {t: deque() for t in self.tiers}
        self._writes: dict[TierState, deque[TierIo]] = {t: deque() for t in self.tiers}
        self._deletes: dict[TierState, deque[Delete]] = {t: deque() for t in self.tiers}
        self.pools = HostPools(pool_paths, num_slots, slot_bytes, unlink=unlink_pools)
        self.pool_paths = self.pools.pool_paths
        for store in stores:
            if store.block_bytes != slot_bytes * len(self.pool_paths):
                raise ValueError(
                    f"tier {store.name} holds blocks of {store.block_bytes} B; "
                    f"{len(self.pool_paths)} rank(s) x {slot_bytes} B expected"
                )
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._closed = False
        # The shared tiers' private loop, stepped from here (see the module docstring).
        self._loop = PrivateLoop() if self._shared else None
        #: Questions out on the private loop (each one's task in its ``job``).
        self._queries: list[Exists] = []
        self.deadline_s = self.core.deadline_s
        for store in stores:
            store.bind(None)  # vLLM polls: no wake-up fd
        for tier in self._shared:
            self._connect(tier)

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

    # --- the shared host pool -------------------------------------------------------

    @property
    def pool_path(self) -> Path:
        """Rank 0's host pool file."""
        return self.pool_paths[0]

    @property
    def pool_mapped(self) -> bool:
        return self.pools.mapped

    def _pool_base(self) -> int | None:
        """Rank 0's slot 0 here, once every rank's pool is mapped (see HostPools.base)."""
        return None if self._closed else self.pools.base(self._stores)

    def _blocked(self) -> str:
        """Why no tier I/O can run now ("no_pool": the host pools are not mapped), or ""."""
        return "" if self._pool_base() is not None else "no_pool"

    def _connect(self, tier: TierState) -> None:
        """Open a shared tier's connections now, once, at start-up: the private loop
        runs only while vLLM calls the manager, and under load a step can take a
        second, so a handshake of several round trips made in the middle of a request
        would outlive the request's deadline. A server down now is not an error: the
        tier then connects when first used, as it would anyway."""
        connect = getattr(self._ports[tier], "connect", None)
        if connect is None:
            return
        try:
            assert self._loop is not None
            self._loop.run(connect())
        except Exception as exc:
            log.warning(
                "shared tier %s: no connection at start-up (%r): it connects when first used",
                tier.name,
                exc,
            )

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
        host = [self.pools.address(slot) for slot in io.cpu_slots]
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
        removal of a damaged value: vLLM steps the loop only while this says so)."""
        core = self.core
        on_loop = self._loop is not None and bool(self._loop.on_loop)
        return bool(core.batched or core.questions.asking or self._io_in_flight() or on_loop)

    def _io_in_flight(self) -> bool:
        """Whether reads or writes are in flight. Deletes are not waited for (nothing
        waits for their files to go): the next poll, or the drain, takes their ends."""
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
                core.read_done(io, ports.outcome(io.job, len(io.keys)), now)
                if io.tier.shared:
                    self._track_background(self._ports[io.tier])
        for writes in self._writes.values():
            while writes and writes[0].job.query():
                io = writes.popleft()
                core.write_done(io, ports.outcome(io.job, len(io.keys)), now)
        for deletes in self._deletes.values():
            while deletes and deletes[0].job.query():
                req = deletes.popleft()
                core.delete_done(req, ports.outcome(req.job, len(req.keys)), now)
        ports.reap(core, now)  # jobs given up on (stuck disk ops) that ended: their slots go
        due = core.next_deadline()
        if due is not None and due <= now:
            core.check(now)  # stalled promotions (their keys are misses), silent servers
        if self._queries:
            self._answers(now)
        self._carry(core.take_io(now, batched=False))  # the deletes of dropped blocks

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

    # --- promotions -----------------------------------------------------------------

    def promote(
        self,
        key: OffloadKey,
        protect: Sequence[OffloadKey] = (),
        allow: Callable[[TierState], bool] | None = None,
        *,
        ask: bool = True,
    ) -> bool:
        """``key`` is absent from the CPU tier: True if it answers ``HIT_PENDING`` (see
        :meth:`TierHierarchy.promote_key`: its read is queued, it waits for a CPU slot
        or the shared tiers are asked about it). ``allow``: the tiers the request may
        load from (vLLM's per-request ``kv_load_tiers``); ``ask=False``: a lookahead
        promotion, which neither asks nor waits."""
        core = self.core
        pending = core.promote_key(
            key, time.monotonic(), protect, allow, ask=ask, blocked=self._blocked()
        )
        if core.io_due:
            self.flush()
        return pending

    def waits_for_slot(self, key: OffloadKey) -> bool:
        """Whether ``key`` waits for a CPU slot that tier I/O of ours holds (see
        :meth:`promote`): it answers ``HIT_PENDING`` and nothing is read yet."""
        return self.core.waits_for_slot(key)

    def stalled(self, key: OffloadKey) -> bool:
        """Whether ``key``'s promotion failed while its read still runs: a ``MISS``."""
        return self.core.stalled(key)

    # --- write-through --------------------------------------------------------------

    def write_through(self, keys: Sequence[OffloadKey]) -> None:
        """Offer CPU-ready ``keys`` to each tier; those its admission takes are written
        from their CPU slots, which stay pinned until the write ends."""
        if self._closed or not keys:
            return
        self.core.write_through(keys, None, blocked=self._blocked())
        self._carry(self.core.take_io(time.monotonic(), batched=False))

    def reoffer(self, keys: Sequence[OffloadKey], stored: Sequence[OffloadKey]) -> None:
        """A CPU store took only ``stored`` of ``keys``: the others go down again."""
        if self._closed or len(stored) >= len(keys):
            return
        self.core.reoffer(keys, stored, None, blocked=self._blocked())
        self._carry(self.core.take_io(time.monotonic(), batched=False))

    # --- events, stats --------------------------------------------------------------

    def take_events(self) -> list[tuple[list[OffloadKey], bool]]:
        """Each tier's stored / removed events since the last call, as ``(keys,
        removed)``."""
        return [(list(event.keys), event.removed) for event in self.core.take_events()]

    def stats(self) -> tuple[TierStats, ...]:
        return self.core.stats(self._info)

    def _info(self, tier: TierState) -> dict[str, object]:
        return {**self._ports[tier].describe(), **self.pools.describe()}

    # --- lifecycle ------------------------------------------------------------------

    def drain(self) -> bool:
        """Finish every I/O job (promotions not submitted are released; questions to the
        shared tiers go on, they touch no slot): wait at most the tiers' deadline plus
        the core's grace. False if a job still runs then (a stalled disk or server: its
        slots may still be read or written)."""
        core = self.core
        core.cancel_reads()
        start = time.monotonic()
        limit = core.drain_deadline(start)
        while True:
            if self._loop is not None:
                self._loop.step()
            self.poll()
            if not self._jobs():
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

    def close(self) -> None:
        """Drain, close every tier (its lanes joined; a shared tier's client closed on
        the private loop, for at most ``_CLOSE_TIMEOUT_S``), close the loop, unmap the
        pool. Idempotent."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        for q in self.core.close():
            if isinstance(q.job, asyncio.Future):
                q.job.cancel()
        self._queries.clear()
        for tier, store in self._ports.items():
            try:
                if tier.shared and self._loop is not None:
                    closing = asyncio.wait_for(_aclose_shared(store), _CLOSE_TIMEOUT_S)
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
        core = self.core
        ports.reap(core, time.monotonic())
        if ports.running(core):  # an op stuck in a system call still uses the mapped pools

            def ended() -> bool:
                return not ports.running(core)

            keep_until_ended(f"the host pools {self.pool_paths}", ended, self.pools.close)
        else:
            self.pools.close()


async def _aclose_shared(store: LowerTier) -> None:
    """``store.aclose()`` (which closes its client's connections too)."""
    await store.aclose()
