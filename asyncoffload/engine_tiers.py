"""The engine's driver of the tier core, on its event loop.

:class:`~asyncoffload.tiers.core.TierHierarchy` decides; this driver carries its
requests to the tiers' ports (reads, writes and deletes to their lanes, one read lane
and one write lane per tier, whose ends the completion bridge reports; questions
awaited by ``alookup``), feeds each result back with the loop's time, arms
one timer at the core's next deadline, and keeps what an awaitable world needs: the
load handle of each promotion. It holds no rule of its own.

Life of a promotion (a load with keys that live only lower down), in core calls:
``sources`` (in ``prepare_load``), ``promote``, ``take_io`` (the reads go to the
lanes), ``read_done`` for each read as the bridge reports it, and ``check`` when the
timer fires: when the last read ended and every block passed its checks, the whole
load is copied into the KV blocks as one :class:`~asyncoffload.Transfer`; otherwise
(a failed block, or a read that stalled) the handle fails and nothing is copied.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from asyncoffload._sigint import InterruptsHeld
from asyncoffload.config import EngineConfig
from asyncoffload.copies import Copies
from asyncoffload.errors import PromotionError, TransferError
from asyncoffload.handles import Transfer
from asyncoffload.keys import OffloadKey
from asyncoffload.layout import KVLayout
from asyncoffload.manager import CPUOffloadingManager, ReqContext
from asyncoffload.tiers import ports
from asyncoffload.tiers._io import keep_until_ended
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.core import (
    CostedHierarchy,
    CostModel,
    Delete,
    Exists,
    Promotion,
    Request,
    TierIo,
    TierState,
    TierStats,
)
from asyncoffload.tiers.format import Namespace
from asyncoffload.transfer import CompletionBridge, CopyJob, TransferBackend
from asyncoffload.transfer.completion import CopyLane

__all__ = ["LoopTiers", "cost_model", "namespace_of", "observe_prefill", "open_tiers"]

log = logging.getLogger("asyncoffload")


@dataclass(eq=False)
class _Load:
    """What the engine keeps of a promotion: the load it is part of."""

    handle: Transfer
    ids: list[int]
    ctx: ReqContext
    #: The load's keys already in the CPU tier (pinned until the load ends).
    cpu_keys: list[OffloadKey]
    #: When its reads were handed out (the loop's time).
    submitted: float


class LoopTiers:
    """Drives the tier core for an engine: ``stores`` are the tiers' ports and
    ``states`` the core's view of them (:func:`~asyncoffload.tiers.ports.tier_states`),
    below the CPU tier ``cpu``; copies into the KV blocks go through ``copies``, host
    slot addresses come from ``backend``, and ``publish`` sends pending events.
    ``forked``: whether this process is a fork of the engine's."""

    def __init__(
        self,
        cpu: CPUOffloadingManager,
        stores: Sequence[LowerTier],
        states: Sequence[TierState],
        copies: Copies,
        backend: TransferBackend,
        publish: Callable[[], None],
        forked: Callable[[], bool],
    ) -> None:
        self.core = CostedHierarchy(cpu, states)
        self._ports = dict(zip(self.core.tiers, stores))
        self._cpu = cpu
        self._copies = copies
        self._backend = backend
        self._publish = publish
        self._forked = forked
        self._lanes: dict[TierState, tuple[CopyLane, CopyLane]] = {}
        self._bridge: CompletionBridge | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        #: ``alookup``'s questions still running (past their deadline, some of them).
        self._asking: set[asyncio.Task[None]] = set()

    @property
    def stores(self) -> tuple[LowerTier, ...]:
        return tuple(self._ports.values())

    def bind(self, bridge: CompletionBridge) -> None:
        self._bridge = bridge
        for tier, store in self._ports.items():
            self._lanes[tier] = (
                bridge.lane(f"{tier.name}-read"),
                bridge.lane(f"{tier.name}-write"),
            )
            store.bind(bridge.wake_fd)

    def _now(self) -> float:
        """The tier core's clock: ``time.monotonic()``, asyncio's own loop clock. Not the
        loop's ``time()``: uvloop's is libuv's, in whole milliseconds and read once per
        loop iteration, so a one-block read of 0.3-0.8 ms measured 0 or 1 ms, and the
        read guard, the read models and the write lag learned from noise (issue 41: on
        uvloop the guard ended runs at 16-24 blocks in flight, on asyncio at 0.06)."""
        return time.monotonic()

    # --- carrying the core's requests ------------------------------------------------

    def _carry(self, requests: Sequence[Request]) -> None:
        """Hand each request to its port: reads, writes and deletes to the tier's lanes
        (their ends come back through the bridge; a delete with no job is done), questions
        to a task."""
        bridge = self._bridge
        for req in requests:
            port = self._ports[req.tier]
            if isinstance(req, TierIo):
                assert bridge is not None
                job = ports.submit(
                    port, req, [self._backend.host_address(s) for s in req.cpu_slots]
                )
                done = self._written if req.write else self._read
                lane = self._lanes[req.tier][1 if req.write else 0]
                bridge.watch(lane, job, functools.partial(done, io=req))
            elif isinstance(req, Delete):
                if (removal := ports.delete(port, req)) is not None:
                    assert bridge is not None
                    deleted = functools.partial(self._deleted, req=req)
                    bridge.watch(self._lanes[req.tier][1], removal, deleted)
            else:
                assert bridge is not None
                req.job = bridge.loop.create_task(self._answer(req))

    async def _answer(self, q: Exists, check: Callable[[], None] | None = None) -> None:
        """Ask ``q`` of its port and hand the answer (or the failure) to the core;
        ``check`` runs once it came (raises if the engine closed meanwhile)."""
        found: list[bool] | None = None
        error: BaseException | None = None
        try:
            found = await ports.shared(self._ports[q.tier]).exists(q.keys)
        except Exception as exc:
            error = exc
        if check is not None:
            check()
        with InterruptsHeld():
            self.core.answered(q, found, error, self._now())
            self._carry(self.core.take_io(self._now()))  # the deletes of evictions
        self._publish()
        self._arm()

    def _arm(self) -> None:
        """One timer, at the core's next deadline."""
        bridge = self._bridge
        at = self.core.next_deadline()
        if bridge is None or at is None:
            return
        if self._timer is not None:
            if self._timer_at <= at:
                return  # it fires sooner, and arms again then
            self._timer.cancel()
        self._timer_at = at
        # A delay on the core's clock, rounded up to whole milliseconds (uvloop's timers'
        # unit): a timer that fires early would find nothing due and arm again at once.
        delay = math.ceil(max(0.0, at - self._now()) * 1e3) / 1e3
        self._timer = bridge.loop.call_later(delay, self._due)

    def _due(self) -> None:
        self._timer = None
        now = self._now()
        with InterruptsHeld():
            for promotion in self.core.check(now):
                self._stalled(promotion)
            if ports.reap(self.core, now):
                self._publish()
            self._carry(self.core.take_io(now, batched=False))  # writes the guard paused
        self._arm()

    # --- lookups ---------------------------------------------------------------------

    def lookup(self, keys: list[OffloadKey], n: int) -> int:
        return self.core.lookup(keys, n, now=self._now())  # load or recompute: core.cost

    async def ask(self, keys: list[OffloadKey], n: int, check: Callable[[], None]) -> None:
        """``alookup``'s questions: ask each shared tier about the keys after the first
        ``n`` (the CPU tier's prefix) that no tier has ready, which its index does not
        know (and that no recent answer said were not there); those it holds join its
        index. A server that does not answer counts as a miss, and is not asked again
        for a while. ``check`` runs after each answer (raises if the engine closed
        meanwhile)."""
        core = self.core
        if not core.shared_tiers:
            return
        n = core.lookup(keys, n, count=False)  # counted once, by the lookup that follows
        if n >= len(keys):
            return
        loop = asyncio.get_running_loop()
        for q in core.ask(keys[n:], self._now()):
            # Due by the recompute time of its keys (core.cost) or the tier's deadline: an
            # answer later than that is a miss now (and the tier is not asked for a while);
            # the question itself ends in the background, by the tier's own timeout.
            task = q.job = loop.create_task(self._answer(q))
            self._asking.add(task)
            task.add_done_callback(self._asking.discard)
            await asyncio.wait([task], timeout=max(0.0, q.deadline - self._now()))
            if not task.done():
                with InterruptsHeld():
                    late = TimeoutError("no answer by the question's deadline")
                    core.answered(q, None, late, self._now())
            elif not task.cancelled():  # (cancelled: the engine closed; check() says so)
                task.result()  # a defect of ours surfaces here
            check()
        self._arm()

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
        now = self._now()
        promotion.owner = _Load(handle, ids, ctx, cpu_keys, now)
        self._copies.loads += 1
        self._copies.track(handle._future)
        self._publish()  # the reservation's evictions
        self._carry(self.core.take_io(now))
        self._arm()

    def _read(self, job: CopyJob, io: TierIo) -> None:
        with InterruptsHeld():
            finished = self.core.read_done(io, ports.outcome(job, len(io.keys)), self._now())
            self._carry(self.core.take_io(self._now()))  # the deletes of dropped blocks
            self._publish()
            for promotion in finished:
                self._finish(promotion)
        self._arm()

    def _stalled(self, promotion: Promotion) -> None:
        """A read is still running past its deadline (a stalled disk or mount: a system
        call no deadline can interrupt): the core failed the promotion; fail the handle
        now. The reserved CPU slots stay reserved until the read really ends; then its
        completion frees them."""
        load: _Load = promotion.owner
        if load.handle.done():
            return
        self._copies.fail(
            load.handle,
            TransferError(
                f"load of {len(load.handle.keys)} blocks: a lower tier read is still running "
                f"{promotion.deadline - load.submitted:.3f}s after submission, past its "
                "deadline (recomputing them is expected to be faster by now, or the tier is "
                "stalled); treat the blocks as misses and recompute"
            ),
        )

    def _finish(self, promotion: Promotion) -> None:
        """Every read of ``promotion`` ended: copy the whole load into the KV blocks, or
        fail it."""
        load: _Load = promotion.owner
        cpu = self._cpu
        handle = load.handle
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
        self.core.write_through(keys, ctx)
        self._carry(self.core.take_io(self._now()))
        self._publish()

    def reoffer(self, keys: list[OffloadKey], stored: list[OffloadKey], ctx: ReqContext) -> None:
        """A CPU store took only ``stored`` of ``keys``: the others go down again."""
        self.core.reoffer(keys, stored, ctx)
        self._carry(self.core.take_io(self._now()))

    def _deleted(self, job: CopyJob, req: Delete) -> None:
        with InterruptsHeld():
            self.core.delete_done(req, ports.outcome(job, len(req.keys)), self._now())

    def _written(self, job: CopyJob, io: TierIo) -> None:
        with InterruptsHeld():
            try:
                self.core.write_done(io, ports.outcome(job, len(io.keys)), self._now())
                self._carry(self.core.take_io(self._now(), batched=False))  # writes waiting
            finally:
                self._publish()
        self._arm()

    # --- events, stats, closing ------------------------------------------------------

    def stats(self) -> tuple[TierStats, ...]:
        return self.core.stats(lambda tier: self._ports[tier].describe())

    async def settle_writes(self, wait_idle: Callable[[], Awaitable[None]]) -> None:
        """``wait_idle`` (every job ended), again after each pause of the read guard
        (writes waiting in the core with none in flight: the timer hands them out when
        the pause ends), until no write waits."""
        await wait_idle()
        while True:
            paused = [at for t in self.core.tiers if (at := t.pressure.resume_at()) is not None]
            if not paused and not any(t.pressure.waiting for t in self.core.tiers):
                return
            # The pause is at most 1 / READ_LEAST times a write (each bounded by the
            # tier's deadline); a write waiting with none paused is handed out now.
            now = self._now()
            await asyncio.sleep(max(0.0, min(paused, default=now) - now))
            if self._bridge is None:  # closed meanwhile: the waiting writes were dropped
                return
            with InterruptsHeld():
                self._carry(self.core.take_io(self._now(), batched=False))
            self._arm()
            await wait_idle()

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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for q in self.core.close():
            if isinstance(q.job, asyncio.Task):
                q.job.cancel()
        for task in list(self._asking):  # given up on by their lookups, still running
            task.cancel()
        ports.close_tiers(self.stores)
        core = self.core
        ports.reap(core, self._now())
        if not ports.running(core):
            return False
        backend = self._backend

        def ended() -> bool:
            return not ports.running(core)

        keep_until_ended(f"the host memory of {backend.name}", ended, backend.close)
        return True


def _slot_of(manager: CPUOffloadingManager, key: OffloadKey) -> int:
    block = manager.block_of(key)
    assert block is not None
    return block.block_id


def cost_model(cfg: EngineConfig) -> CostModel:
    """The load-or-recompute rule of an engine's tiers (``load_or_recompute``, with
    ``recompute_tokens_per_s`` x ``tokens_per_block``; see ``tiers.core.cost``)."""
    model = CostModel(
        enabled=cfg.load_or_recompute,
        deadline_factor=cfg.load_deadline_factor,
        min_deadline_s=cfg.load_deadline_floor_s,
        probe_every_s=cfg.load_probe_every_s,
    )
    model.recompute.tokens_per_block = cfg.tokens_per_block
    if cfg.recompute_tokens_per_s is not None:
        model.recompute.tokens_per_s = cfg.recompute_tokens_per_s
        model.recompute.configured = True
    return model


def observe_prefill(tiers: LoopTiers | None, tokens: int, seconds: float) -> None:
    """``AsyncOffloadEngine.observe_prefill``: the serving engine computed ``tokens`` of
    prompts in ``seconds``, its prefill throughput (an exponential average; ignored with
    ``recompute_tokens_per_s`` set, or without tiers). ``ValueError`` for a negative
    count or a time that is not a positive finite number."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"observe_prefill: tokens must be an int >= 0, got {tokens!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"observe_prefill: seconds must be a number, got {seconds!r}")
    if not 0 < seconds < math.inf:
        raise ValueError(f"observe_prefill: seconds must be > 0 and finite, got {seconds!r}")
    if tiers is not None:
        tiers.core.cost.recompute.observe(tokens, float(seconds))


def open_tiers(
    cfg: EngineConfig, namespace: Namespace, backend: TransferBackend
) -> list[LowerTier]:
    """Open ``cfg.tiers`` for ``namespace``, highest first (all closed again if one
    fails); warns of a tier no larger than the one above it."""
    try:
        backend.host_address(0)
    except NotImplementedError as exc:
        raise ValueError(f"lower tiers need host slot addresses: {exc}") from None
    return ports.open_tiers(cfg.tiers, namespace, backend.host_regions(), cfg.cpu_blocks)


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
