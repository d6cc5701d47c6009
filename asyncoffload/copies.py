"""The CPU tier's copies on the event loop: jobs handed to the backend's lanes, their
completions told to the manager, their handles resolved.

:class:`Copies` is the engine's room for everything between "the manager decided" and
"the handle resolved": submission (a submission that raises becomes a failed job, so
failures take one path), the completion callbacks (run by the completion bridge on the
loop thread, in submission order per direction), the undo of a call cut short by an
interrupt (a fence job of the same lane), the in-flight set that ``aclose`` waits for,
and the copy counters and histograms of ``engine.stats()``.

A completion callback may run twice: when an interrupt (``KeyboardInterrupt``,
``SystemExit``) cuts a run short, the bridge runs it again at once, before the interrupt
goes on (see ``CompletionBridge.drain``). A transfer's ``step`` says how far earlier
runs got: 0 (none ran), 1 (one began, the manager was not told yet), 2 (the manager was
told). A run that finds 1 fails the transfer (its slots freed or unpinned); one that
finds 2 only resolves the handle. So the manager is told exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from asyncoffload._native import load_mgrcore
from asyncoffload._sigint import InterruptsHeld, interrupts_held
from asyncoffload.config import EngineConfig
from asyncoffload.errors import TransferError
from asyncoffload.handles import Completion, Transfer, TransferResult
from asyncoffload.histogram import BYTES_PER_SECOND_BUCKETS, TRANSFER_BUCKETS_S, Histogram
from asyncoffload.keys import OffloadKey
from asyncoffload.layout import KVLayout
from asyncoffload.manager import CPUOffloadingManager, ReqContext
from asyncoffload.transfer import CompletionBridge, CopyJob, CpuCopyBackend, TransferBackend
from asyncoffload.transfer.base import FailedJob
from asyncoffload.transfer.completion import JobCallback, run_completion

__all__ = ["Copies", "make_backend"]

log = logging.getLogger("asyncoffload")

# How often waiting for the transfers checks for handles whose copy job was lost.
_ORPHAN_CHECK_S = 0.5
# How often it looks again at lane jobs that no handle waits for.
_FENCE_POLL_S = 0.001


class Copies:
    """The copies between the KV blocks and the CPU tier ``manager``'s host slots.

    ``publish`` sends the manager's pending events to subscribers; ``stored`` is told
    the keys (and context) of each store that completed, after its stored event (the
    write-through to lower tiers)."""

    def __init__(
        self,
        manager: CPUOffloadingManager,
        backend: TransferBackend,
        publish: Callable[[], None],
        stored: Callable[[list[OffloadKey], ReqContext], None] | None = None,
    ) -> None:
        self._manager = manager
        self._backend = backend
        self._publish = publish
        self.stored = stored
        self.bridge: CompletionBridge | None = None
        #: Every handle whose transfer has not resolved.
        self.inflight: set[asyncio.Future[TransferResult]] = set()
        self.stores = self.loads = self.failed = 0
        self.bytes_stored = self.bytes_loaded = 0
        self.store_hist = Histogram(TRANSFER_BUCKETS_S)
        self.load_hist = Histogram(TRANSFER_BUCKETS_S)
        self.store_rate = Histogram(BYTES_PER_SECOND_BUCKETS)
        self.load_rate = Histogram(BYTES_PER_SECOND_BUCKETS)
        self._block_bytes = backend.layout.block_bytes
        # The native one-step path's fixed arguments (see _how) and its module.
        self._hows: dict[tuple[bool, bool], tuple[object, ...]] = {}
        self._core: Any = None

    def open(
        self, loop: asyncio.AbstractEventLoop, config: EngineConfig, block_bytes: int
    ) -> CompletionBridge:
        """Bind to ``loop``: the completion bridge of ``config.completion`` (``poll``
        for a backend that cannot signal an fd), the store and load lanes."""
        backend = self._backend
        mode = config.completion
        if not backend.can_wake and mode != "poll":
            if mode == "eventfd":
                log.warning(
                    "completion='eventfd' but backend %s cannot signal an fd: polling",
                    backend.name,
                )
            mode = "poll"
        self.bridge = bridge = CompletionBridge(loop, mode, config.poll_interval_s)
        self._store_lane = bridge.lane("store")
        self._load_lane = bridge.lane("load")
        backend.bind(bridge.notify, bridge.wake_fd)
        log.info(
            "asyncoffload engine ready: backend=%s completion=%s cpu_blocks=%d block_bytes=%d",
            backend.name,
            bridge.mechanism,
            config.cpu_blocks,
            block_bytes,
        )
        return bridge

    def close(self) -> None:
        """Join the copy lanes, then close the bridge they signal."""
        self._backend.close()  # nothing signals the bridge after this
        self.close_bridge()

    def close_bridge(self) -> None:
        """Close the bridge only, the backend left open (kept for an op that still uses
        its host memory): its lanes signal their own duplicate of the wake-up fd."""
        if self.bridge is not None:
            self.bridge.close()

    def handle(
        self,
        kind: Literal["store", "load"],
        keys: list[OffloadKey],
        to_store: list[OffloadKey] | None = None,
        evicted: list[OffloadKey] | None = None,
        declined: list[OffloadKey] | None = None,
    ) -> Transfer:
        """A handle of a transfer on the engine's loop (not resolved, not tracked)."""
        assert self.bridge is not None
        future = Completion(loop=self.bridge.loop)
        return Transfer(future, kind, keys, to_store, evicted, declined)

    def track(self, fut: asyncio.Future[TransferResult]) -> None:
        """Count ``fut`` in flight until it ends. Whatever ends a tracked handle takes it
        out (``resolve``, ``fail``, an abandon's ``finish``); a :class:`Completion` marks
        its own failure retrieved, so a fire-and-forget store that failed does not also
        print "exception was never retrieved"."""
        self.inflight.add(fut)
        if not isinstance(fut, Completion):
            fut.add_done_callback(_retrieve)
            fut.add_done_callback(self.inflight.discard)

    # --- a store, a load ---------------------------------------------------------------

    def store(
        self, handle: Transfer, src: list[int], slots: Sequence[int], ctx: ReqContext
    ) -> None:
        """Copy KV blocks ``src`` into the host ``slots`` reserved for
        ``handle.keys_to_store`` (being written in the manager). Every way out frees them
        or hands them to a job whose completion does."""
        self._begin("store", _Ending(self, handle, ctx), len(handle.keys_to_store), src, slots)

    def load(
        self,
        handle: Transfer,
        slots: Sequence[int],
        ids: list[int],
        ctx: ReqContext,
        touch: bool = False,
    ) -> None:
        """Copy the pinned host ``slots`` of ``handle.keys`` into KV blocks ``ids``,
        the keys first touched (``touch``). Every way out unpins them or hands them to a
        job whose completion does."""
        ending = _Ending(self, handle, ctx)
        self._begin("load", ending, len(handle.keys), slots, ids, touch)

    def now(
        self,
        kind: Literal["store", "load"],
        handle: Transfer,
        gpu_ids: Sequence[int],
        host_ids: Sequence[int],
        ctx: ReqContext,
        touch: bool = False,
    ) -> bool:
        """What :meth:`store` / :meth:`load` do, in one step on this thread, when the
        backend copies the job at once (``copy_now``) and nothing is ahead of it on its
        lane: copy, touch the keys (``touch``), complete. False: nothing was done (a
        copy that raised copied nothing; the submission meets its error again and fails
        the transfer the usual way). Call inside the caller's hold. The layers it skips
        are most of a small call's cost beyond the manager's own."""
        store = kind == "store"
        jobs = (self._store_lane if store else self._load_lane).jobs
        if not gpu_ids or jobs:
            return False
        # The manager core's one-step functions: the same calls, in the same order, as
        # the Python below, with the glue between them in C (see mgrcore.c's one_step).
        keys = handle.keys_to_store if store else handle.keys
        target = self._backend.copy_target(store, len(gpu_ids))
        if target is not None and (how := self._how(store, touch)) is not None:
            ending = _Ending(self, handle, ctx)
            nbytes = len(gpu_ids) * self._block_bytes
            fn, tables, direction = target
            try:
                done = self._core.one_step(
                    how, fn, tables, direction, gpu_ids, host_ids, keys, ctx,
                    handle._future, ending, nbytes,
                )  # fmt: skip
            except BaseException as exc:
                copied = CopyJob(len(gpu_ids), nbytes)
                copied.finish_inline()
                if self._step_failed(store, handle, ctx, ending, jobs, copied, exc):
                    return True
                raise
            if done is not None:  # None: the core could not take the ids; copy_now can
                return done is True  # False: refused, nothing done (see below)
        try:
            job = self._backend.copy_now(store, gpu_ids, host_ids)
        except Exception:
            return False
        if job is None:
            return False
        ending = _Ending(self, handle, ctx)
        if job.error is None and (how := self._how(store, touch)) is not None:
            try:
                self._core.finish_step(
                    how, job.num_blocks, job.duration_s, keys, ctx, handle._future, ending,
                    job.nbytes,
                )  # fmt: skip
            except BaseException as exc:
                if self._step_failed(store, handle, ctx, ending, jobs, job, exc):
                    return True
                raise
            return True
        if touch:
            try:
                self._manager.touch(handle.keys, ctx)
            except BaseException as exc:
                undo = self._undo(kind, handle, ctx)
                self.abandon(kind, handle._future, False, undo, exc, ending)
                raise
        if store:
            self.stores += 1
        else:
            self.loads += 1
        # As the bridge runs an inline job's completion: in its lane while it runs, run
        # once more if an interrupt cuts it short (see the module docstring).
        jobs.append((job, ending))
        run_completion(jobs, job, ending.held)
        return True

    def _how(self, store: bool, touch: bool) -> tuple[object, ...] | None:
        """What the core's one-step functions are handed for a store or a load (see
        mgrcore.c's ``one_step``); ``None`` without the core, or for a store whose keys
        go on to lower tiers (:attr:`stored`)."""
        if store and self.stored is not None:
            return None
        key = (store, touch)
        how = self._hows.get(key)
        if how is None:
            core = load_mgrcore()
            if core is None:
                return None
            self._core = core
            # The handle is new and nobody awaits it yet: Future's own set_result (see
            # Completion) resolves it.
            set_result = asyncio.Future.set_result
            if store:
                how = (
                    self._manager, None, "complete_store", ("success",), self._publish,
                    self.store_hist, self.store_rate, TransferResult, set_result, self,
                    "stores", "bytes_stored",
                )  # fmt: skip
            else:
                how = (
                    self._manager, "touch" if touch else None, "complete_load", None, None,
                    self.load_hist, self.load_rate, TransferResult, set_result, self,
                    "loads", "bytes_loaded",
                )  # fmt: skip
            self._hows[key] = how
        return how

    def _step_failed(
        self,
        store: bool,
        handle: Transfer,
        ctx: ReqContext,
        ending: _Ending,
        jobs: deque[tuple[CopyJob, JobCallback]],
        job: CopyJob,
        exc: BaseException,
    ) -> bool:
        """Finish a one-step transfer whose ``job`` (ended) one of the core's calls cut
        short with ``exc``, as :meth:`now`'s Python path would have: True where that path
        returns (the handle failed), False where ``exc`` goes on to the caller."""
        kind: Literal["store", "load"] = "store" if store else "load"
        if not ending.step:  # the touch: the job never joined its lane
            self.abandon(kind, handle._future, False, self._undo(kind, handle, ctx), exc, ending)
            return False
        if isinstance(exc, Exception):  # as _complete catches it
            log.error("complete_%s failed", kind, exc_info=exc)
            self.resolve(handle, job, exc)
            return True
        # As run_completion: the completion runs once more (ending.step says how far the
        # first run got), in the job's lane, before the interrupt goes on.
        jobs.append((job, ending))
        try:
            ending.held(job)
        except Exception:
            log.exception("completion callback failed for %r", job)
        finally:
            jobs.popleft()
        return False

    def copy_in(
        self, handle: Transfer, slots: Sequence[int], ids: list[int], ctx: ReqContext
    ) -> None:
        """Submit the load of a counted, tracked ``handle`` (its host ``slots`` pinned) to
        the load lane; its completion unpins them and resolves the handle."""
        self._submit("load", _Ending(self, handle, ctx), slots, ids)

    def _begin(
        self,
        kind: Literal["store", "load"],
        ending: _Ending,
        n: int,
        src: Sequence[int],
        dst: Sequence[int],
        touch: bool = False,
    ) -> None:
        """Touch the keys (``touch``), then (``n`` blocks to copy) count and track the
        handle and submit its copy; whatever escapes after the slots were taken is undone
        (see :meth:`abandon`). No block to copy: the handle resolves at once."""
        handle = ending.handle
        fut: asyncio.Future[TransferResult] | None = None
        attempted = False
        try:
            if touch:
                self._manager.touch(handle.keys, ending.ctx)
            fut = handle._future
            if not n:
                fut.set_result(TransferResult(0, 0, 0.0))
                return
            if kind == "store":
                self.stores += 1
            else:
                self.loads += 1
            self.inflight.add(fut)  # track(), for the engine's own Completion
            attempted = True
            self._submit(kind, ending, src, dst)
        except BaseException as exc:
            self.abandon(kind, fut, attempted, self._undo(kind, handle, ending.ctx), exc, ending)
            raise

    def _undo(
        self, kind: Literal["store", "load"], handle: Transfer, ctx: ReqContext
    ) -> Callable[[], None]:
        """What frees (store) or unpins (load) the slots of a transfer that never ran."""
        manager = self._manager
        if kind == "store":
            return lambda: manager.complete_store(handle.keys_to_store, ctx, success=False)
        return lambda: manager.complete_load(handle.keys)

    def _submit(
        self,
        kind: Literal["store", "load"],
        ending: _Ending,
        src: Sequence[int],
        dst: Sequence[int],
    ) -> None:
        bridge = self.bridge
        assert bridge is not None
        store = kind == "store"
        try:
            if store:
                job = self._backend.submit_store(src, dst)
            else:
                job = self._backend.submit_load(src, dst)
        except Exception as exc:
            job = _failed(exc, len(src))
        bridge.watch(self._store_lane if store else self._load_lane, job, ending)

    def complete(self, job: CopyJob, ending: _Ending) -> None:
        """A copy ended: tell the manager (once: see the module docstring), publish a
        store's stored event and send its keys on down, resolve the handle."""
        if interrupts_held():  # an inline copy's, in the caller's step
            self._complete(job, ending)
            return
        with InterruptsHeld():
            self._complete(job, ending)

    def _complete(self, job: CopyJob, ending: _Ending) -> None:
        handle, ctx = ending.handle, ending.ctx
        error: BaseException | None = None
        try:
            if not ending.step:  # the first run: the step first (see the docstring)
                ending.step = 1
                error = job.error
            elif ending.step == 1:  # a rerun that finds the manager untold
                error = TransferError(f"{handle.kind} completion interrupted")
            else:
                error = job.error
            if ending.step == 1:
                if handle.kind == "store":
                    keys = handle.keys_to_store
                    self._manager.complete_store(keys, ctx, success=error is None)
                    ending.step = 2
                    self._publish()
                    durations, rates = self.store_hist, self.store_rate
                    if error is None:
                        if self.stored is not None:
                            self.stored(keys, ctx)
                        self.bytes_stored += job.nbytes
                else:
                    self._manager.complete_load(handle.keys, ctx)
                    ending.step = 2
                    durations, rates = self.load_hist, self.load_rate
                    if error is None:
                        self.bytes_loaded += job.nbytes
                if error is None:
                    seconds = job.duration_s
                    durations.observe(seconds)
                    if seconds > 0:
                        rates.observe(job.nbytes / seconds)
        except Exception as exc:  # never leave the handle (and aclose) hanging
            log.exception("complete_%s failed", handle.kind)
            error = error or exc
        self.resolve(handle, job, error)

    # --- endings -----------------------------------------------------------------------

    def resolve(self, handle: Transfer, job: CopyJob, error: BaseException | None) -> None:
        fut = handle._future
        self.inflight.discard(fut)  # in_flight counts only what is still running
        if fut.done():
            return
        if error is None:
            fut.set_result(TransferResult(job.num_blocks, job.nbytes, job.duration_s))
            return
        log.warning("%s of %d blocks failed: %r", handle.kind, job.num_blocks, error)
        err = TransferError(f"{handle.kind} of {job.num_blocks} blocks failed: {error!r}")
        err.__cause__ = error
        self.fail(handle, err)

    def fail(self, handle: Transfer, error: BaseException) -> None:
        """End ``handle`` with ``error`` (a failed transfer, counted), unless it ended."""
        fut = handle._future
        self.inflight.discard(fut)
        if not fut.done():
            self.failed += 1
            fut.set_exception(error)

    def abandon(
        self,
        kind: str,
        fut: asyncio.Future[TransferResult] | None,
        attempted: bool,
        undo: Callable[[], None],
        exc: BaseException,
        ending: _Ending,
    ) -> None:
        """Something (an interrupt, say) escaped a call between reserving slots and
        handing the copy to a lane. If no copy was submitted, undo now. If one may have
        been (the interrupt may have come just after the lane took it), the slots stay
        reserved until a fence (an empty job of the same direction, which completes
        after every earlier one) shows the lane is past it. If the job did reach the
        bridge (the interrupt came inside ``watch``), its own completion, which runs
        first, tells the manager, and ``ending.step`` keeps the fence from doing it
        again."""
        error = TransferError(f"{kind} abandoned: {exc!r}")
        error.__cause__ = exc

        def finish(_job: CopyJob | None = None) -> None:
            with InterruptsHeld():  # the undo is a manager update: whole or not at all
                try:
                    if ending.step < 2:
                        ending.step = 1
                        undo()
                        ending.step = 2
                finally:
                    if fut is not None:
                        self.inflight.discard(fut)
                        if not fut.done():
                            fut.set_exception(error)

        if not attempted:
            finish()
            return
        bridge = self.bridge
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
                self.inflight.discard(fut)
                if not fut.done():
                    fut.set_exception(error)

    async def wait_idle(self, fail_orphans: bool) -> None:
        """Wait until every transfer resolved and every lane job ended (a fence of an
        interrupted call, a write to a lower tier); ``fail_orphans``: fail handles whose
        job was lost (closing never waits forever)."""
        bridge = self.bridge
        inflight = self.inflight
        while inflight or (bridge is not None and bridge.pending):
            for fut in [f for f in inflight if f.done()]:  # ended by a path that keeps none
                inflight.discard(fut)
            if self.inflight:
                await asyncio.wait(list(self.inflight), timeout=_ORPHAN_CHECK_S)
                if fail_orphans:
                    self.fail_orphans()
            else:  # a job no handle waits for (the fence of an interrupted call) ends soon
                await asyncio.sleep(_FENCE_POLL_S)

    def fail_orphans(self) -> None:
        """Resolve, with an error, in-flight handles whose job no lane holds any more
        (it can never complete), so that closing never waits forever."""
        bridge = self.bridge
        if not self.inflight or (bridge is not None and bridge.pending):
            return
        for fut in list(self.inflight):
            if not fut.done():
                log.error("a transfer lost its copy job; failing its handle")
                fut.set_exception(TransferError("the transfer's copy job was lost"))
            self.inflight.discard(fut)


class _Ending:
    """A transfer's completion callback: its handle and request context, and how far
    earlier runs of the callback got (``step``, see the module docstring). One object,
    not a closure: the hot path allocates less."""

    __slots__ = ("copies", "ctx", "handle", "step")

    def __init__(self, copies: Copies, handle: Transfer, ctx: ReqContext) -> None:
        self.copies = copies
        self.handle = handle
        self.ctx = ctx
        self.step = 0

    def __call__(self, job: CopyJob) -> None:
        self.copies.complete(job, self)

    def held(self, job: CopyJob) -> None:
        """The callback, called inside a hold (the caller's step)."""
        self.copies._complete(job, self)


def _failed(exc: Exception, num_blocks: int) -> CopyJob:
    """The failed job of a submission that raised ``exc`` (an ``Exception``: the failure
    path frees the slots; anything else propagates to the caller)."""
    # The traceback's frames (and their callers, through f_back) hold the engine and the
    # caller's handle, whose error leads back here: a cycle that kept a closed engine and
    # its host pool alive until the next full collection. Keep the traceback as text (a
    # note, where notes exist) and drop the frames.
    if hasattr(exc, "add_note"):
        exc.add_note("".join(traceback.format_tb(exc.__traceback__)).rstrip())
    return FailedJob(num_blocks, exc.with_traceback(None))


def _retrieve(fut: asyncio.Future[TransferResult]) -> None:
    if not fut.cancelled():
        fut.exception()


def make_backend(
    kv_caches: Sequence[torch.Tensor], layout: KVLayout, config: EngineConfig
) -> TransferBackend:
    """The transfer backend for KV tensors on ``layout.device``: CPU or CUDA."""
    if layout.device.type == "cpu":
        return CpuCopyBackend(
            kv_caches,
            layout,
            config.cpu_blocks,
            config.copy_engine,
            inline_bytes=config.inline_copy_bytes,
            shared_host=any(getattr(tier, "shares_host", False) for tier in config.tiers),
        )
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
            inline_wait_us=config.inline_wait_us,
        )
    raise ValueError(
        f"no transfer backend for KV tensors on {layout.device}: this build copies CPU "
        "and CUDA tensors; pass backend= to use your own"
    )
