"""AsyncOffloadEngine: the async facade over a manager, a transfer backend and the event hub.

All bookkeeping runs on the event-loop thread; copy threads (or the device) only copy
and signal. See docs/architecture.md for the life of a store and of a load.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import logging
import math
import operator
import os
import signal
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, SupportsIndex, TypeAlias

import torch

from asyncoffload.config import EngineConfig
from asyncoffload.errors import (
    BlockIdError,
    CapacityError,
    DuplicateKeyError,
    EngineClosedError,
    KeyNotReadyError,
    LengthMismatchError,
    PromotionError,
    TransferError,
    UnknownKeyError,
)
from asyncoffload.events import EventHub, EventSubscription, SubscriptionStats
from asyncoffload.handles import Completion, Transfer, TransferResult
from asyncoffload.histogram import (
    BYTES_PER_SECOND_BUCKETS,
    LATENCY_BUCKETS_S,
    TRANSFER_BUCKETS_S,
    Histogram,
    HistogramSnapshot,
)
from asyncoffload.hostmem import format_bytes
from asyncoffload.keys import GROUP_IDX_BYTES, BlockTokens, IntArray, OffloadKey, tenant_key
from asyncoffload.layout import KVLayout
from asyncoffload.manager import CPUOffloadingManager, ManagerStats, OffloadingEvent, ReqContext
from asyncoffload.tiers.base import LowerTier, TierCounters, settle_read, settle_write
from asyncoffload.tiers.format import MAX_KEY_BYTES, Namespace
from asyncoffload.transfer import CompletionBridge, CopyJob, CpuCopyBackend, TransferBackend
from asyncoffload.transfer.base import FailedJob
from asyncoffload.transfer.completion import CopyLane

__all__ = ["AsyncOffloadEngine", "EngineStats", "TierStats"]

log = logging.getLogger("asyncoffload")

_SNAPSHOT_CHUNK = 4096
_ANON = ReqContext(req_id="")
# How often aclose() checks for handles whose copy job was lost.
_ORPHAN_CHECK_S = 0.5
# How often aclose() looks again at lane jobs that no handle waits for.
_FENCE_POLL_S = 0.001

# Engines alive in this process; a fork marks them unusable in the child, whose copy
# threads (or device contexts) are the parent's and do not exist there.
_live_engines: weakref.WeakSet[AsyncOffloadEngine] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for engine in list(_live_engines):
        engine._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# The C functions under ``signal.getsignal`` / ``signal.signal``: the wrappers convert
# handlers to enums, and a Python handler fails that lookup through an exception whose
# message formats the handler's repr (about 100 us per step, 6% of a busy tier's loop).
_getsignal: Callable[[int], Any] = signal.getsignal
_setsignal: Callable[[int, Any], Any] = signal.signal
with contextlib.suppress(ImportError):  # CPython
    _c_signal = importlib.import_module("_signal")
    _getsignal, _setsignal = _c_signal.getsignal, _c_signal.signal
_SIGINT = int(signal.SIGINT)


class _InterruptsHeld:
    """While inside, a SIGINT is recorded instead of acted on; on leaving, the handler
    that was installed runs (``KeyboardInterrupt`` for Python's default one).

    The manager's bookkeeping is plain Python: a ``KeyboardInterrupt`` raised between two
    of its updates (a slot taken from the free list and not yet in the policy, a pin
    without its load) leaves it half updated, and no ``except`` can tell what to undo.
    So each engine step that changes the manager and hands a copy to a lane runs whole,
    and the interrupt comes at its end, where every slot is accounted for. Only the main
    thread runs Python signal handlers (and may set them); elsewhere this does nothing.
    Costs two ``sigaction`` calls per step.
    """

    __slots__ = ("_hit", "_old")

    def __enter__(self) -> None:
        self._old: Any = None
        if threading.get_ident() != _MAIN_THREAD or _held[0]:
            return
        old = _getsignal(_SIGINT)
        if not callable(old):  # SIG_IGN or SIG_DFL: nothing raises in Python code
            return
        self._hit = False

        def record(signum: int, frame: FrameType | None) -> None:
            self._hit = True

        _setsignal(_SIGINT, record)
        self._old = old
        _held[0] = True

    def __exit__(self, *exc: object) -> None:
        old = self._old
        if old is None:
            return
        _held[0] = False  # first: once the old handler is back, it may raise at any time
        _setsignal(_SIGINT, old)
        if self._hit:
            old(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt here


#: KV block ids: ints (or anything ``operator.index`` takes: numpy and torch integer
#: scalars), a 1-D integer torch tensor, or a 1-D integer numpy array (vLLM's tables).
BlockIds: TypeAlias = "Sequence[SupportsIndex] | torch.Tensor | IntArray"

_MAIN_THREAD = threading.main_thread().ident
_held = [False]


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time summary of an engine."""

    backend: str
    #: Backend details: copy engine or methods, host memory, pinning.
    backend_info: dict[str, object]
    #: Active completion mechanism: "eventfd", "pipe" or "poll" (None before first use).
    completion: str | None
    #: ``lookup`` calls, keys they asked for, and leading keys found ready.
    lookups: int
    lookup_keys: int
    lookup_hits: int
    stores: int
    loads: int
    stores_rejected: int
    transfers_failed: int
    blocks_stored: int
    blocks_loaded: int
    blocks_evicted: int
    bytes_stored: int
    bytes_loaded: int
    #: Seconds from submission to the end of each copy (queueing included), summed per
    #: direction: a lower bound on throughput when copies queue behind each other.
    store_seconds: float
    load_seconds: float
    in_flight: int
    #: Copy ended -> completion callback ran, microseconds, over recent transfers.
    callback_latency_p50_us: float
    callback_latency_p99_us: float
    events_published: int
    #: Events lost by overflowing subscriptions, summed over subscriptions (ever).
    events_dropped: int
    subscribers: int
    manager: ManagerStats
    #: Seconds from submission to the end of each successful copy, per direction.
    store_duration: HistogramSnapshot
    load_duration: HistogramSnapshot
    #: Bytes per second of each successful copy (its bytes over its duration).
    store_throughput: HistogramSnapshot
    load_throughput: HistogramSnapshot
    #: Copy ended -> completion callback ran, seconds, every transfer since the start.
    callback_latency: HistogramSnapshot
    #: Each live event subscription: buffered events (its lag), drops, deliveries.
    subscriptions: tuple[SubscriptionStats, ...]
    #: Each tier below the CPU tier, highest first.
    tiers: tuple[TierStats, ...] = ()


@dataclass(frozen=True)
class TierStats:
    """A tier below the CPU tier: what it holds and what it did."""

    name: str
    medium: str
    #: Tier details: mode, path, O_DIRECT, capacity, ...
    info: dict[str, object]
    manager: ManagerStats
    #: Leading keys of ``lookup`` calls found only here.
    lookup_hits: int
    #: Blocks written (write-through) and bytes; writes that failed, per block.
    blocks_written: int
    bytes_written: int
    write_failures: int
    #: Blocks read back (promotions) and bytes; reads that failed, per block (each a miss).
    blocks_read: int
    bytes_read: int
    read_failures: int
    #: Blocks dropped from the index because a read failed its checks.
    dropped: int
    #: Failures by cause: "corrupt", "stale", "wrong_key", "short", "missing", "timeout",
    #: or the errno name ("ENOSPC", "EIO", ...).
    failures: dict[str, int]
    #: Offered blocks found there already, nothing written (a shared tier's put-if-absent
    #: over another engine's copy): ready in the index, not in ``blocks_written``.
    blocks_present: int = 0


@dataclass
class _Tier:
    store: LowerTier
    counters: TierCounters
    read_lane: CopyLane | None = None
    write_lane: CopyLane | None = None


def _make_backend(
    kv_caches: Sequence[torch.Tensor], layout: KVLayout, config: EngineConfig
) -> TransferBackend:
    if layout.device.type == "cpu":
        return CpuCopyBackend(kv_caches, layout, config.cpu_blocks, config.copy_engine)
    if layout.device.type == "cuda":
        from asyncoffload.transfer.cuda import CudaCopyBackend

        return CudaCopyBackend(
            kv_caches,
            layout,
            config.cpu_blocks,
            copy_method=config.copy_method,
            chunk_bytes=config.host_chunk_bytes,
            pin=config.pin_memory,
            staging_bytes=config.staging_bytes,
        )
    raise ValueError(
        f"no transfer backend for KV tensors on {layout.device}: this build copies CPU "
        "and CUDA tensors; pass backend= to use your own"
    )


class AsyncOffloadEngine:
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
        self.layout = layout if layout is not None else KVLayout.infer(kv_caches)
        # cpu_bytes -> cpu_blocks for this layout's blocks: self.config is the resolved copy.
        self.config = config.resolve_blocks(self.layout.block_bytes)
        cfg = self.config
        if cfg.cpu_bytes is not None:
            log.info(
                "asyncoffload: cpu_bytes=%d (%s) resolved to cpu_blocks=%d of %d bytes each",
                cfg.cpu_bytes,
                format_bytes(cfg.cpu_bytes),
                cfg.cpu_blocks,
                self.layout.block_bytes,
            )
        self._manager = CPUOffloadingManager(
            cfg.cpu_blocks,
            cfg.policy,
            cfg.store_threshold,
            enable_events=True,
            max_tracker_size=cfg.max_tracker_size,
            admission=cfg.admission,
        )
        if backend is None:
            backend = _make_backend(kv_caches, self.layout, cfg)
        elif backend.num_host_blocks < cfg.cpu_blocks:
            raise ValueError(
                f"backend has {backend.num_host_blocks} host blocks, "
                f"config.cpu_blocks is {cfg.cpu_blocks}"
            )
        self._backend = backend
        self._tiers: list[_Tier] = []
        self._seq = 0
        if cfg.tiers:
            self._open_tiers(cfg)
        self._hub = EventHub()
        self._bridge: CompletionBridge | None = None
        self._loop_thread: int | None = None
        self._pid = os.getpid()
        self._forked = False
        _live_engines.add(self)
        self._inflight: set[asyncio.Future[TransferResult]] = set()
        self._closing = False
        self._closed = False
        self._stores = self._loads = self._stores_rejected = self._failed = 0
        self._lookups = self._lookup_keys = self._lookup_hits = 0
        self._bytes_stored = self._bytes_loaded = 0
        self._store_hist = Histogram(TRANSFER_BUCKETS_S)
        self._load_hist = Histogram(TRANSFER_BUCKETS_S)
        self._store_rate = Histogram(BYTES_PER_SECOND_BUCKETS)
        self._load_rate = Histogram(BYTES_PER_SECOND_BUCKETS)
        # config.log_summary_s: the summary timer and the counters at the last line.
        self._summary_timer: asyncio.TimerHandle | None = None
        self._summary_last: tuple[float, tuple[int, ...]] = (0.0, ())

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
        cfg, layout = self.config, self.layout
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

    @property
    def tiers(self) -> tuple[LowerTier, ...]:
        """The running tiers below the CPU tier, highest first."""
        return tuple(t.store for t in self._tiers)

    def _open_tiers(self, cfg: EngineConfig) -> None:
        try:
            self._backend.host_address(0)
        except NotImplementedError as exc:
            raise ValueError(f"lower tiers need host slot addresses: {exc}") from None
        namespace = self.namespace
        try:
            for i, tier_cfg in enumerate(cfg.tiers):
                store = tier_cfg.open(namespace, f"{tier_cfg.kind}{i}")
                self._tiers.append(_Tier(store, TierCounters()))
                above = self._tiers[-2].store.manager.num_blocks if i else cfg.cpu_blocks
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
            self._close_tiers()
            raise

    def _close_tiers(self) -> None:
        for tier in self._tiers:
            try:
                tier.store.close()
            except Exception:
                log.exception("closing tier %s failed", tier.store.name)

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
        self._stop_summary()
        if self._forked:
            self._closed = True
            return
        while self._inflight or (bridge is not None and bridge.pending):
            if self._inflight:
                await asyncio.wait(list(self._inflight), timeout=_ORPHAN_CHECK_S)
                self._fail_orphans()
            else:  # a job no handle waits for (the fence of an interrupted call) ends soon
                await asyncio.sleep(_FENCE_POLL_S)
        if self._closed:
            return
        self._closed = True
        self._publish_events()
        self._hub.close()
        for tier in self._tiers:  # joins I/O lanes (they read and write host memory)
            try:
                await tier.store.aclose()
            except Exception:
                log.exception("closing tier %s failed", tier.store.name)
        self._close_tiers()
        self._backend.close()  # joins copy threads: nothing signals the bridge after this
        if self._bridge is not None:
            self._bridge.close()

    async def flush(self) -> None:
        """Wait until nothing is in flight: every transfer resolved and every write to a
        lower tier ended (stores resolve when the CPU copy is done; their write-through
        goes on after). Must be awaited on the engine's event loop."""
        self._check_usable()
        bridge = self._ensure_bridge()
        while self._inflight or bridge.pending:
            if self._inflight:
                await asyncio.wait(list(self._inflight), timeout=_ORPHAN_CHECK_S)
            else:
                await asyncio.sleep(_FENCE_POLL_S)

    def _fail_orphans(self) -> None:
        """Resolve, with an error, in-flight handles whose job no lane holds any more
        (it can never complete), so that closing never waits forever."""
        bridge = self._bridge
        if not self._inflight or (bridge is not None and bridge.pending):
            return
        for fut in list(self._inflight):
            if not fut.done():
                log.error("a transfer lost its copy job; failing its handle")
                fut.set_exception(TransferError("the transfer's copy job was lost"))
            self._inflight.discard(fut)

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
            self._close_tiers()
            self._backend.close()
            if self._bridge is not None:
                self._bridge.close()
        except Exception:  # interpreter shutdown, a closed loop: nothing more to do
            pass

    def _check_usable(self) -> None:
        if self._closing:
            raise EngineClosedError("the engine is closed")
        if self._forked:
            raise RuntimeError(
                f"this engine was created in process {self._pid} and is used in process "
                f"{os.getpid()} after os.fork(); its copy threads live in the parent: "
                "create a new engine in the child"
            )
        if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
            where = (
                "from another event loop"
                if asyncio._get_running_loop() is not None
                else "from a thread other than its event loop's"
            )
            raise RuntimeError(
                f"the engine was called {where}; it is bound to the event loop of the "
                "thread that first used it, where its bookkeeping runs (hand calls to it "
                "with loop.call_soon_threadsafe)"
            )

    def _ensure_bridge(self) -> CompletionBridge:
        loop = asyncio.get_running_loop()
        bridge = self._bridge
        if bridge is None:
            mode = self.config.completion
            if not self._backend.can_wake and mode != "poll":
                if mode == "eventfd":
                    log.warning(
                        "completion='eventfd' but backend %s cannot signal an fd: polling",
                        self._backend.name,
                    )
                mode = "poll"
            if self._hub.loop is not None and self._hub.loop is not loop:
                raise RuntimeError("the engine's events are read on another event loop")
            bridge = CompletionBridge(loop, mode, self.config.poll_interval_s)
            self._store_lane = bridge.lane("store")
            self._load_lane = bridge.lane("load")
            for tier in self._tiers:
                tier.read_lane = bridge.lane(f"{tier.store.name}-read")
                tier.write_lane = bridge.lane(f"{tier.store.name}-write")
                tier.store.bind(bridge.wake_fd)
            self._backend.bind(bridge.notify, bridge.wake_fd)
            self._bridge = bridge
            self._loop_thread = threading.get_ident()
            self._hub.loop = loop
            log.info(
                "asyncoffload engine ready: backend=%s completion=%s cpu_blocks=%d block_bytes=%d",
                self._backend.name,
                bridge.mechanism,
                self.config.cpu_blocks,
                self.layout.block_bytes,
            )
            self._start_summary(loop)
        elif bridge.loop is not loop:
            raise RuntimeError("the engine is bound to another event loop")
        return bridge

    # --- periodic summary (config.log_summary_s) --------------------------------------

    def _summary_counters(self) -> tuple[int, ...]:
        return (
            self._lookups,
            self._lookup_keys,
            self._lookup_hits,
            self._stores,
            self._loads,
            self._bytes_stored,
            self._bytes_loaded,
            self._manager.stats().evicted,
        )

    def _start_summary(self, loop: asyncio.AbstractEventLoop) -> None:
        period = self.config.log_summary_s
        if period is None or self._summary_timer is not None:
            return
        self._summary_last = (time.monotonic(), self._summary_counters())
        # A weak reference: the timer must not keep an unclosed engine alive.
        self._summary_timer = loop.call_later(period, _summary_tick, weakref.ref(self), loop)

    def _stop_summary(self) -> None:
        if self._summary_timer is not None:
            self._summary_timer.cancel()
            self._summary_timer = None

    def _log_summary(self) -> None:
        now = time.monotonic()
        then, before = self._summary_last
        counters = self._summary_counters()
        self._summary_last = (now, counters)
        lookups, keys, hits, stores, loads, stored, loaded, evicted = (
            a - b for a, b in zip(counters, before)
        )
        seconds = max(now - then, 1e-9)
        rate = f"{100 * hits / keys:.1f}%" if keys else "-"
        log.info(
            "asyncoffload summary (%.1fs): lookups %d, hit rate %s (%d/%d keys); "
            "stores %d (%.2f GB/s); loads %d (%.2f GB/s); evictions %d; in flight %d",
            seconds,
            lookups,
            rate,
            hits,
            keys,
            stores,
            stored / seconds / 1e9,
            loads,
            loaded / seconds / 1e9,
            evicted,
            len(self._inflight),
        )

    # --- validation ------------------------------------------------------------------

    def _check_keys(self, keys: Sequence[OffloadKey], what: str) -> list[OffloadKey]:
        if isinstance(keys, (bytes, str)):
            raise TypeError(
                f"{what}: keys must be a sequence of OffloadKey, not one {type(keys).__name__}"
            )
        out = list(keys)
        for i, key in enumerate(out):
            if not isinstance(key, bytes):
                raise TypeError(f"{what}: keys[{i}] is a {type(key).__name__}, not bytes")
            if len(key) <= GROUP_IDX_BYTES:
                raise ValueError(
                    f"{what}: keys[{i}] has {len(key)} bytes: an OffloadKey is a block hash "
                    f"followed by a {GROUP_IDX_BYTES}-byte group index"
                )
        return out

    def _check_ctx(self, ctx: object, what: str) -> ReqContext:
        if ctx is None:
            return _ANON
        if not isinstance(ctx, ReqContext):
            raise TypeError(
                f"{what}: ctx must be an asyncoffload.ReqContext or None, got {type(ctx).__name__}"
            )
        return ctx

    def _check_block_ids(self, ids: BlockIds, n: int, what: str, unique: bool) -> list[int]:
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise BlockIdError(f"{what}: block ids must be a 1-D integer tensor")
            if ids.is_meta:
                raise BlockIdError(f"{what}: block ids on the meta device have no values")
            raw: list[Any] = ids.tolist()
        elif hasattr(ids, "dtype") and hasattr(ids, "tolist"):  # a numpy array (vLLM's tables)
            kind = getattr(ids.dtype, "kind", None)
            if kind not in ("i", "u") or getattr(ids, "ndim", 1) != 1:
                raise BlockIdError(
                    f"{what}: block ids must be a 1-D integer array, got dtype {ids.dtype}"
                )
            raw = ids.tolist()
        else:
            raw = list(ids)
        if len(raw) != n:
            raise LengthMismatchError(f"{what}: {n} keys but {len(raw)} block ids")
        limit = self.layout.num_blocks
        out: list[int] = []
        for i, b in enumerate(raw):
            # Anything operator.index takes (numpy and torch integer scalars too).
            try:
                if isinstance(b, bool):
                    raise TypeError
                b = operator.index(b)
            except TypeError:
                raise BlockIdError(f"{what}: block id {b!r} at index {i} is not an int") from None
            out.append(b)
            if not 0 <= b < limit:
                raise BlockIdError(
                    f"{what}: block id {b} at index {i} is outside [0, {limit}) of the KV cache"
                )
        if unique and len(set(out)) != len(out):
            raise BlockIdError(f"{what}: a destination block id appears more than once")
        return out

    # --- the API ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> int:
        """How many leading ``keys`` are stored and ready to load. Does not change
        recency (see :meth:`touch`)."""
        self._check_usable()
        keys = self._check_keys(keys, "lookup")
        ctx = self._check_ctx(ctx, "lookup")
        keys = self._filed(keys, ctx)
        n = self._manager.lookup_prefix(keys, ctx)
        if self._tiers and n < len(keys):
            n = self._lookup_lower(keys, n)
        self._lookups += 1
        self._lookup_keys += len(keys)
        self._lookup_hits += n
        return n

    def _lookup_lower(self, keys: list[OffloadKey], n: int) -> int:
        """Extend a CPU prefix of ``n`` keys through the lower tiers: a key counts if it
        is ready in the CPU tier, or absent there and ready in a lower tier."""
        get = self._manager.block_of
        tiers = self._tiers
        for key in keys[n:]:
            block = get(key)
            if block is not None:
                if block.ref_cnt < 0:
                    break
            else:
                for tier in tiers:
                    if tier.store.manager.ready(key):
                        tier.counters.lookup_hits += 1
                        break
                else:
                    break
            n += 1
        return n

    def _filed(self, keys: list[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        """The keys as every tier files them: per tenant when the request has one."""
        tenant = ctx.tenant
        if tenant is None:
            return keys
        if not isinstance(tenant, str):
            raise TypeError(f"ctx.tenant must be a str or None, got {type(tenant).__name__}")
        return [tenant_key(key, tenant) for key in keys]

    async def alookup(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> int:
        """:meth:`lookup` that also asks the shared tiers (a Redis / Valkey server) about
        keys this engine does not know of, such as blocks another engine stored: those
        found join the tier's index (a stored event), and count. Never blocks the loop;
        a server that does not answer in time counts as a miss."""
        self._check_usable()
        checked = self._check_keys(keys, "alookup")
        ctx = self._check_ctx(ctx, "alookup")
        tier_hits = [t.counters.lookup_hits for t in self._tiers]
        n = self.lookup(checked, ctx)
        remote = [t for t in self._tiers if hasattr(t.store, "exists")]
        if n >= len(checked) or not remote:
            return n
        filed = self._filed(checked, ctx)
        for tier in remote:
            manager = tier.store.manager
            unknown = [k for k in filed[n:] if manager.block_of(k) is None]
            if not unknown:
                continue
            try:
                found = await tier.store.exists(unknown)  # type: ignore[attr-defined]
            except Exception as exc:
                log.warning("alookup: tier %s did not answer: %r", tier.store.name, exc)
                continue
            self._check_usable()
            new = [k for k, hit in zip(unknown, found) if hit and manager.block_of(k) is None]
            if new:
                with _InterruptsHeld():
                    out = manager.reserve(new)
                    if out is not None:
                        manager.complete_store(new)
                        if out.evicted_keys:
                            tier.store.forget(out.evicted_keys)
                self._publish_events()
        # Counted once, as one lookup: undo the first pass's counts.
        self._lookups -= 1
        self._lookup_keys -= len(checked)
        self._lookup_hits -= n
        for tier, hits in zip(self._tiers, tier_hits):
            tier.counters.lookup_hits = hits
        return self.lookup(checked, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used; ``keys[0]`` becomes the most recently used."""
        self._check_usable()
        keys = self._check_keys(keys, "touch")
        ctx = self._check_ctx(ctx, "touch")
        keys = self._filed(keys, ctx)
        with _InterruptsHeld():
            self._manager.touch(keys, ctx)
            for tier in self._tiers:
                tier.store.manager.touch(keys, ctx)

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
        with _InterruptsHeld():
            return self._prepare_load(keys, gpu_blocks, ctx)

    def _prepare_load(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: BlockIds,
        ctx: ReqContext | None,
    ) -> Transfer:
        self._check_usable()
        keys = self._check_keys(keys, "prepare_load")
        ids = self._check_block_ids(gpu_blocks, len(keys), "prepare_load", unique=True)
        ctx = self._check_ctx(ctx, "prepare_load")
        keys = self._filed(keys, ctx)
        bridge = self._ensure_bridge()
        if self._tiers:
            lower = self._lower_sources(keys)
            if lower:
                return self._promote(keys, ids, ctx, lower, bridge)
        spec = self._manager.prepare_load(keys, ctx)
        # From here the slots are pinned: every way out unpins them or hands them to a
        # job whose completion does (an interrupt included; see _abandon).
        fut: asyncio.Future[TransferResult] | None = None
        attempted = False
        step = [0]  # how far the completion got (see _load_done); shared with _abandon
        try:
            if self.config.touch_on_load:
                self._manager.touch(keys, ctx)
            fut = Completion(loop=bridge.loop)
            handle = Transfer(fut, "load", keys)
            if not keys:
                fut.set_result(TransferResult(0, 0, 0.0))
                return handle
            self._loads += 1
            self._track(fut)
            attempted = True
            job = self._start(self._backend.submit_load, list(spec.block_ids), ids)
            bridge.watch(
                self._load_lane, job, lambda j: self._load_done(j, handle, keys, ctx, step)
            )
        except BaseException as exc:
            self._abandon(
                "load", fut, attempted, lambda: self._manager.complete_load(keys), exc, step
            )
            raise
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

        Keys already stored or in flight are skipped, and so are keys the admission
        filter holds back; ``handle.keys_to_store`` lists those actually written and
        ``handle.evicted_keys`` what was evicted for them (already published as one
        removed event). Returns ``None``, storing nothing, when too few idle blocks can
        be evicted now (a later call may succeed). Where the call has more new keys
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
        with _InterruptsHeld():
            return self._prepare_store(keys, gpu_blocks, ctx, tokens)

    def _prepare_store(
        self,
        keys: Sequence[OffloadKey],
        gpu_blocks: BlockIds,
        ctx: ReqContext | None,
        tokens: BlockTokens | None,
    ) -> Transfer | None:
        self._check_usable()
        keys = self._check_keys(keys, "prepare_store")
        ids = self._check_block_ids(gpu_blocks, len(keys), "prepare_store", unique=False)
        ctx = self._check_ctx(ctx, "prepare_store")
        if ctx.tenant is not None and (tokens is not None or ctx.tokens is not None):
            raise ValueError(
                "prepare_store: tokens describe the caller's keys, and a request with a "
                "tenant files its blocks under tenant keys: derive the keys with the salt "
                "(BlockTokens.from_tokens(..., salt=)) instead of ctx.tenant"
            )
        keys = self._filed(keys, ctx)
        if tokens is not None:
            if not isinstance(tokens, BlockTokens):
                raise TypeError(
                    f"prepare_store: tokens is a {type(tokens).__name__}, not BlockTokens"
                )
            ctx = dataclasses.replace(ctx, tokens=tokens)
        if ctx.tokens is not None:
            _check_described(keys, ctx.tokens)
        bridge = self._ensure_bridge()
        manager = self._manager
        out = manager.prepare_store(keys, ctx)
        if out is None:
            # Refused, nothing changed. More new keys than the tier has blocks: no
            # later call can take them either (the admission let too many in to fit).
            if len(keys) > manager.num_blocks:
                new = sum(1 for key in dict.fromkeys(keys) if manager.block_of(key) is None)
                if new > manager.num_blocks:
                    raise CapacityError(new, manager.num_blocks)
            self._publish_events()
            self._stores_rejected += 1
            return None
        to_store = out.keys_to_store
        if self._tiers and len(to_store) < len(keys):
            # Keys already in the CPU tier are offered to the lower tiers again (their
            # admission counts offers): written from their slots now.
            fresh = set(to_store)
            ready = [
                k for k in keys if k not in fresh and (b := manager.block_of(k)) and b.ref_cnt >= 0
            ]
            self._write_through(list(dict.fromkeys(ready)), ctx)
        # From here the slots are being written: every way out frees them or hands them
        # to a job whose completion does (an interrupt included; see _abandon).
        fut: asyncio.Future[TransferResult] | None = None
        attempted = False
        step = [0]  # how far the completion got (see _store_done); shared with _abandon
        try:
            self._publish_events()
            fut = Completion(loop=bridge.loop)
            handle = Transfer(fut, "store", keys, to_store, out.evicted_keys)
            if not to_store:
                fut.set_result(TransferResult(0, 0, 0.0))
                return handle
            self._stores += 1
            if len(to_store) == len(keys):
                src = ids
            else:
                position = {key: i for i, key in enumerate(keys)}
                src = [ids[position[key]] for key in to_store]
            self._track(fut)
            attempted = True
            job = self._start(self._backend.submit_store, src, list(out.store_spec.block_ids))
            bridge.watch(self._store_lane, job, lambda j: self._store_done(j, handle, ctx, step))
        except BaseException as exc:
            self._abandon(
                "store",
                fut,
                attempted,
                lambda: self._manager.complete_store(to_store, ctx, success=False),
                exc,
                step,
            )
            raise
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
        self._publish_events()
        initial: list[OffloadingEvent] = []
        if snapshot:
            seq = self._seq if self._tiers else self._manager.last_seq
            managers = [self._manager, *(t.store.manager for t in self._tiers)]
            for manager in managers:
                keys = list(manager.resident_keys())
                for i in range(0, len(keys), _SNAPSHOT_CHUNK):
                    initial.append(
                        OffloadingEvent(
                            tuple(keys[i : i + _SNAPSHOT_CHUNK]),
                            manager.medium,
                            False,
                            seq,
                            0.0,
                            snapshot=True,
                        )
                    )
        size = self.config.event_buffer if max_buffer is None else max_buffer
        return self._hub.subscribe(size, initial)

    def stats(self) -> EngineStats:
        bridge = self._bridge
        p50 = bridge.latency.percentile_us(50) if bridge else math.nan
        p99 = bridge.latency.percentile_us(99) if bridge else math.nan
        callbacks = bridge.latency.histogram if bridge else Histogram(LATENCY_BUCKETS_S)
        subs = self._hub.subscribers
        store_duration = self._store_hist.snapshot()
        load_duration = self._load_hist.snapshot()
        m = self._manager.stats()
        return EngineStats(
            backend=self._backend.name,
            backend_info=self._backend.describe(),
            completion=bridge.mechanism if bridge else None,
            lookups=self._lookups,
            lookup_keys=self._lookup_keys,
            lookup_hits=self._lookup_hits,
            stores=self._stores,
            loads=self._loads,
            stores_rejected=self._stores_rejected,
            transfers_failed=self._failed,
            blocks_stored=m.stored,
            blocks_loaded=m.loaded,
            blocks_evicted=m.evicted,
            bytes_stored=self._bytes_stored,
            bytes_loaded=self._bytes_loaded,
            store_seconds=store_duration.total,
            load_seconds=load_duration.total,
            in_flight=len(self._inflight),
            callback_latency_p50_us=p50,
            callback_latency_p99_us=p99,
            events_published=self._hub.published,
            events_dropped=self._hub.dropped,
            subscribers=len(subs),
            manager=m,
            store_duration=store_duration,
            load_duration=load_duration,
            store_throughput=self._store_rate.snapshot(),
            load_throughput=self._load_rate.snapshot(),
            callback_latency=callbacks.snapshot(),
            subscriptions=tuple(sub.statistics() for sub in subs),
            tiers=tuple(_tier_stats(t) for t in self._tiers),
        )

    def __repr__(self) -> str:
        m = self._manager.stats()
        state = "closed" if self._closed else ("closing" if self._closing else "open")
        mech = self._bridge.mechanism if self._bridge else "unbound"
        return (
            f"<AsyncOffloadEngine {state} backend={self._backend.name} completion={mech} "
            f"[{m.ready} ready, {m.pinned} pinned, {m.write_pending} writing, {m.free} free | "
            f"{len(self._inflight)} in flight | {len(self._hub.subscribers)} subscribers]>"
        )

    # --- internals -------------------------------------------------------------------

    def _publish_events(self) -> None:
        events = self._manager.take_events()
        if not self._tiers:
            for event in events:
                self._hub.publish(event)
            return
        # Several managers: one seq for the engine's stream, in publication order.
        for tier in self._tiers:
            events += tier.store.manager.take_events()
        for event in events:
            self._seq += 1
            self._hub.publish(dataclasses.replace(event, seq=self._seq))

    def _track(self, fut: asyncio.Future[TransferResult]) -> None:
        self._inflight.add(fut)
        # Failures are reported through the handle and logged; a fire-and-forget
        # store that failed must not also print "exception was never retrieved".
        fut.add_done_callback(_retrieve)
        fut.add_done_callback(self._inflight.discard)

    def _start(
        self, submit: Callable[[list[int], list[int]], CopyJob], src: list[int], dst: list[int]
    ) -> CopyJob:
        """Submit a copy; a submission that raises an ``Exception`` becomes a failed job
        (the failure path frees the slots). Anything else propagates to the caller."""
        try:
            return submit(src, dst)
        except Exception as exc:
            # The traceback's frames (and their callers, through f_back) hold this engine
            # and the caller's handle, whose error leads back here: a cycle that kept a
            # closed engine and its host pool alive until the next full collection. Keep
            # the traceback as text (a note, where notes exist) and drop the frames.
            if hasattr(exc, "add_note"):
                exc.add_note("".join(traceback.format_tb(exc.__traceback__)).rstrip())
            return FailedJob(len(src), exc.with_traceback(None))

    def _abandon(
        self,
        kind: str,
        fut: asyncio.Future[TransferResult] | None,
        attempted: bool,
        undo: Callable[[], None],
        exc: BaseException,
        step: list[int],
    ) -> None:
        """Something (an interrupt, say) escaped ``prepare_*`` between reserving slots
        and handing the copy to a lane. If no copy was submitted, undo now. If one may
        have been (the interrupt may have come just after the lane took it), the slots
        stay reserved until a fence (an empty job of the same direction, which completes
        after every earlier one) shows the lane is past it. If the job did reach the
        bridge (the interrupt came inside ``watch``), its own completion, which runs
        first, tells the manager, and ``step`` keeps the fence from doing it again."""
        error = TransferError(f"{kind} abandoned: {exc!r}")
        error.__cause__ = exc

        def finish(_job: CopyJob | None = None) -> None:
            with _InterruptsHeld():  # the undo is a manager update: whole or not at all
                try:
                    if step[0] < 2:
                        step[0] = 1
                        undo()
                        step[0] = 2
                finally:
                    if fut is not None:
                        self._inflight.discard(fut)
                        if not fut.done():
                            fut.set_exception(error)

        if not attempted:
            finish()
            return
        bridge = self._bridge
        assert bridge is not None
        submit = self._backend.submit_store if kind == "store" else self._backend.submit_load
        lane = self._store_lane if kind == "store" else self._load_lane
        try:
            fence = submit([], [])
            bridge.watch(lane, fence, finish)
        except BaseException:
            # No way to learn when the lane is past the copy: keep its slots reserved
            # (a leak beats a write into a slot handed out again) and fail the handle.
            log.error("an interrupted %s keeps its slots reserved: no fence could be queued", kind)
            if fut is not None:
                self._inflight.discard(fut)
                if not fut.done():
                    fut.set_exception(error)

    # --- lower tiers: promotion and write-through -------------------------------------

    def _lower_sources(self, keys: list[OffloadKey]) -> dict[OffloadKey, _Tier]:
        """The keys of a load that are absent from the CPU tier, with the highest tier
        that has each ready; raises (changing nothing) for a key no tier can give."""
        if len(set(keys)) != len(keys):
            seen: set[OffloadKey] = set()
            for key in keys:
                if key in seen:
                    raise DuplicateKeyError(f"prepare_load: key {key.hex()} is listed twice")
                seen.add(key)
        get = self._manager.block_of
        out: dict[OffloadKey, _Tier] = {}
        for key in keys:
            block = get(key)
            if block is not None:
                if block.ref_cnt < 0:
                    raise KeyNotReadyError(f"prepare_load: key {key.hex()} is still being stored")
                continue
            for tier in self._tiers:
                if tier.store.manager.ready(key):
                    out[key] = tier
                    break
            else:
                raise UnknownKeyError(f"prepare_load: key {key.hex()} is not stored in any tier")
        return out

    def _promote(
        self,
        keys: list[OffloadKey],
        ids: list[int],
        ctx: ReqContext,
        lower: dict[OffloadKey, _Tier],
        bridge: CompletionBridge,
    ) -> Transfer:
        """A load with keys found only in lower tiers: reserve CPU slots for them, read
        them in, and only when every block passed its checks copy all ``keys`` into the
        KV blocks, as one :class:`Transfer`. A block that fails is a miss: dropped from
        its tier in the same step, its CPU slot freed, the handle failed, nothing copied."""
        cpu = self._manager
        cpu_keys = [key for key in keys if key not in lower]
        lower_keys = [key for key in keys if key in lower]
        cpu.prepare_load(cpu_keys, ctx)  # pinned: the reservation cannot evict them
        try:
            out = cpu.reserve(lower_keys)
        except BaseException:
            cpu.complete_load(cpu_keys)
            raise
        if out is None:
            cpu.complete_load(cpu_keys)
            raise PromotionError(
                f"prepare_load: {len(lower_keys)} blocks must come from lower tiers and the "
                "CPU tier has no idle slot to bring them into (every slot is pinned or being "
                "written); retry later, or recompute"
            )
        slot_of = dict(zip(lower_keys, out.store_spec.block_ids))
        by_tier: dict[int, tuple[_Tier, list[OffloadKey]]] = {}
        for key in lower_keys:
            tier = lower[key]
            by_tier.setdefault(id(tier), (tier, []))[1].append(key)
        fut = Completion(loop=bridge.loop)
        handle = Transfer(fut, "load", keys)
        state = _Promotion(keys, ids, ctx, cpu_keys, lower_keys, handle, len(by_tier))
        self._loads += 1
        self._track(fut)
        self._publish_events()  # the reservation's evictions
        deadline = max(tier.store.deadline_s for tier, _ in by_tier.values())
        state.timer = bridge.loop.call_later(
            deadline + _STALL_GRACE_S, self._promotion_stalled, state, deadline
        )
        for tier, tkeys in by_tier.values():
            spec = tier.store.manager.prepare_load(tkeys)
            host = [self._backend.host_address(slot_of[key]) for key in tkeys]
            job = self._start_io(tier.store.submit_read, tkeys, list(spec.block_ids), host)
            tier.counters.reads += 1
            assert tier.read_lane is not None
            bridge.watch(
                tier.read_lane,
                job,
                functools.partial(self._promoted, tier=tier, tkeys=tkeys, state=state),
            )
        return handle

    def _start_io(
        self,
        submit: Callable[[list[OffloadKey], list[int], list[int]], CopyJob],
        keys: list[OffloadKey],
        slots: list[int],
        host: list[int],
    ) -> CopyJob:
        try:
            return submit(keys, slots, host)
        except Exception as exc:
            log.warning("a tier I/O submission failed: %r", exc)
            return FailedJob(len(keys), exc.with_traceback(None))

    def _promoted(
        self, job: CopyJob, tier: _Tier, tkeys: list[OffloadKey], state: _Promotion
    ) -> None:
        with _InterruptsHeld():
            if id(job) in state.seen:
                return  # a rerun after an interrupt
            state.seen.add(id(job))
            try:
                self._promoted_held(job, tier, tkeys, state)
            except Exception as exc:
                log.exception("a promotion's completion failed")
                state.error = state.error or exc
            state.left -= 1
            if state.left == 0:
                self._finish_promotion(state)

    def _promoted_held(
        self, job: CopyJob, tier: _Tier, tkeys: list[OffloadKey], state: _Promotion
    ) -> None:
        good, bad, causes = settle_read(tier.store, tier.counters, tkeys, job)
        cpu = self._manager
        if good:
            cpu.complete_store(good, state.ctx, success=True)
        if bad:
            cpu.complete_store(bad, state.ctx, success=False)
            state.bad += len(bad)
            state.causes.append(f"{tier.store.name}: {causes}")
            log.warning(
                "%d of %d blocks read from %s failed (%s): misses, dropped from its index",
                len(bad),
                len(tkeys),
                tier.store.name,
                ", ".join(f"{k} {v}" for k, v in causes.items()),
            )
        self._publish_events()

    def _promotion_stalled(self, state: _Promotion, deadline: float) -> None:
        """A read is still running past its deadline (a stalled disk or mount: a system
        call no deadline can interrupt): fail the handle now. The reserved CPU slots stay
        reserved until the read really ends; then its completion frees them."""
        state.timer = None
        fut = state.handle._future
        if fut.done() or state.left == 0:
            return
        self._failed += 1
        self._inflight.discard(fut)
        fut.set_exception(
            TransferError(
                f"load of {len(state.keys)} blocks: a lower tier read is still running "
                f"{deadline + _STALL_GRACE_S:.1f}s after submission (the disk or its mount "
                "is stalled); treat the blocks as misses and recompute"
            )
        )

    def _finish_promotion(self, state: _Promotion) -> None:
        """Every read ended: copy the whole load into the KV blocks, or fail it."""
        cpu = self._manager
        handle = state.handle
        fut = handle._future
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        if state.bad or state.error is not None or self._forked or fut.done():
            cpu.complete_load(state.cpu_keys)
            self._inflight.discard(fut)
            if fut.done():
                return
            self._failed += 1
            if state.error is not None:
                err = TransferError(f"load of {len(state.keys)} blocks failed: {state.error!r}")
                err.__cause__ = state.error
            else:
                err = TransferError(
                    f"load of {len(state.keys)} blocks: {state.bad} could not be read from a "
                    f"lower tier ({'; '.join(state.causes)}); they are misses (dropped from "
                    "the index), and no block was copied: look up again and recompute the rest"
                )
            fut.set_exception(err)
            return
        bridge = self._bridge
        assert bridge is not None
        step = [0]
        spec = cpu.prepare_load(state.lower_keys, state.ctx)  # pinned like the others
        slot = dict(zip(state.lower_keys, spec.block_ids))
        src = [slot[key] if key in slot else _slot_of(cpu, key) for key in state.keys]
        keys, ctx = state.keys, state.ctx
        job = self._start(self._backend.submit_load, src, state.ids)
        bridge.watch(self._load_lane, job, lambda j: self._load_done(j, handle, keys, ctx, step))

    def _write_through(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """Offer CPU-ready ``keys`` to each lower tier; those its admission takes are
        written from their CPU slots, which stay pinned until the write ends."""
        keys = [key for key in keys if len(key) <= MAX_KEY_BYTES]
        if not keys:
            return
        bridge = self._bridge
        assert bridge is not None
        cpu = self._manager
        for tier in self._tiers:
            manager = tier.store.manager
            out = manager.prepare_store(keys, ctx)
            if out is None:  # the tier is full of blocks being read or written
                tier.counters.failures["full"] = tier.counters.failures.get("full", 0) + 1
                continue
            if out.evicted_keys:
                tier.store.forget(out.evicted_keys)
            chosen = out.keys_to_store
            if not chosen:
                continue
            spec = cpu.pin(chosen)
            host = [self._backend.host_address(b) for b in spec.block_ids]
            job = self._start_io(
                tier.store.submit_write, chosen, list(out.store_spec.block_ids), host
            )
            tier.counters.writes += 1
            assert tier.write_lane is not None
            bridge.watch(
                tier.write_lane,
                job,
                functools.partial(self._written, tier=tier, keys=chosen, ctx=ctx, done=[False]),
            )
        self._publish_events()

    def _written(
        self, job: CopyJob, tier: _Tier, keys: list[OffloadKey], ctx: ReqContext, done: list[bool]
    ) -> None:
        with _InterruptsHeld():
            if done[0]:
                return
            done[0] = True
            try:
                failed, causes = settle_write(tier.store, tier.counters, keys, job, ctx)
                if failed:
                    _warn_limited(
                        log,
                        f"tier-write-{tier.store.name}",
                        "%d of %d blocks could not be written to %s (%s): skipped",
                        failed,
                        len(keys),
                        tier.store.name,
                        ", ".join(f"{k} {v}" for k, v in causes.items()),
                    )
            finally:
                self._manager.complete_load(keys)
                self._publish_events()

    # A completion callback may run twice: when an interrupt (KeyboardInterrupt,
    # SystemExit) cuts a run short, the bridge runs it again at once, before the interrupt
    # goes on (see CompletionBridge.drain). ``step[0]`` says how far earlier runs got: 0
    # (none ran), 1 (one began, the manager was not told yet), 2 (the manager was told).
    # A run that finds 1 fails the transfer (its slots freed or unpinned); one that finds
    # 2 only resolves the handle. So the manager is told exactly once.

    def _store_done(self, job: CopyJob, handle: Transfer, ctx: ReqContext, step: list[int]) -> None:
        with _InterruptsHeld():
            self._store_done_held(job, handle, ctx, step)

    def _store_done_held(
        self, job: CopyJob, handle: Transfer, ctx: ReqContext, step: list[int]
    ) -> None:
        error: BaseException | None = None
        try:
            if step[0]:
                if step[0] == 1:
                    error = TransferError("store completion interrupted")
            else:
                step[0] = 1
            if error is None:
                error = job.error
            if step[0] == 1:
                self._manager.complete_store(handle.keys_to_store, ctx, success=error is None)
                step[0] = 2
                self._publish_events()
                if error is None and self._tiers:
                    self._write_through(handle.keys_to_store, ctx)
                if error is None:
                    self._bytes_stored += job.nbytes
                    _observe(self._store_hist, self._store_rate, job)
        except Exception as exc:  # never leave the handle (and aclose) hanging
            log.exception("complete_store failed")
            error = error or exc
        self._resolve(handle, job, error)

    def _load_done(
        self,
        job: CopyJob,
        handle: Transfer,
        keys: list[OffloadKey],
        ctx: ReqContext,
        step: list[int],
    ) -> None:
        with _InterruptsHeld():
            self._load_done_held(job, handle, keys, ctx, step)

    def _load_done_held(
        self,
        job: CopyJob,
        handle: Transfer,
        keys: list[OffloadKey],
        ctx: ReqContext,
        step: list[int],
    ) -> None:
        error: BaseException | None = None
        try:
            if step[0]:
                if step[0] == 1:
                    error = TransferError("load completion interrupted")
            else:
                step[0] = 1
            if error is None:
                error = job.error
            if step[0] == 1:
                self._manager.complete_load(keys, ctx)
                step[0] = 2
                if error is None:
                    self._bytes_loaded += job.nbytes
                    _observe(self._load_hist, self._load_rate, job)
        except Exception as exc:
            log.exception("complete_load failed")
            error = error or exc
        self._resolve(handle, job, error)

    def _resolve(self, handle: Transfer, job: CopyJob, error: BaseException | None) -> None:
        fut = handle._future
        self._inflight.discard(fut)  # in_flight counts only what is still running
        if fut.done():
            return
        if error is None:
            fut.set_result(TransferResult(job.num_blocks, job.nbytes, job.duration_s))
            return
        self._failed += 1
        log.warning("%s of %d blocks failed: %r", handle.kind, job.num_blocks, error)
        err = TransferError(f"{handle.kind} of {job.num_blocks} blocks failed: {error!r}")
        err.__cause__ = error
        fut.set_exception(err)


def _summary_tick(
    ref: weakref.ReferenceType[AsyncOffloadEngine], loop: asyncio.AbstractEventLoop
) -> None:
    """One summary line (config.log_summary_s), then the next tick, until aclose()."""
    engine = ref()
    if engine is None or engine._closing or engine._summary_timer is None:
        return
    try:
        engine._log_summary()
    except Exception:  # a summary must never break the loop
        log.exception("the periodic summary failed")
    period = engine.config.log_summary_s
    assert period is not None
    engine._summary_timer = loop.call_later(period, _summary_tick, ref, loop)


def _check_described(keys: Sequence[OffloadKey], tokens: BlockTokens) -> None:
    for i, key in enumerate(keys):
        if tokens.index(key) is None:
            raise ValueError(
                f"prepare_store: keys[{i}] is not one of the {len(tokens)} keys its "
                "BlockTokens describes"
            )


def _observe(durations: Histogram, rates: Histogram, job: CopyJob) -> None:
    seconds = job.duration_s
    durations.observe(seconds)
    if seconds > 0:
        rates.observe(job.nbytes / seconds)


def _retrieve(fut: asyncio.Future[TransferResult]) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclass(eq=False)
class _Promotion:
    """A load that brings blocks up from lower tiers (see ``_promote``)."""

    keys: list[OffloadKey]
    ids: list[int]
    ctx: ReqContext
    cpu_keys: list[OffloadKey]
    lower_keys: list[OffloadKey]
    handle: Transfer
    left: int
    bad: int = 0
    causes: list[str] = dataclasses.field(default_factory=list)
    error: BaseException | None = None
    seen: set[int] = dataclasses.field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


def _slot_of(manager: CPUOffloadingManager, key: OffloadKey) -> int:
    block = manager.block_of(key)
    assert block is not None
    return block.block_id


_last_warned: dict[str, float] = {}
#: A promotion's handle fails this long after its tier's deadline if a read still runs.
_STALL_GRACE_S = 1.0


def _warn_limited(logger: logging.Logger, topic: str, msg: str, *args: object) -> None:
    """A warning at most every 10 s per topic (a full disk fails every write)."""
    now = time.monotonic()
    if now - _last_warned.get(topic, -1e9) >= 10.0:
        _last_warned[topic] = now
        logger.warning(msg, *args)


def _tier_stats(tier: _Tier) -> TierStats:
    c = tier.counters
    m = tier.store.manager
    return TierStats(
        name=tier.store.name,
        medium=tier.store.medium.value,
        info=tier.store.describe(),
        manager=m.stats(),
        lookup_hits=c.lookup_hits,
        blocks_written=c.blocks_written,
        bytes_written=c.bytes_written,
        write_failures=c.write_failures,
        blocks_read=c.blocks_read,
        bytes_read=c.bytes_read,
        read_failures=c.read_failures,
        dropped=m.dropped,
        failures=dict(c.failures),
        blocks_present=c.blocks_present,
    )
