"""AsyncOffloadEngine: the async facade over a manager, a transfer backend and the event hub.

The engine keeps the public API, input validation, handles and lifecycle. The rest lives
in rooms named for what they are: :mod:`asyncoffload.copies` (the CPU tier's copies and
their completions), :mod:`asyncoffload.engine_tiers` (the engine's driver of the tier
hierarchy of :mod:`asyncoffload.tiers.core`), :mod:`asyncoffload.events` (the event
stream), :mod:`asyncoffload.stats` (stats and the periodic summary),
:mod:`asyncoffload._checks` (input checks) and :mod:`asyncoffload._sigint` (the interrupt
hold). All bookkeeping runs on the event-loop thread; copy threads (or the device) only
copy and signal. See docs/architecture.md for the life of a store and of a load.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import warnings
import weakref
from collections.abc import Sequence
from types import TracebackType

import torch

from asyncoffload._checks import (
    BlockIds,
    check_call,
    check_ctx,
    check_described,
    check_keys,
    check_tokens,
    distinct,
    filed,
)
from asyncoffload._sigint import InterruptsHeld
from asyncoffload.config import EngineConfig
from asyncoffload.copies import Copies, make_backend
from asyncoffload.engine_binding import LoopBinding
from asyncoffload.engine_tiers import (
    LoopTiers,
    cost_model,
    namespace_of,
    observe_prefill,
    open_tiers,
)
from asyncoffload.errors import CapacityError
from asyncoffload.events import EventStream, EventSubscription
from asyncoffload.handles import Transfer
from asyncoffload.hostmem import format_bytes
from asyncoffload.keys import BlockTokens, OffloadKey
from asyncoffload.layout import KVLayout
from asyncoffload.manager import CPUOffloadingManager, ReqContext
from asyncoffload.manager.quotas import resolve_quotas
from asyncoffload.stats import EngineStats, Summary, TierStats, engine_stats
from asyncoffload.tiers.base import LowerTier
from asyncoffload.tiers.format import Namespace
from asyncoffload.tiers.ports import tier_states
from asyncoffload.transfer import CompletionBridge, TransferBackend

__all__ = ["AsyncOffloadEngine", "BlockIds", "EngineStats", "TierStats"]

log = logging.getLogger("asyncoffload")

# Engines alive in this process; a fork marks them unusable in the child, whose copy
# threads (or device contexts) are the parent's and do not exist there.
_live_engines: weakref.WeakSet[AsyncOffloadEngine] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for engine in list(_live_engines):
        engine._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class AsyncOffloadEngine(LoopBinding):
    """Offloads KV blocks to a CPU tier and loads them back, asynchronously.

    ``kv_caches`` is the list of per-layer KV tensors (see :class:`KVLayout`); the
    engine copies whole blocks between them and the host tier. Methods must be called
    from one event loop (the one of the first call). Use ``async with engine:`` or
    ``await engine.aclose()``.

    On a GPU, a transfer is ordered after the work already queued on the *calling
    thread's* current CUDA stream (``torch.cuda.current_stream()``) when ``prepare_*`` is
    called: call it from the thread, and with the stream, that produced (or will consume)
    the KV blocks.

    Completion order: per direction, transfers complete (callback run, handle resolved)
    in submission order. A store's callback makes its keys loadable and publishes one
    stored event before its handle wakes anyone; a load's callback unpins its slots
    before its handle wakes anyone.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        config: EngineConfig | None = None,
        *,
        layout: KVLayout | None = None,
        backend: TransferBackend | None = None,
    ) -> None:
        config = config if config is not None else EngineConfig()
        self._forked = False
        self.layout = layout if layout is not None else KVLayout.infer(kv_caches)
        # cpu_bytes -> cpu_blocks for this layout's blocks: self.config is the resolved copy.
        self.config = cfg = _resolved(config, self.layout.block_bytes)
        self._manager = manager = _cpu_manager(cfg, self.layout.block_bytes)
        if backend is None:
            backend = make_backend(kv_caches, self.layout, cfg)
        elif backend.num_host_blocks < cfg.cpu_blocks:
            raise ValueError(
                f"backend has {backend.num_host_blocks} host blocks, "
                f"config.cpu_blocks is {cfg.cpu_blocks}"
            )
        self._backend = backend
        stores = open_tiers(cfg, self.namespace, backend) if cfg.tiers else []
        states = tier_states(stores)  # the tier core's view of them, with their indices
        self._events = EventStream([manager, *(state.index for state in states)])
        self._hub = self._events.hub
        publish = self._publish_events = self._events.publish
        self._copies = copies = Copies(manager, backend, publish)
        self._tiers: LoopTiers | None = None
        if stores:
            # Through a weak reference: the tiers must not keep the engine (and its host
            # memory) alive in a cycle that only the cyclic GC would break.
            engine = weakref.ref(self)

            def forked() -> bool:
                alive = engine()
                return alive is None or alive._forked

            self._tiers = LoopTiers(manager, stores, states, copies, backend, publish, forked)
            self._tiers.core.cost = cost_model(cfg)  # load or recompute, by measured cost
            # A completed store goes on down; weakly, as the tiers hold the copies.
            write_through = weakref.WeakMethod(self._tiers.write_through)

            def stored(keys: list[OffloadKey], ctx: ReqContext) -> None:
                method = write_through()
                if method is not None:
                    method(keys, ctx)

            copies.stored = stored
        self._bridge: CompletionBridge | None = None
        self._loop_thread: int | None = None
        self._pid = os.getpid()
        self._closing = self._closed = False
        _live_engines.add(self)
        self._stores_rejected = self._lookups = self._lookup_keys = self._lookup_hits = 0
        self._summary = Summary(cfg.log_summary_s, self.stats) if cfg.log_summary_s else None

    # --- properties ------------------------------------------------------------------

    @property
    def manager(self) -> CPUOffloadingManager:
        """The synchronous manager behind the engine. Calling its mutating methods
        directly bypasses the copies; use it for inspection."""
        return self._manager

    @property
    def backend(self) -> TransferBackend:
        return self._backend

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine is bound to (None before its first use)."""
        return self._bridge.loop if self._bridge is not None else None

    @property
    def namespace(self) -> Namespace:
        """The identity of this engine's blocks in lower tiers (see docs/tiers.md)."""
        return namespace_of(self.config, self.layout)

    @property
    def tiers(self) -> tuple[LowerTier, ...]:
        """The running tiers below the CPU tier, highest first."""
        return self._tiers.stores if self._tiers is not None else ()

    @property
    def in_flight(self) -> int:
        """Transfers whose handles have not resolved."""
        return len(self._copies.inflight)

    # --- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> AsyncOffloadEngine:
        self._check_usable()
        self._ensure_bridge()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Refuse new work, wait for every in-flight copy to complete (callbacks run,
        handles resolved), then end every event subscription and release the backend.

        Must be awaited on the engine's event loop (``RuntimeError`` otherwise: its
        transfers complete only there). Cancelling ``aclose`` leaves the engine closing:
        copies still complete, and a later ``aclose`` finishes the job. In a child
        process after ``os.fork`` there is nothing to wait for (the copies belong to the
        parent): the engine is marked closed and nothing of the parent's is touched.
        """
        bridge = self._bridge
        if (
            bridge is not None
            and not self._forked
            and asyncio.get_running_loop() is not bridge.loop
        ):
            raise RuntimeError(
                "aclose() must be awaited on the engine's event loop, where its transfers complete"
            )
        self._closing = True
        if self._summary is not None:
            self._summary.stop()
        if self._forked:
            self._closed = True
            return
        await self._copies.wait_idle(fail_orphans=True)
        if self._closed:
            return
        self._closed = True
        self._publish_events()
        self._hub.close()
        # Joins the I/O lanes (they read and write host memory); where an op stuck in a
        # system call still runs, the tiers keep its lanes and the backend (whose host
        # memory it uses) until it ends: then only the bridge closes here.
        if self._tiers is not None and await self._tiers.aclose():
            self._copies.close_bridge()
            return
        self._copies.close()  # joins copy threads, then closes the bridge they signal

    async def flush(self) -> None:
        """Wait until nothing is in flight: every transfer resolved and every write to a
        lower tier ended (those a read guard paused too), and every removal of a block
        file it evicted (stores resolve when the CPU copy is done; their write-through
        goes on after). Must be awaited on the engine's event loop."""
        self._check_usable()
        self._ensure_bridge()
        idle = functools.partial(self._copies.wait_idle, fail_orphans=False)
        await (idle() if self._tiers is None else self._tiers.settle_writes(idle))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The serving engine computed ``tokens`` of prompts in ``seconds``: the recompute
        side of ``load_or_recompute`` (see :func:`asyncoffload.engine_tiers.observe_prefill`)."""
        observe_prefill(self._tiers, tokens, seconds)

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or getattr(self, "_forked", False):
            return
        warnings.warn(
            f"unclosed {self!r}: use 'async with engine' or 'await engine.aclose()'",
            ResourceWarning,
            stacklevel=1,
            source=self,
        )
        # Nothing is in flight (a pending job's callback would keep the engine alive):
        # release the copy threads, then the wake-up fd they signal.
        try:
            if self._tiers is not None and self._tiers.close():
                self._copies.close_bridge()  # the backend is kept (see aclose)
            else:
                self._copies.close()
        except Exception:  # interpreter shutdown, a closed loop: nothing more to do
            pass

    # --- the API ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> int:
        """How many leading ``keys`` are stored and ready to load. Does not change
        recency (see :meth:`touch`)."""
        self._check_usable()
        checked = check_keys(keys, "lookup")
        n = self._lookup(filed(checked, ctx := check_ctx(ctx, "lookup")), ctx)
        self._lookups += 1
        self._lookup_keys += len(checked)
        self._lookup_hits += n
        return n

    def _lookup(self, keys: list[OffloadKey], ctx: ReqContext, observe: bool = True) -> int:
        n = self._manager.lookup_prefix(keys, ctx, observe=observe)
        if self._tiers is not None and n < len(keys):
            n = self._tiers.lookup(keys, n)
        return n

    async def alookup(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> int:
        """:meth:`lookup` that also asks the shared tiers (a Redis / Valkey server) about
        keys this engine does not know of, such as blocks another engine stored: those
        found join the tier's index (a stored event), and count. Never blocks the loop;
        a server that does not answer in time counts as a miss."""
        self._check_usable()
        checked = check_keys(keys, "alookup")
        keys = filed(checked, ctx := check_ctx(ctx, "alookup"))
        if self._tiers is not None:  # the policy hears of the lookup once, below
            n = self._manager.lookup_prefix(keys, ctx, observe=False)
            await self._tiers.ask(keys, n, self._check_usable)
        return self.lookup(checked, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used; ``keys[0]`` becomes the most recently used."""
        self._check_usable()
        keys = filed(check_keys(keys, "touch"), ctx := check_ctx(ctx, "touch"))
        with InterruptsHeld():
            self._manager.touch(keys, ctx)
            if self._tiers is not None:
                self._tiers.touch(keys, ctx)

    async def prepare_load(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: BlockIds,
        ctx: ReqContext | None = None,
    ) -> Transfer:
        """Start copying stored ``keys`` into KV blocks ``gpu_blocks`` (same order).

        Every key must be ready (see :meth:`lookup`); the call raises
        :class:`~asyncoffload.UnknownKeyError`, :class:`~asyncoffload.KeyNotReadyError`,
        :class:`~asyncoffload.DuplicateKeyError`, :class:`~asyncoffload.BlockIdError` or
        :class:`~asyncoffload.LengthMismatchError` and changes nothing otherwise. The
        source slots stay pinned (unevictable) until the copy ends. Awaiting the returned
        handle waits until the bytes are in the KV blocks.
        """
        with InterruptsHeld():
            return self._prepare_load(keys, gpu_blocks, ctx)

    def _prepare_load(
        self, keys: Sequence[OffloadKey], gpu_blocks: BlockIds, ctx: ReqContext | None
    ) -> Transfer:
        bound = self._bound()
        limit = self.layout.num_blocks
        keys, ids, ctx = check_call("prepare_load", keys, gpu_blocks, ctx, limit, unique=True)
        if not bound:
            self._ensure_bridge()
        handle = self._copies.handle("load", keys)
        if self._tiers is not None and (lower := self._tiers.sources(keys)):
            self._tiers.promote(handle, ids, ctx, lower)
            return handle
        spec = self._manager.prepare_load(keys, ctx)
        # From here the slots are pinned: every way out unpins them or hands them to a
        # job whose completion does (an interrupt included; see Copies.abandon).
        copies, slots, touch = self._copies, spec.block_ids, self.config.touch_on_load
        if not copies.now("load", handle, ids, slots, ctx, touch):
            copies.load(handle, slots, ids, ctx, touch)
        return handle

    async def prepare_store(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: BlockIds,
        ctx: ReqContext | None = None,
        *,
        tokens: BlockTokens | None = None,
    ) -> Transfer | None:
        """Start copying KV blocks ``gpu_blocks`` out under ``keys`` (same order).

        ``tokens`` (or ``ctx.tokens``) describes what the blocks hold; the stored event
        then carries it (see :class:`~asyncoffload.BlockTokens`). It must describe every
        key (``ValueError`` otherwise).

        Keys already stored or in flight are skipped, and so are keys the CPU tier
        declines (its policy's admission, the admission filter, ``store_threshold``):
        ``handle.keys_to_store`` lists those written, ``handle.skipped_keys`` the others,
        ``handle.declined_keys`` the declined ones (stored nowhere: not loadable unless a
        lower tier has them), ``handle.evicted_keys`` what was evicted for them (already
        published as one removed event). Returns ``None``, storing nothing, when too few
        idle blocks can be evicted now (a later call may succeed). Where the call has more new keys
        (neither stored nor in flight) than the CPU tier has blocks and the tier refuses
        it (the ones admission lets in do not fit), it raises
        :class:`~asyncoffload.CapacityError` (a ``ValueError``) instead, storing nothing:
        that call can never succeed, so store a prefix that fits or skip the store. Bad
        input raises (see :meth:`prepare_load`) and changes nothing.

        The source KV blocks must not be overwritten until the handle resolves; then the
        keys of ``keys_to_store`` are loadable and one stored event has been published.
        Keys skipped because another store of them is still in flight become loadable
        when that store completes, not with this handle.
        """
        with InterruptsHeld():
            return self._prepare_store(keys, gpu_blocks, ctx, tokens)

    def _prepare_store(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: BlockIds,
        ctx: ReqContext | None,
        tokens: BlockTokens | None,
    ) -> Transfer | None:
        bound = self._bound()
        limit = self.layout.num_blocks
        keys, ids, ctx = check_call("prepare_store", keys, gpu_blocks, ctx, limit, unique=False)
        if (tokens is not None or ctx.tokens is not None) and (
            ctx := check_tokens(ctx, tokens)
        ).tokens is not None:
            check_described(keys, ctx.tokens)
        if not bound:
            self._ensure_bridge()
        if self.config.touch_on_store and keys:
            # The request uses these blocks, stored or not (see EngineConfig).
            self._manager.touch(distinct(keys), ctx)  # a key listed twice once
        out = self._manager.prepare_store(keys, ctx)
        if out is None:  # refused, nothing changed
            _check_capacity(self._manager, keys)
            self._publish_events()
            self._stores_rejected += 1
            return None
        to_store = out.keys_to_store
        declined = _declined(self._manager, keys) if len(to_store) < len(keys) else []
        if self._tiers is not None:
            self._tiers.reoffer(keys, to_store, ctx)  # the keys the CPU tier holds already
        # From here the slots are being written: every way out frees them or hands them
        # to a job whose completion does (an interrupt included; see Copies.abandon).
        handle = self._copies.handle("store", keys, to_store, out.evicted_keys, declined)
        src = ids if len(to_store) == len(keys) else _sources(keys, ids, to_store)
        slots = out.store_spec.block_ids
        try:
            if not self._copies.now("store", handle, src, slots, ctx):
                self._copies.store(handle, src, slots, ctx)
        except BaseException:
            self._publish_events()  # the removed event of the evictions
            raise
        if not (to_store and handle.done()):
            # The removed event of the evictions (a copy that ended at once published it
            # already, before its stored event).
            self._publish_events()
        return handle

    def events(self, snapshot: bool = False, max_buffer: int | None = None) -> EventSubscription:
        """Subscribe to the event stream: every event published after this call returns,
        in ``seq`` order, with :class:`~asyncoffload.Lagged` markers where the buffer of
        ``max_buffer`` events (default ``config.event_buffer``) overflowed.

        With ``snapshot=True`` the subscription first yields every resident key as stored
        events marked ``snapshot=True`` (their ``seq`` is that of the last live event they
        reflect), so replaying it rebuilds the exact resident set.
        """
        self._check_usable()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop yet: the first reader's loop or first use binds
            pass
        else:
            self._ensure_bridge()  # the engine's loop is this one (RuntimeError if not)
        size = self.config.event_buffer if max_buffer is None else max_buffer
        return self._events.subscribe(size, snapshot)

    def stats(self) -> EngineStats:
        return engine_stats(
            backend=self._backend,
            bridge=self._bridge,
            lookups=(self._lookups, self._lookup_keys, self._lookup_hits),
            stores_rejected=self._stores_rejected,
            copies=self._copies,
            hub=self._hub,
            manager=self._manager,
            tiers=self._tiers.stats() if self._tiers is not None else (),
        )

    def __repr__(self) -> str:
        m = self._manager.stats()
        state = "closed" if self._closed else ("closing" if self._closing else "open")
        mech = self._bridge.mechanism if self._bridge else "unbound"
        return (
            f"<AsyncOffloadEngine {state} backend={self._backend.name} completion={mech} "
            f"[{m.ready} ready, {m.pinned} pinned, {m.write_pending} writing, {m.free} free | "
            f"{self.in_flight} in flight | {len(self._hub.subscribers)} subscribers]>"
        )


def _resolved(config: EngineConfig, block_bytes: int) -> EngineConfig:
    """``config`` with ``cpu_bytes`` resolved to ``cpu_blocks`` of ``block_bytes``."""
    cfg = config.resolve_blocks(block_bytes)
    if cfg.cpu_bytes is not None:
        log.info(
            "asyncoffload: cpu_bytes=%d (%s) resolved to cpu_blocks=%d of %d bytes each",
            cfg.cpu_bytes,
            format_bytes(cfg.cpu_bytes),
            cfg.cpu_blocks,
            block_bytes,
        )
    return cfg


def _cpu_manager(cfg: EngineConfig, block_bytes: int) -> CPUOffloadingManager:
    """The CPU tier's index, its quotas in blocks of ``block_bytes``."""
    return CPUOffloadingManager(
        cfg.cpu_blocks,
        cfg.policy,
        cfg.store_threshold,
        enable_events=True,
        max_tracker_size=cfg.max_tracker_size,
        admission=cfg.admission,
        quotas=resolve_quotas(cfg.quotas, cfg.cpu_blocks, block_bytes, "quotas"),
        pin_budget=cfg.pin_budget,
    )


def _check_capacity(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> None:
    """A store was refused. With more new keys (neither stored nor in flight) than the
    tier has blocks, no later call can take them either: :class:`CapacityError`."""
    if len(keys) > manager.num_blocks:
        new = sum(1 for key in dict.fromkeys(keys) if manager.block_of(key) is None)
        if new > manager.num_blocks:
            raise CapacityError(new, manager.num_blocks)


def _declined(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> list[OffloadKey]:
    """After a store of ``keys``: those the CPU tier declined, each once. A store never
    evicts a key of its own call, so a key absent now was absent before and not taken."""
    block_of = manager.block_of
    return [key for key in dict.fromkeys(keys) if block_of(key) is None]


def _sources(keys: list[OffloadKey], ids: list[int], chosen: list[OffloadKey]) -> list[int]:
    """The KV block ids of the ``chosen`` of ``keys`` (``ids``: one per key)."""
    position = {key: i for i, key in enumerate(keys)}
    return [ids[position[key]] for key in chosen]
