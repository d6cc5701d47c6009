"""Control-plane throughput: KV blocks per second through the engine vs the manager alone.

The KV tensors are tiny (one layer, ``[2, gpu_blocks, 1, 1, 8]`` fp16: 32 bytes a block),
so what is measured is bookkeeping, hand-offs and wake-ups, not memcpy. Paths:

- ``manager``: a standalone :class:`asyncoffload.CPUOffloadingManager` driven
  synchronously with the calls the engine makes of its own (store: lookup_prefix, touch,
  prepare_store, complete_store, take_events; load: lookup_prefix, prepare_load, touch,
  complete_load). No copy, no thread, no future: the baseline every ratio is taken
  against.
- ``engine`` with the CPU backend, as configured by default: the full path. A copy of
  at most ``inline_copy_bytes`` (64 KiB: every call here) runs on the loop thread at
  submission and completes at once; a larger one is handed to a copy lane (a native
  pthread, or a Python thread with ``--copy-engine threads``), whose completion comes
  back through the completion bridge.
- ``engine ..., lanes only``: the same with ``inline_copy_bytes=0``, every copy handed
  to a lane: what larger copies pay for the hop and the wake-up.
- ``engine`` with an inline backend: jobs complete at submission on the loop thread (no
  copy, no thread hop), which isolates the async facade.

Each engine path runs ``seq`` (one task awaiting every call) and ``conc`` (``--tasks``
tasks at once, so copies and wake-ups pipeline). The store workload offers only new keys
to a full tier, so every call evicts ``--blocks-per-call`` blocks and publishes a removed
and a stored event; one subscriber drains the engine's event stream and the timed region
ends when it has seen the last event. The load workload loads resident keys (and, like
the engine's default ``touch_on_load``, touches them).

Every repetition runs all paths in turn (so drift hits them alike); figures are medians
over ``--reps`` repetitions after ``--warmup``. Results: docs/benchmarks.md.

Run: ``.venv/bin/python benchmarks/control_plane.py [--loop uvloop|asyncio] [--policy lru|arc]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import math
import os
import platform
import statistics
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import asyncoffload as ao

# --- workload pieces ---------------------------------------------------------------------


def make_keys(start: int, n: int) -> list[ao.OffloadKey]:
    """``n`` distinct keys, numbered from ``start`` (group 0)."""
    return [ao.make_offload_key(i.to_bytes(8, "big")) for i in range(start, start + n)]


def tiny_kv(gpu_blocks: int) -> list[torch.Tensor]:
    """One layer, K/V split, 16 bytes per fragment: copies cost next to nothing."""
    return [torch.zeros((2, gpu_blocks, 1, 1, 8), dtype=torch.float16)]


class InlineBackend(ao.TransferBackend):
    """Every job has ended when ``submit_*`` or ``copy_now`` returns (``finish_inline``:
    no copy, no thread, no wake-up; the engine completes it at once)."""

    name = "inline"

    def _ended(self, n: int) -> ao.CopyJob:
        job = ao.CopyJob(n, n * self.layout.block_bytes)
        if hasattr(job, "finish_inline"):
            job.finish_inline()
        else:  # a checkout from before finish_inline (measured for before/after figures)
            job.finish()
            self._wake()
        return job

    def copy_now(
        self, store: bool, gpu_ids: Sequence[int], host_ids: Sequence[int]
    ) -> ao.CopyJob | None:
        # Every job ends at once: the engine may take its one-step path (a checkout
        # from before copy_now never calls this).
        return self._ended(len(gpu_ids))

    def submit_store(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> ao.CopyJob:
        return self._ended(len(gpu_ids))

    def submit_load(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> ao.CopyJob:
        return self._ended(len(gpu_ids))

    def read_host_block(self, host_id: int) -> bytes:
        return bytes(self.layout.block_bytes)

    def close(self) -> None:
        return None


class EventDrain:
    """The one subscriber: counts what it reads and remembers the last ``seq``."""

    def __init__(self, sub: ao.EventSubscription, last_seq: int) -> None:
        self.sub = sub
        self.events = 0
        self.keys = 0
        self.missed = 0
        self.last_seq = last_seq  # the subscription sees events after this one
        self._target = 0
        self._reached = asyncio.Event()

    async def run(self) -> None:
        async for item in self.sub:
            if isinstance(item, ao.Lagged):
                self.missed += item.missed
            else:
                self.events += 1
                self.keys += len(item.keys)
                self.last_seq = item.seq
                if item.seq >= self._target:
                    self._reached.set()

    async def caught_up(self, seq: int) -> None:
        """Return once the event numbered ``seq`` has been read."""
        if self.last_seq >= seq:
            return
        self._target = seq
        self._reached.clear()
        await self._reached.wait()


# --- paths -------------------------------------------------------------------------------


@dataclass
class Options:
    blocks_per_call: int
    calls: int
    cpu_blocks: int
    tasks: int
    policy: str
    completion: str
    copy_engine: str


@dataclass
class Path(ABC):
    """One measured path. ``prepare`` builds the next repetition's inputs (untimed);
    ``run`` does it and returns the elapsed seconds."""

    name: str
    op: str  # "store" or "load"
    opts: Options
    notes: dict[str, float] = field(default_factory=dict)

    async def setup(self) -> None:
        return None

    @abstractmethod
    def prepare(self) -> None: ...

    @abstractmethod
    async def run(self) -> float: ...

    async def teardown(self) -> None:
        return None


class StoreBatches:
    """New keys for every call; continues across repetitions so the tier stays full."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.next_key = opts.cpu_blocks  # keys [0, cpu_blocks) fill the tier in setup
        self.batches: list[list[ao.OffloadKey]] = []

    def prepare(self) -> None:
        bpc = self.opts.blocks_per_call
        self.batches = [make_keys(self.next_key + c * bpc, bpc) for c in range(self.opts.calls)]
        self.next_key += self.opts.calls * bpc


class LoadBatches:
    """Windows of ``blocks_per_call`` resident keys, visited round-robin."""

    def __init__(self, opts: Options) -> None:
        bpc = opts.blocks_per_call
        windows = max(1, opts.cpu_blocks // bpc)
        self.windows = [make_keys(w * bpc, bpc) for w in range(windows)]
        self.batches = [self.windows[c % windows] for c in range(opts.calls)]


class ManagerStore(Path):
    def __init__(self, opts: Options) -> None:
        super().__init__("manager", "store", opts)
        self.m = ao.CPUOffloadingManager(opts.cpu_blocks, opts.policy)
        self.ctx = ao.ReqContext("bench")
        self.feed = StoreBatches(opts)
        fill = self.m.prepare_store(make_keys(0, opts.cpu_blocks), self.ctx)
        assert fill is not None
        self.m.complete_store(fill.keys_to_store, self.ctx)
        self.m.take_events()

    def prepare(self) -> None:
        self.feed.prepare()

    async def run(self) -> float:
        m, ctx = self.m, self.ctx
        lookup, touch, prepare, complete, take = (
            m.lookup_prefix,
            m.touch,
            m.prepare_store,
            m.complete_store,
            m.take_events,
        )
        events = 0
        t0 = time.perf_counter()
        for keys in self.feed.batches:
            lookup(keys, ctx)
            touch(keys, ctx)  # as the engine's prepare_store does (touch_on_store)
            out = prepare(keys, ctx)
            if out is None:
                raise RuntimeError("manager store rejected: the tier has no idle block")
            complete(out.keys_to_store, ctx)
            for _ev in take():
                events += 1
        elapsed = time.perf_counter() - t0
        self.notes["events"] = events
        return elapsed


class ManagerLoad(Path):
    def __init__(self, opts: Options) -> None:
        super().__init__("manager", "load", opts)
        self.m = ao.CPUOffloadingManager(opts.cpu_blocks, opts.policy)
        self.ctx = ao.ReqContext("bench")
        self.feed = LoadBatches(opts)
        fill = self.m.prepare_store(make_keys(0, opts.cpu_blocks), self.ctx)
        assert fill is not None
        self.m.complete_store(fill.keys_to_store, self.ctx)
        self.m.take_events()

    def prepare(self) -> None:
        return None

    async def run(self) -> float:
        m, ctx, bpc = self.m, self.ctx, self.opts.blocks_per_call
        lookup, prepare, touch, complete = (
            m.lookup_prefix,
            m.prepare_load,
            m.touch,
            m.complete_load,
        )
        t0 = time.perf_counter()
        for keys in self.feed.batches:
            if lookup(keys, ctx) != bpc:
                raise RuntimeError("manager load: a resident key went missing")
            prepare(keys, ctx)
            touch(keys, ctx)
            complete(keys, ctx)
        return time.perf_counter() - t0


class EnginePath(Path):
    """Shared engine plumbing: one engine per path, one event subscriber."""

    def __init__(self, op: str, opts: Options, backend: str, concurrent: bool) -> None:
        super().__init__("engine", op, opts)
        self.concurrent = concurrent
        self.backend_name = backend
        self.ctx = ao.ReqContext("bench")
        gpu_blocks = opts.tasks * opts.blocks_per_call
        kv = tiny_kv(gpu_blocks)
        settings: dict[str, object] = {
            "cpu_blocks": opts.cpu_blocks,
            "policy": opts.policy,
            "completion": opts.completion,
            "copy_engine": opts.copy_engine,
        }
        if backend == "lanes" and "inline_copy_bytes" in ao.EngineConfig.model_fields:
            # Every copy on a copy thread: the hop the default skips for small copies.
            # (Before inline_copy_bytes, every copy went to a lane: the default path.)
            settings["inline_copy_bytes"] = 0
        cfg = ao.EngineConfig.model_validate(settings)
        layout = ao.KVLayout.infer(kv)
        backend_obj = InlineBackend(layout, opts.cpu_blocks) if backend == "inline" else None
        self.engine = ao.AsyncOffloadEngine(kv, cfg, layout=layout, backend=backend_obj)
        mode = f"conc x{opts.tasks}" if concurrent else "seq"
        name = self.engine.backend.name + (", lanes only" if backend == "lanes" else "")
        self.name = f"engine {name} {mode}"
        bpc = opts.blocks_per_call
        self.gpu = [list(range(t * bpc, (t + 1) * bpc)) for t in range(opts.tasks)]
        self.mechanism = "-"
        self.drain: EventDrain | None = None
        self.drain_task: asyncio.Task[None] | None = None

    async def setup(self) -> None:
        engine = await self.engine.__aenter__()
        # Fill the tier: the store workload then evicts on every call.
        bpc = self.opts.blocks_per_call
        keys = make_keys(0, self.opts.cpu_blocks)
        for start in range(0, len(keys), bpc):
            chunk = keys[start : start + bpc]
            handle = await engine.prepare_store(chunk, self.gpu[0][: len(chunk)], self.ctx)
            assert handle is not None
            await handle
        self.drain = EventDrain(engine.events(), engine.manager.last_seq)
        self.drain_task = asyncio.create_task(self.drain.run())

    async def teardown(self) -> None:
        await self.engine.aclose()
        if self.drain_task is not None:
            await self.drain_task
        if self.drain is not None:
            self.notes["lagged_missed"] = self.drain.missed
        stats = self.engine.stats()
        self.mechanism = stats.completion or "-"
        self.notes["cb_p50_us"] = stats.callback_latency_p50_us
        self.notes["cb_p99_us"] = stats.callback_latency_p99_us
        self.notes["evicted"] = stats.blocks_evicted
        self.notes["rejected"] = stats.stores_rejected

    async def run(self) -> float:
        assert self.drain is not None
        engine = self.engine
        batches = self.batches()
        events_before = self.drain.events
        if self.concurrent:
            tasks = self.opts.tasks
            t0 = time.perf_counter()
            await asyncio.gather(
                *(self.worker(batches[t::tasks], self.gpu[t]) for t in range(tasks))
            )
        else:
            t0 = time.perf_counter()
            await self.worker(batches, self.gpu[0])
        await self.drain.caught_up(engine.manager.last_seq)
        elapsed = time.perf_counter() - t0
        self.notes["events"] = self.drain.events - events_before
        return elapsed

    @abstractmethod
    def batches(self) -> list[list[ao.OffloadKey]]: ...

    @abstractmethod
    async def worker(self, batches: list[list[ao.OffloadKey]], gpu: list[int]) -> None: ...


class EngineStore(EnginePath):
    def __init__(self, opts: Options, backend: str, concurrent: bool) -> None:
        super().__init__("store", opts, backend, concurrent)
        self.feed = StoreBatches(opts)

    def prepare(self) -> None:
        self.feed.prepare()

    def batches(self) -> list[list[ao.OffloadKey]]:
        return self.feed.batches

    async def worker(self, batches: list[list[ao.OffloadKey]], gpu: list[int]) -> None:
        engine, ctx = self.engine, self.ctx
        for keys in batches:
            engine.lookup(keys, ctx)
            handle = await engine.prepare_store(keys, gpu, ctx)
            if handle is None:
                raise RuntimeError("engine store rejected: the tier has no idle block")
            await handle


class EngineLoad(EnginePath):
    def __init__(self, opts: Options, backend: str, concurrent: bool) -> None:
        super().__init__("load", opts, backend, concurrent)
        self.feed = LoadBatches(opts)

    def prepare(self) -> None:
        return None

    def batches(self) -> list[list[ao.OffloadKey]]:
        return self.feed.batches

    async def worker(self, batches: list[list[ao.OffloadKey]], gpu: list[int]) -> None:
        engine, ctx, bpc = self.engine, self.ctx, self.opts.blocks_per_call
        for keys in batches:
            if engine.lookup(keys, ctx) != bpc:
                raise RuntimeError("engine load: a resident key went missing")
            await (await engine.prepare_load(keys, gpu, ctx))


# --- running and reporting ---------------------------------------------------------------


@dataclass
class Result:
    path: Path
    seconds: list[float]

    @property
    def blocks(self) -> int:
        return self.path.opts.calls * self.path.opts.blocks_per_call

    @property
    def median_bps(self) -> float:
        return self.blocks / statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median, of the repetitions' times."""
        return (max(self.seconds) - min(self.seconds)) / statistics.median(self.seconds)


def submit_cost_us(opts: Options, reps: int) -> tuple[str, float]:
    """Loop-thread microseconds of one ``submit_store`` on the default CPU backend (the
    part of the engine path that the inline backend skips), median over ``reps``."""
    bpc = opts.blocks_per_call
    kv = tiny_kv(opts.tasks * bpc)
    backend = ao.CpuCopyBackend(
        kv,
        ao.KVLayout.infer(kv),
        opts.cpu_blocks,
        opts.copy_engine,  # type: ignore[arg-type]
    )
    gpu = list(range(bpc))
    host = [list(range(c * bpc, (c + 1) * bpc)) for c in range(opts.cpu_blocks // bpc)]
    samples: list[float] = []
    try:
        for _ in range(reps + 1):
            jobs = []
            t0 = time.perf_counter()
            for c in range(opts.calls):
                jobs.append(backend.submit_store(gpu, host[c % len(host)]))
            samples.append((time.perf_counter() - t0) / opts.calls * 1e6)
            while not jobs[-1].query():  # let the lane drain before the next sample
                time.sleep(0.0001)
    finally:
        backend.close()
    return backend.name, statistics.median(samples[1:])


#: The engine paths: the default backend (whose copies of at most inline_copy_bytes run
#: at submission), the same with every copy on a lane, and the inline backend.
BACKENDS = ("default", "lanes", "inline")


def build_paths(opts: Options) -> list[Path]:
    paths: list[Path] = [ManagerStore(opts)]
    for backend in BACKENDS:
        for concurrent in (False, True):
            paths.append(EngineStore(opts, backend, concurrent))
    paths.append(ManagerLoad(opts))
    for backend in BACKENDS:
        for concurrent in (False, True):
            paths.append(EngineLoad(opts, backend, concurrent))
    return paths


async def measure(opts: Options, reps: int, warmup: int) -> list[Result]:
    paths = build_paths(opts)
    for path in paths:
        await path.setup()
    times: dict[int, list[float]] = {id(p): [] for p in paths}
    # Interleave the paths inside each repetition so that drift on a shared machine
    # hits them all alike and the ratios stay fair.
    for rep in range(warmup + reps):
        for path in paths:
            path.prepare()
            gc.collect()
            elapsed = await path.run()
            if rep >= warmup:
                times[id(path)].append(elapsed)
    for path in paths:
        await path.teardown()
    return [Result(p, times[id(p)]) for p in paths]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(loop_name: str) -> list[tuple[str, str]]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    try:
        uv = importlib.metadata.version("uvloop")
    except importlib.metadata.PackageNotFoundError:
        uv = "not installed"
    return [
        ("cpu", cpu_model()),
        ("cores", f"{os.cpu_count()} logical, {usable} usable"),
        ("os", f"{platform.system()} {platform.release()}"),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("uvloop", uv),
        ("asyncoffload", ao.__version__),
        ("loop", loop_name),
        ("load average", " ".join(f"{x:.2f}" for x in os.getloadavg())),
    ]


def report(
    results: list[Result], submit: tuple[str, float], opts: Options, args: argparse.Namespace
) -> str:
    lines: list[str] = []
    for key, value in machine_info(args.loop):
        lines.append(f"{key:>13}: {value}")
    lines.append(
        f"{'workload':>13}: {opts.blocks_per_call} blocks/call, {opts.calls} calls/rep, "
        f"cpu_blocks={opts.cpu_blocks}, tasks={opts.tasks}, policy={opts.policy}, "
        f"completion={opts.completion}, copy_engine={opts.copy_engine}, "
        f"median of {args.reps} reps after {args.warmup} warm-up"
    )
    lines.append("")
    lines.append(
        "| op | path | blocks/s | us/call | vs manager | spread | cb p50/p99 us | events |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---|")
    base: dict[str, float] = {}
    for r in results:
        p = r.path
        bps = r.median_bps
        if p.name == "manager":
            base[p.op] = bps
        us_call = statistics.median(r.seconds) / opts.calls * 1e6
        ratio = bps / base[p.op]
        cb = "-"
        events = "-"
        if isinstance(p, EnginePath) and not math.isnan(p.notes["cb_p50_us"]):
            # Only copies that ended on a lane have a wake-up latency (an inline copy's
            # callback runs as it ends).
            cb = f"{p.notes['cb_p50_us']:.0f} / {p.notes['cb_p99_us']:.0f}"
        if isinstance(p, EnginePath):
            if p.op == "store":
                events = f"{p.notes['events']:.0f}, {p.notes['lagged_missed']:.0f} lagged"
        elif p.op == "store":
            events = f"{p.notes['events']:.0f}"
        lines.append(
            f"| {p.op} | {p.name} | {bps:,.0f} | {us_call:.1f} | {ratio:.3f} | "
            f"{r.spread:.0%} | {cb} | {events} |"
        )
    mechanisms = {r.path.mechanism for r in results if isinstance(r.path, EnginePath)}
    lines.append("")
    lines.append(f"completion mechanism: {', '.join(sorted(mechanisms))}")
    lines.append(
        f"loop-thread cost of one submit_store ({opts.blocks_per_call} blocks) on "
        f"{submit[0]}, measured alone: {submit[1]:.1f} us"
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    try:
        import uvloop  # noqa: F401

        default_loop = "uvloop"
    except ImportError:
        default_loop = "asyncio"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--blocks-per-call", type=int, default=16, help="keys per call (16)")
    ap.add_argument("--calls", type=int, default=2000, help="calls per repetition and path")
    ap.add_argument("--cpu-blocks", type=int, default=4096, help="slots of the CPU tier (4096)")
    ap.add_argument("--tasks", type=int, default=64, help="tasks of the concurrent paths")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions; median (7)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (1)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default=default_loop)
    ap.add_argument("--policy", choices=tuple(ao.available_policies()), default="lru")
    ap.add_argument(
        "--completion",
        choices=("auto", "eventfd", "poll"),
        default="auto",
        help="completion mechanism of the engines (auto)",
    )
    ap.add_argument(
        "--copy-engine",
        choices=("auto", "native", "threads"),
        default="auto",
        help="copy engine of the CPU backend (the engine's default backend)",
    )
    args = ap.parse_args(argv)
    bpc, tasks = args.blocks_per_call, args.tasks
    if min(bpc, args.calls, args.cpu_blocks, tasks, args.reps) <= 0 or args.warmup < 0:
        ap.error("counts must be positive (warm-up may be 0)")
    if args.cpu_blocks < tasks * bpc + bpc:
        ap.error("--cpu-blocks must exceed tasks * blocks-per-call so stores can evict")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    opts = Options(
        blocks_per_call=args.blocks_per_call,
        calls=args.calls,
        cpu_blocks=args.cpu_blocks,
        tasks=args.tasks,
        policy=args.policy,
        completion=args.completion,
        copy_engine=args.copy_engine,
    )
    t0 = time.perf_counter()
    results = ao.run(measure(opts, args.reps, args.warmup), use_uvloop=args.loop == "uvloop")
    submit = submit_cost_us(opts, args.reps)
    print(report(results, submit, opts, args))
    print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
