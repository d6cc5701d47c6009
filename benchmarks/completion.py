"""Completion bridge figures: GPU job done -> awaiting coroutine resumes, per mechanism.

Every mechanism resolves an asyncio future when a GPU job queued on a side stream ends.
The GPU jobs are ``torch.cuda._sleep`` kernels (calibrated in cycles per microsecond) and,
with ``--jobs sleep,copy``, device -> pinned-host copies of the same duration.

Mechanisms (``--mechanisms``):

- ``ours-eventfd``: our real path. ``CompletionBridge(loop, "eventfd")`` and a
  :class:`CopyLane`; each job is a :class:`CudaJob` marked with :func:`mark_completion`
  and the native helper, whose host function (C, no GIL) stamps the job and writes the
  bridge's eventfd, watched with ``add_reader``.
- ``ours-poll``: ``CompletionBridge(loop, "poll", 1 ms)``; jobs marked with the CUDA
  event only (``lib=None``), so the bridge's loop timer polls the lane's head.
- ``waiter-thread`` (rejected in DESIGN.md): a thread doing
  ``Event(blocking=True).synchronize()`` then ``loop.call_soon_threadsafe``.
- ``py-hostfunc`` (rejected): a Python host function through cupy's
  ``ExternalStream.launch_host_func`` calling ``loop.call_soon_threadsafe``.

Figures, each on asyncio and uvloop (``--loops``), for each job length (``--lengths-us``):

- reference: the main thread, no asyncio, spinning on ``event.query()``; every latency
  is reported as its overhead over this reference's median (``+p50``, ``+p99``).
- idle loop: enqueue -> awaiting coroutine resumes. For ``ours-eventfd`` also the
  host function's stamp (``CudaJob.finished_ns``) -> bridge callback, as we measure it and
  as the bridge's own ``LatencyWindow`` records it.
- busy loop: a task doing ``--busy-ms`` of pure-Python work between
  ``await asyncio.sleep(0)``; it submits each job at a random point of one of its chunks
  (so job ends fall at random phases of the busy cycle) and another coroutine awaits it.
  Per completion: busy-loop iterations (busy chunks started) between the job's end and
  the bridge callback ("deliver") and the coroutine resuming ("resume"). The job's end is
  the host function's stamp where there is one (``ours-eventfd``), else submit time +
  the reference's median. A completion not delivered within ``--starve-timeout`` counts
  as starved; the busy test of that mechanism then stops.
- CPU: ``time.process_time`` (every thread of the process) over wall time while awaiting
  back-to-back jobs on an idle loop ("wait"), and over the whole submit + wait cycle.

Targets (issue 3), marked PASS/FAIL on the ``ours-eventfd`` rows: on idle uvloop, for 0.2
and 2 ms jobs, +p50 <= 50 us and +p99 <= 150 us; on a busy loop every completion is
delivered within one loop iteration, never starved; under 0.05 cores while waiting for
a 2 ms job.

Output: progress lines, a Markdown table at the end and ``$OUT/completion.json`` (or
``--json PATH``), rewritten after each mechanism so a partial run leaves its figures.

Run (needs a CUDA device): ``.venv/bin/python benchmarks/completion.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import ctypes
import dataclasses
import faulthandler
import gc
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import platform
import queue
import random
import statistics
import sys
import threading
import time
import zlib
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Run as a script from a checkout without ``pip install -e .``: import the package beside.
if importlib.util.find_spec("asyncoffload") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncoffload import loops
from asyncoffload._native import load_cuda_helpers
from asyncoffload.transfer.completion import CompletionBridge, CopyLane
from asyncoffload.transfer.cuda import CudaJob, mark_completion

MECHANISMS = ("ours-eventfd", "ours-spin", "ours-poll", "waiter-thread", "py-hostfunc")
REJECTED = ("waiter-thread", "py-hostfunc")
JOB_KINDS = ("sleep", "copy")
FEATURE_HOST_WAKE = 1
FEATURE_BATCH_MEMCPY = 2
# Targets (issue 3), microseconds / cores / loop iterations.
TARGET_P50_US = 50.0
TARGET_P99_US = 150.0
TARGET_CPU_CORES = 0.05
TARGET_ITERATIONS = 1
TARGET_LENGTHS_US = (200.0, 2000.0)


class BenchError(RuntimeError):
    """A phase could not be measured."""


def log(msg: str) -> None:
    print(msg, flush=True)


def now_ns() -> int:
    return time.perf_counter_ns()


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank ``q``-th percentile (0-100); NaN when empty."""
    if not values:
        return math.nan
    data = sorted(values)
    return data[min(len(data) - 1, max(0, math.ceil(q / 100 * len(data)) - 1))]


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


# --- the GPU side ------------------------------------------------------------------------


def _new_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


def _new_event(*, timing: bool = False, blocking: bool = False) -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=timing, blocking=blocking)  # type: ignore[no-untyped-call]


def _event_done(event: torch.cuda.Event) -> bool:
    return bool(event.query())  # type: ignore[no-untyped-call]


@dataclass
class GpuJob:
    """One kind and length of GPU work; ``enqueue()`` queues it on the side stream."""

    kind: str
    length_us: float
    enqueue: Callable[[], None]
    gpu_us: float = math.nan  # measured with timing events
    nbytes: int = 0  # copy jobs

    @property
    def label(self) -> str:
        return f"{self.kind} {self.length_us / 1000:g} ms"


class Gpu:
    """The side stream, the ``_sleep`` calibration and the copy buffers."""

    def __init__(self, kinds: Sequence[str], max_length_us: float) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.side = _new_stream()
        self.cycles_per_us = self._calibrate_sleep()
        self.copy_gbps = math.nan
        self._src: torch.Tensor | None = None
        self._dst: torch.Tensor | None = None
        if "copy" in kinds:
            self._calibrate_copy(max_length_us)

    def gpu_time_us(self, enqueue: Callable[[], None], reps: int = 5) -> float:
        """Median GPU time of ``enqueue``'s work, from timing events on the side stream."""
        times = []
        for _ in range(reps):
            start, end = _new_event(timing=True), _new_event(timing=True)
            start.record(self.side)
            enqueue()
            end.record(self.side)
            end.synchronize()
            times.append(float(start.elapsed_time(end)) * 1000.0)
        return statistics.median(times)

    def _sleep(self, cycles: int) -> None:
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]

    def _calibrate_sleep(self) -> float:
        # Warm the kernel and the clocks up first: an idle GPU runs slow for a while.
        self._sleep(1000)
        for _ in range(20):
            self._sleep(5_000_000)
        torch.cuda.synchronize()
        cycles = 20_000_000
        rates = [cycles / self.gpu_time_us(lambda: self._sleep(cycles), reps=1) for _ in range(5)]
        return statistics.median(rates)

    def _calibrate_copy(self, max_length_us: float) -> None:
        probe = 64 << 20
        self._src = torch.empty(probe, dtype=torch.uint8, device=self.device)
        self._dst = torch.empty(probe, dtype=torch.uint8, pin_memory=True)
        src, dst = self._src, self._dst
        us = self.gpu_time_us(lambda: self._copy(dst, src), reps=5)
        self.copy_gbps = probe / us / 1e3
        need = int(self.copy_gbps * 1e3 * max_length_us * 1.2)
        size = min(max(need, probe), 1 << 30)
        if size > probe:
            self._src = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            torch.cuda.synchronize()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)

    def job(self, kind: str, length_us: float) -> GpuJob:
        if kind == "sleep":
            cycles = max(1, int(length_us * self.cycles_per_us))

            def enqueue_sleep() -> None:
                with torch.cuda.stream(self.side):
                    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]

            job = GpuJob(kind, length_us, enqueue_sleep)
        elif kind == "copy":
            assert self._src is not None and self._dst is not None
            nbytes = int(self.copy_gbps * 1e3 * length_us) // 4096 * 4096
            nbytes = max(4096, min(nbytes, self._src.numel()))
            src, dst = self._src[:nbytes], self._dst[:nbytes]

            def enqueue_copy() -> None:
                with torch.cuda.stream(self.side):
                    dst.copy_(src, non_blocking=True)

            job = GpuJob(kind, length_us, enqueue_copy, nbytes=nbytes)
        else:
            raise ValueError(f"unknown job kind {kind!r}")
        job.gpu_us = self.gpu_time_us(job.enqueue)
        return job


def spin_reference(gpu: Gpu, job: GpuJob, n: int) -> list[float]:
    """Enqueue -> done seen by the main thread spinning on ``event.query()``, in us."""
    lat: list[float] = []
    warmup = max(5, n // 10)
    for i in range(warmup + n):
        t0 = now_ns()
        job.enqueue()
        event = _new_event()
        event.record(gpu.side)
        while not _event_done(event):
            pass
        t1 = now_ns()
        if i >= warmup:
            lat.append((t1 - t0) / 1e3)
    return lat


# --- mechanisms --------------------------------------------------------------------------


class _Starved(Exception):
    """The completion did not arrive before the guard timer."""


class Pending:
    """One submitted job and the future its completion resolves."""

    __slots__ = ("fut", "job", "t_cb", "t_submit")

    def __init__(self, fut: asyncio.Future[None], t_submit: int) -> None:
        self.fut = fut
        self.t_submit = t_submit
        self.t_cb = 0  # when the mechanism's callback ran on the loop
        self.job: CudaJob | None = None

    def deliver(self, *_args: object) -> None:
        """The mechanism's callback, on the loop thread."""
        if self.t_cb == 0:
            self.t_cb = now_ns()
        if not self.fut.done():
            self.fut.set_result(None)


class Mechanism(ABC):
    name: str = ""
    description: str = ""
    #: Whether ``Pending.job.finished_ns`` is the GPU-side end (a host function's stamp).
    host_stamp = False

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "mechanism not open"
        return self._loop

    def unavailable(self) -> str | None:
        """Why this mechanism cannot run here, or ``None``."""
        return None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @abstractmethod
    def submit(self, job: GpuJob) -> Pending:
        """Loop thread: enqueue ``job`` and arrange for its completion to resolve a future."""

    def window_us(self) -> tuple[float, float, int] | None:
        """The bridge's own LatencyWindow (p50, p99, count), where there is one."""
        return None

    def close(self) -> None:
        """After ``torch.cuda.synchronize()``: release what ``open`` made."""
        self._loop = None


class OursBridge(Mechanism):
    """Our engine's path: CompletionBridge + CopyLane + CudaJob + mark_completion."""

    def __init__(
        self, gpu: Gpu, mode: str, lib: ctypes.CDLL | None, poll_s: float, spin: bool = False
    ) -> None:
        super().__init__(gpu)
        self.mode = mode
        self.spin = spin
        self.lib = lib
        self.poll_s = poll_s
        self.host_stamp = mode == "eventfd"
        self.name = "ours-spin" if spin else f"ours-{mode}"
        if spin:
            self.description = (
                "host function -> eventfd, plus the native spinner polling the event from "
                "60 us before to 150 us after the expected end (ours, as the CUDA backend "
                "does for transfers; the expected end here is the job's measured GPU time)"
            )
        elif mode == "eventfd":
            self.description = "native host function -> eventfd -> add_reader (ours)"
        else:
            self.description = f"loop timer polls the lane head every {poll_s * 1e3:g} ms (ours)"
        self._bridge: CompletionBridge | None = None
        self._lane: CopyLane | None = None
        self._window: tuple[float, float, int] | None = None

    def unavailable(self) -> str | None:
        if self.mode == "eventfd" and self.lib is None:
            return "the native CUDA helper with host-function wake-ups is not available"
        if self.spin:
            helpers = load_cuda_helpers()
            if helpers is None or not helpers[1] & 8:
                return "the native completion spinner is not available"
        return None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        super().open(loop)
        bridge = CompletionBridge(loop, self.mode, self.poll_s)
        expected = ("eventfd", "pipe") if self.mode == "eventfd" else ("poll",)
        if bridge.mechanism not in expected:
            bridge.close()
            raise BenchError(f"bridge mode {self.mode!r} became {bridge.mechanism!r}")
        if self.mode == "eventfd" and bridge.wake_fd is None:
            bridge.close()
            raise BenchError("eventfd bridge without a wake fd")
        self._bridge = bridge
        self._lane = bridge.lane("bench")
        self._window = None

    def submit(self, job: GpuJob) -> Pending:
        bridge, lane = self._bridge, self._lane
        assert bridge is not None and lane is not None
        p = Pending(self.loop.create_future(), now_ns())
        cjob = CudaJob(0, 0, "bench")
        job.enqueue()
        spin: tuple[int, int] | None = None
        if self.spin:
            end = time.perf_counter_ns() + int(job.gpu_us * 1000)
            spin = (end - 60_000, end + 150_000)
        mark_completion(cjob, self.gpu.side, self.lib, bridge.wake_fd, spin_ns=spin)
        p.job = cjob
        bridge.watch(lane, cjob, p.deliver)
        return p

    def window_us(self) -> tuple[float, float, int] | None:
        bridge = self._bridge
        if bridge is None:
            return self._window
        lat = bridge.latency
        return (lat.percentile_us(50), lat.percentile_us(99), lat.count)

    def close(self) -> None:
        if self._bridge is not None:
            self._window = self.window_us()
            pending = self._bridge.pending
            self._bridge.close()
            self._bridge = None
            self._lane = None
            if pending:
                log(f"    warning: {self.name} bridge closed with {pending} jobs pending")
        super().close()


class WaiterThread(Mechanism):
    """Rejected: a Python thread blocks on the event, then hands over with the GIL."""

    name = "waiter-thread"
    description = "thread: Event(blocking=True).synchronize() -> call_soon_threadsafe"

    def __init__(self, gpu: Gpu) -> None:
        super().__init__(gpu)
        self._queue: queue.SimpleQueue[tuple[torch.cuda.Event, Pending] | None] | None = None
        self._thread: threading.Thread | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        super().open(loop)
        q: queue.SimpleQueue[tuple[torch.cuda.Event, Pending] | None] = queue.SimpleQueue()
        self._queue = q
        self._thread = threading.Thread(
            target=self._run, args=(loop, q), name="bench-waiter", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _run(
        loop: asyncio.AbstractEventLoop,
        q: queue.SimpleQueue[tuple[torch.cuda.Event, Pending] | None],
    ) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            event, p = item
            try:
                event.synchronize()  # releases the GIL while blocked
            except Exception as exc:
                print(f"    waiter thread: synchronize failed: {exc}", file=sys.stderr, flush=True)
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(p.deliver)

    def submit(self, job: GpuJob) -> Pending:
        assert self._queue is not None
        p = Pending(self.loop.create_future(), now_ns())
        job.enqueue()
        event = _new_event(blocking=True)
        event.record(self.gpu.side)
        self._queue.put((event, p))
        return p

    def close(self) -> None:
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                log("    warning: waiter thread did not stop within 10 s")
        self._queue = None
        self._thread = None
        super().close()


class PyHostFunc(Mechanism):
    """Rejected: a Python host function (cupy) takes the GIL on the driver's thread."""

    name = "py-hostfunc"
    description = "cupy launch_host_func (Python, takes the GIL) -> call_soon_threadsafe"

    def __init__(self, gpu: Gpu) -> None:
        super().__init__(gpu)
        self._cupy: Any = None
        self._reason: str | None = None
        try:
            self._cupy = importlib.import_module("cupy")
        except Exception as exc:
            self._reason = f"cupy not importable: {type(exc).__name__}: {exc}"
        self._stream: Any = None

    @property
    def version(self) -> str | None:
        return str(self._cupy.__version__) if self._cupy is not None else None

    def unavailable(self) -> str | None:
        return self._reason

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        super().open(loop)
        self._stream = self._cupy.cuda.ExternalStream(self.gpu.side.cuda_stream)

    def submit(self, job: GpuJob) -> Pending:
        p = Pending(self.loop.create_future(), now_ns())
        job.enqueue()
        loop = self.loop

        def host_fn(arg: Pending) -> None:  # on the driver's callback thread
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(arg.deliver)

        self._stream.launch_host_func(host_fn, p)
        return p

    def close(self) -> None:
        self._stream = None
        super().close()


# --- measurements ------------------------------------------------------------------------


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(_Starved())


async def wait_pending(p: Pending, timeout_s: float) -> bool:
    """Await ``p``'s future; False if the guard timer fired first. The guard is a plain
    loop timer, so awaiting costs no extra loop iteration."""
    loop = asyncio.get_running_loop()
    guard = loop.call_later(timeout_s, _expire, p.fut)
    try:
        await p.fut
    except _Starved:
        return False
    finally:
        guard.cancel()
    return True


async def wait_late(p: Pending, timeout_s: float) -> float | None:
    """After a starved completion (and the busy loop stopped): seconds until it arrived
    after all, or ``None``."""
    deadline = now_ns() + int(timeout_s * 1e9)
    while p.t_cb == 0 and now_ns() < deadline:  # noqa: ASYNC110 - set from a callback
        await asyncio.sleep(0.001)
    return (p.t_cb - p.t_submit) / 1e9 if p.t_cb else None


@dataclass
class Row:
    mechanism: str
    loop: str
    job: str
    length_us: float
    gpu_us: float
    ref_p50_us: float
    # idle loop: enqueue -> coroutine resumes
    n: int = 0
    p50_us: float = math.nan
    p99_us: float = math.nan
    over_p50_us: float = math.nan
    over_p99_us: float = math.nan
    over_max_us: float = math.nan
    # ours-eventfd: host-function stamp -> bridge callback / coroutine resumes
    end_cb_p50_us: float = math.nan
    end_cb_p99_us: float = math.nan
    end_resume_p50_us: float = math.nan
    end_resume_p99_us: float = math.nan
    window_p50_us: float = math.nan  # the bridge's LatencyWindow
    window_p99_us: float = math.nan
    window_count: int = 0
    # busy loop
    busy_n: int = 0
    busy_done_source: str = ""
    busy_deliver_iters_max: int | None = None
    busy_resume_iters_max: int | None = None
    busy_resume_iters_p50: float = math.nan
    busy_deliver_ms_max: float = math.nan
    busy_resume_ms_p50: float = math.nan
    busy_resume_ms_max: float = math.nan
    busy_chunk_ms_p50: float = math.nan
    starved: int = 0
    starved_late_s: float | None = None
    # CPU
    cpu_jobs: int = 0
    cpu_wait_cores: float = math.nan
    cpu_cycle_cores: float = math.nan
    errors: list[str] = field(default_factory=list)
    targets: dict[str, bool] = field(default_factory=dict)
    idle_lat_us: list[float] = field(default_factory=list)  # raw: enqueue -> resumed


async def idle_phase(mech: Mechanism, job: GpuJob, n: int, timeout_s: float, row: Row) -> None:
    loop = asyncio.get_running_loop()
    mech.open(loop)
    try:
        lat: list[float] = []
        end_cb: list[float] = []
        end_res: list[float] = []
        warmup = max(5, n // 10)
        for i in range(warmup + n):
            p = mech.submit(job)
            if not await wait_pending(p, timeout_s):
                raise BenchError(f"no completion within {timeout_s:g} s on an idle loop")
            t_res = now_ns()
            if i < warmup:
                continue
            lat.append((t_res - p.t_submit) / 1e3)
            if mech.host_stamp and p.job is not None and p.job.finished_ns:
                end_cb.append((p.t_cb - p.job.finished_ns) / 1e3)
                end_res.append((t_res - p.job.finished_ns) / 1e3)
    finally:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        mech.close()
    row.n = len(lat)
    row.idle_lat_us = [round(x, 1) for x in lat]
    row.p50_us = statistics.median(lat)
    row.p99_us = pct(lat, 99)
    row.over_p50_us = row.p50_us - row.ref_p50_us
    row.over_p99_us = row.p99_us - row.ref_p50_us
    row.over_max_us = max(lat) - row.ref_p50_us
    if end_cb:
        row.end_cb_p50_us = statistics.median(end_cb)
        row.end_cb_p99_us = pct(end_cb, 99)
        row.end_resume_p50_us = statistics.median(end_res)
        row.end_resume_p99_us = pct(end_res, 99)
    window = mech.window_us()
    if window is not None:
        row.window_p50_us, row.window_p99_us, row.window_count = window


async def cpu_phase(mech: Mechanism, job: GpuJob, n: int, timeout_s: float, row: Row) -> None:
    loop = asyncio.get_running_loop()
    mech.open(loop)
    try:
        for _ in range(3):
            if not await wait_pending(mech.submit(job), timeout_s):
                raise BenchError(f"no completion within {timeout_s:g} s on an idle loop")
        cpu_wait = wall_wait = 0
        c_start, w_start = time.process_time_ns(), now_ns()
        for _ in range(n):
            p = mech.submit(job)
            c0, w0 = time.process_time_ns(), now_ns()
            if not await wait_pending(p, timeout_s):
                raise BenchError(f"no completion within {timeout_s:g} s on an idle loop")
            cpu_wait += time.process_time_ns() - c0
            wall_wait += now_ns() - w0
        c_total, w_total = time.process_time_ns() - c_start, now_ns() - w_start
    finally:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        mech.close()
    row.cpu_jobs = n
    row.cpu_wait_cores = cpu_wait / wall_wait if wall_wait else math.nan
    row.cpu_cycle_cores = c_total / w_total if w_total else math.nan


def _burn_until(deadline_ns: int) -> int:
    """Pure-Python work until ``deadline_ns``."""
    x = 0
    while time.perf_counter_ns() < deadline_ns:
        for i in range(64):
            x += i
    return x


class _BusyState:
    def __init__(self) -> None:
        self.stop = False
        self.request: asyncio.Future[Pending] | None = None
        self.steps = array("q")  # start of each busy chunk, perf_counter_ns


async def _busy_task(
    state: _BusyState, mech: Mechanism, job: GpuJob, chunk_ns: int, rng: random.Random
) -> None:
    """``chunk_ns`` of Python work between yields; submits a requested job at a random
    point of a chunk, so job ends fall at random phases of the busy cycle."""
    while not state.stop:
        start = now_ns()
        state.steps.append(start)
        req = state.request
        if req is not None and not req.done():
            _burn_until(start + rng.randrange(chunk_ns))
            state.request = None
            try:
                p = mech.submit(job)
            except Exception as exc:
                req.set_exception(exc)
            else:
                req.set_result(p)
        _burn_until(start + chunk_ns)
        await asyncio.sleep(0)


async def busy_phase(
    mech: Mechanism,
    job: GpuJob,
    n: int,
    chunk_ms: float,
    timeout_s: float,
    row: Row,
    seed: int,
) -> None:
    loop = asyncio.get_running_loop()
    mech.open(loop)
    state = _BusyState()
    ref_done_ns = int(row.ref_p50_us * 1e3)
    chunk_ns = int(chunk_ms * 1e6)
    task = loop.create_task(_busy_task(state, mech, job, chunk_ns, random.Random(seed)))
    done: list[tuple[int, int, int]] = []  # (job end, callback ran, coroutine resumed)
    sources: set[str] = set()
    starved: Pending | None = None
    try:
        for _ in range(3):  # let the busy task get going
            await asyncio.sleep(0)
        for i in range(n + 2):
            req: asyncio.Future[Pending] = loop.create_future()
            state.request = req
            p = await asyncio.wait_for(req, timeout=timeout_s)
            if not await wait_pending(p, timeout_s):
                starved = p
                break
            t_res = now_ns()
            if i < 2:  # warm-up
                continue
            if mech.host_stamp and p.job is not None and p.job.finished_ns:
                t_done = p.job.finished_ns
                sources.add("host-function stamp")
            else:
                t_done = p.t_submit + ref_done_ns
                sources.add("submit + reference median")
            done.append((t_done, p.t_cb, t_res))
    finally:
        state.stop = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=5)
        if starved is not None:
            row.starved = 1
            row.starved_late_s = await wait_late(starved, max(10.0, timeout_s))
            if row.starved_late_s is None:
                row.errors.append("busy: a starved completion never arrived")
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        mech.close()
    steps = list(state.steps)
    row.busy_n = len(done)
    row.busy_done_source = ", ".join(sorted(sources))
    if len(steps) > 1:
        row.busy_chunk_ms_p50 = statistics.median(b - a for a, b in itertools.pairwise(steps)) / 1e6
    if done:

        def iters(t_done: int, t_then: int) -> int:
            return max(0, bisect.bisect_left(steps, t_then) - bisect.bisect_right(steps, t_done))

        deliver_iters = [iters(d, c) for d, c, _ in done]
        resume_iters = [iters(d, r) for d, _, r in done]
        row.busy_deliver_iters_max = max(deliver_iters)
        row.busy_resume_iters_max = max(resume_iters)
        row.busy_resume_iters_p50 = statistics.median(resume_iters)
        row.busy_deliver_ms_max = max(c - d for d, c, _ in done) / 1e6
        resume_ms = [(r - d) / 1e6 for d, _, r in done]
        row.busy_resume_ms_p50 = statistics.median(resume_ms)
        row.busy_resume_ms_max = max(resume_ms)


# --- driver ------------------------------------------------------------------------------


@dataclass
class Options:
    samples: int
    busy_samples: int
    cpu_jobs: int
    loops: list[str]
    mechanisms: list[str]
    kinds: list[str]
    lengths_us: list[float]
    busy_ms: float
    starve_timeout_s: float
    poll_interval_s: float
    watchdog_s: float
    json_path: str | None


def make_mechanism(name: str, gpu: Gpu, lib: ctypes.CDLL | None, opts: Options) -> Mechanism:
    if name == "ours-eventfd":
        return OursBridge(gpu, "eventfd", lib, opts.poll_interval_s)
    if name == "ours-spin":
        return OursBridge(gpu, "eventfd", lib, opts.poll_interval_s, spin=True)
    if name == "ours-poll":
        return OursBridge(gpu, "poll", None, opts.poll_interval_s)
    if name == "waiter-thread":
        return WaiterThread(gpu)
    if name == "py-hostfunc":
        return PyHostFunc(gpu)
    raise ValueError(f"unknown mechanism {name!r}")


async def run_mechanism(
    mech: Mechanism,
    loop_name: str,
    jobs: Sequence[GpuJob],
    refs: dict[str, list[float]],
    opts: Options,
) -> list[Row]:
    rows: list[Row] = []
    rejected = mech.name in REJECTED
    n = max(20, opts.samples // 2) if rejected else opts.samples
    for job in jobs:
        ref = refs[job.label]
        row = Row(
            mechanism=mech.name,
            loop=loop_name,
            job=job.kind,
            length_us=job.length_us,
            gpu_us=job.gpu_us,
            ref_p50_us=statistics.median(ref),
        )
        rows.append(row)
        head = f"[{loop_name}] {mech.name:13s} {job.label:13s}"
        for phase in ("idle", "cpu", "busy"):
            gc.collect()
            t0 = time.perf_counter()
            try:
                if phase == "idle":
                    await idle_phase(mech, job, n, opts.starve_timeout_s, row)
                elif phase == "cpu":
                    await cpu_phase(mech, job, opts.cpu_jobs, opts.starve_timeout_s, row)
                else:
                    seed = zlib.crc32(f"{mech.name} {loop_name} {job.label}".encode())
                    await busy_phase(
                        mech, job, opts.busy_samples, opts.busy_ms, opts.starve_timeout_s, row, seed
                    )
            except Exception as exc:
                row.errors.append(f"{phase}: {type(exc).__name__}: {exc}")
                log(f"{head} {phase}: ERROR {type(exc).__name__}: {exc}")
                continue
            dt = time.perf_counter() - t0
            if phase == "idle":
                extra = ""
                if not math.isnan(row.end_cb_p50_us):
                    extra = (
                        f" | end->callback p50 {fmt(row.end_cb_p50_us)} p99 "
                        f"{fmt(row.end_cb_p99_us)} us, window p50 {fmt(row.window_p50_us)} "
                        f"p99 {fmt(row.window_p99_us)} us (n={row.window_count})"
                    )
                log(
                    f"{head} idle n={row.n}: +p50 {fmt(row.over_p50_us)} us +p99 "
                    f"{fmt(row.over_p99_us)} us (raw p50 {fmt(row.p50_us)}, ref "
                    f"{fmt(row.ref_p50_us)}){extra} [{dt:.1f} s]"
                )
            elif phase == "cpu":
                log(
                    f"{head} cpu  n={row.cpu_jobs}: waiting {fmt(row.cpu_wait_cores, 3)} cores,"
                    f" submit+wait {fmt(row.cpu_cycle_cores, 3)} cores [{dt:.1f} s]"
                )
            else:
                state = (
                    f"STARVED (no completion within {opts.starve_timeout_s:g} s; it came "
                    f"{fmt(row.starved_late_s, 2)} s after submission, once the loop idled)"
                    if row.starved
                    else "never starved"
                )
                log(
                    f"{head} busy n={row.busy_n}: iterations deliver max "
                    f"{row.busy_deliver_iters_max}, resume max {row.busy_resume_iters_max} "
                    f"(p50 {fmt(row.busy_resume_iters_p50)}), resume p50 "
                    f"{fmt(row.busy_resume_ms_p50, 2)} max {fmt(row.busy_resume_ms_max, 2)} ms, "
                    f"chunk {fmt(row.busy_chunk_ms_p50, 2)} ms; {state} [{dt:.1f} s]"
                )
            if row.starved:
                break
    return rows


def judge(row: Row) -> None:
    """PASS/FAIL of the issue's targets, on our eventfd rows."""
    if row.mechanism not in ("ours-eventfd", "ours-spin"):
        return
    t: dict[str, bool] = {}
    if row.loop == "uvloop" and row.length_us in TARGET_LENGTHS_US and row.n:
        t["p50"] = row.over_p50_us <= TARGET_P50_US
        t["p99"] = row.over_p99_us <= TARGET_P99_US
    if row.busy_n or row.starved:
        t["busy"] = (
            not row.starved
            and row.busy_deliver_iters_max is not None
            and row.busy_deliver_iters_max <= TARGET_ITERATIONS
        )
    if row.length_us == max(TARGET_LENGTHS_US) and row.cpu_jobs:
        t["cpu"] = row.cpu_wait_cores < TARGET_CPU_CORES
    row.targets = t


def table(rows: Sequence[Row], opts: Options) -> str:
    head = (
        "| mechanism | loop | job | +p50 us | +p99 us | end->callback p50/p99 us "
        "| busy: max iters deliver/resume | busy: resume p50/max ms | starved "
        "| CPU waiting (cores) | CPU submit+wait | targets |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if r.starved:
            late = f", came after {fmt(r.starved_late_s, 2)} s" if r.starved_late_s else ", never"
            starved = f"**yes** (> {opts.starve_timeout_s:g} s{late})"
        elif r.busy_n:
            starved = f"no (n={r.busy_n})"
        else:
            starved = "-"
        iters = (
            f"{r.busy_deliver_iters_max} / {r.busy_resume_iters_max}"
            if r.busy_deliver_iters_max is not None
            else "-"
        )
        end_cb = (
            f"{fmt(r.end_cb_p50_us)} / {fmt(r.end_cb_p99_us)}"
            if not math.isnan(r.end_cb_p50_us)
            else "-"
        )
        targets = ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in r.targets.items())
        if r.errors:
            targets = (targets + "; " if targets else "") + "ERRORS: " + "; ".join(r.errors)
        lines.append(
            f"| {r.mechanism} | {r.loop} | {r.job} {r.length_us / 1000:g} ms "
            f"| {fmt(r.over_p50_us)} | {fmt(r.over_p99_us)} | {end_cb} | {iters} "
            f"| {fmt(r.busy_resume_ms_p50, 2)} / {fmt(r.busy_resume_ms_max, 2)} | {starved} "
            f"| {fmt(r.cpu_wait_cores, 3)} | {fmt(r.cpu_cycle_cores, 3)} | {targets or '-'} |"
        )
    return "\n".join(lines)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _clean(value: object) -> object:
    """NaN -> None, recursively: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(path: str | None, payload: dict[str, object]) -> None:
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(_clean(payload), f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        log(f"warning: could not write {path}: {exc}")


def parse_args(argv: Sequence[str] | None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--samples", type=int, default=None, help="idle-loop samples per job (300)")
    ap.add_argument("--busy-samples", type=int, default=None, help="busy-loop completions (40)")
    ap.add_argument("--cpu-jobs", type=int, default=None, help="jobs in the CPU figure (60)")
    ap.add_argument("--loops", default="asyncio,uvloop", help="asyncio,uvloop")
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS), help=",".join(MECHANISMS))
    ap.add_argument(
        "--jobs",
        default="sleep,copy",
        help="GPU work: sleep (torch.cuda._sleep), copy (D2H into pinned memory); "
        "the rejected mechanisms run only the first",
    )
    ap.add_argument("--lengths-us", default="200,2000", help="job lengths in microseconds")
    ap.add_argument("--busy-ms", type=float, default=2.0, help="Python work between yields")
    ap.add_argument(
        "--starve-timeout", type=float, default=None, help="seconds before starved (5; quick: 2)"
    )
    ap.add_argument("--poll-interval-ms", type=float, default=1.0, help="ours-poll interval")
    ap.add_argument(
        "--watchdog", type=float, default=180.0, help="abort one mechanism+loop after this (s)"
    )
    ap.add_argument("--json", default=None, help="result file (default: $OUT/completion.json)")
    ap.add_argument("--quick", action="store_true", help="few samples: a smoke run")
    a = ap.parse_args(argv)

    def split(s: str) -> list[str]:
        return [x.strip() for x in s.split(",") if x.strip()]

    quick = bool(a.quick)
    opts = Options(
        samples=a.samples if a.samples is not None else (40 if quick else 300),
        busy_samples=a.busy_samples if a.busy_samples is not None else (8 if quick else 40),
        cpu_jobs=a.cpu_jobs if a.cpu_jobs is not None else (10 if quick else 60),
        loops=split(a.loops),
        mechanisms=split(a.mechanisms),
        kinds=split(a.jobs),
        lengths_us=[float(x) for x in split(a.lengths_us)],
        busy_ms=a.busy_ms,
        starve_timeout_s=a.starve_timeout
        if a.starve_timeout is not None
        else 2.0
        if quick
        else 5.0,
        poll_interval_s=a.poll_interval_ms / 1e3,
        watchdog_s=a.watchdog,
        json_path=a.json
        or (os.path.join(os.environ["OUT"], "completion.json") if os.environ.get("OUT") else None),
    )
    for name in opts.loops:
        if name not in ("asyncio", "uvloop"):
            ap.error(f"unknown loop {name!r} (asyncio, uvloop)")
    for name in opts.mechanisms:
        if name not in MECHANISMS:
            ap.error(f"unknown mechanism {name!r} ({', '.join(MECHANISMS)})")
    for name in opts.kinds:
        if name not in JOB_KINDS:
            ap.error(f"unknown job kind {name!r} ({', '.join(JOB_KINDS)})")
    if not opts.lengths_us or min(opts.lengths_us) <= 0:
        ap.error("--lengths-us needs positive lengths")
    if opts.samples < 1 or opts.busy_samples < 1 or opts.cpu_jobs < 1:
        ap.error("--samples, --busy-samples and --cpu-jobs must be >= 1")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if not sys.platform.startswith("linux"):
        print(f"error: this benchmark needs Linux (eventfd), not {sys.platform}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            f"error: the completion benchmark needs a CUDA device, and torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}) sees none. Run it on the GPU machine.",
            file=sys.stderr,
            flush=True,
        )
        return 2
    t_start = time.perf_counter()
    log(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), python {platform.python_version()}"
    )
    log(
        f"device: {torch.cuda.get_device_name()} (capability "
        f"{'.'.join(map(str, torch.cuda.get_device_capability()))})"
    )
    clock = time.get_clock_info("perf_counter").implementation
    if "CLOCK_MONOTONIC" not in clock:
        log(f"warning: perf_counter is {clock}, not CLOCK_MONOTONIC: host stamps misread")
    uv_version = _version("uvloop") if loops.uvloop_available() else None
    log(f"uvloop {uv_version or 'not installed'}, switch interval {sys.getswitchinterval()} s")
    if "uvloop" in opts.loops and uv_version is None:
        log("uvloop not installed: skipping the uvloop runs")
        opts.loops = [x for x in opts.loops if x != "uvloop"]

    log("loading the native CUDA helper ...")
    helpers = load_cuda_helpers()
    lib: ctypes.CDLL | None = None
    features = 0
    if helpers is None:
        log("native CUDA helper: NOT available (no compiler, no libcuda or ASYNCOFFLOAD_NO_NATIVE)")
    else:
        lib, features = helpers
        log(
            f"native CUDA helper: loaded, features={features:#x} (host-function wake-ups: "
            f"{bool(features & FEATURE_HOST_WAKE)}, batched memcpy: "
            f"{bool(features & FEATURE_BATCH_MEMCPY)})"
        )
        if not features & FEATURE_HOST_WAKE:
            lib = None

    log("calibrating the GPU ...")
    try:
        gpu = Gpu(opts.kinds, max(opts.lengths_us))
    except Exception as exc:
        print(f"error: GPU setup failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    log(f"torch.cuda._sleep: {gpu.cycles_per_us:.1f} cycles/us")
    if "copy" in opts.kinds:
        log(f"D2H copy into pinned memory: {gpu.copy_gbps:.1f} GB/s")
    jobs = [gpu.job(kind, us) for kind in opts.kinds for us in opts.lengths_us]
    for job in jobs:
        size = f", {job.nbytes / 2**20:.1f} MiB" if job.nbytes else ""
        log(f"job {job.label}: {job.gpu_us:.1f} us on the GPU{size}")

    names = [name for name in MECHANISMS if name in opts.mechanisms]
    mechs = [make_mechanism(name, gpu, lib, opts) for name in names]
    skipped: dict[str, str] = {}
    for m in mechs:
        reason = m.unavailable()
        if reason:
            skipped[m.name] = reason
            log(f"mechanism {m.name}: SKIPPED, {reason}")
        else:
            log(f"mechanism {m.name}: {m.description}")
    mechs = [m for m in mechs if m.name not in skipped]
    cupy_version = next((m.version for m in mechs if isinstance(m, PyHostFunc)), None)

    log("reference: main thread spinning on event.query() ...")
    refs: dict[str, list[float]] = {}
    for job in jobs:
        refs[job.label] = spin_reference(gpu, job, opts.samples)
        ref = refs[job.label]
        log(
            f"reference {job.label}: p50 {statistics.median(ref):.1f} us, "
            f"p99 {pct(ref, 99):.1f} us (+{pct(ref, 99) - statistics.median(ref):.1f})"
        )

    env: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "uvloop": uv_version,
        "cupy": cupy_version,
        "native_helper": helpers is not None,
        "native_features": features,
        "host_function_wakeups": bool(features & FEATURE_HOST_WAKE),
        "sleep_cycles_per_us": gpu.cycles_per_us,
        "copy_gbps": gpu.copy_gbps,
        "switch_interval_s": sys.getswitchinterval(),
        "options": dataclasses.asdict(opts),
        "skipped": skipped,
    }
    reference = [
        {
            "job": j.kind,
            "length_us": j.length_us,
            "gpu_us": j.gpu_us,
            "nbytes": j.nbytes,
            "p50_us": statistics.median(refs[j.label]),
            "p99_us": pct(refs[j.label], 99),
            "samples_us": [round(x, 1) for x in refs[j.label]],
        }
        for j in jobs
    ]
    rows: list[Row] = []

    def payload() -> dict[str, object]:
        return {
            "env": env,
            "reference": reference,
            "rows": [dataclasses.asdict(r) for r in rows],
        }

    # Mechanism by mechanism, the rejected (riskiest) last: a hang the watchdog ends costs
    # only the rows of the mechanism that hung.
    first_kind = opts.kinds[:1]
    log(f"watchdog: {opts.watchdog_s:g} s per mechanism and loop")
    for mech in mechs:
        for loop_name in opts.loops:
            mjobs = [j for j in jobs if j.kind in first_kind] if mech.name in REJECTED else jobs
            log(f"--- {mech.name} on {loop_name} ---")
            faulthandler.dump_traceback_later(opts.watchdog_s, exit=True)
            try:
                rows += loops.run(
                    run_mechanism(mech, loop_name, mjobs, refs, opts),
                    use_uvloop=loop_name == "uvloop",
                )
            except Exception as exc:
                log(f"{mech.name} on {loop_name}: FAILED {type(exc).__name__}: {exc}")
            finally:
                faulthandler.cancel_dump_traceback_later()
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            write_json(opts.json_path, payload())

    log("reference again (drift check) ...")
    drift = []
    for job in jobs:
        again = spin_reference(gpu, job, max(20, opts.samples // 3))
        before = statistics.median(refs[job.label])
        after = statistics.median(again)
        drift.append({"job": job.kind, "length_us": job.length_us, "p50_us_after": after})
        log(f"reference {job.label}: p50 {before:.1f} -> {after:.1f} us ({after - before:+.1f})")
    env["reference_after"] = drift

    for r in rows:
        judge(r)
    log("")
    log(
        "Overheads are over the spinning reference's median (enqueue -> done seen); "
        "'end->callback': host-function stamp -> bridge callback (ours-eventfd only). "
        "Busy loop: busy chunks started between the job's end and the callback (deliver) "
        f"/ the coroutine resuming; {opts.busy_ms:g} ms of Python between yields; the job's "
        "end is the host-function stamp for ours-eventfd, else submit time + the reference "
        "median; resuming usually takes one iteration more than delivery (a resolved future "
        "wakes its task with call_soon, behind the busy task). CPU: process CPU time / wall "
        "time, all threads, on an idle loop, while awaiting back-to-back jobs (waiting) and "
        "over submit + wait."
    )
    log("")
    log(table(rows, opts))
    ours = [r for r in rows if r.targets]
    if ours:
        verdicts = [v for r in ours for v in r.targets.values()]
        log("")
        log(
            f"ours-eventfd / ours-spin targets: {sum(verdicts)}/{len(verdicts)} PASS "
            f"(idle uvloop +p50 <= {TARGET_P50_US:g} us, +p99 <= {TARGET_P99_US:g} us; busy "
            f"loop: delivered within {TARGET_ITERATIONS} iteration, never starved; CPU < "
            f"{TARGET_CPU_CORES:g} cores waiting for a 2 ms job)"
        )
    elif "ours-eventfd" in skipped:
        log(f"ours-eventfd targets: NOT MEASURED ({skipped['ours-eventfd']})")
    write_json(opts.json_path, payload())
    if opts.json_path:
        log(f"wrote {opts.json_path}")
    log(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
