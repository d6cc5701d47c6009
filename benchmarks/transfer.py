"""GPU <-> host transfer bandwidth through the full engine path, next to the ceilings.

For each KV layout, blocks per call and copy method, times ``prepare_store`` / ``prepare_load``
-> copy -> completion callback -> the awaiting coroutine resumes, and reports GB/s beside:

- the pinned-memory ceiling measured in the same run: one large ``copy_`` between a GPU
  tensor and a pinned host tensor, per direction, and both directions at once;
- a naive loop of one ``copy_`` per fragment (what batching replaces).

Layouts: ``llama8b`` (32 layers, K/V split, 8 KV heads x 128 dims, bf16, 16-token blocks:
32 KiB fragments, 2 MiB blocks) and ``small`` (32 layers, 4 KiB fragments). Block ids are
random. Needs a CUDA device; run it with ``scripts/gpu-check.sh`` or by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

import asyncoffload as ao
from asyncoffload.transfer.cuda import CudaCopyBackend

LAYOUTS: dict[str, tuple[int, tuple[int, ...]]] = {
    # name: (layers, per-layer shape after [2, num_blocks])
    "llama8b": (32, (16, 8, 128)),
    "small": (32, (16, 1, 128)),
}


_key_counter = [0]


def fresh_keys(k: int) -> list[ao.OffloadKey]:
    """``k`` keys never used before in this process (across layouts, block counts and
    methods: a key stored already would be skipped by the next store of it)."""
    _key_counter[0] += 1
    run = _key_counter[0].to_bytes(8, "big")
    return [ao.make_offload_key(run + i.to_bytes(4, "big")) for i in range(k)]


def check_stored(handle: ao.Transfer) -> None:
    """Every key of a timed store must be copied (else its bytes per second are not the
    call's): a skipped key, stored already or declined by the CPU tier's admission, is
    a broken run, named here."""
    skipped = handle.skipped_keys
    if skipped:
        declined = set(handle.declined_keys)
        named = ", ".join(
            f"{key.hex()} ({'declined' if key in declined else 'stored already'})"
            for key in skipped[:4]
        )
        more = f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""
        raise RuntimeError(
            f"the store skipped {len(skipped)} of {len(handle.keys)} keys: {named}{more}"
        )


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def median_time(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of one large copy_ per direction, and of both directions at once."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev.random_(0, 255)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def d2h() -> None:
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        s1.synchronize()

    def h2d() -> None:
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        s1.synchronize()

    def both() -> None:
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)
        s1.synchronize()
        s2.synchronize()

    d2h()
    h2d()
    both()
    out = {
        "d2h": gbps(nbytes, median_time(d2h, reps)),
        "h2d": gbps(nbytes, median_time(h2d, reps)),
        "both": gbps(2 * nbytes, median_time(both, reps)),
    }
    return out


def naive_per_fragment(
    kv: list[torch.Tensor], pool_block: Callable[[int], torch.Tensor], n: int, reps: int
) -> tuple[float, float]:
    """GB/s of one copy_ per (block, layer, K/V) fragment, D2H then H2D."""
    layout = ao.KVLayout.infer(kv)
    frags = layout.fragment_views(kv)
    frag = layout.fragment_bytes
    gpu_ids = random.sample(range(layout.num_blocks), n)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def run(store: bool) -> None:
        with torch.cuda.stream(stream):
            for i, g in enumerate(gpu_ids):
                host = pool_block(i)
                for f, view in enumerate(frags):
                    h = host[f * frag : (f + 1) * frag]
                    if store:
                        h.copy_(view[g], non_blocking=True)
                    else:
                        view[g].copy_(h, non_blocking=True)
        stream.synchronize()

    nbytes = n * layout.block_bytes
    run(True)
    return (
        gbps(nbytes, median_time(lambda: run(True), reps)),
        gbps(nbytes, median_time(lambda: run(False), reps)),
    )


async def engine_rates(
    engine: ao.AsyncOffloadEngine, n: int, reps: int, methods: list[str]
) -> list[dict[str, Any]]:
    """Store and load GB/s per copy method through the engine, and both at once."""
    backend = engine.backend
    assert isinstance(backend, CudaCopyBackend)
    layout = engine.layout
    rows: list[dict[str, Any]] = []

    async def timed(prepare: Awaitable[ao.Transfer | None]) -> float:
        # The coroutine has not started yet: the clock covers prepare -> copy -> resume.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = await prepare
        assert handle is not None, "store refused: not enough idle blocks"
        await handle
        return time.perf_counter() - t0

    async def store_all(keys: list[ao.OffloadKey], ids: list[int]) -> float:
        """A timed store of every key; a store that skipped one (stored already, held
        back by admission) is a broken run of this benchmark, named here."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = await engine.prepare_store(keys, ids)
        assert handle is not None, "store refused: not enough idle blocks"
        await handle
        seconds = time.perf_counter() - t0
        check_stored(handle)
        return seconds

    for method in methods:
        if method != "auto" and not backend._available(method):
            print(f"  {method}: not available here, skipped", flush=True)
            continue
        backend.copy_method = method  # type: ignore[assignment]
        chosen = backend.choose_method(n)
        store_t: list[float] = []
        load_t: list[float] = []
        both_t: list[float] = []
        for rep in range(reps + 1):  # the first is a warm-up (kernel compile, first touch)
            keys = fresh_keys(n)
            ids = random.sample(range(layout.num_blocks), n)
            st = await store_all(keys, ids)
            dst = random.sample(range(layout.num_blocks), n)
            lt = await timed(engine.prepare_load(keys, dst))
            # Both directions at once: store new keys while loading the previous ones.
            keys2 = fresh_keys(n)
            ids2 = random.sample(range(layout.num_blocks), n)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            # The load first: it holds its keys, which the store's evictions then leave
            # alone (an adaptive policy may evict keys stored once and never loaded).
            hl = await engine.prepare_load(keys, dst)
            hs = await engine.prepare_store(keys2, ids2)
            assert hs is not None, "store refused: not enough idle blocks"
            check_stored(hs)
            await asyncio.gather(hs, hl)
            bt = time.perf_counter() - t0
            if rep:
                store_t.append(st)
                load_t.append(lt)
                both_t.append(bt)
        nbytes = n * layout.block_bytes
        rows.append(
            {
                "method": method if method != "auto" else f"auto->{chosen}",
                "blocks": n,
                "store": gbps(nbytes, statistics.median(store_t)),
                "load": gbps(nbytes, statistics.median(load_t)),
                "both": gbps(2 * nbytes, statistics.median(both_t)),
            }
        )
        r = rows[-1]
        print(
            f"  {r['method']:>14} n={n:5d} store {r['store']:6.1f} GB/s  load {r['load']:6.1f} GB/s"
            f"  both {r['both']:6.1f} GB/s",
            flush=True,
        )
    backend.copy_method = "auto"
    return rows


async def run_layout(name: str, args: argparse.Namespace) -> dict[str, Any]:
    layers, inner = LAYOUTS[name]
    gpu_blocks = max(args.blocks) * 2
    kv = [
        torch.randn((2, gpu_blocks, *inner), device="cuda").to(torch.bfloat16)
        for _ in range(layers)
    ]
    # LRU: every offered block is stored (a policy with its own admission, as kv and the
    # default auto have, may decline some once the tier is full: then a timed store
    # copies fewer blocks than it was given).
    cfg = ao.EngineConfig(
        cpu_blocks=max(args.blocks) * 3, staging_bytes=args.staging_mib << 20, policy="lru"
    )
    engine = ao.AsyncOffloadEngine(kv, cfg)
    layout = engine.layout
    print(
        f"layout {name}: {layers} layers, fragment {layout.fragment_bytes >> 10} KiB, "
        f"block {layout.block_bytes >> 10} KiB, {gpu_blocks} GPU blocks",
        flush=True,
    )
    out: dict[str, Any] = {"layout": name, "fragment_bytes": layout.fragment_bytes, "rows": []}
    async with engine:
        backend = engine.backend
        assert isinstance(backend, CudaCopyBackend)
        out["backend"] = backend.describe()
        out["completion"] = engine.stats().completion
        for n in args.blocks:
            out["rows"] += await engine_rates(engine, n, args.reps, args.methods)
        if args.sweep_programs and backend.has_kernel:
            n = max(args.blocks)
            sweep = []
            for programs in args.sweep_programs:
                backend.kernel_programs = programs
                row = (await engine_rates(engine, n, args.reps, ["kernel"]))[0]
                sweep.append({"programs": programs, **row})
            backend.kernel_programs = CudaCopyBackend.DEFAULT_KERNEL_PROGRAMS
            out["kernel_programs_sweep"] = sweep
        if args.program_pairs and backend.has_kernel:
            # Both directions at once with a different kernel program count per direction.
            n = max(args.blocks)
            for store_p, load_p in args.program_pairs:
                backend.kernel_programs_by_direction = [store_p, load_p]
                row = (await engine_rates(engine, n, args.reps, ["kernel"]))[0]
                row["method"] = f"kernel, programs store {store_p} / load {load_p}"
                out["rows"].append(row)
            backend.kernel_programs_by_direction = [None, None]
        if args.mixed:
            # Both directions at once with a different method per direction.
            n = max(args.blocks)
            mixed = []
            for store_m, load_m in (("kernel", "batch"), ("batch", "kernel"), ("batch", "batch")):
                if not (backend._available(store_m) and backend._available(load_m)):
                    continue
                backend.method_by_direction = [store_m, load_m]  # type: ignore[list-item]
                row = (await engine_rates(engine, n, args.reps, ["auto"]))[0]
                row["method"] = f"store {store_m} / load {load_m}"
                mixed.append(row)
            backend.method_by_direction = [None, None]
            out["rows"] += mixed
        n_naive = min(args.blocks)
        st, lt = naive_per_fragment(kv, backend.pool.block, n_naive, max(1, args.reps // 2))
        out["naive"] = {"blocks": n_naive, "store": st, "load": lt}
        print(
            f"  naive per-fragment n={n_naive}: store {st:.1f} GB/s  load {lt:.1f} GB/s", flush=True
        )
        stats = engine.stats()
        out["callback_latency_us"] = [stats.callback_latency_p50_us, stats.callback_latency_p99_us]
    del kv
    torch.cuda.empty_cache()
    return out


def table(results: list[dict[str, Any]], ceil: dict[str, float]) -> str:
    lines = [
        f"pinned ceiling: D2H {ceil['d2h']:.1f} GB/s, H2D {ceil['h2d']:.1f} GB/s, "
        f"both at once {ceil['both']:.1f} GB/s",
        "",
        "| layout | method | blocks/call | store GB/s (% D2H ceiling) | load GB/s (% H2D) | "
        "both GB/s (% both) |",
        "|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["rows"]:
            lines.append(
                f"| {res['layout']} | {r['method']} | {r['blocks']} | {r['store']:.1f} "
                f"({100 * r['store'] / ceil['d2h']:.0f}%) | {r['load']:.1f} "
                f"({100 * r['load'] / ceil['h2d']:.0f}%) | {r['both']:.1f} "
                f"({100 * r['both'] / ceil['both']:.0f}%) |"
            )
        nv = res["naive"]
        lines.append(
            f"| {res['layout']} | naive per-fragment copy_ | {nv['blocks']} | {nv['store']:.1f} "
            f"({100 * nv['store'] / ceil['d2h']:.0f}%) | {nv['load']:.1f} "
            f"({100 * nv['load'] / ceil['h2d']:.0f}%) | - |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layouts", default="llama8b,small")
    parser.add_argument("--blocks", default="256,2048", help="blocks per call, comma-separated")
    parser.add_argument("--methods", default="auto,kernel,staged,batch,gather")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--staging-mib", type=int, default=192, help="staging per buffer")
    parser.add_argument(
        "--mixed", action="store_true", help="also time a different method per direction"
    )
    parser.add_argument(
        "--program-pairs",
        default="",
        help="also time the kernel with store:load program counts, e.g. 66:264,264:66",
    )
    parser.add_argument(
        "--sweep-programs",
        default="",
        help="also time the kernel method with these program counts, e.g. 16,32,64,132",
    )
    args = parser.parse_args(argv)
    args.layouts = args.layouts.split(",")
    args.blocks = [int(b) for b in args.blocks.split(",")]
    args.methods = args.methods.split(",")
    args.sweep_programs = [int(p) for p in args.sweep_programs.split(",") if p]
    args.program_pairs = [
        tuple(int(x) for x in pair.split(":")) for pair in args.program_pairs.split(",") if pair
    ]
    if not torch.cuda.is_available():
        print("benchmarks/transfer.py needs a CUDA device", file=sys.stderr)
        return 2
    random.seed(0)
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | python "
        f"{platform.python_version()} | asyncoffload {ao.__version__}",
        flush=True,
    )
    ceil = ceilings(1 << 30, args.reps)
    print(f"ceilings: {ceil}", flush=True)
    results = [ao.run(run_layout(name, args)) for name in args.layouts]
    print()
    print(table(results, ceil))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "transfer.json"), "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "ceiling": ceil, "results": results},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
