"""Our worker through vLLM 0.34's worker-side API on a GPU: byte-exact at TP 1 and TP 2,
throughput against the pinned ceiling, and an expedited load's latency behind stores.

The KV cache is built by hand in vLLM 0.34's canonical form (``CanonicalKVCaches``): a
Llama-3-8B-like cache, ``--layers`` layers split into K and V tensors, pages of
``16 tokens x heads x 128 x 2 B`` (8 KV heads: 32 KiB; under TP 2 each rank holds 4).
Transfers go as vLLM 0.34's connector sends them: ``resolve_device_pointers`` (vLLM's own
function) turns GPU block ids into ``DevicePointers``, and ``AsyncOffloadWorker``
(``submit_store`` / ``submit_load(..., expedited=...)`` / ``get_finished`` / ``wait`` /
``completion``) moves them.

- **byte-exact**: random blocks are stored, then loaded into other blocks, for each rank
  (TP 2: two ranks' workers, each its own KV and host pool, on the one GPU); every loaded
  page must equal its source, byte for byte.
- **throughput**: ``--jobs`` jobs of ``--blocks`` random blocks each way, timed from the
  first submission to the last completion, against the pinned ceiling measured in the
  same run: one contiguous pinned host <-> device copy of the same bytes.
- **expedited latency**: a 1-block expedited load, from its submission to its completion
  (``completion(job).result()``), alone and with ``--queued`` store jobs of 256 blocks
  submitted just before it; for reference, the same load on the regular lane behind 256-
  block loads. p50 and p99 over ``--reps``.

    PYTHONPATH=<vLLM 0.34's modules> python3 benchmarks/vllm_worker_034.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

from asyncoffload.integrations.vllm.settings import VllmOffloadSettings
from asyncoffload.integrations.vllm.versions import installed_api
from asyncoffload.integrations.vllm.worker import AsyncOffloadWorker

HEAD_DIM, TOKENS = 128, 16


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_caches(layers: int, heads: int, num_blocks: int, seed: int) -> CanonicalKVCaches:
    page = TOKENS * heads * HEAD_DIM * 2
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            tensor=torch.randint(
                -128, 128, (num_blocks, page), dtype=torch.int8, device=DEVICE, generator=gen
            ),
            page_size_bytes=page,
        )
        for _ in range(2 * layers)
    ]
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(2 * layers)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def make_worker(caches: CanonicalKVCaches, slots: int) -> AsyncOffloadWorker:
    slot_bytes = sum(t.page_size_bytes for t in caches.tensors)
    settings = VllmOffloadSettings(cpu_bytes_to_use=slots * slot_bytes)
    return AsyncOffloadWorker(caches, 1, slots, settings)


def pointers(caches: CanonicalKVCaches, blocks: list[int]) -> Any:
    return resolve_device_pointers(GPULoadStoreSpec(blocks, [len(blocks)], [0]), caches)


class Rank:
    def __init__(self, layers: int, heads: int, num_blocks: int, slots: int, seed: int) -> None:
        self.caches = make_caches(layers, heads, num_blocks, seed)
        self.worker = make_worker(self.caches, slots)
        self.num_blocks = num_blocks
        self.job = 0

    def next_job(self) -> int:
        self.job += 1
        return self.job

    def store(self, blocks: list[int], slots: list[int], wait: bool = True) -> int:
        job = self.next_job()
        self.worker.submit_store(job, pointers(self.caches, blocks), CPULoadStoreSpec(slots))
        if wait:
            self.worker.wait({job})
        return job

    def load(
        self, slots: list[int], blocks: list[int], expedited: bool = False, wait: bool = True
    ) -> int:
        job = self.next_job()
        self.worker.submit_load(
            job, CPULoadStoreSpec(slots), pointers(self.caches, blocks), expedited=expedited
        )
        if wait:
            self.worker.wait({job})
        return job

    def page(self, block: int) -> list[torch.Tensor]:
        return [t.tensor[block].clone() for t in self.caches.tensors]


def byte_exact(ranks: list[Rank], blocks: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for rank in ranks:
        perm = torch.randperm(rank.num_blocks, generator=gen).tolist()
        src, dst = perm[:blocks], perm[blocks : 2 * blocks]
        slots = torch.randperm(rank.worker.transfers.num_slots, generator=gen)[:blocks].tolist()
        expected = [rank.page(b) for b in src]
        rank.store(src, slots)
        rank.load(slots, dst)
        rank.load(slots[:4], dst[:4], expedited=True)  # the expedited lane, too
        rank.worker.get_finished()
        sync()
        for b, pages in zip(dst, expected):
            for got, want in zip(rank.page(b), pages):
                assert torch.equal(got, want), f"block {b} differs"
                checked += got.numel()
    return {"ranks": len(ranks), "blocks_per_rank": blocks, "bytes_checked": checked}


def ceiling(nbytes: int, reps: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    out = {}
    for name, (dst, src) in {"d2h": (host, dev), "h2d": (dev, host)}.items():
        times = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            times.append(time.perf_counter() - t)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


def throughput(ranks: list[Rank], jobs: int, blocks: int, reps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    slots_total = ranks[0].worker.transfers.num_slots
    nbytes = sum(r.worker.slot_bytes for r in ranks) * jobs * blocks
    results: dict[str, list[float]] = {"store": [], "load": []}
    for _ in range(reps):
        plan = []
        for _ in range(jobs):
            blk = torch.randperm(ranks[0].num_blocks, generator=gen)[:blocks].tolist()
            slt = torch.randperm(slots_total, generator=gen)[:blocks].tolist()
            plan.append((blk, slt))
        for direction in ("store", "load"):
            sync()
            t = time.perf_counter()
            submitted = []
            for blk, slt in plan:
                for rank in ranks:
                    if direction == "store":
                        submitted.append((rank, rank.store(blk, slt, wait=False)))
                    else:
                        submitted.append((rank, rank.load(slt, blk, wait=False)))
            for rank, job in submitted:
                rank.worker.wait({job})
            results[direction].append(time.perf_counter() - t)
            for rank in ranks:
                rank.worker.get_finished()
    ceil = ceiling(nbytes, reps)
    out: dict[str, Any] = {"bytes": nbytes, "ceiling_gbps": ceil}
    for direction, key in (("store", "d2h"), ("load", "h2d")):
        gbps = nbytes / statistics.median(results[direction]) / 1e9
        out[direction] = {"gbps": gbps, "of_ceiling": gbps / ceil[key]}
    return out


def latency(rank: Rank, queued: int, reps: int) -> dict[str, Any]:
    """A 1-block expedited load's submission-to-completion time, alone and behind
    ``queued`` 256-block store jobs; the same load on the regular lane behind 256-block
    loads, for reference."""
    gen = torch.Generator().manual_seed(13)
    slots = rank.worker.transfers.num_slots
    rank.store([0], [0])  # the block the 1-block load reads back
    rank.worker.get_finished()

    def backlog(store: bool) -> list[int]:
        jobs = []
        for _ in range(queued):
            blk = torch.randperm(rank.num_blocks - 8, generator=gen)[:256].add(8).tolist()
            slt = torch.randperm(slots - 8, generator=gen)[:256].add(8).tolist()
            if store:
                jobs.append(rank.store(blk, slt, wait=False))
            else:
                jobs.append(rank.load(slt, blk, wait=False))
        return jobs

    cases: dict[str, list[float]] = {"alone": [], "behind_stores": [], "regular_behind_loads": []}
    for _ in range(reps):
        for case in cases:
            pending = []
            if case == "behind_stores":
                pending = backlog(store=True)
            elif case == "regular_behind_loads":
                pending = backlog(store=False)
            expedited = case != "regular_behind_loads"
            t = time.perf_counter()
            job = rank.load([0], [1], expedited=expedited, wait=False)
            rank.worker.completion(job).result()
            cases[case].append(time.perf_counter() - t)
            rank.worker.wait(set(pending))
            rank.worker.get_finished()
    out: dict[str, Any] = {"queued_jobs": queued, "reps": reps}
    for case, times in cases.items():
        times.sort()
        out[case] = {
            "p50_us": 1e6 * times[len(times) // 2],
            "p99_us": 1e6 * times[min(len(times) - 1, int(len(times) * 0.99))],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=2048)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--queued", type=int, default=4)
    parser.add_argument("--latency-reps", type=int, default=200)
    parser.add_argument("--json")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try it out")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    api = installed_api()
    assert api.device_pointers, f"needs vLLM 0.34's modules, found {api.version}"
    report: dict[str, Any] = {
        "vllm": api.version,
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    for tp in (1, 2):
        ranks = [
            Rank(args.layers, 8 // tp, args.num_blocks, args.slots, seed=100 * tp + r)
            for r in range(tp)
        ]
        report[f"tp{tp}"] = {
            "byte_exact": byte_exact(ranks, 64, seed=tp),
            "throughput": throughput(ranks, args.jobs, args.blocks, args.reps),
            "engine": ranks[0].worker.stats().engine,
        }
        if tp == 1:
            report["latency"] = latency(ranks[0], args.queued, args.latency_reps)
        for rank in ranks:
            rank.worker.shutdown()
        del ranks
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    _ = np  # numpy is vLLM's (DevicePointers); imported here to fail early without it
    main()
