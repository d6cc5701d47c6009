"""Copy throughput of PagedTransferWorker (the layer vLLM's offloading worker drives), per
direction, next to a ceiling measured in the same run.

Layout: a Llama-3-8B-like KV cache in vLLM's canonical form: ``--layers`` layers split
into K and V tensors (64 tensors for 32 layers), pages of ``block_size x heads x head_dim``
fp16 (16 x 8 x 128 x 2 B = 32 KiB), one KV-cache group, ``blocks_per_chunk`` 1 and 4.

A run submits ``--jobs`` jobs of ``--blocks`` random GPU blocks each (stores, then loads of
the same slots into other blocks) and stops the clock when the last job has *completed*
(``wait``), not when it was submitted. The ceiling moves the same number of bytes as one
contiguous copy: on CPU one ``memmove`` (single-threaded, like a copy lane) and one torch
``copy_``; on CUDA one pinned host <-> device ``copy_`` per direction. The submit column is
the median time ``submit_*`` takes on the calling thread (plan building and queueing).
On CUDA each copy method (``--methods``) is forced in turn on one worker per bpc, so the
methods are compared on the same memory in the same run; ``used`` names the methods the
jobs ran (``auto`` picks per job).

    python benchmarks/vllm_worker.py                 # CPU here, small sizes
    python benchmarks/vllm_worker.py --device cuda   # on the GPU machine
    python benchmarks/vllm_worker.py --blocks 256 --jobs 8 --num-blocks 4096

``--tp N`` shapes the cache as one of N tensor-parallel ranks sees it (``heads / N`` KV
heads each) and runs N workers side by side on the device, each with its own host pool
in a shared-memory file (``--pool-dir``, as under vLLM with lower tiers), every job
submitted to all N: the rows give the bytes of all ranks together against the ceiling
for the same bytes. Every slot is then checked byte-exact, each rank's against its own
KV. (On one GPU the N ranks share its copy engines, which a real TP engine, one rank per
GPU, does not.)
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from asyncoffload.transfer.paged_worker import PagedTransferWorker


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], None], reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_kv(
    layers: int, num_blocks: int, page_shape: tuple[int, int, int], device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Per layer one ``[2, num_blocks, *page_shape]`` fp16 cache (FlashAttention-like), and
    its canonical int8 views: K and V ``(num_blocks, page_bytes)``."""
    raws: list[torch.Tensor] = []
    tensors: list[torch.Tensor] = []
    page = 0
    for _ in range(layers):
        raw = torch.empty((2, num_blocks, *page_shape), dtype=torch.float16, device=device)
        raw.view(torch.int16).random_(-(2**15), 2**15 - 1)
        page = raw[0, 0].numel() * raw.element_size()
        pages = raw.view(torch.int8).view(2, num_blocks, page)
        raws.append(raw)
        tensors += [pages[0], pages[1]]
    return raws, tensors, page


def ceilings(nbytes: int, device: torch.device, reps: int) -> dict[str, float]:
    """GB/s of one contiguous copy of ``nbytes`` per direction."""
    if device.type == "cuda":
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

        def d2h() -> None:
            with torch.cuda.stream(stream):
                host.copy_(dev, non_blocking=True)
            stream.synchronize()

        def h2d() -> None:
            with torch.cuda.stream(stream):
                dev.copy_(host, non_blocking=True)
            stream.synchronize()

        d2h()
        h2d()
        return {
            "store": gbps(nbytes, median_seconds(d2h, reps, device)),
            "load": gbps(nbytes, median_seconds(h2d, reps, device)),
        }
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)

    def memmove() -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)

    def torch_copy() -> None:
        dst.copy_(src)

    memmove()
    torch_copy()
    rate = gbps(nbytes, median_seconds(memmove, reps, device))
    return {
        "store": rate,
        "load": rate,
        "torch_copy": gbps(nbytes, median_seconds(torch_copy, reps, device)),
    }


def run_case(
    tensors: list[torch.Tensor],
    page: int,
    bpc: int,
    args: argparse.Namespace,
    device: torch.device,
    engine: str,
    methods: list[str],
) -> list[dict[str, Any]]:
    """One worker; per copy method (CUDA: forced on the engine, side by side on the same
    worker and memory; CPU: ``auto``) a row of store and load GB/s and submit times."""
    refs = [[(t, page) for t in range(len(tensors))]]
    n = args.blocks
    slots_per_job = -(-n // bpc)
    num_slots = args.jobs * slots_per_job
    gen = torch.Generator().manual_seed(0)
    worker = PagedTransferWorker(
        tensors,
        [page] * len(tensors),
        refs,
        bpc,
        num_slots,
        copy_engine=engine,  # type: ignore[arg-type]
    )
    if args.staging_mib and hasattr(worker.engine, "staging_bytes"):
        worker.engine.staging_bytes = args.staging_mib << 20  # before the first staged job
    jobs = []
    for j in range(args.jobs):
        gpu = torch.randperm(args.num_blocks, generator=gen)[:n]
        dst = torch.randperm(args.num_blocks, generator=gen)[:n]
        slots = torch.arange(j * slots_per_job, (j + 1) * slots_per_job)
        jobs.append((gpu, dst, slots))
    nbytes = args.jobs * n * page * len(tensors)
    next_id = 0
    submit_s: dict[str, list[float]] = {"store": [], "load": []}

    def run(direction: str) -> None:
        nonlocal next_id
        ids = []
        for gpu, dst, slots in jobs:
            t0 = time.perf_counter()
            if direction == "store":
                worker.submit_store(next_id, gpu, [n], [0], slots)
            else:
                worker.submit_load(next_id, slots, dst, [n], [0])
            submit_s[direction].append(time.perf_counter() - t0)
            ids.append(next_id)
            next_id += 1
        worker.wait(ids)
        done = worker.get_finished()
        assert len(done) == len(ids), (len(done), len(ids))

    results = []
    try:
        for method in methods:
            cuda_engine = getattr(worker.engine, "jobs_by_method", None) is not None
            if cuda_engine and method != "default":
                try:
                    cast(Any, worker.engine).primary_method = method
                except ValueError:
                    continue
            by_method = dict(getattr(worker.engine, "jobs_by_method", {}))
            run("store")  # warm-up: first touch of the host pages, staging, plan caches
            run("load")
            for v in submit_s.values():
                v.clear()
            out: dict[str, Any] = {"bpc": bpc, "engine": worker.stats().engine}
            for direction in ("store", "load"):
                timed = functools.partial(run, direction)
                out[direction] = gbps(nbytes, median_seconds(timed, args.reps, device))
                out[f"{direction}_submit_us"] = statistics.median(submit_s[direction]) * 1e6
            after = getattr(worker.engine, "jobs_by_method", {})
            used = sorted(m for m, c in after.items() if c > by_method.get(m, 0))
            out["used"] = "+".join(used)
            stats = worker.stats()
            out["retries"] = stats.store.retries + stats.load.retries
            results.append(out)
    finally:
        worker.shutdown()
    return results


def run_tp(
    ranks: list[list[torch.Tensor]],
    page: int,
    args: argparse.Namespace,
    device: torch.device,
    pool_dir: str,
) -> dict[str, Any]:
    """``len(ranks)`` workers, one per rank's tensors, host pools in ``pool_dir``; each job
    goes to every rank. Store and load GB/s of all ranks' bytes, then a byte-exact check
    of every rank's loaded blocks against its stored ones."""
    n = args.blocks
    num_slots = args.jobs * n
    refs = [[(t, page) for t in range(len(ranks[0]))]]
    workers = [
        PagedTransferWorker(
            tensors,
            [page] * len(tensors),
            refs,
            1,
            num_slots,
            host_file=os.path.join(pool_dir, f"tp-rank{r}.pool"),
        )
        for r, tensors in enumerate(ranks)
    ]
    gen = torch.Generator().manual_seed(1)
    half = args.num_blocks // 2
    if args.jobs * n > half:
        raise ValueError(f"--tp needs jobs x blocks <= num_blocks / 2 ({half})")
    # Distinct blocks in every job, sources in the lower half, destinations in the upper.
    src_all = torch.randperm(half, generator=gen)
    dst_all = half + torch.randperm(args.num_blocks - half, generator=gen)
    jobs = []
    for j in range(args.jobs):
        part = slice(j * n, (j + 1) * n)
        jobs.append((src_all[part], dst_all[part], torch.arange(j * n, (j + 1) * n)))
    nbytes = len(ranks) * args.jobs * n * page * len(ranks[0])
    next_id = 0

    def run(direction: str) -> None:
        nonlocal next_id
        ids = []
        for gpu, dst, slots in jobs:
            for worker in workers:
                if direction == "store":
                    worker.submit_store(next_id, gpu, [n], [0], slots)
                else:
                    worker.submit_load(next_id, slots, dst, [n], [0])
            ids.append(next_id)
            next_id += 1
        for worker in workers:
            worker.wait(ids)
            assert len(worker.get_finished()) == len(ids)

    try:
        run("store")
        run("load")
        out: dict[str, Any] = {"tp": len(ranks), "engine": workers[0].stats().engine}
        for direction in ("store", "load"):
            out[direction] = gbps(
                nbytes, median_seconds(functools.partial(run, direction), args.reps, device)
            )
        sync(device)
        exact = True
        for tensors in ranks:  # the last load brought each rank's own blocks back
            for gpu, dst, _ in jobs:
                for t in tensors:
                    exact &= bool(torch.equal(t[dst.to(t.device)], t[gpu.to(t.device)]))
        out["byte_exact"] = exact
        out["pinned"] = all(
            getattr(getattr(w.engine, "pool", None), "pinned", True) for w in workers
        )
    finally:
        for worker in workers:
            worker.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=None, help="GPU blocks (CPU 64, CUDA 2048)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per job (CPU 16, CUDA 256)")
    ap.add_argument("--jobs", type=int, default=None, help="jobs per measurement (CPU 2, CUDA 4)")
    ap.add_argument("--bpc", default="1,4", help="blocks_per_chunk values")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--copy-engines", default="native", help="CPU: native,threads (threads: torch copies)"
    )
    ap.add_argument(
        "--methods",
        default="staged,kernel,batch,auto",
        help="CUDA: copy methods to force, side by side (staged, kernel, batch, each, auto)",
    )
    ap.add_argument(
        "--staging-mib", type=int, default=0, help="CUDA: staging MiB per direction (0: default)"
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks side by side")
    ap.add_argument("--pool-dir", default="/dev/shm", help="--tp: where the host pools live")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.tp < 1 or args.heads % args.tp:
        ap.error(f"--tp {args.tp} must be at least 1 and divide --heads {args.heads}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cpu = device.type == "cpu"
    args.num_blocks = args.num_blocks or (64 if cpu else 2048)
    args.blocks = min(args.blocks or (16 if cpu else 256), args.num_blocks)
    args.jobs = args.jobs or (2 if cpu else 4)
    engines = args.copy_engines.split(",") if cpu else ["auto"]
    methods = ["default"] if cpu else args.methods.split(",")

    if args.tp > 1:
        main_tp(args, device)
        return
    page_shape = (args.block_size, args.heads, args.head_dim)
    raws, tensors, page = make_kv(args.layers, args.num_blocks, page_shape, device)
    nbytes = args.jobs * args.blocks * page * len(tensors)
    ceiling = ceilings(nbytes, device, args.reps)
    results = []
    for engine in engines:
        for bpc in (int(b) for b in args.bpc.split(",")):
            results += run_case(tensors, page, bpc, args, device, engine, methods)
    del raws
    report = {
        "device": torch.cuda.get_device_name(device) if not cpu else "cpu",
        "tensors": len(tensors),
        "page_bytes": page,
        "blocks_per_job": args.blocks,
        "jobs": args.jobs,
        "bytes_per_measurement": nbytes,
        "ceiling_gbps": ceiling,
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"{report['device']}: {len(tensors)} tensors of {page >> 10} KiB pages, "
        f"{args.jobs} jobs x {args.blocks} blocks = {nbytes / 2**20:.0f} MiB per direction"
    )
    extra = f", torch copy_ {ceiling['torch_copy']:.1f}" if "torch_copy" in ceiling else ""
    print(
        f"ceiling (one contiguous copy): store {ceiling['store']:.1f} GB/s, "
        f"load {ceiling['load']:.1f} GB/s{extra}"
    )
    print(
        f"{'engine':<12} {'used':<10} {'bpc':>3} {'dir':<5} {'GB/s':>7} {'ratio':>6} "
        f"{'submit (median)':>16}"
    )
    for r in results:
        for direction in ("store", "load"):
            rate = r[direction]
            print(
                f"{r['engine']:<12} {r['used']:<10} {r['bpc']:>3} {direction:<5} {rate:>7.2f} "
                f"{rate / ceiling[direction]:>6.2f} {r[f'{direction}_submit_us']:>14.0f}us"
            )


def main_tp(args: argparse.Namespace, device: torch.device) -> None:
    page_shape = (args.block_size, args.heads // args.tp, args.head_dim)
    made = [make_kv(args.layers, args.num_blocks, page_shape, device) for _ in range(args.tp)]
    page = made[0][2]
    ranks = [tensors for _, tensors, _ in made]
    nbytes = args.tp * args.jobs * args.blocks * page * len(ranks[0])
    ceiling = ceilings(nbytes, device, args.reps)
    pool_dir = tempfile.mkdtemp(prefix="ao-tp-", dir=args.pool_dir)
    try:
        result = run_tp(ranks, page, args, device, pool_dir)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tp": args.tp,
        "page_bytes": page,
        "tensors_per_rank": len(ranks[0]),
        "bytes_per_measurement": nbytes,
        "ceiling_gbps": ceiling,
        "result": result,
    }
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"{report['device']}: TP {args.tp}, per rank {len(ranks[0])} tensors of "
        f"{page >> 10} KiB pages, {args.jobs} jobs x {args.blocks} blocks x {args.tp} ranks = "
        f"{nbytes / 2**20:.0f} MiB per direction; pools in {args.pool_dir} "
        f"(pinned: {result['pinned']}), byte-exact: {result['byte_exact']}"
    )
    for direction in ("store", "load"):
        rate = result[direction]
        print(
            f"{result['engine']:<12} {direction:<5} {rate:>7.2f} GB/s, ceiling "
            f"{ceiling[direction]:.2f}, ratio {rate / ceiling[direction]:.2f}"
        )


if __name__ == "__main__":
    main()
