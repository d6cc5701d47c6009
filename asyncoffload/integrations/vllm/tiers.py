"""Lower tiers under vLLM: the scheduler side of the disk and shared (Redis / Valkey)
tiers below the CPU tier.

vLLM splits the offloading backend in two: the manager (every index) in the scheduler
process, the host slots and their copies in each worker process. With ``tiers`` set,
the scheduler maps every worker's host pool file (``host_pools.HostPools``) so that the
tiers' lanes move blocks straight between the slots and the tier, driven from here.

Nothing here blocks or runs a Python thread: I/O jobs are submitted to the native
lanes and polled (:meth:`SchedulerTiers.poll`) at the start of every manager call,
which vLLM makes every step. A shared tier's client runs on a private event loop
(``tiers.private_loop.PrivateLoop``) that :meth:`SchedulerTiers.flush` (every manager call
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

The carrying and polling are :class:`~asyncoffload.tiers.polled.PolledTiers`', which the
frameworks' own host memory drivers share (``tiers/lent.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from asyncoffload.integrations.vllm.host_pools import HostPools, host_pool_path
from asyncoffload.integrations.vllm.steps import PrefillClock
from asyncoffload.keys import OffloadKey
from asyncoffload.manager import CPUOffloadingManager, ReqContext
from asyncoffload.tiers import ports
from asyncoffload.tiers._io import keep_until_ended
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.core import TierState
from asyncoffload.tiers.polled import PolledTiers

__all__ = ["SchedulerTiers", "host_pool_path"]


class SchedulerTiers(PolledTiers):
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
        super().__init__(cpu, stores, self.pools.address, wake_fd=None)  # vLLM polls
        #: Load or recompute: vLLM's steps, timed, and the chunks of the current one.
        self._clock = PrefillClock()
        self._computed = 0
        self.connect()

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

    # --- promotions -----------------------------------------------------------------

    def promote(
        self,
        key: OffloadKey,
        protect: Sequence[OffloadKey] = (),
        allow: Callable[[TierState], bool] | None = None,
        *,
        ask: bool = True,
        ctx: ReqContext | None = None,
    ) -> bool:
        """``key`` is absent from the CPU tier: True if it answers ``HIT_PENDING`` (see
        :meth:`TierHierarchy.promote_key`: its read is queued, it waits for a CPU slot
        or the shared tiers are asked about it). ``allow``: the tiers the request may
        load from (vLLM's per-request ``kv_load_tiers``); ``ask=False``: a lookahead
        promotion, which neither asks nor waits; ``ctx``: the request's tenant, whose
        quota in the CPU tier the promoted block counts in."""
        core = self.core
        pending = core.promote_key(
            key, time.monotonic(), protect, allow, ask=ask, blocked=self._blocked(), ctx=ctx
        )
        if core.io_due:
            self.flush()
        return pending

    def worth(
        self,
        key: OffloadKey,
        later: Callable[[], Sequence[OffloadKey]],
        allow: Callable[[TierState], bool] | None = None,
        count: bool = True,
    ) -> bool:
        """Load or recompute (``tiers.core.cost``): whether the run of lower-tier blocks
        from ``key`` (absent from the CPU tier) through ``later()`` (the request's next
        keys, asked for only when a lower tier has ``key``) is worth promoting; False
        counts them ``recomputed_by_choice`` (unless ``count`` is False: the request's
        walk declined them before), and the caller answers ``MISS`` (vLLM recomputes
        from there)."""
        core = self.core
        if core.source(key, allow) is None:
            return True
        return core.worth([key, *later()], time.monotonic(), allow, count)

    def computed(self, chunks: int) -> None:
        """vLLM offered ``chunks`` it computed in the step scheduled last (its stores of
        newly computed chunks are prepared as the step is scheduled)."""
        self._computed += chunks

    def step_ended(self) -> None:
        """vLLM schedules its next step: the step before ran since the last call, and
        computed the chunks counted since (``steps.PrefillClock``)."""
        recompute = self.core.cost.recompute
        tokens, self._computed = self._computed * recompute.tokens_per_block, 0
        step = self._clock.step(time.monotonic(), tokens, recompute.tokens_per_s)
        if step is not None:
            recompute.observe(*step)

    def waits_for_slot(self, key: OffloadKey) -> bool:
        """Whether ``key`` waits for a CPU slot that tier I/O of ours holds (see
        :meth:`promote`): it answers ``HIT_PENDING`` and nothing is read yet."""
        return self.core.waits_for_slot(key)

    def stalled(self, key: OffloadKey) -> bool:
        """Whether ``key``'s promotion failed while its read still runs: a ``MISS``."""
        return self.core.stalled(key)

    # --- write-through --------------------------------------------------------------

    def reoffer(self, keys: Sequence[OffloadKey], stored: Sequence[OffloadKey]) -> None:
        """A CPU store took only ``stored`` of ``keys``: the others go down again."""
        if self._closed or len(stored) >= len(keys):
            return
        self.core.reoffer(keys, stored, None, blocked=self._blocked())
        self._carry(self.core.take_io(time.monotonic(), batched=False))

    # --- events, stats --------------------------------------------------------------

    def take_events(self) -> list[tuple[list[OffloadKey], bool]]:
        """Each tier's stored / removed events since the last call, as ``(keys,
        removed)`` (vLLM's events have no pin changes: those are counted only)."""
        events = self.core.take_events()
        return [(list(e.keys), e.removed) for e in events if e.retention is None]

    def _info(self, tier: TierState) -> dict[str, object]:
        return {**self._ports[tier].describe(), **self.pools.describe()}

    # --- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Drain, close every tier (its lanes joined; a shared tier's client closed on
        the private loop), close the loop, unmap the pool. Idempotent."""
        if self._closed:
            return
        self._close_ports()
        core = self.core
        if ports.running(core):  # an op stuck in a system call still uses the mapped pools

            def ended() -> bool:
                return not ports.running(core)

            keep_until_ended(f"the host pools {self.pool_paths}", ended, self.pools.close)
        else:
            self.pools.close()
