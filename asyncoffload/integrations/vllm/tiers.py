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
  :class:`~asyncoffload.tiers.hierarchy.TierHierarchy`, which the engine drives too;
  this module only carries its I/O requests to the lanes and the private loop and
  polls for their ends, and keeps the scheduler's world: ``HIT_PENDING``, the shared
  tiers' questions and their negative answers, the host pool file.
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
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncoffload.integrations.vllm.host_pools import HostPools, host_pool_path
from asyncoffload.integrations.vllm.private_loop import PrivateLoop
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.tiers._io import keep_until_ended
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.format import MAX_KEY_BYTES
from asyncoffload.tiers.hierarchy import TierHierarchy, TierIo, TierState, TierStats, submit
from asyncoffload.transfer.base import CopyJob, FailedJob

__all__ = ["SchedulerTiers", "host_pool_path"]

log = logging.getLogger("asyncoffload.vllm")

#: A drain waits for I/O at most the tiers' deadline plus this.
_DRAIN_GRACE_S = 1.0
#: Promotions found in one step are read as one job per tier; a batch this large is
#: submitted at once (and so is a shared tier's query of this many keys).
_MAX_BATCH = 256
#: Seconds a shared tier's "not there" (or a failed query) is remembered, and how many
#: such keys at most.
_MISS_TTL_S = 2.0
_MISS_KEYS = 65_536
#: Keys at most that wait for a CPU slot held by tier I/O of ours (see ``promote``).
_SLOT_WAIT_KEYS = 65_536
#: A failed query is logged at most once this often (the others are counted).
_LOG_EVERY_S = 60.0
#: Seconds the shutdown waits for a shared tier's client to close.
_CLOSE_TIMEOUT_S = 5.0


@dataclass
class _Jobs:
    """A tier's I/O jobs in flight, in submission order (they end about in order), each
    with its number (``SchedulerTiers._submitted``), and when a shared tier whose last
    query failed may be asked again."""

    reads: deque[tuple[TierIo, CopyJob, int]] = field(default_factory=deque)
    writes: deque[tuple[TierIo, CopyJob, int]] = field(default_factory=deque)
    down_until: float = 0.0


@dataclass
class _Query:
    """An ``exists`` query of one shared tier, a task on the private loop."""

    tier: TierState
    keys: list[OffloadKey]
    task: asyncio.Task[list[bool]]


class SchedulerTiers:
    """The lower tiers of one vLLM engine, driven from its scheduler thread.

    ``cpu``: the CPU tier's manager (its slots are the worker's host slots, ``num_slots``
    of ``slot_bytes`` in the file at ``pool_path``); ``stores``: the running tiers,
    highest first. The caller polls (:meth:`poll`) at the start of each call and flushes
    (:meth:`flush`) once its step's lookups are done. ``miss_ttl_s``: how long a shared
    tier's "not there" is remembered.
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
        self.core = TierHierarchy(cpu, stores)
        self.tiers = self.core.tiers
        self._stores = list(stores)
        self._shared = self.core.shared_tiers
        self._jobs = {tier: _Jobs() for tier in self.tiers}
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
        #: Keys to ask the shared tiers about at the next flush.
        self._ask: dict[OffloadKey, None] = {}
        #: Keys asked about (or to be): how many queries of them are still out.
        self._asking: dict[OffloadKey, int] = {}
        #: Keys of ``_asking`` that some shared tier holds.
        self._found: set[OffloadKey] = set()
        self._queries: list[_Query] = []
        #: Keys no shared tier holds, until when (monotonic), oldest first.
        self._misses: OrderedDict[OffloadKey, float] = OrderedDict()
        self.miss_ttl_s = _MISS_TTL_S
        #: Tier I/O jobs submitted (reads and writes): the number of the last one.
        self._submitted = 0
        #: Keys whose promotion found no idle CPU slot while tier I/O of ours held some,
        #: each with the number of the last job submitted then: the key waits until
        #: every job up to that one has ended.
        self._slot_waits: OrderedDict[OffloadKey, int] = OrderedDict()
        self._logged_at = -_LOG_EVERY_S
        self._unlogged = 0
        self.deadline_s = self.core.deadline_s
        for store in stores:
            store.bind(None)  # vLLM polls: no wake-up fd
        for tier in self._shared:
            self._connect(tier)

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

    def _connect(self, tier: TierState) -> None:
        """Open a shared tier's connections now, once, at start-up: the private loop
        runs only while vLLM calls the manager, and under load a step can take a
        second, so a handshake of several round trips made in the middle of a request
        would outlive the request's deadline. A server down now is not an error: the
        tier then connects when first used, as it would anyway."""
        connect = getattr(tier.store, "connect", None)
        if connect is None:
            return
        try:
            assert self._loop is not None
            self._loop.run(connect())
        except Exception as exc:
            log.warning(
                "shared tier %s: no connection at start-up (%r): it connects when first used",
                tier.store.name,
                exc,
            )

    # --- polling --------------------------------------------------------------------

    def pending(self) -> bool:
        """Whether I/O or a shared tier's query is in flight, promotions or queries wait
        to be submitted, or a task of ours runs on the private loop (a shared tier's
        removal of a damaged value: vLLM steps the loop only while this says so)."""
        on_loop = self._loop is not None and bool(self._loop.on_loop)
        return bool(self.core.batched or self._asking or self._io_in_flight() or on_loop)

    def _io_in_flight(self) -> bool:
        return any(jobs.reads or jobs.writes for jobs in self._jobs.values())

    def _oldest_in_flight(self) -> int | None:
        """The number of the oldest tier I/O job still in flight (each tier's jobs are
        taken back in order), or None."""
        heads = [
            queue[0][2]
            for jobs in self._jobs.values()
            for queue in (jobs.reads, jobs.writes)
            if queue
        ]
        return min(heads, default=None)

    def poll(self) -> None:
        """Finish the I/O jobs that ended (only each tier's heads: a tier's jobs end
        about in order) and take the shared tiers' answers that arrived. It does not
        step the private loop (cheap enough for every lookup)."""
        core = self.core
        for jobs in self._jobs.values():
            reads = jobs.reads
            while reads and reads[0][1].query():
                io, job, _ = reads.popleft()
                core.read_done(io, job)
                if io.tier.shared is not None:
                    self._track_background(io.tier)
                if io.bad and self._shared:  # gone from every index: not asked at once
                    now = time.monotonic()
                    for key in io.bad:
                        self._remember_miss(key, now)
            writes = jobs.writes
            while writes and writes[0][1].query():
                io, job, _ = writes.popleft()
                core.write_done(io, job)
        if core.late:  # jobs given up on (stuck disk ops) that ended: their slots go
            core.reap()
        if self._queries:
            self._answers()

    def _track_background(self, tier: TierState) -> None:
        """Step the private loop while ``tier``'s own tasks run (see ``pending``)."""
        loop = self._loop
        for task in getattr(tier.store, "background", ()):
            if loop is not None:
                loop.track(task)

    def flush(self) -> None:
        """Submit the promotions found since the last flush, one read job per tier, and
        the shared tiers' queries; then step the private loop and take what ended."""
        for io in self.core.take_reads():
            self._submitted += 1
            self._jobs[io.tier].reads.append((io, self._submit(io), self._submitted))
        if self._ask:
            self._send_queries()
        loop = self._loop
        if loop is not None and loop.on_loop:
            loop.step()
            self.poll()

    def _submit(self, io: TierIo) -> CopyJob:
        """Hand ``io`` to its tier: a shared tier's job is a task on the private loop,
        submitted from inside it."""
        host = [self.pools.address(slot) for slot in io.cpu_slots]
        loop = self._loop
        if io.tier.shared is None or loop is None:
            return submit(io, host)
        try:
            job = loop.call(submit, io, host)
        except Exception as exc:
            log.warning("a tier I/O submission failed: %r", exc)
            return FailedJob(len(io.keys), exc.with_traceback(None))
        task = getattr(job, "task", None)
        if isinstance(task, asyncio.Future):
            loop.track(task)
        return job

    # --- promotions -----------------------------------------------------------------

    def promote(
        self,
        key: OffloadKey,
        protect: Sequence[OffloadKey] = (),
        allow: Callable[[TierState], bool] | None = None,
        *,
        ask: bool = True,
    ) -> bool:
        """``key`` is absent from the CPU tier: if a lower tier has it ready, reserve a
        CPU slot (never evicting one of ``protect``: the keys of the same lookup walk
        found before it) and queue its read (True: the caller answers ``HIT_PENDING``).
        ``allow``: the tiers the request may load from (vLLM's per-request
        ``kv_load_tiers``); ``ask``: whether a key no tier knows is asked of the
        shared tiers, and whether a key that finds no CPU slot waits for one that tier
        I/O of ours holds (True as well, nothing read yet: :meth:`waits_for_slot`); a
        lookahead promotion does neither."""
        core = self.core
        tier = core.source(key, allow)
        if tier is None:
            if not (ask and self._shared):
                return False
            if allow is not None and not any(allow(shared) for shared in self._shared):
                return False
            return self._ask_shared(key)
        if self._pool_base() is None:
            core.skip(tier, "no_pool", 1)
            return False
        # No slot: a lookahead gives up (the lookup walk reaches the key in this step,
        # and waits or counts the skip then).
        if core.promote({key: tier}, None, protect, lookup=True, count_no_slot=False) is None:
            if not ask:
                return False
            if self._wait_for_slot(key):
                return True
            core.skip(tier, "no_slot", 1)
            return False
        if self._slot_waits:
            self._slot_waits.pop(key, None)
        if core.batched >= _MAX_BATCH:
            self.flush()
        return True

    def _wait_for_slot(self, key: OffloadKey) -> bool:
        """``key``'s promotion found no idle CPU slot: whether it waits for one
        (``HIT_PENDING``, nothing reserved). Tier I/O of ours holds CPU slots until it
        ends (a write-through pins the blocks it writes, a read fills the slots it
        reserved), and every store vLLM completes is written through at once: a
        request looked up then finds no slot for the rest of its prefix and would load
        only the part that found one. So the key waits until every tier job submitted
        when it first found none has ended (each within its tier's deadline), and no
        longer: still no slot then, it is a miss."""
        waits = self._slot_waits
        oldest = self._oldest_in_flight()
        if oldest is None or self._closed:
            waits.clear()  # every wait is over: the next lookups take a slot or miss
            return False
        mark = waits.get(key)
        if mark is None:
            waits[key] = self._submitted
            if len(waits) > _SLOT_WAIT_KEYS:
                waits.popitem(last=False)
            return True
        if oldest <= mark:
            return True
        del waits[key]
        return False

    def waits_for_slot(self, key: OffloadKey) -> bool:
        """Whether ``key`` waits for a CPU slot that tier I/O of ours holds (see
        :meth:`promote`): it answers ``HIT_PENDING`` and nothing is read yet."""
        return key in self._slot_waits

    # --- asking the shared tiers ------------------------------------------------------

    def _ask_shared(self, key: OffloadKey) -> bool:
        """``key`` is in no tier's index: True (``HIT_PENDING``) while the shared tiers
        are asked about it; False (``MISS``) if a tier knows it but cannot read it yet,
        if the answer "not there" (or a failure) is recent, or if no tier can be asked."""
        if key in self._asking:
            return True
        for tier in self.tiers:
            if tier.store.manager.block_of(key) is not None:
                return False  # being written there: as for disk
        now = time.monotonic()
        misses = self._misses
        if misses:
            until = misses.get(key)
            if until is not None:
                if until > now:
                    return False
                del misses[key]
        if len(key) > MAX_KEY_BYTES or self._closed:
            return False
        if all(self._jobs[tier].down_until > now for tier in self._shared):
            return False
        if self._pool_base() is None:  # nothing could be read: do not ask
            self.core.skip(self._shared[0], "no_pool", 1)
            return False
        self._ask[key] = None
        self._asking[key] = 0
        if len(self._ask) >= _MAX_BATCH:
            self._send_queries()
        return True

    def _send_queries(self) -> None:
        """One ``exists`` query per shared tier of the keys asked for since the last
        send that it does not know of, each a task on the private loop."""
        keys = list(self._ask)
        self._ask.clear()
        loop = self._loop
        assert loop is not None and loop.loop is not None
        asking = self._asking
        now = time.monotonic()
        for tier in self._shared:
            if self._jobs[tier].down_until > now:
                continue
            unknown = self.core.ask(tier, keys)
            if not unknown:
                continue
            assert tier.shared is not None
            task = loop.loop.create_task(tier.shared.exists(unknown))
            loop.track(task)
            self._queries.append(_Query(tier, unknown, task))
            for key in unknown:
                asking[key] += 1
        for key in keys:
            if asking.get(key) == 0:  # no tier was asked
                del asking[key]
                self._settle_asked(key, now)

    def _answers(self) -> None:
        """Take the answers of the queries that ended."""
        done = [q for q in self._queries if q.task.done()]
        if not done:
            return
        self._queries = [q for q in self._queries if not q.task.done()]
        now = time.monotonic()
        for query in done:
            self._answered(query, now)

    def _answered(self, query: _Query, now: float) -> None:
        tier, keys, task = query.tier, query.keys, query.task
        found: list[bool] | None = None
        error: BaseException | None = None
        if task.cancelled():
            error = asyncio.CancelledError()
        else:
            error = task.exception()
            if error is None:
                found = task.result()
        if found is None or len(found) != len(keys):
            # The server is down or late: misses, and no more queries for a while.
            self._jobs[tier].down_until = now + self.miss_ttl_s
            self.core.skip(tier, "lookup_failed", len(keys))
            self._log_failure(tier, error)
        else:
            # Those found join the tier's index (a stored event), as alookup's do; the
            # next lookup promotes them as from disk.
            self._found.update(self.core.join(tier, keys, found))
        asking = self._asking
        for key in keys:
            left = asking.get(key, 0) - 1
            if left > 0:
                asking[key] = left
                continue
            asking.pop(key, None)
            self._settle_asked(key, now)

    def _settle_asked(self, key: OffloadKey, now: float) -> None:
        """Every query of ``key`` ended: a miss to remember unless a tier had it."""
        if key in self._found:
            self._found.discard(key)
        else:
            self._remember_miss(key, now)

    def _remember_miss(self, key: OffloadKey, now: float) -> None:
        misses = self._misses
        misses[key] = now + self.miss_ttl_s
        misses.move_to_end(key)
        if len(misses) > _MISS_KEYS:
            misses.popitem(last=False)

    def _log_failure(self, tier: TierState, error: BaseException | None) -> None:
        now = time.monotonic()
        if now - self._logged_at < _LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f"; {self._unlogged} more failed since the last report" if self._unlogged else ""
        self._logged_at = now
        self._unlogged = 0
        log.warning(
            "shared tier %s did not answer a lookup (%s): its keys are misses, and it is "
            "not asked again for %.1fs%s",
            tier.store.name,
            repr(error) if error is not None else "a malformed answer",
            self.miss_ttl_s,
            more,
        )

    # --- write-through --------------------------------------------------------------

    def write_through(self, keys: Sequence[OffloadKey]) -> None:
        """Offer CPU-ready ``keys`` to each tier; those its admission takes are written
        from their CPU slots, which stay pinned until the write ends."""
        if self._closed or not keys:
            return
        blocked = "" if self._pool_base() is not None else "no_pool"
        for io in self.core.write_through(keys, None, blocked=blocked):
            self._submitted += 1
            self._jobs[io.tier].writes.append((io, self._submit(io), self._submitted))

    # --- events, stats --------------------------------------------------------------

    def take_events(self) -> list[tuple[list[OffloadKey], bool]]:
        """Each tier's stored / removed events since the last call, as ``(keys,
        removed)``."""
        return [(list(event.keys), event.removed) for event in self.core.take_events()]

    def stats(self) -> tuple[TierStats, ...]:
        return self.core.stats(self._info)

    def _info(self, tier: TierState) -> dict[str, object]:
        return self.pools.describe()

    # --- lifecycle ------------------------------------------------------------------

    def drain(self) -> bool:
        """Finish every I/O job (promotions not submitted are released; queries of the
        shared tiers go on, they touch no slot): wait at most the tiers' deadline plus a
        second. False if a job still runs then (a stalled disk or server: its slots may
        still be read or written)."""
        self.core.cancel_reads()
        limit = time.monotonic() + self.deadline_s + _DRAIN_GRACE_S
        while True:
            if self._loop is not None:
                self._loop.step()
            self.poll()
            if not self._io_in_flight():
                return True
            if time.monotonic() > limit:
                log.error(
                    "%d tier I/O jobs still run %.1fs after the drain began (a stalled "
                    "disk or server?): going on without them",
                    sum(len(j.reads) + len(j.writes) for j in self._jobs.values()),
                    self.deadline_s + _DRAIN_GRACE_S,
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
        self._ask.clear()
        self._asking.clear()
        self._found.clear()
        self._slot_waits.clear()
        for query in self._queries:
            query.task.cancel()
        self._queries.clear()
        for tier in self.tiers:
            try:
                if tier.shared is not None and self._loop is not None:
                    closing = asyncio.wait_for(_aclose_shared(tier.store), _CLOSE_TIMEOUT_S)
                    self._loop.run(closing)
                else:
                    tier.store.close()
            except Exception:
                log.exception("closing tier %s failed", tier.store.name)
                if tier.shared is not None:
                    with contextlib.suppress(Exception):
                        tier.store.close()
            self._jobs[tier].reads.clear()
            self._jobs[tier].writes.clear()
        if self._loop is not None:
            self._loop.close()
        self.core.reap()
        if self.core.running:  # an op stuck in a system call still uses the mapped pools
            core = self.core

            def ended() -> bool:
                return not core.running

            keep_until_ended(f"the host pools {self.pool_paths}", ended, self.pools.close)
        else:
            self.pools.close()


async def _aclose_shared(store: LowerTier) -> None:
    """``store.aclose()`` (which closes its client's connections too)."""
    await store.aclose()
