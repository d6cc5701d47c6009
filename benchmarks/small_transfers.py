"""Small CUDA transfers and worker submission (issue 25): latency of one-block copies
through the public paths, next to the raw copy of the same bytes in the same process.

Layout: Llama-3-8B-like, 32 layers split into K and V, 16 tokens x 8 KV heads x 128 dims
of bf16: 32 KiB fragments, 2 MiB blocks. Needs a CUDA device.

Parts (``--parts``):

- ``engine``: one 1-block store and one 1-block load through the engine's public API,
  awaited (``await (await engine.prepare_store(keys, ids, ctx))``; the load the same
  with ``prepare_load`` of a stored key into another block), each sample timed from the
  call to the awaiting coroutine resuming. Beside them, in the same process: the raw copy
  of the same 2 MiB (one contiguous ``copy_`` between the GPU and pinned host memory on a
  side stream, then ``synchronize``). Loaded blocks are checked byte-exact.
- ``worker``: ``PagedTransferWorker.submit_*`` of 256-block jobs (vLLM's canonical layout:
  64 tensors of 32 KiB pages, bpc 1) per copy method: median submit time on the calling
  thread, and GB/s of back-to-back jobs against the pinned ceiling measured in the same
  run (as ``benchmarks/vllm_worker.py`` does).
- ``ttft``: the time to first token of a 1-block prefix hit through the worker, as far as
  the worker alone can show it: look the key up (a dict), ``submit_load`` the block,
  wait for it (``wait`` then ``get_finished`` reports it), run a tiny "prefill" kernel
  reading the loaded block (a reduction over its layer-0 K page) and synchronize.

``--profile``: cProfile of the timed loops (the top functions by own time go to
``$OUT/small_transfers-<label>-profile.txt``). ``--label`` names the run (``before`` /
``after``); results go to ``$OUT/small_transfers-<label>.json`` (or ``--json``).

    python benchmarks/small_transfers.py --label after
    PYTHONPATH=/path/to/old/checkout python benchmarks/small_transfers.py --label before
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import json
import math
import os
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

import asyncoffload as ao
from asyncoffload import loops
from asyncoffload._native import build_all
from asyncoffload.transfer.paged_worker import PagedTransferWorker

LAYERS = 32
INNER = (16, 8, 128)  # tokens per block, KV heads, head dim: 32 KiB fragments in bf16


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank ``q``-th percentile (0-100); NaN when empty."""
    if not values:
        return math.nan
    data = sorted(values)
    k = max(0, min(len(data) - 1, math.ceil(q / 100 * len(data)) - 1))
    return data[k]


def summary(samples_us: Sequence[float]) -> dict[str, float]:
    return {
        "p50_us": pct(samples_us, 50),
        "p99_us": pct(samples_us, 99),
        "mean_us": statistics.fmean(samples_us) if samples_us else math.nan,
        "n": len(samples_us),
    }


class Profiler:
    """cProfile around chosen regions (or nothing when disabled)."""

    def __init__(self, enabled: bool) -> None:
        self.prof = cProfile.Profile() if enabled else None
        self.sections: dict[str, str] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        if self.prof is None:
            return fn()
        self.prof.enable()
        try:
            return fn()
        finally:
            self.prof.disable()

    def cut(self, name: str, top: int = 35) -> None:
        if self.prof is None:
            return
        out = io.StringIO()
        stats = pstats.Stats(self.prof, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        self.sections[name] = out.getvalue()
        self.prof = cProfile.Profile()


# --- engine: 1-block store and load through the public API ------------------------------


def make_kv(num_blocks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        raw = torch.randint(0, 256, (2, num_blocks, *INNER[:-1], INNER[-1] * 2), generator=gen)
        out.append(raw.to(torch.uint8).view(torch.bfloat16).to("cuda"))
    return out


def block_bytes_of(kv: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([t[:, block].reshape(-1).view(torch.uint8) for t in kv])


def raw_copy(samples: int) -> dict[str, dict[str, float]]:
    """One contiguous copy of one block's bytes (2 MiB) per direction, plus synchronize."""
    nbytes = LAYERS * 2 * math.prod(INNER) * 2
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    out: dict[str, dict[str, float]] = {}
    for name, dst, src in (("store", host, dev), ("load", dev, host)):
        times: list[float] = []
        for i in range(samples + 20):
            t0 = time.perf_counter_ns()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            if i >= 20:
                times.append((time.perf_counter_ns() - t0) / 1e3)
        out[name] = summary(times)
    return out


async def engine_part(
    args: argparse.Namespace, prof: Profiler, wait_us: float | None = None, full: bool = False
) -> dict[str, Any]:
    """``wait_us``: the engine's ``inline_wait_us`` (``None``: the default, or a checkout
    from before the setting). ``full``: the CPU tier is filled before the timed calls, so
    that each timed store evicts a block (else the tier never fills: fewer stores than
    ``--cpu-blocks``)."""
    num_blocks = 64
    kv = make_kv(num_blocks)
    settings: dict[str, Any] = {"cpu_blocks": args.cpu_blocks, "copy_method": args.method}
    if full:
        # Each store evicts the least recently used key: the policy ``auto`` may switch to
        # one that evicts the newest keys of a stream never read back, which the loads
        # below want.
        settings["policy"] = "lru"
    if wait_us is not None:
        settings["inline_wait_us"] = wait_us
    cfg = ao.EngineConfig.model_validate(settings)
    ctx = ao.ReqContext("bench")
    counter = 0

    def key() -> ao.OffloadKey:
        nonlocal counter
        counter += 1
        return ao.make_offload_key(counter.to_bytes(8, "big"))

    stored: list[tuple[ao.OffloadKey, int]] = []
    store_us: list[float] = []
    load_us: list[float] = []
    # Per sample: the call until prepare_* returned, and the copy's device time.
    split: dict[str, list[tuple[float, float]]] = {"store": [], "load": []}
    exact = True
    rng = random.Random(0)
    async with ao.AsyncOffloadEngine(kv, cfg) as engine:
        # The backend's submit, timed from the inside: (entered, returned, job).
        seen: list[tuple[int, int, Any]] = []
        backend: Any = engine.backend

        def timing(real: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
            def submit(a: Any, b: Any) -> Any:
                t_in = time.perf_counter_ns()
                job = real(a, b)
                seen.append((t_in, time.perf_counter_ns(), job))
                return job

            return submit

        for name in ("submit_store", "submit_load"):
            setattr(backend, name, timing(getattr(backend, name)))
        phases: dict[str, list[tuple[float, ...]]] = {"store": [], "load": []}

        def phase(direction: str, t0: int, t_end: int) -> None:
            t_in, t_out, job = seen[-1]
            end = getattr(job, "finished_ns", 0) or t_end
            phases[direction].append(
                ((t_in - t0) / 1e3, (t_out - t_in) / 1e3, (end - t_out) / 1e3, (t_end - end) / 1e3)
            )

        async def store_one() -> float:
            k = key()
            block = rng.randrange(num_blocks)
            t0 = time.perf_counter_ns()
            handle = await engine.prepare_store([k], [block], ctx)
            t1 = time.perf_counter_ns()
            assert handle is not None, "store refused"
            result = await handle
            t_end = time.perf_counter_ns()
            dt = (t_end - t0) / 1e3
            phase("store", t0, t_end)
            stored.append((k, block))
            split["store"].append(((t1 - t0) / 1e3, result.duration_s * 1e6))
            return dt

        async def fill() -> None:
            """Store ``--cpu-blocks`` keys, 32 a call: the tier is full afterwards."""
            for lo in range(0, args.cpu_blocks, 32):
                m = min(32, args.cpu_blocks - lo)
                keys = [key() for _ in range(m)]
                handle = await engine.prepare_store(keys, list(range(m)), ctx)
                assert handle is not None, "store refused while filling the tier"
                await handle

        def stored_key() -> tuple[ao.OffloadKey, int]:
            """A recently stored key still in the tier (with a full tier, the policy may
            have evicted any of them; the lookup is outside the timed region)."""
            lo = max(0, len(stored) - args.cpu_blocks // 2)
            for i in rng.sample(range(lo, len(stored)), len(stored) - lo):
                k, src = stored[i]
                if engine.lookup([k], ctx):
                    return k, src
            tier = "full" if full else "fresh"
            raise RuntimeError(
                f"none of the last {len(stored) - lo} stored keys is in the {tier} tier"
            )

        async def load_one() -> float:
            k, src = stored_key()
            dst = (src + 1 + rng.randrange(num_blocks - 1)) % num_blocks
            t0 = time.perf_counter_ns()
            handle = await engine.prepare_load([k], [dst], ctx)
            t1 = time.perf_counter_ns()
            result = await handle
            t_end = time.perf_counter_ns()
            phase("load", t0, t_end)
            split["load"].append(((t1 - t0) / 1e3, result.duration_s * 1e6))
            return (t_end - t0) / 1e3

        if full:
            await fill()
        for _ in range(args.warmup):
            await store_one()
            await load_one()
        torch.cuda.synchronize()
        for v in split.values():
            v.clear()
        for w in phases.values():
            w.clear()

        async def timed() -> None:
            for _ in range(args.samples):
                store_us.append(await store_one())
                await asyncio.sleep(0)
            for _ in range(args.samples):
                load_us.append(await load_one())
                await asyncio.sleep(0)

        if prof.prof is not None:
            prof.prof.enable()
        try:
            await timed()
        finally:
            if prof.prof is not None:
                prof.prof.disable()
        prof.cut("engine: 1-block store then load, awaited")
        # Byte-exactness: store a block, overwrite it, load it back elsewhere, compare.
        for _ in range(8):
            k = key()
            src = rng.randrange(num_blocks)
            want = block_bytes_of(kv, src).cpu()
            handle = await engine.prepare_store([k], [src], ctx)
            assert handle is not None
            await handle
            dst = (src + 1) % num_blocks
            await (await engine.prepare_load([k], [dst], ctx))
            exact &= bool(torch.equal(block_bytes_of(kv, dst).cpu(), want))
        conc = await concurrent_part(engine, args, key, ctx)
        info = engine.stats().backend_info
        evictions = engine.stats().blocks_evicted
    return {
        "tier": "full" if full else "fresh",
        "evictions": evictions,
        "concurrent": conc,
        "inline_wait_us": info.get("inline_wait_us", "-"),
        "inline_waits_missed": info.get("inline_waits_missed", "-"),
        "store": summary(store_us),
        "load": summary(load_us),
        "byte_exact": exact,
        "methods": info.get("transfers_by_method"),
        "native_copy": info.get("native_copy", False),
        "raw_copy": raw_copy(args.samples),
        "prepare_returned": {d: summary([a for a, _ in v]) for d, v in split.items()},
        "copy_device": {d: summary([b for _, b in v]) for d, v in split.items()},
        # p50 of each phase: call -> backend submit entered, the submit itself, submit
        # returned -> the end seen natively (host function / spinner stamp), that stamp
        # -> the awaiting coroutine resumed.
        "phases_p50_us": {
            d: dict(
                zip(
                    ("before_submit", "submit", "to_end_stamp", "stamp_to_resume"),
                    (pct([row[i] for row in v], 50) for i in range(4)),
                )
            )
            for d, v in phases.items()
        },
    }


async def concurrent_part(
    engine: ao.AsyncOffloadEngine,
    args: argparse.Namespace,
    key: Callable[[], ao.OffloadKey],
    ctx: ao.ReqContext,
) -> dict[str, float]:
    """Throughput of ``--conc-tasks`` tasks each storing ``--conc-calls`` 1-block
    stores back to back (each into its own KV block), then loading its last stored
    keys back (into another block of its own): blocks per second each way. Where copies
    are waited for in the call (``inline_wait_us``) they no longer overlap the next
    call's Python: this is what that costs."""
    tasks, calls = args.conc_tasks, args.conc_calls
    keep = max(1, min(calls, args.cpu_blocks // tasks))
    stored: list[list[ao.OffloadKey]] = [[] for _ in range(tasks)]

    async def storer(t: int) -> None:
        for _ in range(calls):
            k = key()
            handle = await engine.prepare_store([k], [t], ctx)
            assert handle is not None, "store refused"
            await handle
            stored[t].append(k)

    loaded = 0

    async def loader(t: int) -> None:
        nonlocal loaded
        for k in stored[t][-keep:]:
            if engine.lookup([k], ctx):  # the policy may have evicted it
                await (await engine.prepare_load([k], [tasks + t], ctx))
                loaded += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(storer(t) for t in range(tasks)))
    t1 = time.perf_counter()
    await asyncio.gather(*(loader(t) for t in range(tasks)))
    t2 = time.perf_counter()
    return {
        "store_blocks_per_s": tasks * calls / (t1 - t0),
        "load_blocks_per_s": loaded / (t2 - t1),
        "loaded": loaded,
    }


# --- worker: submit_* of 256-block jobs and the TTFT of a 1-block hit ---------------------


def make_pages(num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    raws: list[torch.Tensor] = []
    tensors: list[torch.Tensor] = []
    for _ in range(LAYERS):
        raw = torch.empty((2, num_blocks, *INNER), dtype=torch.float16, device="cuda")
        raw.view(torch.int16).random_(-(2**15), 2**15 - 1)
        pages = raw.view(torch.int8).view(2, num_blocks, -1)
        raws.append(raw)
        tensors += [pages[0], pages[1]]
    return raws, tensors, int(tensors[0].shape[1])


def pinned_ceiling(nbytes: int, reps: int) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    out = {}
    for name, dst, src in (("store", host, dev), ("load", dev, host)):
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def worker_part(args: argparse.Namespace, prof: Profiler) -> dict[str, Any]:
    num_blocks, n, jobs = 2048, 256, 4
    raws, tensors, page = make_pages(num_blocks)
    ceiling = pinned_ceiling(nbytes_of(jobs, n, page, len(tensors)), args.reps)
    rows = []
    for method in args.worker_methods.split(","):
        row = worker_method(method, tensors, page, num_blocks, n, jobs, ceiling, args, prof)
        if row is not None:
            rows.append(row)
    ttft = ttft_part(tensors, page, args, prof)
    del raws
    return {"ceiling_gbps": ceiling, "jobs": rows, "ttft": ttft}


def worker_method(
    method: str,
    tensors: list[torch.Tensor],
    page: int,
    num_blocks: int,
    n: int,
    jobs: int,
    ceiling: dict[str, float],
    args: argparse.Namespace,
    prof: Profiler,
) -> dict[str, Any] | None:
    """One worker with ``method`` forced: submit times and GB/s of ``jobs`` jobs of ``n``
    blocks back to back, per direction; then a byte-exact check."""
    refs = [[(t, page) for t in range(len(tensors))]]
    worker = PagedTransferWorker(tensors, [page] * len(tensors), refs, 1, jobs * n)
    gen = torch.Generator().manual_seed(0)
    try:
        try:
            cast(Any, worker.engine).primary_method = method
        except ValueError:
            return None
        # Distinct blocks: sources in the lower half, destinations in the upper.
        half = num_blocks // 2
        src_all = torch.randperm(half, generator=gen)
        dst_all = half + torch.randperm(num_blocks - half, generator=gen)
        plan = []
        for j in range(jobs):
            part = slice(j * n, (j + 1) * n)
            plan.append((src_all[part], dst_all[part], torch.arange(j * n, (j + 1) * n)))
        next_id = 0
        submit: dict[str, list[float]] = {"store": [], "load": []}

        def run(direction: str) -> float:
            nonlocal next_id
            torch.cuda.synchronize()
            t_start = time.perf_counter()
            ids = []
            for gpu, dst, slots in plan:
                t0 = time.perf_counter_ns()
                if direction == "store":
                    worker.submit_store(next_id, gpu, [n], [0], slots)
                else:
                    worker.submit_load(next_id, slots, dst, [n], [0])
                submit[direction].append((time.perf_counter_ns() - t0) / 1e3)
                ids.append(next_id)
                next_id += 1
            worker.wait(ids)
            assert len(worker.get_finished()) == len(ids)
            return time.perf_counter() - t_start

        for _ in range(2):
            run("store")
            run("load")
        for v in submit.values():
            v.clear()
        row: dict[str, Any] = {"method": method}
        for direction in ("store", "load"):
            secs: list[float] = []
            for _ in range(args.reps):
                secs.append(prof.run(direction, functools.partial(run, direction)))
            rate = nbytes_of(jobs, n, page, len(tensors)) / statistics.median(secs) / 1e9
            row[direction] = {
                "gbps": rate,
                "ratio": rate / ceiling[direction],
                "submit_p50_us": pct(submit[direction], 50),
                "submit_p99_us": pct(submit[direction], 99),
            }
        prof.cut(f"worker submit_* of 256-block jobs, {method}")
        torch.cuda.synchronize()
        row["byte_exact"] = all(
            torch.equal(t[dst.cuda()], t[gpu.cuda()]) for gpu, dst, _ in plan for t in tensors
        )
        row["engine"] = worker.stats().engine
        row["used"] = {k: v for k, v in getattr(worker.engine, "jobs_by_method", {}).items() if v}
        return row
    finally:
        worker.shutdown()


def nbytes_of(jobs: int, n: int, page: int, tensors: int) -> int:
    return jobs * n * page * tensors


def ttft_part(
    tensors: list[torch.Tensor], page: int, args: argparse.Namespace, prof: Profiler
) -> dict[str, Any]:
    """lookup -> submit_load of 1 block -> wait -> tiny prefill kernel on it -> sync."""
    num_blocks = int(tensors[0].shape[0])
    refs = [[(t, page) for t in range(len(tensors))]]
    worker = PagedTransferWorker(tensors, [page] * len(tensors), refs, 1, 64)
    rng = random.Random(1)
    index: dict[bytes, int] = {}
    try:
        for slot in range(64):  # 64 stored prefixes
            worker.submit_store(slot, [slot], [1], [0], [slot])
            index[slot.to_bytes(8, "big")] = slot
        worker.wait(range(64))
        worker.get_finished()
        samples: list[float] = []
        load_only: list[float] = []
        job = 1000

        def once(timed: bool) -> None:
            nonlocal job
            key = rng.randrange(64).to_bytes(8, "big")
            dst = 64 + rng.randrange(num_blocks - 64)
            t0 = time.perf_counter_ns()
            slot = index.get(key)
            assert slot is not None
            worker.submit_load(job, [slot], [dst], [1], [0])
            worker.wait([job])
            done = worker.get_finished()
            assert done and done[-1].job_id == job
            t1 = time.perf_counter_ns()
            # The "prefill": one kernel over the loaded block's layer-0 K page.
            torch.sum(tensors[0][dst].view(torch.float16), dtype=torch.float32)
            torch.cuda.current_stream().synchronize()
            t2 = time.perf_counter_ns()
            job += 1
            if timed:
                samples.append((t2 - t0) / 1e3)
                load_only.append((t1 - t0) / 1e3)

        for _ in range(args.warmup):
            once(False)

        def timed() -> None:
            for _ in range(args.samples):
                once(True)

        prof.run("ttft", timed)
        prof.cut("worker TTFT of a 1-block hit")
        return {"ttft": summary(samples), "load_wait": summary(load_only)}
    finally:
        worker.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default="engine,worker,ttft")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5, help="worker: timed runs per direction")
    ap.add_argument("--cpu-blocks", type=int, default=512)
    ap.add_argument("--method", default="auto", help="engine copy_method")
    ap.add_argument("--worker-methods", default="auto,staged,kernel")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default=None)
    ap.add_argument(
        "--inline-wait-us",
        default="100,0",
        help="engine: inline_wait_us values, run in turn --rounds times ('' : the default)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="engine: rounds of those values")
    ap.add_argument(
        "--tier",
        default="fresh,full",
        help="engine: the CPU tier's state, in turn: 'fresh' (never fills), 'full' (filled "
        "first: each timed store evicts)",
    )
    ap.add_argument("--conc-tasks", type=int, default=16, help="engine: concurrent tasks")
    ap.add_argument("--conc-calls", type=int, default=60, help="engine: stores per task")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--label", default="run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    build_all()  # native helpers built before any event loop runs
    parts = args.parts.split(",")
    use_uv = loops.uvloop_available() if args.loop is None else args.loop == "uvloop"
    prof = Profiler(args.profile)
    report: dict[str, Any] = {
        "label": args.label,
        "device": torch.cuda.get_device_name(),
        "loop": "uvloop" if use_uv else "asyncio",
        "torch": torch.__version__,
    }
    if "engine" in parts:
        waits: list[float | None] = [float(w) for w in args.inline_wait_us.split(",") if w]
        runs = report["engine_runs"] = []
        tiers = args.tier.split(",")
        if not set(tiers) <= {"fresh", "full"}:
            ap.error(f"--tier takes 'fresh' and 'full', got {args.tier!r}")
        for _ in range(args.rounds):
            for tier in tiers:
                for wait in waits or [None]:
                    part = engine_part(args, prof, wait, full=tier == "full")
                    runs.append(loops.run(part, use_uvloop=use_uv))
    if "worker" in parts or "ttft" in parts:
        if "worker" not in parts:
            args.worker_methods = ""
        report["worker"] = worker_part(args, prof)
    print_report(report)
    outdir = os.environ.get("OUT", ".")
    path = args.json or os.path.join(outdir, f"small_transfers-{args.label}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    if prof.sections:
        with open(os.path.join(outdir, f"small_transfers-{args.label}-profile.txt"), "w") as f:
            for name, text in prof.sections.items():
                f.write(f"==== {name}\n{text}\n")
    return 0


def print_report(r: dict[str, Any]) -> None:
    print(f"[{r['label']}] {r['device']}, loop {r['loop']}, torch {r['torch']}")
    for e in r.get("engine_runs", []):
        print(
            f"  engine, {e.get('tier', 'fresh')} tier (evictions {e.get('evictions')}), "
            f"inline_wait_us {e['inline_wait_us']} (waits missed {e['inline_waits_missed']})"
        )
        for d in ("store", "load"):
            s, raw = e[d], e["raw_copy"][d]
            print(
                f"  engine 1-block {d:<5} p50 {s['p50_us']:7.1f} us  p99 {s['p99_us']:7.1f} us"
                f"   | raw 2 MiB copy+sync p50 {raw['p50_us']:6.1f} p99 {raw['p99_us']:6.1f}"
            )
        for d in ("store", "load"):
            if "phases_p50_us" in e:
                ph = " ".join(f"{k} {v:.1f}" for k, v in e["phases_p50_us"][d].items())
                print(f"    {d} phases p50 (us): {ph}")
        print(
            f"  byte-exact {e['byte_exact']}, methods {e['methods']}, native {e.get('native_copy')}"
        )
        c = e["concurrent"]
        print(
            f"    concurrent 1-block copies: store {c['store_blocks_per_s']:,.0f} blocks/s,"
            f" load {c['load_blocks_per_s']:,.0f} blocks/s ({c['loaded']:.0f} loaded)"
        )
    w = r.get("worker")
    if w:
        c = w["ceiling_gbps"]
        print(f"  ceiling store {c['store']:.1f} GB/s load {c['load']:.1f} GB/s")
        for row in w["jobs"]:
            for d in ("store", "load"):
                x = row[d]
                print(
                    f"  worker {row['method']:<7} {d:<5} submit p50 {x['submit_p50_us']:7.1f} us"
                    f" p99 {x['submit_p99_us']:7.1f} us  {x['gbps']:6.1f} GB/s"
                    f" ratio {x['ratio']:.3f}  exact {row['byte_exact']} used {row['used']}"
                )
        t = w["ttft"]
        print(
            f"  TTFT 1-block hit p50 {t['ttft']['p50_us']:.1f} us p99 {t['ttft']['p99_us']:.1f}"
            f" us (load+wait p50 {t['load_wait']['p50_us']:.1f} p99 {t['load_wait']['p99_us']:.1f})"
        )


if __name__ == "__main__":
    raise SystemExit(main())
