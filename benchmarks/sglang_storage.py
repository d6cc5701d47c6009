"""What asyncoffload's SGLang backend costs per page, against calling its tier driver
(:class:`~asyncoffload.tiers.lent.LentTiers`) directly, in the same run: SGLang 0.5.23's
own MHA host pool on a CPU, a disk tier (slab) in a temporary directory, SGLang's batches
of 128 pages. Per layout: the bytes each page moves and the copies it makes (the
page-first layouts are addressed in place; layer_first goes through the staging area).

    PYTHONPATH=.sglang-0.5.23/site:.sglang-0.5.23/deps .venv-vllm/bin/python \\
        benchmarks/sglang_storage.py [--pages 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.sglang.sglang_cpu import import_sglang

import_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from asyncoffload.integrations.sglang.storage import AsyncOffloadStorage  # noqa: E402
from asyncoffload.keys import OffloadKey  # noqa: E402
from asyncoffload.tiers.lent import LentTiers  # noqa: E402

#: A page of an 8-layer, 8-KV-head, 128-dim bf16 model with SGLang's 16-token pages.
LAYERS, HEADS, DIM, PAGE = 8, 8, 128, 16
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


def pool(layout: str, pages: int) -> MHATokenToKVPoolHost:
    tokens = pages * PAGE
    k = tuple(torch.zeros(PAGE, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.zeros(PAGE, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
            layout=KVBufferLayout.NHD,
        ),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=DIM,
        v_head_dim=DIM,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        1.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=LAYERS,
    )


def backend(layout: str, pages: int, root: Path, staging: int) -> AsyncOffloadStorage:
    extra = {
        "backend_name": "asyncoffload",
        "module_path": "asyncoffload.integrations.sglang",
        "class_name": "AsyncOffloadStorage",
        "interface_v1": 1,
        "staging_pages": staging,
        "tiers": [
            {
                "kind": "disk",
                "path": str(root),
                "capacity": 4 * pages * (PAGE * LAYERS * HEADS * DIM * 4 + 8192),
                "mode": "slab",
                "admission": None,
            }
        ],
    }
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench",
        extra_config=extra,
    )
    p = pool(layout, pages)
    b = StorageBackendFactory.create_backend("dynamic", cfg, p)
    b.register_mem_pool_host(p)
    assert isinstance(b, AsyncOffloadStorage)
    return b


def keys(n: int, tag: str) -> list[str]:
    return [f"{tag}-{i:060d}" for i in range(n)]


def per_page_us(fn: Any, n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / n * 1e6


def run(layout: str, pages: int, rounds: int, staging: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ao-sglang-bench-") as tmp:
        b = backend(layout, pages, Path(tmp), staging)
        hp, pm = b.mem_pool_host, b.pages
        assert pm is not None and b.tiers is not None
        idx = hp.alloc(pages * PAGE)
        hp.kv_buffer.view(torch.uint8).random_(0, 255)
        out: dict[str, list[float]] = {
            k: []
            for k in ("set_backend", "set_direct", "exists_backend", "get_backend", "get_direct")
        }
        tiers: LentTiers = b.tiers
        slots = list(range(BATCH))
        for r in range(rounds):
            ks = keys(pages, f"b{r}")
            dk = keys(pages, f"d{r}")

            def backend_set(ks: list[str] = ks) -> None:
                for i in range(0, pages, BATCH):
                    ok = b.batch_set_v1(ks[i : i + BATCH], idx[i * PAGE : (i + BATCH) * PAGE])
                    assert all(ok)

            def backend_get(ks: list[str] = ks) -> None:
                for i in range(0, pages, BATCH):
                    ok = b.batch_get_v1(ks[i : i + BATCH], idx[i * PAGE : (i + BATCH) * PAGE])
                    assert all(ok)

            def backend_exists(ks: list[str] = ks) -> None:
                for i in range(0, pages, BATCH):
                    assert b.batch_exists(ks[i : i + BATCH]) == min(BATCH, pages - i)

            # LentTiers directly over the same slots (the pool's pages in place, or the
            # staging area's, with no copy in or out): what the driver adds is the rest.
            def direct(write: bool, dk: list[str] = dk) -> None:
                for i in range(0, pages, BATCH):
                    part = [OffloadKey(k.encode()) for k in dk[i : i + BATCH]]
                    s = list(range(i, i + len(part))) if b.staging is None else slots[: len(part)]
                    job = tiers.store(part, s) if write else tiers.load(part, s)
                    assert tiers.wait([job], 60) and all(job.ok)

            out["set_backend"].append(per_page_us(backend_set, pages))
            out["set_direct"].append(per_page_us(lambda: direct(True), pages))
            out["exists_backend"].append(per_page_us(backend_exists, pages))
            out["get_backend"].append(per_page_us(backend_get, pages))
            out["get_direct"].append(per_page_us(lambda: direct(False), pages))
        staged = b.staging is not None
        b.close()
    med = {k: round(statistics.median(v), 1) for k, v in out.items()}
    return {
        "layout": layout,
        "page_bytes": pm.page_bytes,
        "in_place": not staged,
        "copies_per_page": 1 if staged else 0,
        "host_bytes_moved_per_page": pm.page_bytes * (2 if staged else 1),
        "us_per_page": med,
        "driver_overhead_us": {
            "set": round(med["set_backend"] - med["set_direct"], 1),
            "get": round(med["get_backend"] - med["get_direct"], 1),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--staging", type=int, default=BATCH)
    args = parser.parse_args()
    for layout in ("page_first", "page_first_direct", "page_head", "layer_first"):
        print(json.dumps(run(layout, args.pages, args.rounds, args.staging)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
