"""What the vLLM 0.34 secondary-tier driver (``AsyncOffloadTier``) costs per block over
calling its tier (``LentTiers``) directly, in the same run, on the CPU.

One disk tier (slab, in ``--dir``: a tmpfs by default, so the disk's own time is small
and steady) under a region laid out like vLLM's primary tier (``--rows`` rows of
``--row-bytes``). Each round moves ``--blocks`` blocks out and back, in jobs of ``--job``
blocks, both ways through each path, the paths alternating round by round:

- ``driver``: vLLM's calls: ``submit_store`` / ``submit_load`` of a ``TransferJob``, then
  ``get_finished_jobs`` until every job's ``JobResult`` is back (what vLLM's manager
  does each step);
- ``direct``: ``LentTiers.store`` / ``load`` of the same keys and rows, then ``ended``
  until every job ended.

Per block: the wall time of a round, and the calling thread's CPU time (``thread_time``:
the control plane, what the driver adds to; the lanes' I/O runs on their own threads; a
poll that finds nothing sleeps 50 us in both paths, so no spin is counted).
Then ``lookup`` of ``--blocks`` stored keys, each way. Medians over ``--rounds``.
Needs vLLM 0.34's modules (``PYTHONPATH=.vllm-0.34/site``, vLLM's venv)::

    PYTHONPATH=.vllm-0.34/site .venv-vllm/bin/python benchmarks/vllm_secondary.py
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
from vllm.v1.kv_offload.base import OffloadingKVEventsConfig, ReqContext, make_offload_key
from vllm.v1.kv_offload.base import OffloadKey as VllmKey
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob

from asyncoffload.integrations.vllm.secondary import AsyncOffloadTier
from asyncoffload.keys import OffloadKey
from asyncoffload.tiers.lent import LentTiers

_CTX = ReqContext(req_id="bench")
#: A poll that found nothing ended sleeps this long (both paths): the calling thread's
#: CPU time is then the control plane's, not a spin's.
_IDLE_S = 50e-6


def _spec(row_bytes: int) -> Any:
    """What the tier reads of vLLM's spec: its config, blocks per chunk, KV events."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers",), 0),),
        worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=True,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig(name="bench", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    events = OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False)
    return SimpleNamespace(config=config, blocks_per_chunk=1, kv_events_config=events)


def _region(rows: int, row_bytes: int) -> np.ndarray:
    """``rows`` page-aligned rows, as vLLM's shared region holds its chunks."""
    raw = np.zeros(rows * row_bytes + 4096, dtype=np.int8)
    shift = -raw.ctypes.data % 4096
    region = raw[shift : shift + rows * row_bytes].reshape(rows, row_bytes)
    region[:] = np.random.default_rng(0).integers(-128, 128, region.shape, dtype=np.int8)
    return region


class Paths:
    """The two ways to one tier: vLLM's calls on the driver, and the driver's tier."""

    def __init__(self, args: argparse.Namespace, directory: str) -> None:
        self.region = _region(args.rows, args.row_bytes)
        tier = {
            "kind": "disk",
            "path": directory,
            "capacity": 4 * args.blocks * (args.row_bytes + 8192),
            "admission": None,
            "io_threads": args.io_threads,
        }
        self.tier = AsyncOffloadTier(
            _spec(args.row_bytes), memoryview(self.region.data), "AsyncOffloadTier", tier=tier
        )
        self.tiers: LentTiers = self.tier._tiers
        self.job = args.job
        self.blocks = args.blocks
        self.half = args.rows // 2
        self._ids = 0

    def _next(self) -> int:
        self._ids += 1
        return self._ids

    def keys(self, round_: int, path: str) -> list[OffloadKey]:
        tag = f"{path}{round_}".encode()
        return [
            OffloadKey(make_offload_key(tag + i.to_bytes(4, "big"), 0)) for i in range(self.blocks)
        ]

    def batches(self, keys: list[OffloadKey]) -> list[tuple[list[OffloadKey], list[int]]]:
        """The jobs of a round, one way: their keys, and their rows (the first half of
        the region for a store, the second for a load: add ``half``)."""
        return [
            (keys[at : at + self.job], list(range(at, min(at + self.job, len(keys)))))
            for at in range(0, len(keys), self.job)
        ]

    def driver_jobs(self, keys: list[OffloadKey]) -> list[list[TransferJob]]:
        """vLLM's ``TransferJob`` of each batch, stores then loads (made before timing:
        vLLM makes them whichever tier is beneath)."""
        return [
            [
                TransferJob(
                    job_id=self._next(),
                    keys=cast("list[VllmKey]", part),
                    chunk_ids=np.asarray(slots, dtype=np.int64) + (self.half if load else 0),
                    is_promotion=load,
                    req_context=_CTX,
                )
                for part, slots in self.batches(keys)
            ]
            for load in (False, True)
        ]

    def direct_jobs(self, keys: list[OffloadKey]) -> list[list[tuple[list[OffloadKey], list[int]]]]:
        return [
            [
                (part, [s + (self.half if load else 0) for s in slots])
                for part, slots in self.batches(keys)
            ]
            for load in (False, True)
        ]

    def driver(self, jobs: list[list[TransferJob]]) -> None:
        """Store the blocks from the first half of the rows, load them into the second."""
        for way in jobs:
            pending = set()
            for job in way:
                pending.add(job.job_id)
                (self.tier.submit_load if job.is_promotion else self.tier.submit_store)(job)
            while pending:
                results = list(self.tier.get_finished_jobs())
                for result in results:
                    assert result.success, result
                    pending.discard(result.job_id)
                if not results:
                    time.sleep(_IDLE_S)
            self.tier.take_events()

    def direct(self, jobs: list[list[tuple[list[OffloadKey], list[int]]]]) -> None:
        for load, way in enumerate(jobs):
            call = self.tiers.load if load else self.tiers.store
            for part, slots in way:
                call(part, slots, None)
            left = len(way)
            while left:
                ended = self.tiers.ended()
                for job in ended:
                    assert all(job.ok), job.causes
                    left -= 1
                if not ended:
                    time.sleep(_IDLE_S)
            self.tiers.take_events()

    def check(self) -> None:
        """The last round's blocks came back byte-exact."""
        n = self.blocks
        assert np.array_equal(self.region[:n], self.region[self.half : self.half + n])
        self.region[self.half :] = 0

    def close(self) -> None:
        self.tier.shutdown()


def _measure(fn: Callable[[Any], None], jobs: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn(jobs)
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256, help="blocks each way per round")
    parser.add_argument("--job", type=int, default=16, help="blocks per job")
    parser.add_argument("--row-bytes", type=int, default=64 << 10)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--io-threads", type=int, default=2)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    args.rows = 2 * args.blocks
    with tempfile.TemporaryDirectory(prefix="ao-bench-", dir=args.dir) as directory:
        paths = Paths(args, directory)
        try:
            samples: dict[str, list[tuple[float, float]]] = {"driver": [], "direct": []}
            for round_ in range(args.rounds + 2):  # two warm-up rounds
                for name in ("driver", "direct") if round_ % 2 else ("direct", "driver"):
                    keys = paths.keys(round_, name)
                    if name == "driver":
                        took = _measure(paths.driver, paths.driver_jobs(keys))
                    else:
                        took = _measure(paths.direct, paths.direct_jobs(keys))
                    paths.check()
                    if round_ >= 2:
                        samples[name].append(took)
            lookups = paths.keys(args.rounds + 1, "direct")
            timing: dict[str, float] = {}
            for name, call in (
                ("driver", lambda key: paths.tier.lookup(key, _CTX)),
                ("direct", paths.tiers.lookup),
            ):
                runs = []
                for _ in range(20):
                    start = time.perf_counter()
                    for key in lookups:
                        call(key)
                    runs.append(time.perf_counter() - start)
                timing[name] = statistics.median(runs) / len(lookups)
        finally:
            paths.close()
    per = 2 * args.blocks  # blocks moved per round (out and back)
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}; disk tier (slab) in {args.dir}, "
        f"{args.io_threads} lanes; {args.blocks} blocks of {args.row_bytes} B each way per "
        f"round in jobs of {args.job}, {args.rounds} rounds (medians)"
    )
    print(f"{'path':8} {'wall us/block':>14} {'cpu us/block':>13} {'lookup us':>10}")
    for name, rows in samples.items():
        wall = statistics.median(w for w, _ in rows) / per * 1e6
        cpu = statistics.median(c for _, c in rows) / per * 1e6
        print(f"{name:8} {wall:14.2f} {cpu:13.2f} {timing[name] * 1e6:10.3f}")
    d_wall = statistics.median(w for w, _ in samples["driver"])
    d_cpu = statistics.median(c for _, c in samples["driver"])
    l_wall = statistics.median(w for w, _ in samples["direct"])
    l_cpu = statistics.median(c for _, c in samples["direct"])
    print(
        f"driver - direct: {(d_wall - l_wall) / per * 1e6:+.2f} us/block wall, "
        f"{(d_cpu - l_cpu) / per * 1e6:+.2f} us/block CPU, "
        f"{(timing['driver'] - timing['direct']) * 1e6:+.3f} us/lookup"
    )


if __name__ == "__main__":
    main()
