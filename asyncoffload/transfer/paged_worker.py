"""PagedTransferWorker: loop-free copies between paged KV caches and host slots.

This is the transfer layer a serving engine's worker process drives from its own thread,
with no event loop: vLLM's ``OffloadingWorker`` (``asyncoffload.integrations.vllm`` wraps
it, converting vLLM's specs to plain ids). It imports nothing from vLLM.

Life of a job::

    worker.submit_store(7, gpu_ids, group_sizes, block_indices, slot_ids)  # queued
    ...                                                # the model keeps running
    for job in worker.get_finished():                  # once per step, never blocks
        ...                                            # job.job_id, job.nbytes, job.seconds
    worker.wait({8})                                   # or block until job 8 is done

**Guarantees.**

- A submission only queues the copy (the CPU ``threads``/torch engine excepted: it copies
  on the calling thread) and returns; invalid input raises ``TypeError`` /
  ``ValueError`` / ``IndexError`` and nothing is queued.
- Jobs run on three lanes: stores, loads, and expedited loads (``submit_load(...,
  expedited=True)``: the caller waits for them soon, so they queue behind no store and no
  other load). Jobs of one lane complete, and are reported, in submission order. A store reads
  the KV blocks only after the work queued so far on the caller's current CUDA stream (a
  load likewise writes them after it).
- A job is reported by :meth:`~PagedTransferWorker.get_finished` only once all its bytes
  have landed. A copy that fails is retried once on a slower, independent copy path
  (``stats()`` counts it); if that fails too, :class:`PagedTransferError` is raised,
  naming the job, its direction, its blocks and both errors. Success is never reported
  for bytes that did not land.
- Until a store is reported (or waited for), the caller must not overwrite its KV blocks,
  and until a load is, it must not use its KV blocks or reuse its slots.

**Faults (tests).** :meth:`~PagedTransferWorker.inject_faults` makes every job consult a
:class:`~asyncoffload.transfer.faults.FaultPlan` once, at submission (``store`` /
``load``, its GPU block count). A fault it draws hits every attempt of that job, the
primary copy and its retry alike, as a persistent fault would: ``copy_error`` ends both
attempts failed without copying anything, ``submit_error`` makes both submissions raise.
Either way the job fails on both paths (:class:`PagedTransferError`, naming the
injected error). Other kinds of fault are refused.

**Threads.** No Python thread is involved. CPU tensors are copied by the native copy
lanes (one native thread per direction, no GIL) where the C helper builds, else by torch
on the calling thread; CUDA tensors by the copy engines on one CUDA stream per direction,
their completion seen by polling CUDA events. A worker is not thread-safe: call it from
one thread at a time (vLLM calls it from its model-runner thread).

**Fork.** Copy threads, streams and pinned memory do not survive ``os.fork``: in a child,
a worker made before the fork raises ``RuntimeError`` from every method, and
:meth:`~PagedTransferWorker.shutdown` returns at once without touching the parent's copies.
Make a new worker in the child.
"""

from __future__ import annotations

import heapq
import logging
import operator
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, NoReturn

import torch

from asyncoffload.errors import TransferError
from asyncoffload.transfer.base import CopyJob, FailedJob, check_process, forked_since
from asyncoffload.transfer.faults import Direction, FaultDecision, FaultPlan
from asyncoffload.transfer.paged import CopyPlan, IdsLike, PageLayout
from asyncoffload.transfer.paged_engines import (
    EXPEDITED,
    LANES,
    LOAD,
    STORE,
    CpuCopyEngine,
    CpuPagedEngine,
    CudaPagedEngine,
    PagedEngine,
)

__all__ = [
    "CpuCopyEngine",
    "CpuPagedEngine",
    "CudaPagedEngine",
    "DirectionStats",
    "FinishedJob",
    "JobCompletion",
    "PagedEngine",
    "PagedTransferError",
    "PagedTransferWorker",
    "PagedWorkerStats",
]

log = logging.getLogger("asyncoffload.transfer")

_DIRECTIONS = ("store", "load", "load")
_FAULT_DIRECTIONS: tuple[Direction, ...] = ("store", "load", "load")


class FinishedJob(NamedTuple):
    """A job whose bytes have all landed."""

    job_id: int
    #: Bytes copied (the sum of every ref's ``nbytes`` over the job's blocks).
    nbytes: int
    #: How long the copy ran: device time between the start and end of the copy on its
    #: stream (CUDA), or the copy lane's run time (CPU). For a retried job, the time from
    #: the first submission to the end of the retry.
    seconds: float


class DirectionStats(NamedTuple):
    """Counters of one direction since the worker was made."""

    #: Jobs completed successfully (retried ones included).
    jobs: int
    #: Their bytes.
    bytes: int
    #: Jobs whose first copy failed and that were retried on the fallback path.
    retries: int
    #: Jobs that failed on both paths (each raised :class:`PagedTransferError`).
    failures: int
    #: Jobs submitted and not yet reported by ``get_finished``.
    in_flight: int


class PagedWorkerStats(NamedTuple):
    store: DirectionStats
    #: Loads of the regular lane.
    load: DirectionStats
    #: The primary copy path, e.g. ``cpu-native``, ``cuda-batch``.
    engine: str
    #: The path a failed copy is retried on, e.g. ``cpu-torch``, ``cuda-each``.
    fallback: str
    #: Expedited loads (their own lane).
    expedited: DirectionStats = DirectionStats(0, 0, 0, 0, 0)


class PagedTransferError(TransferError):
    """A job's copy failed on the primary path and again on the fallback path.

    ``job_id``, ``direction`` (``"store"`` / ``"load"``), ``gpu_ids`` and ``slot_ids``
    (lists) say which; ``primary_error`` and ``fallback_error`` say why.
    ``failed_gpu_ids``: the GPU blocks whose bytes did not land. For a load that spans
    several host slots, the worker retries each slot alone on the fallback path before
    giving up, so this may be fewer than ``gpu_ids`` (the others landed); for a store,
    and whenever every slot failed, it is all of them."""

    def __init__(
        self,
        job_id: int,
        direction: str,
        plan: CopyPlan,
        paths: tuple[str, str],
        primary_error: BaseException,
        fallback_error: BaseException,
        failed_gpu_ids: list[int] | None = None,
    ) -> None:
        self.job_id = job_id
        self.direction = direction
        self.gpu_ids: list[int] = plan.gpu_ids.tolist()
        self.slot_ids: list[int] = plan.slot_ids.tolist()
        self.primary_error = primary_error
        self.fallback_error = fallback_error
        self.failed_gpu_ids: list[int] = (
            list(self.gpu_ids) if failed_gpu_ids is None else failed_gpu_ids
        )
        partial = ""
        if len(self.failed_gpu_ids) < len(self.gpu_ids):
            partial = (
                f"; {len(self.gpu_ids) - len(self.failed_gpu_ids)} blocks landed, "
                f"{len(self.failed_gpu_ids)} did not: {_head(self.failed_gpu_ids)}"
            )
        super().__init__(
            f"{direction} job {job_id} failed ({len(self.gpu_ids)} GPU blocks "
            f"{_head(self.gpu_ids)}, host slots {_head(self.slot_ids)}, {plan.nbytes} B): "
            f"{paths[0]} copy: {_describe(primary_error)}; retry on {paths[1]}: "
            f"{_describe(fallback_error)}{partial}"
        )


def _head(ids: list[int], n: int = 8) -> str:
    return str(ids) if len(ids) <= n else f"[{', '.join(map(str, ids[:n]))}, ...]"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Transfer:
    """One submitted job, from submission until ``get_finished`` reports it."""

    __slots__ = (
        "direction",
        "end_ns",
        "error",
        "fault",
        "job",
        "job_id",
        "ok",
        "plan",
        "primary_error",
        "seconds",
        "submitted_ns",
    )

    def __init__(
        self,
        job_id: int,
        direction: int,
        plan: CopyPlan,
        job: CopyJob,
        fault: FaultDecision | None = None,
    ) -> None:
        self.job_id = job_id
        self.direction = direction
        self.plan = plan
        self.job = job
        self.submitted_ns = time.perf_counter_ns()
        #: Whether every byte landed (after a retry, maybe); then end_ns and seconds hold.
        self.ok = False
        self.end_ns = 0
        self.seconds = 0.0
        #: Set once the primary path failed: ``job`` is then the fallback attempt.
        self.primary_error: BaseException | None = None
        #: The injected fault every attempt of this job gets (tests), if any.
        self.fault = fault
        #: Set when the job failed on both paths (it is then forgotten).
        self.error: PagedTransferError | None = None


class _Counters:
    __slots__ = ("bytes", "failures", "jobs", "retries")

    def __init__(self) -> None:
        self.jobs = self.bytes = self.retries = self.failures = 0


class PagedTransferWorker:
    """Moves KV blocks between paged KV tensors and ``num_slots`` host slots.

    ``tensors``, ``page_bytes``, ``group_refs`` and ``blocks_per_chunk`` describe the KV
    cache as :class:`~asyncoffload.transfer.paged.PageLayout` does (its docstring gives
    the host layout and the meaning of a transfer's ids). The tensors' device picks the
    engine: CPU tensors use :class:`CpuPagedEngine` (``copy_engine``), CUDA tensors
    :class:`CudaPagedEngine` (``pin``, ``chunk_bytes``, ``staging_bytes``: device
    memory per direction for its staged copies, allocated on first use). The worker keeps
    the tensors until :meth:`shutdown`. ``host_file``: the host slots live in a
    :class:`~asyncoffload.transfer.paged_engines.SharedHostFile` made at that path
    (another process may map it; unlinked at :meth:`shutdown`) instead of private memory;
    ``host_file_owner=False``: in the one another worker makes there (waited for), which
    this worker maps and leaves be (a layout replicated across tensor-parallel ranks).

    Job ids are ints chosen by the caller; an id may be used again once its job has been
    reported by :meth:`get_finished`. See the module docstring for ordering, failure and
    thread guarantees.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        page_bytes: Sequence[int],
        group_refs: Sequence[Sequence[tuple[int, int]]],
        blocks_per_chunk: int,
        num_slots: int,
        *,
        copy_engine: CpuCopyEngine = "auto",
        pin: bool = True,
        chunk_bytes: int = 1 << 30,
        staging_bytes: int = 256 << 20,
        host_file: str | os.PathLike[str] | None = None,
        host_file_owner: bool = True,
    ) -> None:
        self.layout = PageLayout(tensors, page_bytes, group_refs, blocks_per_chunk)
        if isinstance(num_slots, bool) or not isinstance(num_slots, int):
            raise TypeError(f"num_slots must be an int, got {num_slots!r}")
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        device = self.layout.device
        self._engine: PagedEngine
        if device.type == "cpu":
            self._engine = CpuPagedEngine(
                self.layout, num_slots, copy_engine, host_file, host_file_owner
            )
        elif device.type == "cuda":
            if chunk_bytes <= 0:
                raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
            if staging_bytes <= 0:
                raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
            self._engine = CudaPagedEngine(
                self.layout,
                num_slots,
                pin=pin,
                chunk_bytes=chunk_bytes,
                staging_bytes=staging_bytes,
                host_file=host_file,
                host_file_owner=host_file_owner,
            )
        else:
            raise ValueError(f"no copy engine for KV tensors on {device} (want cpu or cuda)")
        self._lanes: tuple[deque[_Transfer], ...] = tuple(deque() for _ in range(LANES))
        self._jobs: dict[int, _Transfer] = {}
        self._ready: list[FinishedJob] = []
        self._counters = tuple(_Counters() for _ in range(LANES))
        self._closed = False
        self._pid = os.getpid()
        self._faults: FaultPlan | None = None

    @property
    def slot_bytes(self) -> int:
        """Bytes of one host slot (one chunk of ``blocks_per_chunk`` blocks of a group)."""
        return self.layout.slot_bytes

    @property
    def engine(self) -> PagedEngine:
        return self._engine

    def __repr__(self) -> str:
        state = "shut down" if self._closed else self._engine.primary_name
        return (
            f"<PagedTransferWorker {state} [store: {len(self._lanes[STORE])} in flight | "
            f"load: {len(self._lanes[LOAD])} in flight | expedited: "
            f"{len(self._lanes[EXPEDITED])} in flight] {self.num_slots} slots of "
            f"{self.slot_bytes} B>"
        )

    def __enter__(self) -> PagedTransferWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- faults (tests) ---------------------------------------------------------------------

    def inject_faults(self, plan: FaultPlan | None) -> None:
        """Make every job submitted from now on consult ``plan`` (``None``: stop). Only
        ``copy_error`` and ``submit_error`` faults apply to a paged worker; a plan with
        another kind raises ``ValueError``. See the module docstring."""
        if plan is not None:
            if not isinstance(plan, FaultPlan):
                raise TypeError(
                    f"inject_faults takes a FaultPlan or None, got {type(plan).__name__}"
                )
            allowed = {"copy_error", "submit_error", "slot_error"}
            other = sorted({f.kind for f in plan.faults} - allowed)
            if other:
                raise ValueError(
                    f"a PagedTransferWorker takes copy_error, submit_error and slot_error faults, "
                    f"not {', '.join(other)}"
                )
        self._faults = plan

    @property
    def faults(self) -> FaultPlan | None:
        """The fault plan in effect (:meth:`inject_faults`), if any."""
        return self._faults

    @staticmethod
    def _attempt(
        submit: Callable[[int, CopyPlan], CopyJob],
        direction: int,
        plan: CopyPlan,
        fault: FaultDecision | None,
    ) -> CopyJob:
        if fault is not None:
            if fault.raise_before is not None:
                raise fault.raise_before
            if fault.copy_error is not None:
                return FailedJob(plan.num_copies, fault.copy_error)
            if fault.bad_slots and not fault.bad_slots.isdisjoint(plan.slot_ids.tolist()):
                assert fault.slot_error is not None
                return FailedJob(plan.num_copies, fault.slot_error)
        return submit(direction, plan)

    # --- submission ------------------------------------------------------------------------

    def submit_store(
        self,
        job_id: int,
        gpu_ids: IdsLike,
        group_sizes: IdsLike,
        block_indices: IdsLike,
        slot_ids: IdsLike,
    ) -> None:
        """Queue copying KV blocks ``gpu_ids`` into host slots ``slot_ids``; returns once
        queued. The KV blocks are read after the work queued so far on the caller's
        current CUDA stream. Raises ``ValueError`` for an id already in flight, the
        errors of :meth:`PageLayout.plan` for bad ids (nothing queued then), and
        :class:`PagedTransferError` if both copy paths refuse the job."""
        self._submit(STORE, job_id, gpu_ids, group_sizes, block_indices, slot_ids)

    def submit_load(
        self,
        job_id: int,
        slot_ids: IdsLike,
        gpu_ids: IdsLike,
        group_sizes: IdsLike,
        block_indices: IdsLike,
        *,
        expedited: bool = False,
    ) -> None:
        """Queue copying host slots ``slot_ids`` into KV blocks ``gpu_ids``; returns once
        queued. The blocks are written after the work queued so far on the caller's
        current CUDA stream. ``expedited``: the caller waits for it soon (vLLM's sync
        loads): it goes on a lane of its own, queued behind no store and no other load
        (on CUDA a stream of the highest priority). Errors as for :meth:`submit_store`."""
        lane = EXPEDITED if expedited else LOAD
        self._submit(lane, job_id, gpu_ids, group_sizes, block_indices, slot_ids)

    def _submit(
        self,
        direction: int,
        job_id: int,
        gpu_ids: IdsLike,
        group_sizes: IdsLike,
        block_indices: IdsLike,
        slot_ids: IdsLike,
    ) -> None:
        self._check_open()
        if isinstance(job_id, bool):
            raise TypeError(f"job_id must be an int, got {job_id!r}")
        try:
            job_id = operator.index(job_id)  # numpy integers too
        except TypeError:
            raise TypeError(f"job_id must be an int, got {job_id!r}") from None
        if job_id in self._jobs:
            raise ValueError(
                f"job id {job_id} is already in flight "
                f"({_DIRECTIONS[self._jobs[job_id].direction]}): ids may be reused only "
                "once get_finished has reported them"
            )
        plan = self.layout.plan(
            gpu_ids,
            group_sizes,
            block_indices,
            slot_ids,
            num_slots=self.num_slots,
            store=direction == STORE,
        )
        engine = self._engine
        fault = None
        if self._faults is not None:
            fault = self._faults.draw(_FAULT_DIRECTIONS[direction], int(plan.gpu_ids.numel()))
        primary: Exception | None = None
        try:
            job = self._attempt(engine.submit_primary, direction, plan, fault)
        except Exception as exc:
            primary = exc
            self._counters[direction].retries += 1
            log.warning(
                "%s job %d: %s copy failed at submission (%s); running it on %s",
                _DIRECTIONS[direction],
                job_id,
                engine.primary_name,
                _describe(exc),
                engine.fallback_name,
            )
            try:
                job = self._attempt(engine.submit_fallback, direction, plan, fault)
            except Exception as fallback:
                self._counters[direction].failures += 1
                raise PagedTransferError(
                    job_id,
                    _DIRECTIONS[direction],
                    plan,
                    (engine.primary_name, engine.fallback_name),
                    exc,
                    fallback,
                ) from fallback
        record = _Transfer(job_id, direction, plan, job, fault)
        record.primary_error = primary
        self._lanes[direction].append(record)
        self._jobs[job_id] = record

    # --- completion ------------------------------------------------------------------------

    def get_finished(self) -> list[FinishedJob]:
        """The jobs whose bytes have all landed since the last call; never blocks on a
        copy (a job found failed is retried first, synchronously).

        Each lane's jobs (stores, loads, expedited loads) come in submission order
        (which is their completion order); the lanes' lists are merged by completion
        time. A job that
        failed on both paths raises :class:`PagedTransferError` after the others found
        so far are set aside for the next call; it is not reported again.
        """
        self._check_open()
        found, self._ready = self._ready, []
        per_direction: list[list[tuple[int, FinishedJob]]] = [[] for _ in self._lanes]
        try:
            for direction, lane in enumerate(self._lanes):
                out = per_direction[direction]
                while lane:
                    record = lane[0]
                    if not record.ok:
                        if not record.job.query():
                            break
                        self._settle(record)
                    lane.popleft()
                    del self._jobs[record.job_id]
                    out.append((record.end_ns, _finished(record)))
        except BaseException:
            self._ready = found + [f for _, f in heapq.merge(*per_direction, key=_end)]
            raise
        found += [f for _, f in heapq.merge(*per_direction, key=_end)]
        return found

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until the bytes of every job in ``job_ids`` (and of the jobs submitted
        before them on the same lane) have landed, retrying failed copies. Ids not
        in flight (unknown, or already reported) are ignored. The jobs are still
        reported by the next :meth:`get_finished`. Raises :class:`PagedTransferError`
        for a job that failed on both paths (it is then forgotten), ``TimeoutError`` if
        ``timeout`` seconds pass first (the jobs stay in flight). No thread waits: the
        copy lane's own wait (CPU) or the job's CUDA event (GPU)."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        for job_id in job_ids:
            record = self._jobs.get(job_id)
            if record is not None and not record.ok:
                self._settle_through(record, deadline)

    def completion(self, job_id: int) -> JobCompletion:
        """Job ``job_id`` (in flight) as an ``IOCompletion`` (vLLM 0.34's protocol:
        ``done()``, ``result(timeout)``), backed by the job's own completion: the copy
        lane's status word on CPU, its CUDA event on GPU. ``KeyError`` for an id not in
        flight."""
        self._check_open()
        record = self._jobs.get(job_id)
        if record is None:
            raise KeyError(f"job {job_id} is not in flight")
        return JobCompletion(self, record)

    def _settle_through(self, target: _Transfer, deadline: float | None = None) -> None:
        for record in list(self._lanes[target.direction]):
            if not record.ok:
                timeout = None
                if deadline is not None:
                    timeout = max(0.0, deadline - time.monotonic())
                self._engine.wait(record.job, timeout)
                self._settle(record)
            if record is target:
                return

    def _settle(self, record: _Transfer) -> None:
        """``record``'s job has ended: mark it done, or retry it on the fallback path
        (waiting for the retry). Raises PagedTransferError, after forgetting the job, if
        the fallback attempt fails too."""
        job = record.job
        primary = record.primary_error
        if job.error is None:
            if primary is None:
                self._mark_ok(record, job.finished_ns, job.duration_s)
            else:
                end = job.finished_ns or time.perf_counter_ns()
                self._mark_ok(record, end, (end - record.submitted_ns) / 1e9)
            return
        if primary is not None:  # this was the retry
            self._fail(record, primary, job.error, self._salvage(record))
        direction = record.direction
        engine = self._engine
        record.primary_error = job.error
        self._counters[direction].retries += 1
        log.warning(
            "%s job %d: %s copy failed (%s); retrying on %s",
            _DIRECTIONS[direction],
            record.job_id,
            engine.primary_name,
            _describe(job.error),
            engine.fallback_name,
        )
        try:
            engine.quiesce(direction)  # the failed attempt must not touch the slots again
            record.job = self._attempt(engine.submit_fallback, direction, record.plan, record.fault)
            engine.wait(record.job)
        except Exception as fallback:
            self._fail(record, job.error, fallback, self._salvage(record))
        self._settle(record)

    def _salvage(self, record: _Transfer) -> list[int] | None:
        """A load that failed on both paths, retried one host slot at a time on the
        fallback path (waiting for each): the GPU blocks of the slots that failed
        again, or ``None`` when nothing landed (one slot, a store, every slot failed).
        vLLM then recomputes from the first failed block instead of from the first of
        the job."""
        plan = record.plan
        if record.direction == STORE or plan.slot_ids.numel() < 2:
            return None
        engine = self._engine
        layout = self.layout
        bpc = layout.blocks_per_chunk
        failed: list[int] = []
        landed = 0
        try:
            engine.quiesce(record.direction)
            for span in plan.spans:
                for i in range(span.num_slots):
                    lo = max(0, i * bpc - span.skip)
                    hi = min(span.n, (i + 1) * bpc - span.skip)
                    if lo >= hi:
                        continue
                    ids = plan.gpu_ids[span.gpu_lo + lo : span.gpu_lo + hi]
                    sizes = [0] * layout.num_groups
                    sizes[span.group] = hi - lo
                    starts = [0] * layout.num_groups
                    starts[span.group] = span.skip + lo
                    one = layout.plan(
                        ids,
                        sizes,
                        starts,
                        plan.slot_ids[span.slot_lo + i : span.slot_lo + i + 1],
                        num_slots=self.num_slots,
                        store=False,
                    )
                    try:
                        job = self._attempt(
                            engine.submit_fallback, record.direction, one, record.fault
                        )
                        engine.wait(job)
                        ok = job.error is None
                    except Exception:
                        ok = False
                    if ok:
                        landed += 1
                    else:
                        failed += ids.tolist()
        except Exception:
            return None
        return failed if landed and failed else None

    def _mark_ok(self, record: _Transfer, end_ns: int, seconds: float) -> None:
        record.ok = True
        record.end_ns = end_ns
        record.seconds = seconds
        record.job = _DONE  # drop the engine's job (its buffers, events) now
        counters = self._counters[record.direction]
        counters.jobs += 1
        counters.bytes += record.plan.nbytes

    def _fail(
        self,
        record: _Transfer,
        primary: BaseException,
        fallback: BaseException,
        failed_gpu_ids: list[int] | None = None,
    ) -> NoReturn:
        self._counters[record.direction].failures += 1
        lane = self._lanes[record.direction]
        if record in lane:
            lane.remove(record)
        self._jobs.pop(record.job_id, None)
        engine = self._engine
        error = PagedTransferError(
            record.job_id,
            _DIRECTIONS[record.direction],
            record.plan,
            (engine.primary_name, engine.fallback_name),
            primary,
            fallback,
            failed_gpu_ids,
        )
        record.error = error
        raise error from fallback

    # --- inspection and shutdown -----------------------------------------------------------

    def read_slot(self, slot_id: int) -> bytes:
        """The bytes of host slot ``slot_id`` (tests, lower tiers). Read a slot only while
        no copy into it is in flight."""
        self._check_open()
        if isinstance(slot_id, bool) or not isinstance(slot_id, int):
            raise TypeError(f"slot_id must be an int, got {slot_id!r}")
        if not 0 <= slot_id < self.num_slots:
            raise IndexError(
                f"slot_id {slot_id} is out of range: slots are 0 to {self.num_slots - 1}"
            )
        return self._engine.read_slot(slot_id)

    def stats(self) -> PagedWorkerStats:
        """Counters per direction (also after :meth:`shutdown`)."""

        def direction(d: int) -> DirectionStats:
            c = self._counters[d]
            return DirectionStats(c.jobs, c.bytes, c.retries, c.failures, len(self._lanes[d]))

        return PagedWorkerStats(
            direction(STORE),
            direction(LOAD),
            self._engine.primary_name,
            self._engine.fallback_name,
            direction(EXPEDITED),
        )

    def shutdown(self) -> None:
        """Finish every queued copy (retrying failed ones), then release the host memory
        and the engine's threads and streams. Jobs not yet reported are dropped. Safe to
        call twice; every other method but :meth:`stats` then raises ``RuntimeError``.
        If a job failed on both paths, resources are released all the same and the first
        such :class:`PagedTransferError` is raised at the end."""
        if self._closed:
            return
        self._closed = True
        error: PagedTransferError | None = None
        # In a fork's child the jobs in flight are the parent's: nothing to wait for.
        for lane in () if forked_since(self._pid) else self._lanes:
            while lane:
                record = lane[-1]
                try:
                    self._settle_through(record)
                except PagedTransferError as exc:
                    error = error or exc
                    continue
                break
        for lane in self._lanes:
            lane.clear()
        self._jobs.clear()
        self._ready.clear()
        try:
            self._engine.close()
        finally:
            self.layout.tensors.clear()
            self.layout.byte_views.clear()
        if error is not None:
            raise error

    def _check_open(self) -> None:
        check_process(self._pid, "PagedTransferWorker")
        if self._closed:
            raise RuntimeError("PagedTransferWorker is shut down")


class JobCompletion:
    """One job of a :class:`PagedTransferWorker` as an ``IOCompletion`` (vLLM 0.34's
    protocol, which ``concurrent.futures.Future`` satisfies too), with no thread behind
    it: :meth:`done` polls the job's own completion (the copy lane's status word on CPU,
    its CUDA event or host-function slot on GPU), :meth:`result` waits for it from the
    calling thread. The job is still reported by the worker's ``get_finished``."""

    __slots__ = ("_record", "_worker")

    def __init__(self, worker: PagedTransferWorker, record: _Transfer) -> None:
        self._worker = worker
        self._record = record

    @property
    def job_id(self) -> int:
        return self._record.job_id

    def done(self) -> bool:
        """Whether the job's copy has ended (its bytes landed, or it failed: then
        :meth:`result` retries it on the fallback path or raises). Never blocks."""
        record = self._record
        if record.ok or record.error is not None:
            return True
        if record.job.query():
            return True
        return bool(record.job.check_failed())

    def result(self, timeout: float | None = None) -> FinishedJob:
        """The finished job once its bytes have all landed (a failed copy retried first);
        :class:`PagedTransferError` if it failed on both paths, ``TimeoutError`` if
        ``timeout`` seconds pass first (it stays in flight)."""
        record = self._record
        if record.error is not None:
            raise record.error
        if not record.ok:
            try:
                self._worker.wait([record.job_id], timeout)
            except PagedTransferError:
                if record.error is not None:
                    raise record.error from None
                raise
        if record.error is not None:  # forgotten by an earlier wait
            raise record.error
        return _finished(record)

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<JobCompletion job {self.job_id} {_DIRECTIONS[self._record.direction]} {state}>"


_DONE = CopyJob(0, 0)
_DONE.finish()


def _end(item: tuple[int, FinishedJob]) -> int:
    return item[0]


def _finished(record: _Transfer) -> FinishedJob:
    return FinishedJob(record.job_id, record.plan.nbytes, record.seconds)
