"""Lower tiers under vLLM: the scheduler side of a disk tier below the CPU tier.

vLLM splits the offloading backend in two: the manager (every index) in the scheduler
process, the host slots and their copies in each worker process. With ``tiers`` set,
the worker keeps its host slots in a :class:`~asyncoffload.transfer.paged_engines.
SharedHostFile` named after the engine and its rank (:func:`host_pool_path`), and the
scheduler maps that file (lazily, the first time it needs it) so that the disk tier's
native I/O lanes move blocks straight between the slots and disk, driven from here.

Nothing here blocks or runs a Python thread: I/O jobs are submitted to the native
lanes and polled (:meth:`SchedulerTiers.poll`) at the start of every manager call,
which vLLM makes every step. It does not import vLLM.

- A lookup of a key absent from the CPU tier and ready in a lower tier starts a
  *promotion*: a CPU slot is reserved (the CPU tier's ``reserve``), the key answers
  ``HIT_PENDING`` and the read is submitted, with the others of that step, when the
  step's scheduling ends. When the read has ended and passed its checks, the CPU tier's
  ``complete_store`` makes the key ready (``HIT`` from then on); a failed read drops the
  key from the tier and frees the slot (``MISS`` from then on: it is never offered
  again). No free or idle CPU slot: ``MISS`` (counted as ``no_slot``).
- Stores the CPU tier completed are written through to each tier its admission lets in,
  from their CPU slots, pinned until the write ends, as the engine does.
- Failures are counted by cause and skipped; nothing reaches vLLM's worker.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncoffload.engine import TierStats
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import CPUOffloadingManager
from asyncoffload.tiers.base import LowerTier, TierCounters, settle_read, settle_write
from asyncoffload.tiers.format import MAX_KEY_BYTES
from asyncoffload.transfer.base import CopyJob, FailedJob
from asyncoffload.transfer.paged_engines import SharedHostFile

__all__ = ["SchedulerTiers", "host_pool_path"]

log = logging.getLogger("asyncoffload.vllm")

#: How often the scheduler looks for a host pool file not there yet, and after how long
#: it warns (once) that it is still missing.
_RETRY_S = 0.1
_WARN_AFTER_S = 60.0
#: A drain waits for I/O at most the tiers' deadline plus this.
_DRAIN_GRACE_S = 1.0
#: Promotions found in one step are read as one job per tier; a batch this large is
#: submitted at once.
_MAX_BATCH = 256


def host_pool_path(directory: str | os.PathLike[str], engine_id: str, rank: int) -> Path:
    """The shared host pool file of ``engine_id``'s worker ``rank``: the worker makes it,
    the scheduler finds it by the same name. Characters outside ``[A-Za-z0-9_.-]`` in
    the engine id are replaced, with a hash of the id so that names stay distinct."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:64]
    if safe != engine_id:
        safe += "-" + hashlib.blake2b(engine_id.encode(), digest_size=6).hexdigest()
    return Path(directory) / f"asyncoffload-{safe}-rank{rank}.pool"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): it exists
        return True
    return True


@dataclass
class _Tier:
    store: LowerTier
    counters: TierCounters = field(default_factory=TierCounters)
    #: Promotions of this step not submitted yet: (key, tier slot, CPU slot).
    batch: list[tuple[OffloadKey, int, int]] = field(default_factory=list)


@dataclass
class _Io:
    job: CopyJob
    tier: _Tier
    keys: list[OffloadKey]


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
        pool_path: str | os.PathLike[str],
        num_slots: int,
        slot_bytes: int,
    ) -> None:
        self.cpu = cpu
        self.tiers = [_Tier(store) for store in stores]
        self.pool_path = Path(pool_path)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._pool: SharedHostFile | None = None
        self._view: object = None
        self._base = 0
        self._pool_error: str | None = None
        self._first_try = 0.0
        self._next_try = 0.0
        self._warned = False
        self._reads: deque[_Io] = deque()
        self._writes: deque[_Io] = deque()
        self._batched = 0
        self._closed = False
        self.deadline_s = max((s.deadline_s for s in stores), default=0.0)
        for store in stores:
            store.bind(None)  # vLLM polls: no wake-up fd

    # --- the shared host pool -------------------------------------------------------

    @property
    def pool_mapped(self) -> bool:
        return self._pool is not None

    def _pool_base(self) -> int | None:
        """The address of slot 0 in this process, mapping the worker's file the first
        time it is there; ``None`` (tier I/O is skipped) until then, or for good where
        the file is not a pool of this engine."""
        if self._pool is not None:
            return self._base
        if self._pool_error is not None or self._closed:
            return None
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + _RETRY_S
        if not self._first_try:
            self._first_try = now
        try:
            pool = SharedHostFile.open(self.pool_path, self.num_slots, self.slot_bytes)
        except FileNotFoundError:
            if not self._warned and now - self._first_try > _WARN_AFTER_S:
                self._warned = True
                log.warning(
                    "the worker's host pool %s is still missing after %.0fs: tier I/O is "
                    "skipped until it appears",
                    self.pool_path,
                    now - self._first_try,
                )
            return None
        except (OSError, ValueError) as exc:
            self._pool_error = str(exc)
            log.error("cannot map the worker's host pool (%s): tier I/O is off", exc)
            return None
        if not _alive(pool.creator_pid):  # a stale file of a dead worker: not ours
            pool.close()
            return None
        with contextlib.suppress(OSError):  # mapped by both: nothing need name it now
            os.unlink(self.pool_path)
        self._pool = pool
        view = pool.tensor()
        self._view = view
        self._base = view.data_ptr()
        log.info("mapped the worker's host pool %s", self.pool_path)
        return self._base

    def _skip(self, tier: _Tier, cause: str, n: int) -> None:
        tier.counters.failures[cause] = tier.counters.failures.get(cause, 0) + n

    # --- polling --------------------------------------------------------------------

    def pending(self) -> bool:
        """Whether I/O is in flight or promotions wait to be submitted."""
        return bool(self._reads or self._writes or self._batched)

    def poll(self) -> None:
        """Finish the I/O jobs that ended (only the heads: jobs end about in order)."""
        reads = self._reads
        while reads and reads[0].job.query():
            self._read_done(reads.popleft())
        writes = self._writes
        while writes and writes[0].job.query():
            self._written(writes.popleft())

    def flush(self) -> None:
        """Submit the promotions found since the last flush, one read job per tier."""
        if not self._batched:
            return
        self._batched = 0
        base = self._base
        size = self.slot_bytes
        for tier in self.tiers:
            batch = tier.batch
            if not batch:
                continue
            tier.batch = []
            keys = [key for key, _, _ in batch]
            host = [base + cpu_slot * size for _, _, cpu_slot in batch]
            job = self._submit(tier.store.submit_read, keys, [s for _, s, _ in batch], host)
            tier.counters.reads += 1
            self._reads.append(_Io(job, tier, keys))

    @staticmethod
    def _submit(
        submit: object, keys: list[OffloadKey], slots: list[int], host: list[int]
    ) -> CopyJob:
        try:
            return submit(keys, slots, host)  # type: ignore[operator,no-any-return]
        except Exception as exc:
            log.warning("a tier I/O submission failed: %r", exc)
            return FailedJob(len(keys), exc.with_traceback(None))

    # --- promotions -----------------------------------------------------------------

    def promote(self, key: OffloadKey, protect: Sequence[OffloadKey] = ()) -> bool:
        """``key`` is absent from the CPU tier: if a lower tier has it ready, reserve a
        CPU slot (never evicting one of ``protect``: the keys of the same lookup walk
        found before it) and queue its read (True: the caller answers ``HIT_PENDING``)."""
        for tier in self.tiers:
            manager = tier.store.manager
            if not manager.ready(key):
                continue
            if self._pool_base() is None:
                self._skip(tier, "no_pool", 1)
                return False
            out = self.cpu.reserve([key], protect)
            if out is None:
                self._skip(tier, "no_slot", 1)
                return False
            (cpu_slot,) = out.store_spec.block_ids
            (tier_slot,) = manager.prepare_load([key]).block_ids
            tier.counters.lookup_hits += 1
            tier.batch.append((key, tier_slot, cpu_slot))
            self._batched += 1
            if self._batched >= _MAX_BATCH:
                self.flush()
            return True
        return False

    def _read_done(self, io: _Io) -> None:
        tier, keys = io.tier, io.keys
        good, bad, causes = settle_read(tier.store, tier.counters, keys, io.job)
        if good:
            self.cpu.complete_store(good, None, success=True)
        if bad:
            self.cpu.complete_store(bad, None, success=False)
            log.warning(
                "%d of %d blocks read from %s failed (%s): misses, dropped from its index",
                len(bad),
                len(keys),
                tier.store.name,
                ", ".join(f"{k} {v}" for k, v in causes.items()),
            )

    def _cancel_batches(self) -> None:
        """Promotions reserved but not submitted: release them (nothing was read)."""
        for tier in self.tiers:
            if tier.batch:
                keys = [key for key, _, _ in tier.batch]
                tier.batch = []
                tier.store.manager.complete_load(keys)
                self.cpu.complete_store(keys, None, success=False)
        self._batched = 0

    # --- write-through --------------------------------------------------------------

    def write_through(self, keys: Sequence[OffloadKey]) -> None:
        """Offer CPU-ready ``keys`` to each tier; those its admission takes are written
        from their CPU slots, which stay pinned until the write ends."""
        get = self.cpu.block_of
        ready = []
        for key in keys:
            block = get(key)
            if block is not None and block.ref_cnt >= 0 and len(key) <= MAX_KEY_BYTES:
                ready.append(key)
        if not ready or self._closed:
            return
        base = self._pool_base()
        if base is None:
            for tier in self.tiers:
                self._skip(tier, "no_pool", len(ready))
            return
        size = self.slot_bytes
        for tier in self.tiers:
            manager = tier.store.manager
            out = manager.prepare_store(ready)
            if out is None:  # the tier is full of blocks being read or written
                self._skip(tier, "full", 1)
                continue
            if out.evicted_keys:
                tier.store.forget(out.evicted_keys)
            chosen = list(out.keys_to_store)
            if not chosen:
                continue
            spec = self.cpu.pin(chosen)
            host = [base + b * size for b in spec.block_ids]
            job = self._submit(
                tier.store.submit_write, chosen, list(out.store_spec.block_ids), host
            )
            tier.counters.writes += 1
            self._writes.append(_Io(job, tier, chosen))

    def _written(self, io: _Io) -> None:
        tier, keys = io.tier, io.keys
        try:
            failed, causes = settle_write(tier.store, tier.counters, keys, io.job, None)
            if failed:
                log.warning(
                    "%d of %d blocks could not be written to %s (%s): skipped",
                    failed,
                    len(keys),
                    tier.store.name,
                    ", ".join(f"{k} {v}" for k, v in causes.items()),
                )
        finally:
            self.cpu.complete_load(keys)  # unpin

    # --- events, stats --------------------------------------------------------------

    def take_events(self) -> list[tuple[list[OffloadKey], bool]]:
        """Each tier's stored / removed events since the last call, as ``(keys,
        removed)``."""
        out: list[tuple[list[OffloadKey], bool]] = []
        for tier in self.tiers:
            for event in tier.store.manager.take_events():
                out.append((list(event.keys), event.removed))
        return out

    def stats(self) -> tuple[TierStats, ...]:
        out = []
        for tier in self.tiers:
            c = tier.counters
            info = dict(tier.store.describe())
            info["host_pool"] = str(self.pool_path)
            info["host_pool_mapped"] = self._pool is not None
            out.append(
                TierStats(
                    name=tier.store.name,
                    medium=tier.store.medium.value,
                    info=info,
                    manager=tier.store.manager.stats(),
                    lookup_hits=c.lookup_hits,
                    blocks_written=c.blocks_written,
                    bytes_written=c.bytes_written,
                    write_failures=c.write_failures,
                    blocks_read=c.blocks_read,
                    bytes_read=c.bytes_read,
                    read_failures=c.read_failures,
                    dropped=tier.store.manager.dropped,
                    failures=dict(c.failures),
                )
            )
        return tuple(out)

    # --- lifecycle ------------------------------------------------------------------

    def drain(self) -> bool:
        """Finish every I/O job (promotions not submitted are released): wait at most
        the tiers' deadline plus a second. False if a job still runs then (a stalled
        disk: its slots may still be written)."""
        self._cancel_batches()
        limit = time.monotonic() + self.deadline_s + _DRAIN_GRACE_S
        while True:
            self.poll()
            if not (self._reads or self._writes):
                return True
            if time.monotonic() > limit:
                log.error(
                    "%d tier I/O jobs still run %.1fs after the drain began (a stalled "
                    "disk?): going on without them",
                    len(self._reads) + len(self._writes),
                    self.deadline_s + _DRAIN_GRACE_S,
                )
                return False
            time.sleep(0.001)

    def close(self) -> None:
        """Drain, close every tier (its lanes joined), unmap the pool. Idempotent."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        for tier in self.tiers:
            try:
                tier.store.close()
            except Exception:
                log.exception("closing tier %s failed", tier.store.name)
        self._reads.clear()
        self._writes.clear()
        pool, self._pool = self._pool, None
        self._view = None
        if pool is not None:
            pool.close()
