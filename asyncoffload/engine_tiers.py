"""The engine's driver of the tier hierarchy, on its event loop.

:class:`~asyncoffload.tiers.hierarchy.TierHierarchy` decides; this driver carries its
I/O requests to the tiers' lanes, learns that they ended through the completion bridge
(one read lane and one write lane per tier), feeds the results back, and keeps what an
awaitable world needs: the load handle of each promotion, the timer that fails a handle
whose read stalls, the questions to a shared tier's server (``alookup``). It holds no
rule of its own.

Life of a promotion (a load with keys that live only lower down): the load's CPU keys
are pinned, :meth:`~asyncoffload.tiers.hierarchy.TierHierarchy.promote` reserves CPU
slots for the others, each read goes to its tier's lane, and when the last one ended and
every block passed its checks, the whole load is copied into the KV blocks as one
:class:`~asyncoffload.Transfer`; otherwise the handle fails and nothing is copied.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncoffload._sigint import InterruptsHeld
from asyncoffload.config import EngineConfig
from asyncoffload.copies import Copies
from asyncoffload.errors import PromotionError, TransferError
from asyncoffload.handles import Transfer
from asyncoffload.keys import OffloadKey
from asyncoffload.layout import KVLayout
from asyncoffload.manager import CPUOffloadingManager, ReqContext
from asyncoffload.tiers._io import keep_until_ended
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.format import Namespace
from asyncoffload.tiers.hierarchy import (
    Promotion,
    TierHierarchy,
    TierIo,
    TierState,
    TierStats,
    submit,
)
from asyncoffload.transfer import CompletionBridge, CopyJob, TransferBackend
from asyncoffload.transfer.completion import CopyLane

__all__ = ["LoopTiers", "namespace_of", "open_tiers"]

log = logging.getLogger("asyncoffload")

#: A promotion's handle fails this long after its tier's deadline if a read still runs.
STALL_GRACE_S = 1.0
#: How often the slots held by jobs given up on are looked at (see ``_reap``).
_REAP_S = 0.25


@dataclass(eq=False)
class _Load:
    """What the engine keeps of a promotion: the load it is part of."""

    handle: Transfer
    ids: list[int]
    ctx: ReqContext
    #: The load's keys already in the CPU tier (pinned until the load ends).
    cpu_keys: list[OffloadKey]
    timer: asyncio.TimerHandle | None = None


class LoopTiers:
    """Drives ``core`` (the tiers below ``cpu``) for an engine: copies into the KV blocks
    go through ``copies``, host slot addresses come from ``backend``, and ``publish``
    sends pending events. ``forked``: whether this process is a fork of the engine's."""

    def __init__(
        self,
        cpu: CPUOffloadingManager,
        stores: Sequence[LowerTier],
        copies: Copies,
        backend: TransferBackend,
        publish: Callable[[], None],
        forked: Callable[[], bool],
    ) -> None:
        self.core = TierHierarchy(cpu, stores)
        self._cpu = cpu
        self._copies = copies
        self._backend = backend
        self._publish = publish
        self._forked = forked
        self._lanes: dict[TierState, tuple[CopyLane, CopyLane]] = {}
        self._bridge: CompletionBridge | None = None
        self._reaper: asyncio.TimerHandle | None = None

    @property
    def stores(self) -> tuple[LowerTier, ...]:
        return tuple(tier.store for tier in self.core.tiers)

    def bind(self, bridge: CompletionBridge) -> None:
        self._bridge = bridge
        for tier in self.core.tiers:
            name = tier.store.name
            self._lanes[tier] = (bridge.lane(f"{name}-read"), bridge.lane(f"{name}-write"))
            tier.store.bind(bridge.wake_fd)

    # --- lookups ---------------------------------------------------------------------

    def lookup(self, keys: list[OffloadKey], n: int) -> int:
        return self.core.lookup(keys, n)

    async def ask(self, keys: list[OffloadKey], check: Callable[[], None]) -> None:
        """Ask each shared tier about ``keys`` its index does not know; those it holds
        join its index. A server that does not answer counts as a miss. ``check`` runs
        after each answer (raises if the engine closed meanwhile)."""
        core = self.core
        for tier in core.shared_tiers:
            unknown = core.ask(tier, keys)
            if not unknown:
                continue
            assert tier.shared is not None
            try:
                found = await tier.shared.exists(unknown)
            except Exception as exc:
                log.warning("alookup: tier %s did not answer: %r", tier.name, exc)
                continue
            check()
            if len(found) != len(unknown):
                log.warning("alookup: tier %s gave a malformed answer", tier.name)
                continue
            with InterruptsHeld():
                core.join(tier, unknown, found)
            self._publish()

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.core.touch(keys, ctx)

    # --- promotion -------------------------------------------------------------------

    def sources(self, keys: list[OffloadKey]) -> dict[OffloadKey, TierState]:
        return self.core.sources(keys)

    def promote(
        self,
        handle: Transfer,
        ids: list[int],
        ctx: ReqContext,
        sources: dict[OffloadKey, TierState],
    ) -> None:
        """Load ``handle.keys`` into ``ids``, those of ``sources`` brought up first; raises
        :class:`~asyncoffload.PromotionError` (changing nothing) when the CPU tier has no
        idle slot for them."""
        cpu = self._cpu
        keys = handle.keys
        cpu_keys = [key for key in keys if key not in sources]
        cpu.prepare_load(cpu_keys, ctx)  # pinned: the reservation cannot evict them
        try:
            promotion = self.core.promote(sources, ctx)
        except BaseException:
            cpu.complete_load(cpu_keys)
            raise
        if promotion is None:
            cpu.complete_load(cpu_keys)
            raise PromotionError(
                f"prepare_load: {len(sources)} blocks must come from lower tiers and the "
                "CPU tier has no idle slot to bring them into (every slot is pinned or being "
                "written); retry later, or recompute"
            )
        load = _Load(handle, ids, ctx, cpu_keys)
        promotion.owner = load
        self._copies.loads += 1
        self._copies.track(handle._future)
        self._publish()  # the reservation's evictions
        bridge = self._bridge
        assert bridge is not None
        deadline = max(tier.store.deadline_s for tier in set(sources.values()))
        load.timer = bridge.loop.call_later(
            deadline + STALL_GRACE_S, self._stalled, promotion, deadline
        )
        for io in self.core.take_reads():
            job = submit(io, [self._backend.host_address(s) for s in io.cpu_slots])
            bridge.watch(self._lanes[io.tier][0], job, functools.partial(self._read, io=io))

    def _read(self, job: CopyJob, io: TierIo) -> None:
        with InterruptsHeld():
            finished = self.core.read_done(io, job)
            self._publish()
            for promotion in finished:
                self._finish(promotion)
        self._watch_late()

    def _watch_late(self) -> None:
        """While a job given up on holds slots, look now and then whether it ended."""
        bridge = self._bridge
        if self._reaper is None and self.core.late and bridge is not None:
            self._reaper = bridge.loop.call_later(_REAP_S, self._reap)

    def _reap(self) -> None:
        self._reaper = None
        with InterruptsHeld():
            if self.core.reap():
                self._publish()
        self._watch_late()

    def _stalled(self, promotion: Promotion, deadline: float) -> None:
        """A read is still running past its deadline (a stalled disk or mount: a system
        call no deadline can interrupt): fail the handle now. The reserved CPU slots stay
        reserved until the read really ends; then its completion frees them."""
        load: _Load = promotion.owner
        load.timer = None
        if load.handle.done() or promotion.done:
            return
        self._copies.fail(
            load.handle,
            TransferError(
                f"load of {len(load.handle.keys)} blocks: a lower tier read is still running "
                f"{deadline + STALL_GRACE_S:.1f}s after submission (the disk or its mount "
                "is stalled); treat the blocks as misses and recompute"
            ),
        )

    def _finish(self, promotion: Promotion) -> None:
        """Every read of ``promotion`` ended: copy the whole load into the KV blocks, or
        fail it."""
        load: _Load = promotion.owner
        cpu = self._cpu
        handle = load.handle
        if load.timer is not None:
            load.timer.cancel()
            load.timer = None
        if promotion.failed or self._forked() or handle.done():
            cpu.complete_load(load.cpu_keys)
            if handle.done():
                self._copies.inflight.discard(handle._future)
                return
            n = len(handle.keys)
            if promotion.error is not None:
                err = TransferError(f"load of {n} blocks failed: {promotion.error!r}")
                err.__cause__ = promotion.error
            else:
                err = TransferError(
                    f"load of {n} blocks: {promotion.bad} could not be read from a lower "
                    f"tier ({'; '.join(promotion.causes)}); they are misses (dropped from "
                    "the index), and no block was copied: look up again and recompute the rest"
                )
            self._copies.fail(handle, err)
            return
        spec = cpu.prepare_load(promotion.keys, load.ctx)  # pinned like the others
        slot = dict(zip(promotion.keys, spec.block_ids))
        src = [slot[key] if key in slot else _slot_of(cpu, key) for key in handle.keys]
        self._copies.copy_in(handle, src, load.ids, load.ctx)

    # --- write-through ---------------------------------------------------------------

    def write_through(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """Offer CPU-ready ``keys`` to each tier; those its admission takes are written
        from their CPU slots, which stay pinned until the write ends."""
        writes = self.core.write_through(keys, ctx)
        if writes:
            bridge = self._bridge
            assert bridge is not None
            for io in writes:
                job = submit(io, [self._backend.host_address(s) for s in io.cpu_slots])
                bridge.watch(self._lanes[io.tier][1], job, functools.partial(self._written, io=io))
        self._publish()

    def _written(self, job: CopyJob, io: TierIo) -> None:
        with InterruptsHeld():
            try:
                self.core.write_done(io, job)
            finally:
                self._publish()
        self._watch_late()

    # --- events, stats, closing ------------------------------------------------------

    def stats(self) -> tuple[TierStats, ...]:
        return self.core.stats()

    async def aclose(self) -> bool:
        """Close every tier on the loop (its I/O lanes joined: they use host memory).
        True if the backend's host memory is kept (see :meth:`close`)."""
        for store in self.stores:
            try:
                await store.aclose()
            except Exception:
                log.exception("closing tier %s failed", store.name)
        return self.close()

    def close(self) -> bool:
        """Close every tier. Where an op of a job given up on still runs (stuck in a
        system call), its tier keeps its lanes, and the backend (the host memory the op
        reads or writes) is kept too, until it ends (``tiers._io.keep_until_ended``):
        then True, and the caller must not close the backend."""
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for store in self.stores:
            try:
                store.close()
            except Exception:
                log.exception("closing tier %s failed", store.name)
        core = self.core
        core.reap()
        if not core.running:
            return False
        backend = self._backend

        def ended() -> bool:
            return not core.running

        keep_until_ended(f"the host memory of {backend.name}", ended, backend.close)
        return True


def _slot_of(manager: CPUOffloadingManager, key: OffloadKey) -> int:
    block = manager.block_of(key)
    assert block is not None
    return block.block_id


def open_tiers(
    cfg: EngineConfig, namespace: Namespace, backend: TransferBackend
) -> list[LowerTier]:
    """Open ``cfg.tiers`` for ``namespace``, highest first (all closed again if one
    fails); warns of a tier no larger than the one above it."""
    try:
        backend.host_address(0)
    except NotImplementedError as exc:
        raise ValueError(f"lower tiers need host slot addresses: {exc}") from None
    stores: list[LowerTier] = []
    try:
        for i, tier_cfg in enumerate(cfg.tiers):
            store = tier_cfg.open(namespace, f"{tier_cfg.kind}{i}")
            stores.append(store)
            store.attach_host(backend.host_regions())
            above = stores[-2].manager.num_blocks if i else cfg.cpu_blocks
            if store.manager.num_blocks <= above:
                log.warning(
                    "tier %s holds %d blocks, no more than the %d of the tier above: "
                    "tiers are inclusive (every block below is also above until "
                    "evicted there), so it adds few hits; give it more capacity",
                    store.name,
                    store.manager.num_blocks,
                    above,
                )
    except BaseException:
        for opened in stores:
            try:
                opened.close()
            except Exception:
                log.exception("closing tier %s failed", opened.name)
        raise
    return stores


def namespace_of(cfg: EngineConfig, layout: KVLayout) -> Namespace:
    """The identity of an engine's blocks in lower tiers (see docs/tiers.md)."""
    return Namespace(
        model=cfg.model,
        kv_dtype=str(layout.dtype).removeprefix("torch."),
        layout=(
            f"layers={layout.num_layers},kv_split={int(layout.kv_split)},"
            f"fragment_bytes={layout.fragment_bytes}"
        ),
        block_bytes=layout.block_bytes,
        tokens_per_block=cfg.tokens_per_block,
        rank=cfg.rank,
        world_size=cfg.world_size,
        tenant=cfg.tenant,
    )
