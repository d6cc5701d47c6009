"""Soak: one engine under a steady workload for minutes or hours, watched for leaks and stalls.

An engine on the CPU backend serves a paced stream of synthetic multi-turn sessions
(:func:`asyncoffload.workloads.synthetic_sessions`, 16-token blocks): each request looks
up its prefix, loads the hits, "computes" the rest (a sleep per block) and stores it.
Every ``--cancel-every``-th request is cancelled at a random point (the copies it
started still finish; its KV blocks are reused only after they have), and every
``--fail-every``-th copy submission fails (the engine reports it through the handle).
Attached the whole time:

- an ``engine.events()`` subscriber that reads every event;
- a ``KVEventPublisher`` (PUB + ROUTER replay on 127.0.0.1) with a real ZMQ SUB in a
  thread that keeps a router's block index, fills sequence gaps by replay, and every
  ``--replay-every`` seconds a fresh DEALER that replays the last batches;
- ``EngineMetrics`` served over HTTP and scraped every ``--scrape-every`` seconds;
- every ``--churn-every`` seconds a second, short-lived engine with its own publisher and
  subscriber is made, used and closed (resources per lifecycle must come back);
- a ticker that measures loop lag: how late a 10 ms sleep wakes up.

Every ``--sample-every`` seconds it records RSS, open fds, OS threads, Python threads,
pymalloc blocks, the loop lag of the period (p50 / p99 / max), full GC collections and
the longest collection (a full one walks every tracked object: ``--gc-freeze`` takes
what start-up made out of that walk), transfers done and ``stats().in_flight``. At the
end (after ``--warmup``) it judges:

- RSS: least-squares slope (MiB/hour) over the samples after warm-up; a leak when the
  slope exceeds ``--rss-slope-max`` *and* RSS grew by more than ``--rss-min-growth`` MiB
  (a smoke run is too short to tell a slope of a few MiB/hour from noise);
- fds, OS threads and Python threads: the minimum over the first and the last tenth of
  the samples after warm-up (at least 3 samples each) must be equal: transient ones (a
  scrape's server thread, a replay's socket) are ignored, anything that stays counts;
- loop lag: p99 and max after warm-up under ``--lag-p99-max-ms`` / ``--lag-max-ms``;
- no stall (transfers progress in every ``--stall-s`` window), no slot left pinned or
  being written once drained, no extra event subscription, a router index equal to
  the engine's resident blocks, and closing within 30 s.

It prints a table, writes ``--json`` and ``--plot`` (four panels over time: RSS; fds and
threads; loop lag; transfer rate and in-flight) and exits 1 when any check failed.
Linux only (it reads /proc/self). Results: docs/benchmarks.md.

    .venv/bin/python benchmarks/soak.py --smoke --plot soak.png     # 3 minutes
    .venv/bin/python benchmarks/soak.py --duration 3600 --json soak.json --plot soak.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import itertools
import json
import logging
import math
import mmap
import os
import random
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch
import zmq
from control_plane import machine_info

import asyncoffload as ao
from asyncoffload.integrations.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventsConfig,
    decode_batch,
)
from asyncoffload.integrations.prometheus import EngineMetrics
from asyncoffload.workloads import Request, synthetic_sessions

MIB = 1 << 20
BLOCK_TOKENS = 16
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: Shutdown steps that take longer than this count as a hang.
_CLOSE_TIMEOUT_S = 30.0
LEAK_KINDS = ("fd", "thread", "memory")


# --- process probes ----------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * _PAGE


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# --- loop lag ----------------------------------------------------------------------------


class LagHistogram:
    """Counts of lags (ns) in log-linear buckets (16 per power of two): percentiles
    within about 3% at any run length, in constant memory."""

    SUB = 16

    def __init__(self) -> None:
        self.counts = [0] * (64 * self.SUB)
        self.n = 0
        self.max_ns = 0

    def _bucket(self, ns: int) -> int:
        if ns < self.SUB:
            return max(ns, 0)
        shift = ns.bit_length() - 5  # SUB = 2**4 sub-buckets
        return (shift + 1) * self.SUB + ((ns >> shift) - self.SUB)

    def _upper_ns(self, index: int) -> float:
        if index < self.SUB:
            return float(index)
        shift = index // self.SUB - 1
        return float((self.SUB + index % self.SUB + 1) << shift)

    def add(self, ns: int) -> None:
        self.counts[self._bucket(ns)] += 1
        self.n += 1
        self.max_ns = max(self.max_ns, ns)

    def percentile_ms(self, q: float) -> float:
        """Upper bound of the bucket holding the ``q``-th percentile; NaN when empty."""
        if not self.n:
            return math.nan
        rank = min(self.n - 1, max(0, math.ceil(q / 100 * self.n) - 1))
        seen = 0
        for index, c in enumerate(self.counts):
            seen += c
            if seen > rank:
                return min(self._upper_ns(index), self.max_ns) / 1e6
        return self.max_ns / 1e6  # pragma: no cover - counts are consistent

    def clear(self) -> None:
        self.counts = [0] * len(self.counts)
        self.n = 0
        self.max_ns = 0


class GcWatch:
    """Collections of the cyclic garbage collector (``gc.callbacks``): how many of the
    oldest generation, and the longest pause since the last :meth:`take_period`. A full
    collection walks every tracked object (torch imports hundreds of thousands), so it
    stalls the loop."""

    def __init__(self) -> None:
        self.full = 0
        self.period_max_ns = 0
        self.total_max_ns = 0
        self._started = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
            return
        pause = time.perf_counter_ns() - self._started
        self.period_max_ns = max(self.period_max_ns, pause)
        self.total_max_ns = max(self.total_max_ns, pause)
        if info.get("generation") == 2:
            self.full += 1

    def take_period(self) -> float:
        """Longest pause (ms) since the last call."""
        out = self.period_max_ns / 1e6
        self.period_max_ns = 0
        return out


class LagTicker:
    """Sleeps ``interval_s`` over and over and records how late each wake-up is: the
    time a ready callback waits for the loop (plus the timer's own granularity, about
    1 ms under uvloop)."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.period = LagHistogram()  # since the last sample
        self.total = LagHistogram()  # after warm-up
        self.recording = False

    async def run(self) -> None:
        interval_ns = int(self.interval_s * 1e9)
        while True:
            due = time.perf_counter_ns() + interval_ns
            await asyncio.sleep(self.interval_s)
            lag = max(0, time.perf_counter_ns() - due)
            self.period.add(lag)
            if self.recording:
                self.total.add(lag)

    def take_period(self) -> tuple[float, float, float]:
        """p50, p99 and max (ms) since the last call; then starts a new period."""
        p = self.period
        out = (p.percentile_ms(50), p.percentile_ms(99), p.max_ns / 1e6 if p.n else math.nan)
        p.clear()
        return out


# --- options and records -----------------------------------------------------------------


@dataclass
class SoakOptions:
    duration_s: float = 3600.0
    warmup_s: float = 300.0
    sample_every_s: float = 10.0
    loop: str = "uvloop"
    copy_engine: str = "auto"
    policy: str = "lru"
    cpu_blocks: int = 8192
    layers: int = 2
    rate: float = 200.0  # requests per second
    concurrency: int = 32
    max_blocks: int = 32  # keys per request, at most
    compute_us_per_block: float = 200.0
    cancel_every: int = 50
    fail_every: int = 997
    publish: bool = True
    replay_every_s: float = 20.0
    replay_buffer: int = 2000
    scrape_every_s: float = 5.0
    churn_every_s: float = 30.0
    seed: int = 0
    rss_slope_max: float = 10.0  # MiB per hour
    rss_min_growth: float = 4.0  # MiB
    lag_p99_max_ms: float = 50.0
    lag_max_ms: float = 1000.0
    stall_s: float = 30.0
    gc_freeze: bool = False
    inject_leak: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Sample:
    t_s: float
    rss_mib: float
    fds: int
    os_threads: int
    py_threads: int
    py_blocks: int
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    #: Full (generation 2) collections so far, and the longest collection of the period.
    gc_full: int
    gc_max_ms: float
    transfers: int
    failed: int
    in_flight: int
    requests: int
    events: int


@dataclass
class Counters:
    requests: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    loaded_blocks: int = 0
    computed_blocks: int = 0
    events: int = 0
    event_keys: int = 0
    lagged: int = 0
    scrapes: int = 0
    scrape_errors: int = 0
    churns: int = 0
    churn_errors: int = 0
    #: Engine warnings about injected failures (counted, not printed).
    hidden_warnings: int = 0


@dataclass
class SoakResult:
    options: SoakOptions
    samples: list[Sample]
    counters: Counters
    #: Probes before anything was made, and after everything was closed.
    before: dict[str, float]
    after: dict[str, float]
    #: OS threads by name, before start and after close.
    threads_before: dict[str, int]
    threads_after: dict[str, int]
    #: End-of-run checks: name -> (passed, what was seen).
    checks: dict[str, tuple[bool, str]]
    reader: dict[str, int]
    publisher: dict[str, int]
    engine: dict[str, float]
    wall_s: float
    #: Loop lag of every ticker wake-up after warm-up.
    lag: LagHistogram


# --- the workload ------------------------------------------------------------------------


class FlakyBackend(ao.TransferBackend):
    """A CPU backend whose every ``fail_every``-th submission raises (an injected copy
    failure: the engine turns it into a failed job and a ``TransferError``)."""

    def __init__(self, inner: ao.CpuCopyBackend, fail_every: int) -> None:
        super().__init__(inner.layout, inner.num_host_blocks)
        self.inner = inner
        self.name = inner.name
        self.can_wake = inner.can_wake
        self.fail_every = fail_every
        self.submitted = 0
        self.injected = 0

    def bind(self, wake: Any, wake_fd: int | None = None) -> None:
        super().bind(wake, wake_fd)
        self.inner.bind(wake, wake_fd)

    def _maybe_fail(self) -> None:
        self.submitted += 1
        if self.fail_every and self.submitted % self.fail_every == 0:
            self.injected += 1
            raise OSError("injected copy failure (soak)")

    def submit_store(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> ao.CopyJob:
        if gpu_ids:
            self._maybe_fail()
        return self.inner.submit_store(gpu_ids, host_ids)

    def submit_load(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> ao.CopyJob:
        if gpu_ids:
            self._maybe_fail()
        return self.inner.submit_load(host_ids, gpu_ids)

    def read_host_block(self, host_id: int) -> bytes:
        return self.inner.read_host_block(host_id)

    def describe(self) -> dict[str, object]:
        return {**self.inner.describe(), "injected_failures": self.injected}

    def close(self) -> None:
        self.inner.close()


def make_kv(layers: int, gpu_blocks: int) -> list[torch.Tensor]:
    """``layers`` tensors ``[2, gpu_blocks, 16, 1, 16]`` fp16: 1 KiB per block and layer."""
    return [
        torch.zeros((2, gpu_blocks, BLOCK_TOKENS, 1, 16), dtype=torch.float16)
        for _ in range(layers)
    ]


def make_engine(
    opts: SoakOptions, gpu_blocks: int, cpu_blocks: int, fail_every: int
) -> ao.AsyncOffloadEngine:
    kv = make_kv(opts.layers, gpu_blocks)
    layout = ao.KVLayout.infer(kv)
    inner = ao.CpuCopyBackend(kv, layout, cpu_blocks, opts.copy_engine)  # type: ignore[arg-type]
    config = ao.EngineConfig(cpu_blocks=cpu_blocks, policy=opts.policy, event_buffer=65_536)
    return ao.AsyncOffloadEngine(kv, config, layout=layout, backend=FlakyBackend(inner, fail_every))


def requests_forever(seed: int, chunk: int = 100) -> Iterator[Request]:
    """Synthetic sessions, ``chunk`` requests at a time (about 3 ms of loop time each),
    each chunk under a fresh seed (so keys never repeat across chunks and memory stays
    bounded); a session's next turn comes about 15 requests after the last."""
    for k in range(seed << 32, (seed + 1) << 32):
        yield from synthetic_sessions(
            chunk,
            block_size=BLOCK_TOKENS,
            system_prompt_blocks=4,
            blocks_per_turn=6.0,
            output_blocks=1.0,
            mean_turns=4.0,
            think_time_s=5.0,
            seed=k,
        )


class Workload:
    """Paced requests against ``engine``; each of ``concurrency`` slots owns
    ``max_blocks`` KV blocks and serves one request at a time."""

    def __init__(self, engine: ao.AsyncOffloadEngine, opts: SoakOptions, counters: Counters):
        self.engine = engine
        self.opts = opts
        self.c = counters
        self.rng = random.Random(opts.seed)
        self.requests = requests_forever(opts.seed)
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(opts.concurrency):
            self.free.put_nowait(slot)
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        period = 1.0 / self.opts.rate
        next_t = loop.time()
        while not stop.is_set():
            slot = await self.free.get()
            if stop.is_set():
                break
            req = next(self.requests)
            self.c.requests += 1
            task = asyncio.create_task(self._request(req, slot, self.c.requests))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            next_t += period
            now = loop.time()
            if next_t < now - 1.0:  # fell behind by over a second: do not burst
                next_t = now
            if next_t > now:
                await asyncio.sleep(next_t - now)

    async def drain(self) -> None:
        while self.tasks:
            await asyncio.gather(*list(self.tasks))

    async def _request(self, req: Request, slot: int, number: int) -> None:
        handles: list[ao.Transfer] = []
        inner = asyncio.create_task(self._serve(req, slot, handles))
        every = self.opts.cancel_every
        if every and number % every == 0:
            delay = self.rng.uniform(0, 0.004)
            asyncio.get_running_loop().call_later(delay, inner.cancel)
        try:
            await asyncio.wait([inner])
            if inner.cancelled():
                self.c.cancelled += 1
            else:
                inner.result()  # an exception here is a bug: let it show
        finally:
            # The slot's KV blocks are reusable once every copy it started has ended.
            for handle in handles:
                with contextlib.suppress(ao.TransferError):
                    await handle
            self.free.put_nowait(slot)

    async def _serve(self, req: Request, slot: int, handles: list[ao.Transfer]) -> None:
        engine = self.engine
        ctx = ao.ReqContext(req_id=req.req_id)
        keys = list(req.keys[: self.opts.max_blocks])
        base = slot * self.opts.max_blocks
        gpu = list(range(base, base + len(keys)))
        hit = engine.lookup(keys, ctx)
        if hit:
            handle = await engine.prepare_load(keys[:hit], gpu[:hit], ctx)
            handles.append(handle)
            try:
                await handle
                self.c.loaded_blocks += hit
            except ao.TransferError:
                self.c.failed += 1
                hit = 0  # recompute everything
        todo = len(keys) - hit
        self.c.computed_blocks += todo
        await asyncio.sleep(todo * self.opts.compute_us_per_block * 1e-6)
        if todo:
            store = await engine.prepare_store(keys[hit:], gpu[hit:], ctx)
            if store is None:
                self.c.rejected += 1
                return
            handles.append(store)
            try:
                await store
            except ao.TransferError:
                self.c.failed += 1


async def consume(sub: ao.EventSubscription, c: Counters) -> None:
    async for item in sub:
        if isinstance(item, ao.Lagged):
            c.lagged += item.missed
        else:
            c.events += 1
            c.event_keys += len(item.keys)


# --- the ZMQ consumer: SUB + gap-filling replay, and periodic DEALER replays ---------------


class ZmqReader(threading.Thread):
    """A KV-aware router's view of the publisher: a SUB socket keeping an index of the
    blocks the tier holds, filling sequence gaps from the replay socket, plus a fresh
    DEALER that replays the recent batches every ``replay_every_s``."""

    def __init__(self, endpoint: str, replay_endpoint: str, replay_every_s: float) -> None:
        super().__init__(name="soak-zmq-reader", daemon=True)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_every_s = replay_every_s
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.index: set[bytes] = set()
        self.expected = 0  # next sequence number to apply
        self.stats = {
            "batches": 0,
            "gaps": 0,
            "gap_batches_filled": 0,
            "unfilled_gaps": 0,
            "replays": 0,
            "replayed_batches": 0,
            "replay_errors": 0,
            "clears": 0,
        }
        self.error: BaseException | None = None
        #: What went wrong with replays, first ones (at most 10).
        self.problems: list[str] = []

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported in the checks
            self.error = exc
        finally:
            self.ctx.destroy(linger=0)

    def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.connect(self.endpoint)
        next_replay = time.monotonic() + 1.0  # one early: lazily made resources exist
        try:
            while not self.stop.is_set():
                if sub.poll(50):
                    while True:
                        try:
                            _topic, seq_b, payload = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(int.from_bytes(seq_b, "big"), payload)
                if self.replay_every_s and time.monotonic() >= next_replay:
                    next_replay = time.monotonic() + self.replay_every_s
                    self._periodic_replay()
        finally:
            sub.close(linger=0)

    def _receive(self, seq: int, payload: bytes) -> None:
        if seq < self.expected:
            return  # already applied from a replay
        if seq > self.expected:
            self.stats["gaps"] += 1
            for rseq, rpayload in self._replay(self.expected):
                if self.expected <= rseq < seq:
                    if rseq != self.expected:
                        break
                    self._apply(rseq, rpayload)
                    self.stats["gap_batches_filled"] += 1
            if self.expected != seq:
                self.stats["unfilled_gaps"] += 1
                self.expected = seq
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch: KVEventBatch = decode_batch(payload)
        with self.lock:
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self.index.clear()
                    self.stats["clears"] += 1
                elif isinstance(event, BlockStored):
                    self.index.update(h for h in event.block_hashes if isinstance(h, bytes))
                elif isinstance(event, BlockRemoved):
                    self.index.difference_update(
                        h for h in event.block_hashes if isinstance(h, bytes)
                    )
            self.expected = seq + 1
            self.stats["batches"] += 1

    def _replay(self, start: int, timeout_s: float = 5.0) -> list[tuple[int, bytes]]:
        """Every batch the publisher still holds from ``start`` on (a fresh DEALER)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000)):
                    self.stats["replay_errors"] += 1
                    self.problems.append(f"replay from {start}: no end marker in {timeout_s} s")
                    break
                frames = dealer.recv_multipart()
                seq_b, payload = frames[-2], frames[-1]
                if seq_b == END_SEQ:
                    if payload:
                        self.stats["replay_errors"] += 1
                        self.problems.append(f"replay from {start}: {payload[:200]!r}")
                    break
                out.append((int.from_bytes(seq_b, "big"), payload))
        finally:
            dealer.close(linger=0)
        self.stats["replays"] += 1
        self.stats["replayed_batches"] += len(out)
        return out

    def _periodic_replay(self) -> None:
        start = max(0, self.expected - 100)
        got = self._replay(start)
        seqs = [s for s, _ in got]
        if seqs and seqs != list(range(seqs[0], seqs[0] + len(seqs))):
            self.stats["replay_errors"] += 1
            self.problems.append(f"replay from {start}: sequence numbers not contiguous")
        for _, payload in got:  # well-formed, or decode_batch raises
            decode_batch(payload)

    def snapshot(self) -> tuple[int, set[bytes]]:
        with self.lock:
            return self.expected, set(self.index)


# --- Prometheus scrapes and engine churn --------------------------------------------------


def scrape_loop(url: str, every_s: float, stop: threading.Event, c: Counters) -> None:
    while not stop.wait(every_s if c.scrapes + c.scrape_errors else 0.5):
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = resp.read()
            if resp.status != 200 or b"asyncoffload_transfers_total" not in body:
                raise ValueError(f"status {resp.status}, {len(body)} bytes")
            c.scrapes += 1
        except Exception:
            c.scrape_errors += 1


async def churn_once(opts: SoakOptions) -> None:
    """A second engine with a publisher and a subscriber: made, used, closed."""
    engine = make_engine(opts, gpu_blocks=16, cpu_blocks=64, fail_every=0)
    async with engine:
        sub = engine.events()
        cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        async with KVEventPublisher(engine, cfg):
            keys = [ao.make_offload_key(os.urandom(16)) for _ in range(128)]
            for i in range(0, 128, 8):
                handle = await engine.prepare_store(keys[i : i + 8], list(range(8)))
                if handle is not None:
                    await handle
            n = engine.lookup(keys[-8:])
            await (await engine.prepare_load(keys[-8:][:n], list(range(8, 8 + n))))
            while True:
                try:
                    sub.receive_nowait()
                except asyncio.QueueEmpty:
                    break
        sub.close()


async def churn_loop(opts: SoakOptions, c: Counters) -> None:
    await asyncio.sleep(0.5)  # one early: lazily made resources exist before warm-up ends
    while True:
        try:
            await churn_once(opts)
            c.churns += 1
        except Exception:
            c.churn_errors += 1
        await asyncio.sleep(opts.churn_every_s)


async def snapshot_churn(engine: ao.AsyncOffloadEngine) -> int:
    """A snapshot subscription read to its end and closed: how many keys it held."""
    sub = engine.events(snapshot=True)
    n = 0
    while True:
        try:
            item = sub.receive_nowait()
        except asyncio.QueueEmpty:
            break
        if isinstance(item, ao.Lagged) or not item.snapshot:
            break
        n += len(item.keys)
    sub.close()
    return n


# --- the run -----------------------------------------------------------------------------


def thread_names() -> dict[str, int]:
    """Python threads by name, and the OS threads that are no Python thread (copy lanes,
    ZMQ and torch threads) as ``"(native)"``, for the report."""
    names: dict[str, int] = {}
    for thread in threading.enumerate():
        name = thread.name.split(" (")[0]  # "Thread-3 (target)": one name per target
        names[name] = names.get(name, 0) + 1
    native = os_threads() - sum(names.values())
    if native:
        names["(native)"] = native
    return dict(sorted(names.items()))


class _InjectedFailures(logging.Filter):
    """Counts and hides the engine's warnings about the soak's own injected failures."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "injected copy failure" in record.getMessage():
            self.hidden += 1
            return False
        return True


def _probe() -> dict[str, float]:
    return {
        "rss_mib": rss_bytes() / MIB,
        "fds": open_fds(),
        "os_threads": os_threads(),
        "py_threads": threading.active_count(),
    }


class Leaker:
    """Test-only: leaks one of each ``kinds`` per sample, so the judge can be checked."""

    def __init__(self, kinds: Sequence[str]) -> None:
        self.kinds = tuple(kinds)
        self.fds: list[int] = []
        self.blobs: list[mmap.mmap] = []
        self.gate = threading.Event()
        self.threads: list[threading.Thread] = []

    def leak(self) -> None:
        if "fd" in self.kinds:
            self.fds.append(os.open(os.devnull, os.O_RDONLY))
        if "thread" in self.kinds:
            thread = threading.Thread(target=self.gate.wait, name="soak-leak", daemon=True)
            thread.start()
            self.threads.append(thread)
        if "memory" in self.kinds:
            # Fresh anonymous pages, every one touched: RSS must grow by the full MiB.
            # (A bytes object could land in heap memory the process had freed, already
            # resident, and RSS would not show the leak.)
            blob = mmap.mmap(-1, MIB)
            blob.write(b"\x5a" * MIB)
            self.blobs.append(blob)

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.gate.set()
        for thread in self.threads:
            thread.join()
        self.fds.clear()
        for blob in self.blobs:
            blob.close()
        self.blobs.clear()
        self.threads.clear()


async def soak(opts: SoakOptions, progress: TextIO | None = sys.stderr) -> SoakResult:
    """Run the soak for ``opts.duration_s`` and return what was recorded (not judged)."""
    t_start = time.monotonic()
    before = _probe()
    threads_before = thread_names()
    hide = _InjectedFailures()
    logging.getLogger("asyncoffload").addFilter(hide)
    gc_watch = GcWatch()
    gc.callbacks.append(gc_watch)
    counters = Counters()
    checks: dict[str, tuple[bool, str]] = {}
    engine = make_engine(opts, opts.concurrency * opts.max_blocks, opts.cpu_blocks, opts.fail_every)
    leaker = Leaker(opts.inject_leak)
    ticker = LagTicker()
    stop_threads = threading.Event()
    background: list[asyncio.Task[Any]] = []
    samples: list[Sample] = []
    reader: ZmqReader | None = None
    publisher: KVEventPublisher | None = None
    metrics: EngineMetrics | None = None
    scraper: threading.Thread | None = None
    workload = Workload(engine, opts, counters)
    stop = asyncio.Event()
    engine_closed = False
    consumer: asyncio.Task[None] | None = None
    try:
        await engine.__aenter__()
        consumer = asyncio.create_task(consume(engine.events(), counters), name="soak-consumer")
        background.append(asyncio.create_task(ticker.run(), name="soak-ticker"))
        if opts.publish:
            cfg = KVEventsConfig(
                endpoint="tcp://127.0.0.1:*",
                replay_endpoint="tcp://127.0.0.1:*",
                topic="soak",
                buffer_steps=opts.replay_buffer,
            )
            publisher = KVEventPublisher(engine, cfg)
            await publisher.start()
            assert publisher.replay_endpoint is not None
            reader = ZmqReader(publisher.endpoint, publisher.replay_endpoint, opts.replay_every_s)
            reader.start()
        if opts.scrape_every_s:
            metrics = EngineMetrics(engine, publishers=[publisher] if publisher else [])
            port = metrics.serve(0)
            scraper = threading.Thread(
                target=scrape_loop,
                args=(f"http://127.0.0.1:{port}/metrics", opts.scrape_every_s, stop_threads),
                kwargs={"c": counters},
                name="soak-scraper",
                daemon=True,
            )
            scraper.start()
        if opts.churn_every_s:
            background.append(asyncio.create_task(churn_loop(opts, counters), name="soak-churn"))
        if opts.gc_freeze:  # what is alive now is never walked by a collection again
            gc.collect()
            gc.freeze()
            # A full collection sizes the next ones by what it leaves (not frozen): until
            # one runs, the pre-freeze count would hold them off for a long while.
            gc.collect()
        driver = asyncio.create_task(workload.run(stop), name="soak-workload")

        t0 = time.monotonic()
        next_sample = t0 + opts.sample_every_s
        last_print = t0
        snapshots = 0
        while True:
            await asyncio.sleep(max(0.0, next_sample - time.monotonic()))
            now = time.monotonic()
            t = now - t0
            if not ticker.recording and t >= opts.warmup_s:
                ticker.recording = True
            if driver.done():
                driver.result()  # the workload died: raise what killed it
            leaker.leak()
            p50, p99, lag_max = ticker.take_period()
            s = engine.stats()
            probe = _probe()
            samples.append(
                Sample(
                    t_s=round(t, 3),
                    rss_mib=round(probe["rss_mib"], 3),
                    fds=int(probe["fds"]),
                    os_threads=int(probe["os_threads"]),
                    py_threads=int(probe["py_threads"]),
                    py_blocks=sys.getallocatedblocks(),
                    lag_p50_ms=round(p50, 3),
                    lag_p99_ms=round(p99, 3),
                    lag_max_ms=round(lag_max, 3),
                    gc_full=gc_watch.full,
                    gc_max_ms=round(gc_watch.take_period(), 3),
                    transfers=s.stores + s.loads - s.in_flight,
                    failed=s.transfers_failed,
                    in_flight=s.in_flight,
                    requests=counters.requests,
                    events=counters.events,
                )
            )
            if progress is not None and (now - last_print >= 10 or t >= opts.duration_s):
                last_print = now
                x = samples[-1]
                print(
                    f"t={t:7.1f}s rss {x.rss_mib:7.1f} MiB fds {x.fds:4d} threads "
                    f"{x.os_threads}/{x.py_threads} lag p99 {x.lag_p99_ms:6.2f} ms max "
                    f"{x.lag_max_ms:7.2f} ms gc2 {x.gc_full} transfers {x.transfers} in flight "
                    f"{x.in_flight}",
                    file=progress,
                    flush=True,
                )
            if opts.churn_every_s and int(t / opts.churn_every_s) > snapshots:
                snapshots += 1
                await snapshot_churn(engine)
            if t >= opts.duration_s:
                break
            # On the grid t0 + k * sample_every_s; ticks a stalled loop missed are skipped,
            # not caught up: samples taken back to back (the same millisecond, seen on a
            # busy machine) measure nothing.
            next_sample += opts.sample_every_s
            while next_sample <= time.monotonic() + 0.001:
                next_sample += opts.sample_every_s

        # --- drain and check ---
        stop.set()
        workload.free.put_nowait(-1)  # wake the driver if it waits for a slot
        try:
            await asyncio.wait_for(driver, _CLOSE_TIMEOUT_S)
            await asyncio.wait_for(workload.drain(), _CLOSE_TIMEOUT_S)
            checks["requests drain"] = (True, "every request finished")
        except asyncio.TimeoutError:
            checks["requests drain"] = (False, f"requests still running after {_CLOSE_TIMEOUT_S} s")
        s = engine.stats()
        m = s.manager
        checks["slots released"] = (
            s.in_flight == 0 and m.pinned == 0 and m.write_pending == 0,
            f"in flight {s.in_flight}, pinned {m.pinned}, writing {m.write_pending}, "
            f"ready {m.ready} + free {m.free} of {m.num_blocks}",
        )
        want_subs = 2 if publisher is not None else 1
        checks["subscriptions"] = (
            s.subscribers == want_subs,
            f"{s.subscribers} live subscriptions (expected {want_subs})",
        )
        if publisher is not None and reader is not None:
            last = publisher.stats().last_seq
            for _ in range(200):  # up to 10 s for the SUB to apply the last batch
                if reader.snapshot()[0] > last:
                    break
                await asyncio.sleep(0.05)
            applied, index = reader.snapshot()
            resident = {ao.get_offload_block_hash(k) for k in engine.manager.resident_keys()}
            exact = applied > last and index == resident and reader.error is None
            checks["router index"] = (
                exact,
                f"index {len(index)} blocks, tier {len(resident)}, "
                f"{len(index ^ resident)} differ, batches applied to {applied - 1} of {last}"
                + (f", reader error {reader.error!r}" if reader.error else ""),
            )
        engine_info = {
            "stores": s.stores,
            "loads": s.loads,
            "transfers_failed": s.transfers_failed,
            "stores_rejected": s.stores_rejected,
            "blocks_stored": s.blocks_stored,
            "blocks_loaded": s.blocks_loaded,
            "blocks_evicted": s.blocks_evicted,
            "events_published": s.events_published,
            "events_dropped": s.events_dropped,
            "callback_latency_p50_us": s.callback_latency_p50_us,
            "callback_latency_p99_us": s.callback_latency_p99_us,
            "lookup_hit_fraction": s.lookup_hits / s.lookup_keys if s.lookup_keys else 0.0,
        }
        pub_info = publisher.stats()._asdict() if publisher is not None else {}
    finally:
        stop.set()
        stop_threads.set()
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Joined off the loop: a scrape and a replay in progress need the loop to finish.
        if scraper is not None:
            await asyncio.to_thread(scraper.join, _CLOSE_TIMEOUT_S)
        if metrics is not None:
            await asyncio.to_thread(metrics.close)
        if reader is not None:  # before the publisher: a replay then would time out
            reader.stop.set()
            await asyncio.to_thread(reader.join, _CLOSE_TIMEOUT_S)
        if publisher is not None:
            await publisher.aclose()
        try:
            await asyncio.wait_for(engine.aclose(), _CLOSE_TIMEOUT_S)
            engine_closed = True
        except asyncio.TimeoutError:
            pass
        leaker.release()
        logging.getLogger("asyncoffload").removeFilter(hide)
        gc.callbacks.remove(gc_watch)
        if opts.gc_freeze:
            gc.unfreeze()
        counters.hidden_warnings = hide.hidden
    if reader is not None:
        errors = reader.stats["replay_errors"]
        checks["replays"] = (
            errors == 0,
            f"{reader.stats['replays']} replays, {errors} failed"
            + "".join(f"; {p}" for p in reader.problems[:3]),
        )
    checks["engine closed"] = (engine_closed, "aclose() returned" if engine_closed else "hung")
    if consumer is not None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(consumer, 5)
        checks["subscriber ended"] = (consumer.done(), f"read {counters.events} events")
    return SoakResult(
        options=opts,
        samples=samples,
        counters=counters,
        before=before,
        after=_probe(),
        threads_before=threads_before,
        threads_after=thread_names(),
        checks=checks,
        reader=dict(reader.stats) if reader is not None else {},
        publisher={k: int(v) for k, v in pub_info.items()},
        engine=engine_info,
        wall_s=time.monotonic() - t_start,
        lag=ticker.total,
    )


# --- the judge ---------------------------------------------------------------------------


@dataclass
class Verdict:
    rss_slope_mib_h: float
    rss_growth_mib: float
    rss_start_mib: float
    rss_end_mib: float
    py_blocks_slope_per_h: float
    fds: tuple[int, int]
    os_threads: tuple[int, int]
    py_threads: tuple[int, int]
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    #: Full collections after warm-up, and the longest collection (ms) then.
    gc_full: int
    gc_max_ms: float
    samples_judged: int
    window: int
    #: Every failed check, one line each; empty when the run passed.
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


def slope_per_hour(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``ts`` (seconds), per hour."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var * 3600


def judge(result: SoakResult) -> Verdict:
    """Judge a run (see the module docstring for what is checked)."""
    opts = result.options
    post = [s for s in result.samples if s.t_s >= opts.warmup_s]
    failures: list[str] = []
    if len(post) < 4:
        failures.append(f"only {len(post)} samples after warm-up: run longer or sample faster")
        post = result.samples[-4:] if len(result.samples) >= 4 else list(result.samples)
    window = max(3, len(post) // 10) if post else 0
    first, last = post[:window], post[-window:]

    ts = [s.t_s for s in post]
    rss = [s.rss_mib for s in post]
    rss_slope = slope_per_hour(ts, rss)
    blocks_slope = slope_per_hour(ts, [float(s.py_blocks) for s in post])
    median = _median
    rss_start = median([s.rss_mib for s in first]) if first else math.nan
    rss_end = median([s.rss_mib for s in last]) if last else math.nan
    growth = rss_end - rss_start
    if rss_slope > opts.rss_slope_max and growth > opts.rss_min_growth:
        failures.append(
            f"RSS grows {rss_slope:.1f} MiB/h (bound {opts.rss_slope_max:g}), "
            f"{growth:+.1f} MiB after warm-up"
        )

    def flat(name: str, values_first: list[int], values_last: list[int]) -> tuple[int, int]:
        start, end = min(values_first, default=0), min(values_last, default=0)
        if end > start:
            failures.append(f"{name}: {start} after warm-up, {end} at the end (a leak)")
        return start, end

    fds = flat("open fds", [s.fds for s in first], [s.fds for s in last])
    threads = flat("OS threads", [s.os_threads for s in first], [s.os_threads for s in last])
    py_threads = flat("Python threads", [s.py_threads for s in first], [s.py_threads for s in last])

    lag = result.lag
    if lag.n:
        p50, p99, lag_max = lag.percentile_ms(50), lag.percentile_ms(99), lag.max_ns / 1e6
    else:
        p50 = median([s.lag_p50_ms for s in post]) if post else math.nan
        p99 = max((s.lag_p99_ms for s in post), default=math.nan)
        lag_max = max((s.lag_max_ms for s in post), default=math.nan)
    if p99 > opts.lag_p99_max_ms:
        failures.append(f"loop lag p99 {p99:.1f} ms (bound {opts.lag_p99_max_ms:g} ms)")
    if lag_max > opts.lag_max_ms:
        failures.append(f"loop lag max {lag_max:.1f} ms (bound {opts.lag_max_ms:g} ms)")

    # Stalls: transfers must progress within every stall_s window after warm-up.
    j = 0
    for i, s in enumerate(post):
        while post[j].t_s < s.t_s - opts.stall_s:
            j += 1
        if j < i and s.t_s - post[j].t_s >= opts.stall_s and s.transfers == post[j].transfers:
            failures.append(f"no transfer completed from t={post[j].t_s:.0f}s to {s.t_s:.0f}s")
            break
    for name, (passed, seen) in result.checks.items():
        if not passed:
            failures.append(f"{name}: {seen}")
    c = result.counters
    if c.scrape_errors:
        failures.append(f"{c.scrape_errors} of {c.scrapes + c.scrape_errors} scrapes failed")
    if c.churn_errors:
        failures.append(f"{c.churn_errors} of {c.churns + c.churn_errors} engine churns failed")
    return Verdict(
        rss_slope_mib_h=rss_slope,
        rss_growth_mib=growth,
        rss_start_mib=rss_start,
        rss_end_mib=rss_end,
        py_blocks_slope_per_h=blocks_slope,
        fds=fds,
        os_threads=threads,
        py_threads=py_threads,
        lag_p50_ms=p50,
        lag_p99_ms=p99,
        lag_max_ms=lag_max,
        gc_full=post[-1].gc_full - post[0].gc_full if post else 0,
        gc_max_ms=max((s.gc_max_ms for s in post[1:]), default=0.0),
        samples_judged=len(post),
        window=window,
        failures=failures,
    )


def _median(xs: Sequence[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


# --- output ------------------------------------------------------------------------------


def report(result: SoakResult, v: Verdict) -> str:
    o, c = result.options, result.counters
    last = result.samples[-1] if result.samples else None
    lines = [f"{k:>13}: {val}" for k, val in machine_info(o.loop)]
    lines.append(
        f"{'workload':>13}: {o.rate:g} req/s paced, {o.concurrency} slots x {o.max_blocks} "
        f"blocks, {o.layers} layers (1 KiB per block and layer), cpu_blocks={o.cpu_blocks}, "
        f"policy={o.policy}, copy_engine={o.copy_engine}, cancel 1/{o.cancel_every}, "
        f"fail 1/{o.fail_every} submissions" + (", gc.freeze()" if o.gc_freeze else "")
    )
    lines.append(
        f"{'run':>13}: {o.duration_s:g} s ({result.wall_s:.0f} s wall), warm-up "
        f"{o.warmup_s:g} s, a sample every {o.sample_every_s:g} s, {v.samples_judged} judged, "
        f"windows of {v.window}"
    )
    if last is not None:
        lines.append(
            f"{'done':>13}: {c.requests} requests ({c.cancelled} cancelled), "
            f"{last.transfers} transfers ({last.failed} failed), {c.events} events read "
            f"({c.lagged} lagged), {result.reader.get('batches', 0)} batches via SUB, "
            f"{result.reader.get('replays', 0)} replays, {c.scrapes} scrapes, {c.churns} "
            f"engine churns, hit fraction {result.engine.get('lookup_hit_fraction', 0):.2f}"
        )
    lines += [
        "",
        "| metric | after warm-up | end | judged |",
        "|---|---:|---:|---|",
        f"| RSS MiB | {v.rss_start_mib:.1f} | {v.rss_end_mib:.1f} | slope "
        f"{v.rss_slope_mib_h:+.2f} MiB/h (bound {o.rss_slope_max:g}), growth "
        f"{v.rss_growth_mib:+.2f} MiB |",
        f"| open fds (min of window) | {v.fds[0]} | {v.fds[1]} | equal |",
        f"| OS threads (min of window) | {v.os_threads[0]} | {v.os_threads[1]} | equal |",
        f"| Python threads (min of window) | {v.py_threads[0]} | {v.py_threads[1]} | equal |",
        f"| loop lag ms p50 / p99 / max | | {v.lag_p50_ms:.2f} / {v.lag_p99_ms:.2f} / "
        f"{v.lag_max_ms:.1f} | p99 <= {o.lag_p99_max_ms:g}, max <= {o.lag_max_ms:g} |",
        f"| pymalloc blocks | | | slope {v.py_blocks_slope_per_h:+,.0f} /h (not judged) |",
        f"| GC full collections, longest collection | | {v.gc_full}, {v.gc_max_ms:.1f} ms | "
        "(not judged) |",
        "",
        f"before start: {_fmt_probe(result.before)}; after close: {_fmt_probe(result.after)}",
        f"OS threads before start: {_fmt_names(result.threads_before)}; after close: "
        f"{_fmt_names(result.threads_after)}",
    ]
    for name, (passed, seen) in result.checks.items():
        lines.append(f"check {name}: {'ok' if passed else 'FAILED'} ({seen})")
    lines.append("")
    lines.append("PASS" if v.ok else "FAIL:\n  " + "\n  ".join(v.failures))
    return "\n".join(lines)


def _fmt_probe(p: dict[str, float]) -> str:
    return (
        f"RSS {p['rss_mib']:.1f} MiB, {int(p['fds'])} fds, {int(p['os_threads'])} OS threads, "
        f"{int(p['py_threads'])} Python threads"
    )


def _fmt_names(names: dict[str, int]) -> str:
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in names.items())


def write_json(path: str, result: SoakResult, v: Verdict) -> None:
    out = {
        "machine": dict(machine_info(result.options.loop)),
        "options": asdict(result.options),
        "verdict": {**asdict(v), "ok": v.ok},
        "checks": {k: {"ok": ok, "seen": seen} for k, (ok, seen) in result.checks.items()},
        "counters": asdict(result.counters),
        "reader": result.reader,
        "publisher": result.publisher,
        "engine": result.engine,
        "before": result.before,
        "after": result.after,
        "threads_before": result.threads_before,
        "threads_after": result.threads_after,
        "wall_s": result.wall_s,
        "samples": [asdict(s) for s in result.samples],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=float)


def plot(path: str, result: SoakResult, v: Verdict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.samples
    o = result.options
    t = [x.t_s / 60 for x in s]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    ax = axes[0]
    ax.plot(t, [x.rss_mib for x in s], lw=1, label="RSS")
    post = [x for x in s if x.t_s >= o.warmup_s]
    if len(post) >= 2:
        mid_t = sum(x.t_s for x in post) / len(post)
        mid_y = sum(x.rss_mib for x in post) / len(post)
        ends = (post[0].t_s, post[-1].t_s)
        ax.plot(
            [e / 60 for e in ends],
            [mid_y + v.rss_slope_mib_h * (e - mid_t) / 3600 for e in ends],
            "--",
            lw=1,
            label=f"fit {v.rss_slope_mib_h:+.1f} MiB/h",
        )
    ax.set_ylabel("RSS MiB")
    ax.legend(loc="lower right", fontsize=8)
    ax = axes[1]
    ax.plot(t, [x.fds for x in s], lw=1, label="open fds")
    ax.plot(t, [x.os_threads for x in s], lw=1, label="OS threads")
    ax.plot(t, [x.py_threads for x in s], lw=1, label="Python threads")
    ax.set_ylabel("count")
    ax.legend(loc="center right", fontsize=8)
    ax = axes[2]
    ax.plot(t, [max(x.lag_p99_ms, 1e-3) for x in s], lw=1, label="p99 of sample period")
    ax.plot(t, [max(x.lag_max_ms, 1e-3) for x in s], lw=0.8, alpha=0.7, label="max")
    gc_points = [(ti, x.gc_max_ms) for ti, x in zip(t, s) if x.gc_max_ms >= 1]
    if gc_points:
        ax.plot(*zip(*gc_points), ".", ms=3, color="tab:red", label="longest GC pause")
    ax.set_yscale("log")
    ax.set_ylabel("loop lag ms")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[3]
    rates = [0.0] + [
        (b.transfers - a.transfers) / max(b.t_s - a.t_s, 1e-9) for a, b in itertools.pairwise(s)
    ]
    ax.plot(t, rates, lw=1, label="transfers/s")
    ax.set_ylabel("transfers/s")
    ax.set_xlabel("minutes")
    twin = ax.twinx()
    twin.plot(t, [x.in_flight for x in s], lw=0.8, color="tab:red", alpha=0.6, label="in flight")
    twin.set_ylabel("in flight")
    ax.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    for ax in axes:
        ax.axvspan(0, o.warmup_s / 60, color="0.9", zorder=-1)
        ax.grid(alpha=0.3)
    verdict = "PASS" if v.ok else "FAIL"
    fig.suptitle(
        f"soak {o.duration_s / 60:.0f} min, {o.loop}, {o.copy_engine}, {o.policy}: {verdict} "
        f"(grey: warm-up)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# --- command line ------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    default_loop = "uvloop" if ao.loops.uvloop_available() else "asyncio"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--duration", type=float, default=None, help="seconds (3600; smoke 180)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a 3-minute run: --duration 180 --warmup 60 --sample-every 2 (explicit options win)",
    )
    ap.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds not judged (300; smoke 60, at most 1/4 or 1/3 of the run)",
    )
    ap.add_argument("--sample-every", type=float, default=None, help="seconds (10; smoke 2)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default=default_loop)
    ap.add_argument("--copy-engine", choices=("auto", "native", "threads"), default="auto")
    ap.add_argument("--policy", choices=tuple(ao.available_policies()), default="lru")
    ap.add_argument("--cpu-blocks", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2, help="KV layers (1 KiB per block each)")
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second (200)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests served at once")
    ap.add_argument("--max-blocks", type=int, default=32, help="keys per request, at most")
    ap.add_argument("--compute-us-per-block", type=float, default=200.0)
    ap.add_argument("--cancel-every", type=int, default=50, help="cancel every n-th request")
    ap.add_argument("--fail-every", type=int, default=997, help="fail every n-th copy (0: none)")
    ap.add_argument("--no-publish", action="store_true", help="no KV-event publisher")
    ap.add_argument("--replay-every", type=float, default=20.0, help="DEALER replay period, s")
    ap.add_argument("--replay-buffer", type=int, default=2000, help="batches kept for replay")
    ap.add_argument("--scrape-every", type=float, default=5.0, help="Prometheus, s (0: none)")
    ap.add_argument("--churn-every", type=float, default=30.0, help="engine churn, s (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-slope-max", type=float, default=10.0, help="MiB/hour (10)")
    ap.add_argument("--rss-min-growth", type=float, default=4.0, help="MiB (4)")
    ap.add_argument("--lag-p99-max-ms", type=float, default=50.0)
    ap.add_argument("--lag-max-ms", type=float, default=1000.0)
    ap.add_argument("--stall-s", type=float, default=30.0, help="longest time without progress")
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() once set up: full collections skip what startup made",
    )
    ap.add_argument("--plot", metavar="PATH", help="write the four-panel plot (PNG)")
    ap.add_argument("--json", metavar="PATH", help="write samples and verdict")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument(
        "--inject-leak",
        action="append",
        choices=LEAK_KINDS,
        default=[],
        help="testing the judge: leak one fd / thread / MiB per sample",
    )
    args = ap.parse_args(argv)
    if args.duration is None:
        args.duration = 180.0 if args.smoke else 3600.0
    if args.warmup is None:
        args.warmup = min(60.0, args.duration / 3) if args.smoke else min(300.0, args.duration / 4)
    if args.sample_every is None:
        args.sample_every = 2.0 if args.smoke else 10.0
    if min(args.duration, args.sample_every, args.rate, args.concurrency, args.max_blocks) <= 0:
        ap.error("durations, rates and counts must be positive")
    if args.warmup >= args.duration:
        ap.error("--warmup must be shorter than --duration")
    if args.cpu_blocks < 2 * args.max_blocks:
        ap.error("--cpu-blocks must hold at least two requests")
    return args


def options(args: argparse.Namespace) -> SoakOptions:
    return SoakOptions(
        duration_s=args.duration,
        warmup_s=args.warmup,
        sample_every_s=args.sample_every,
        loop=args.loop,
        copy_engine=args.copy_engine,
        policy=args.policy,
        cpu_blocks=args.cpu_blocks,
        layers=args.layers,
        rate=args.rate,
        concurrency=args.concurrency,
        max_blocks=args.max_blocks,
        compute_us_per_block=args.compute_us_per_block,
        cancel_every=args.cancel_every,
        fail_every=args.fail_every,
        publish=not args.no_publish,
        replay_every_s=args.replay_every,
        replay_buffer=args.replay_buffer,
        scrape_every_s=args.scrape_every,
        churn_every_s=args.churn_every,
        seed=args.seed,
        rss_slope_max=args.rss_slope_max,
        rss_min_growth=args.rss_min_growth,
        lag_p99_max_ms=args.lag_p99_max_ms,
        lag_max_ms=args.lag_max_ms,
        stall_s=args.stall_s,
        gc_freeze=args.gc_freeze,
        inject_leak=list(args.inject_leak),
    )


async def run_and_judge(
    opts: SoakOptions, progress: TextIO | None = sys.stderr
) -> tuple[SoakResult, Verdict]:
    """:func:`soak`, then :func:`judge`."""
    result = await soak(opts, progress)
    return result, judge(result)


def main(argv: Sequence[str] | None = None) -> int:
    if not os.path.isdir("/proc/self/fd"):
        print("soak.py reads /proc/self: Linux only", file=sys.stderr)
        return 2
    args = parse_args(argv)
    opts = options(args)
    # A real hang (not one the run's own timeouts catch) dumps every stack and exits.
    faulthandler.dump_traceback_later(opts.duration_s + 600, exit=True, file=sys.__stderr__ or 2)
    try:
        result, verdict = ao.run(
            run_and_judge(opts, None if args.quiet else sys.stderr),
            use_uvloop=opts.loop == "uvloop",
        )
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(report(result, verdict))
    if args.json:
        write_json(args.json, result, verdict)
    if args.plot:
        plot(args.plot, result, verdict)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
